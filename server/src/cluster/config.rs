//! The cluster file: which nodes there are and how the key space is
//! sharded. Every node starts from the same file (`--cluster FILE
//! --node-id N`); the map it describes is the cluster's first.
//!
//! ```toml
//! shards = 8        # raft groups for data (default: 4 per node)
//! replicas = 3      # per shard (default: 3, or fewer nodes)
//!
//! [[node]]
//! id = 1
//! rpc = "127.0.0.1:7070"    # clients
//! peer = "127.0.0.1:7170"   # raft traffic between nodes; dials to peers leave from its IP
//!
//! [[node]]
//! id = 4
//! rpc = "127.0.0.1:7073"
//! peer = "127.0.0.1:7173"
//! spare = true              # in the cluster, given no replicas at first
//! ```
//!
//! A spare is a member every node can reach (its peers know its address
//! and, with peer TLS, its identity) that the first placement leaves out:
//! it serves clients by passing their requests on, and is where
//! replicas go when the cluster grows. Since the first placement is
//! computed from the file's non-spare nodes only, a spare can be added to
//! the file (and the nodes restarted one by one) without moving anything.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use dmkv_common::cluster::map::{ClusterMap, MAX_REPLICAS, NodeId};
use serde::Deserialize;

/// Default shards per node when the file does not say.
pub const DEFAULT_SHARDS_PER_NODE: u32 = 4;
/// Default replicas per shard.
pub const DEFAULT_REPLICAS: usize = 3;
/// Most nodes in one cluster file.
pub const MAX_NODES: usize = 1024;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    shards: Option<u32>,
    replicas: Option<usize>,
    #[serde(default)]
    node: Vec<NodeEntry>,
}

/// One node of the cluster file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeEntry {
    pub id: NodeId,
    pub rpc: SocketAddr,
    pub peer: SocketAddr,
    /// Given no replicas (nor a place in the metadata group) at first.
    #[serde(default)]
    pub spare: bool,
}

/// A checked cluster file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    pub nodes: Vec<NodeEntry>,
    pub shards: u32,
    pub replicas: usize,
}

impl ClusterConfig {
    /// Parses and checks a cluster file's text; errors say what is wrong
    /// and where.
    pub fn parse(text: &str) -> Result<ClusterConfig, String> {
        let f: File = toml::from_str(text)
            .map_err(|e| format!("cluster file: {}", crate::config::validate::toml_error(&e, text)))?;
        if f.node.is_empty() {
            return Err("cluster file: no [[node]] entries".into());
        }
        if f.node.len() > MAX_NODES {
            return Err(format!("cluster file: {} nodes, at most {MAX_NODES}", f.node.len()));
        }
        let mut ids = BTreeSet::new();
        let mut addrs = BTreeSet::new();
        for n in &f.node {
            if n.id == 0 {
                return Err("cluster file: node id 0 is reserved (raft's \"no node\")".into());
            }
            if n.id > u64::from(u32::MAX) {
                return Err(format!(
                    "cluster file: node id {} is over {} (raft ids hold it in 32 bits)",
                    n.id,
                    u32::MAX
                ));
            }
            if !ids.insert(n.id) {
                return Err(format!("cluster file: node id {} appears twice", n.id));
            }
            for a in [n.rpc, n.peer] {
                if !addrs.insert(a) {
                    return Err(format!("cluster file: address {a} (node {}) is used twice", n.id));
                }
            }
        }
        let placed = f.node.iter().filter(|n| !n.spare).count();
        if placed == 0 {
            return Err("cluster file: every node is a spare; at least one must hold replicas".into());
        }
        let replicas = f.replicas.unwrap_or(DEFAULT_REPLICAS.min(placed));
        if replicas == 0 || replicas > placed || replicas > MAX_REPLICAS {
            return Err(format!(
                "cluster file: replicas = {replicas}, must be 1 to {} (nodes that are not spares, at most \
                 {MAX_REPLICAS})",
                placed.min(MAX_REPLICAS)
            ));
        }
        let shards = f.shards.unwrap_or(DEFAULT_SHARDS_PER_NODE * placed as u32);
        let cfg = ClusterConfig { nodes: f.node, shards, replicas };
        cfg.initial_map().map_err(|e| format!("cluster file: {e}"))?;
        Ok(cfg)
    }

    /// The node `id`, or an error naming the ids there are.
    pub fn node(&self, id: NodeId) -> Result<&NodeEntry, String> {
        self.nodes.iter().find(|n| n.id == id).ok_or_else(|| {
            let ids: Vec<String> = self.nodes.iter().map(|n| n.id.to_string()).collect();
            format!("--node-id {id} is not in the cluster file (nodes: {})", ids.join(", "))
        })
    }

    /// The cluster's first map: every node in it, replicas on the nodes
    /// that are not spares.
    pub fn initial_map(&self) -> Result<ClusterMap, dmkv_common::cluster::map::MapError> {
        let nodes: BTreeMap<NodeId, String> = self.nodes.iter().map(|n| (n.id, n.rpc.to_string())).collect();
        let spares: BTreeSet<NodeId> = self.nodes.iter().filter(|n| n.spare).map(|n| n.id).collect();
        ClusterMap::initial_with_spares(nodes, &spares, self.shards, self.replicas)
    }

    /// The nodes the first placement uses (the metadata group's are the
    /// first of them).
    pub fn placed_nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes.iter().filter(|n| !n.spare).map(|n| n.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THREE: &str = r#"
shards = 6
[[node]]
id = 1
rpc = "127.0.0.1:7070"
peer = "127.0.0.1:7170"
[[node]]
id = 2
rpc = "127.0.0.1:7071"
peer = "127.0.0.1:7171"
[[node]]
id = 3
rpc = "127.0.0.1:7072"
peer = "127.0.0.1:7172"
"#;

    #[test]
    fn a_three_node_file_gives_a_map_of_three_replicas() {
        let c = ClusterConfig::parse(THREE).unwrap();
        assert_eq!((c.shards, c.replicas), (6, 3));
        assert_eq!(c.node(2).unwrap().peer.port(), 7171);
        let m = c.initial_map().unwrap();
        assert_eq!(m.shards().len(), 6);
        assert!(m.shards().iter().all(|s| s.replicas.len() == 3));
        assert!(c.node(9).unwrap_err().contains("nodes: 1, 2, 3"));
    }

    #[test]
    fn mistakes_are_named() {
        let err = |t: &str| ClusterConfig::parse(t).unwrap_err();
        assert!(err("").contains("no [[node]]"));
        assert!(err(&THREE.replace("id = 3", "id = 2")).contains("node id 2 appears twice"));
        assert!(err(&THREE.replace("7172", "7171")).contains("127.0.0.1:7171 (node 3) is used twice"));
        assert!(err(&THREE.replace("id = 1", "id = 0")).contains("reserved"));
        assert!(err(&format!("replicas = 4\n{THREE}")).contains("replicas = 4"));
        assert!(err(&THREE.replace("shards = 6", "shards = 0")).contains("0 shards"));
        assert!(err(&THREE.replace("peer = \"127.0.0.1:7170\"", "peer = \"nowhere\"")).contains("cluster file"));
        assert!(err(&format!("{THREE}\nextra = 1")).contains("unknown field"));
        // One node: one replica by default.
        let one = "[[node]]\nid = 1\nrpc = \"127.0.0.1:7070\"\npeer = \"127.0.0.1:7170\"\n";
        assert_eq!(ClusterConfig::parse(one).unwrap().replicas, 1);
    }

    #[test]
    fn a_spare_joins_the_map_but_not_the_placement_and_adding_one_moves_nothing() {
        let with_spare =
            format!("{THREE}[[node]]\nid = 4\nrpc = \"127.0.0.1:7073\"\npeer = \"127.0.0.1:7173\"\nspare = true\n");
        let (c, first) = (ClusterConfig::parse(&with_spare).unwrap(), ClusterConfig::parse(THREE).unwrap());
        let (m, m0) = (c.initial_map().unwrap(), first.initial_map().unwrap());
        assert_eq!(m.nodes.get(&4).map(String::as_str), Some("127.0.0.1:7073"));
        assert_eq!(m.shards(), m0.shards(), "the spare holds nothing and changes nothing");
        assert_eq!(c.placed_nodes().collect::<Vec<_>>(), vec![1, 2, 3]);
        // Replicas count only the nodes that take them.
        assert!(ClusterConfig::parse(&format!("replicas = 4\n{with_spare}")).unwrap_err().contains("not spares"));
        let all_spare = "[[node]]\nid = 1\nrpc = \"127.0.0.1:7070\"\npeer = \"127.0.0.1:7170\"\nspare = true\n";
        assert!(ClusterConfig::parse(all_spare).unwrap_err().contains("every node is a spare"));
    }
}
