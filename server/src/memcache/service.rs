//! What the memcached port's connections share.

use std::sync::Arc;
use std::time::Instant;

use super::counters::Counters;
use crate::kv::Kv;
use crate::service::Shared;

/// The version the port reports: memcached's protocol level, then dmkv's.
/// Clients that parse it see a 1.6 server (meta commands).
pub const VERSION: &str = concat!("1.6.0-dmkv-", env!("CARGO_PKG_VERSION"));

/// What the memcached port's connections share.
pub struct Service {
    /// The server's state: the store and compactor ([`Service::kv`]), the
    /// auth gate, the listener's counters, the connection limits.
    pub shared: Arc<Shared>,
    pub counters: Counters,
    pub started: Instant,
    /// Worker threads, for `stats`.
    pub threads: usize,
    pub max_connections: usize,
}

impl Service {
    /// The port's state over `shared`'s store.
    pub fn new(shared: Arc<Shared>, threads: usize, max_connections: usize) -> Service {
        Service { shared, counters: Default::default(), started: Instant::now(), threads, max_connections }
    }

    /// The store's semantics, as the commands use them.
    pub fn kv(&self) -> Kv<'_> {
        Kv::new(&self.shared.store, &self.shared.compactor)
    }
}
