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
//! ```

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
        let replicas = f.replicas.unwrap_or(DEFAULT_REPLICAS.min(f.node.len()));
        if replicas == 0 || replicas > f.node.len() || replicas > MAX_REPLICAS {
            return Err(format!(
                "cluster file: replicas = {replicas}, must be 1 to {} (nodes, at most {MAX_REPLICAS})",
                f.node.len().min(MAX_REPLICAS)
            ));
        }
        let shards = f.shards.unwrap_or(DEFAULT_SHARDS_PER_NODE * f.node.len() as u32);
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

    /// The cluster's first map.
    pub fn initial_map(&self) -> Result<ClusterMap, dmkv_common::cluster::map::MapError> {
        let nodes: BTreeMap<NodeId, String> = self.nodes.iter().map(|n| (n.id, n.rpc.to_string())).collect();
        ClusterMap::initial(nodes, self.shards, self.replicas)
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
}
