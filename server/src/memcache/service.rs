//! What the memcached port's connections share.

use std::sync::Arc;
use std::time::Instant;

use super::counters::Counters;
use crate::kv::Kv;
use crate::node::SingleNode;
use crate::service::Shared;

/// The version the port reports: memcached's protocol level, then dmkv's.
/// Clients that parse it see a 1.6 server (meta commands).
pub const VERSION: &str = concat!("1.6.0-dmkv-", env!("CARGO_PKG_VERSION"));

/// What the memcached port's connections share.
pub struct Service {
    /// The server's state: the auth gate, the listener's counters, the
    /// connection limits.
    pub shared: Arc<Shared>,
    /// The store and compactor ([`Service::kv`]): the port is a single
    /// node's only (a cluster does not replicate what its commands need).
    pub node: Arc<SingleNode>,
    pub counters: Counters,
    pub started: Instant,
    /// Worker threads, for `stats`.
    pub threads: usize,
    pub max_connections: usize,
}

impl Service {
    /// The port's state over `node`'s store.
    pub fn new(shared: Arc<Shared>, node: Arc<SingleNode>, threads: usize, max_connections: usize) -> Service {
        Service { shared, node, counters: Default::default(), started: Instant::now(), threads, max_connections }
    }

    /// The store's semantics, as the commands use them.
    pub fn kv(&self) -> Kv<'_> {
        self.node.kv()
    }
}
