//! What the memcached port's connections share.

use std::sync::Arc;
use std::time::Instant;

use super::backend::{Backend, McKv};
use super::counters::Counters;
use crate::service::Shared;
use crate::store::Store;

/// The version the port reports: memcached's protocol level, then dmkv's.
/// Clients that parse it see a 1.6 server (meta commands).
pub const VERSION: &str = concat!("1.6.0-dmkv-", env!("CARGO_PKG_VERSION"));

/// What the memcached port's connections share.
pub struct Service {
    /// The server's state: the auth gate, the listener's counters, the
    /// connection limits.
    pub shared: Arc<Shared>,
    /// A single node's store, or a cluster node ([`Service::kv`]).
    pub backend: Backend,
    pub counters: Counters,
    pub started: Instant,
    /// Worker threads, for `stats`.
    pub threads: usize,
    pub max_connections: usize,
}

impl Service {
    /// The port's state over `backend`.
    pub fn new(shared: Arc<Shared>, backend: Backend, threads: usize, max_connections: usize) -> Service {
        Service { shared, backend, counters: Default::default(), started: Instant::now(), threads, max_connections }
    }

    /// The store's semantics, as the commands use them.
    pub fn kv(&self) -> McKv<'_> {
        match &self.backend {
            Backend::Single(n) => McKv::Single(n.kv()),
            Backend::Cluster(c) => McKv::Cluster { node: c, shared: &self.shared },
        }
    }

    /// The stores `stats` counts: a single node's, or the shards a
    /// cluster node leads (each item once across the cluster's nodes).
    pub fn stores(&self) -> Vec<Arc<Store>> {
        match &self.backend {
            Backend::Single(n) => vec![Arc::clone(n.store())],
            Backend::Cluster(c) => c.led_stores(),
        }
    }

    /// The memory items may take (memcached's `limit_maxbytes`): a single
    /// node's region, or all of a cluster node's replicas' regions.
    pub fn region_bytes(&self) -> u64 {
        match &self.backend {
            Backend::Single(n) => n.store().header().region_len,
            Backend::Cluster(c) => c.stores().iter().map(|s| s.header().region_len).sum(),
        }
    }
}
