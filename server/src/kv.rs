//! The store's semantics as the protocols see them (native RPC and the
//! memcached port): reads that honour expiry, conditional writes, counters,
//! touch, flush. The server's time is passed to the store from one clock,
//! the one published in the region for one-sided readers.

use std::sync::Arc;
use std::time::Duration;

use dmkv_common::error::Error;

use crate::service::Shared;
pub use crate::store::item::{Arith, Expiry, Item, ItemMeta, Mode, Write};

/// A handle on the store for a protocol front-end.
#[derive(Clone)]
pub struct Kv {
    shared: Arc<Shared>,
}

impl Kv {
    pub fn new(shared: Arc<Shared>) -> Kv {
        Kv { shared }
    }

    /// What the service shares (store counters, metrics, limits).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// The server's clock (unix ms), as published for one-sided readers.
    pub fn now_ms(&self) -> u64 {
        todo!()
    }

    /// The live item of `key` (an expired one is none).
    pub fn get(&self, _key: &[u8]) -> Result<Option<Item>, Error> {
        todo!()
    }

    /// The live item of `key`, after giving it expiry `expires_at` (0:
    /// never): memcached's gat and touch. Keeps the item's version.
    pub async fn touch(&self, _key: &[u8], _expires_at: u32) -> Result<Option<Item>, Error> {
        todo!()
    }

    /// Runs one write; waits (boundedly) for space as the native PUT does.
    pub async fn write(&self, _key: &[u8], _w: &Write<'_>) -> Result<ItemMeta, Error> {
        todo!()
    }

    /// Removes `key`; `cas` 0 or the item's version. Ok(false): no such
    /// (live) item; Err(Exists): another version.
    pub async fn delete(&self, _key: &[u8], _cas: u64) -> Result<bool, Error> {
        todo!()
    }

    /// A counter operation; returns the new value and the item's meta.
    pub async fn arith(&self, _key: &[u8], _a: &Arith) -> Result<(u64, ItemMeta), Error> {
        todo!()
    }

    /// Removes every item stored up to now, after `delay` (memcached's
    /// flush_all; 0: at once).
    pub fn flush_all(&self, _delay: Duration) {
        todo!()
    }
}
