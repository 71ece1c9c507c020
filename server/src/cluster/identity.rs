//! Which node a peer-port connection speaks for, and what that lets it
//! send. With secrets, a connection is the node whose secret it proved
//! (`dmkv_common::auth::Keys::verify_node`). Without secrets there is no
//! proof, so the best there is is the connection's source address: nodes
//! dial from their own peer IP (`peer::Dialer::source_of`), and when the
//! cluster file gives every node an IP of its own, that IP names one node.
//! Otherwise (every node on 127.0.0.1, say) a connection is any node.
//! docs/security.md says what each protects against.

use std::collections::HashMap;
use std::net::IpAddr;

use dmkv_common::cluster::map::{NodeId, node_of};

use super::config::ClusterConfig;

/// Who a peer-port connection speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sender {
    /// Node N: it proved N's secret, or came from the IP only N has.
    Node(NodeId),
    /// Some node of the cluster: no secrets, and IPs that do not tell
    /// nodes apart. Its batches are taken as they say.
    AnyNode,
}

/// The nodes of a cluster without secrets by their peer IP, when those
/// tell them apart.
#[derive(Debug, Clone, Default)]
pub struct PeerIps(Option<HashMap<IpAddr, NodeId>>);

impl PeerIps {
    /// From the cluster file: a table only if every node's peer IP is
    /// specified (a node listening on `0.0.0.0` dials from wherever the
    /// route says), of one family (a dial to the other family cannot leave
    /// from the node's IP), and its own.
    pub fn of(cfg: &ClusterConfig) -> PeerIps {
        let mut by_ip = HashMap::new();
        let v4 = cfg.nodes.first().is_some_and(|n| n.peer.is_ipv4());
        for n in &cfg.nodes {
            let ip = n.peer.ip().to_canonical();
            if ip.is_unspecified() || ip.is_ipv4() != v4 || by_ip.insert(ip, n.id).is_some() {
                return PeerIps(None);
            }
        }
        PeerIps(Some(by_ip))
    }

    /// Whether connections are bound to nodes by their source IP.
    pub fn binding(&self) -> bool {
        self.0.is_some()
    }

    /// Who a connection from `ip` speaks for on a cluster without secrets;
    /// `None`: an address that is no node's, when addresses tell nodes
    /// apart (or one the socket could not tell).
    pub fn sender(&self, ip: Option<IpAddr>) -> Option<Sender> {
        match &self.0 {
            None => Some(Sender::AnyNode),
            Some(by_ip) => by_ip.get(&ip?.to_canonical()).map(|&n| Sender::Node(n)),
        }
    }
}

/// Refuses a raft batch that says it is from another node than the
/// connection's. Each message's `from` is checked against the batch's
/// node after this (`local::LocalShards`), so together a node's messages
/// can only speak for its own replicas.
pub fn check_batch(sender: Sender, from_node: NodeId) -> Result<(), String> {
    match sender {
        Sender::Node(n) if n != from_node => {
            Err(format!("this connection speaks for node {n}; a raft batch from node {from_node} is refused"))
        }
        _ => Ok(()),
    }
}

/// Refuses a join for another node's replica: a node asks to add its own
/// replicas only (the leader then removes that node's older ones).
pub fn check_join(sender: Sender, replica_id: u64) -> Result<(), String> {
    match sender {
        Sender::Node(n) if node_of(replica_id) != n => Err(format!(
            "this connection speaks for node {n}; it may not ask to add replica {replica_id} of node {}",
            node_of(replica_id)
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(peers: &[&str]) -> ClusterConfig {
        let mut text = String::from("shards = 1\nreplicas = 1\n");
        for (i, p) in peers.iter().enumerate() {
            text += &format!("[[node]]\nid = {}\nrpc = \"127.0.0.1:{}\"\npeer = \"{p}\"\n", i + 1, 7070 + i);
        }
        ClusterConfig::parse(&text).unwrap()
    }

    #[test]
    fn distinct_peer_ips_name_their_node() {
        let ips = PeerIps::of(&cluster(&["127.0.1.1:7170", "127.0.1.2:7170", "127.0.1.3:7170"]));
        assert!(ips.binding());
        let ip = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        assert_eq!(ips.sender(ip("127.0.1.2")), Some(Sender::Node(2)));
        assert_eq!(ips.sender(ip("::ffff:127.0.1.3")), Some(Sender::Node(3)), "a v4-mapped source");
        assert_eq!(ips.sender(ip("127.0.0.1")), None, "no node's address");
        assert_eq!(ips.sender(None), None);
    }

    #[test]
    fn shared_unspecified_or_mixed_ips_tell_no_node_apart() {
        for peers in [
            &["127.0.0.1:7170", "127.0.0.1:7171"][..],
            &["0.0.0.0:7170", "10.0.0.2:7170"],
            &["10.0.0.1:7170", "[::1]:7170"],
        ] {
            let ips = PeerIps::of(&cluster(peers));
            assert!(!ips.binding(), "{peers:?}");
            assert_eq!(ips.sender(Some("10.9.9.9".parse().unwrap())), Some(Sender::AnyNode), "{peers:?}");
        }
    }

    #[test]
    fn a_node_speaks_for_itself_only() {
        assert!(check_batch(Sender::Node(2), 2).is_ok());
        let err = check_batch(Sender::Node(2), 3).unwrap_err();
        assert!(err.contains("node 2") && err.contains("node 3"), "{err}");
        assert!(check_batch(Sender::AnyNode, 3).is_ok());
        assert!(check_join(Sender::Node(2), (2 << 32) | 7).is_ok());
        assert!(check_join(Sender::Node(2), (3 << 32) | 7).is_err());
        assert!(check_join(Sender::AnyNode, (3 << 32) | 7).is_ok());
    }
}
