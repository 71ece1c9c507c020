//! The store's semantics as the protocols see them (native RPC and the
//! memcached port): reads that honour expiry, conditional writes, counters,
//! touch, flush. Every operation takes the server's time from one clock,
//! the one published in the region for one-sided readers ([`clock`]), and
//! every write waits (boundedly) for room the same way.

use std::sync::Arc;
use std::time::Duration;

use dmkv_common::error::Error;
use dmkv_common::layout::{SEGMENT_UNITS, item_units};
use dmkv_common::limits::UNIT;

use crate::clock;
use crate::compact;
use crate::service::Shared;
pub use crate::store::item::{Arith, Expiry, Item, ItemMeta, Mode, Write};

/// A handle on the store for a protocol front-end.
#[derive(Clone)]
pub struct Kv {
    shared: Arc<Shared>,
}

/// Runs `op` until it stops failing with OUT_OF_MEMORY, for at most
/// [`compact::OUT_OF_MEMORY_WAIT`]: space that finishes its grace period
/// soon, that the compactor can put in one piece, or (`--evict lru`) that
/// eviction frees, is not "full". `units`: the item's size.
pub async fn with_room<T>(shared: &Shared, units: usize, mut op: impl FnMut() -> Result<T, Error>) -> Result<T, Error> {
    let deadline = tokio::time::Instant::now() + compact::OUT_OF_MEMORY_WAIT;
    loop {
        match op() {
            Err(Error::OutOfMemory) if tokio::time::Instant::now() < deadline => {
                // The write may have needed a new index segment instead
                // (or as well): ask for room for either.
                let units = units.max(SEGMENT_UNITS) as u64;
                if shared.store.evicts() {
                    shared.store.evict_bytes(units * UNIT as u64);
                }
                match shared.compactor.after_out_of_memory(units) {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => return Err(Error::OutOfMemory),
                }
            }
            r => return r,
        }
    }
}

/// Runs one write on `shared`'s store; waits (boundedly) for space.
pub async fn write(shared: &Shared, key: &[u8], w: &Write<'_>) -> Result<ItemMeta, Error> {
    let units = item_units(key.len(), w.value.len());
    with_room(shared, units, || shared.store.write(key, w, clock::now_ms())).await
}

/// Gives `key`'s live item expiry `expires_at` and returns it (touch, gat).
pub async fn touch(shared: &Shared, key: &[u8], expires_at: u32) -> Result<Option<Item>, Error> {
    // The item is rewritten; `with_room` asks for at least a segment.
    with_room(shared, item_units(key.len(), 0), || shared.store.touch(key, expires_at, clock::now_ms())).await
}

/// A counter operation on `shared`'s store.
pub async fn arith(shared: &Shared, key: &[u8], a: &Arith) -> Result<(u64, ItemMeta), Error> {
    with_room(shared, item_units(key.len(), 20), || shared.store.arith(key, a, clock::now_ms())).await
}

/// Removes `key` (`cas` 0, or only the item of that version).
pub fn delete(shared: &Shared, key: &[u8], cas: u64) -> Result<bool, Error> {
    shared.store.delete_if(key, cas, clock::now_ms())
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
        clock::now_ms()
    }

    /// The live item of `key` (an expired one is none).
    pub fn get(&self, key: &[u8]) -> Result<Option<Item>, Error> {
        Ok(self.shared.store.get_item(key, clock::now_ms())?.map(|(item, _)| item))
    }

    /// The live item of `key`, after giving it expiry `expires_at` (0:
    /// never): memcached's gat and touch. Keeps the item's version.
    pub async fn touch(&self, key: &[u8], expires_at: u32) -> Result<Option<Item>, Error> {
        touch(&self.shared, key, expires_at).await
    }

    /// Runs one write; waits (boundedly) for space as the native PUT does.
    pub async fn write(&self, key: &[u8], w: &Write<'_>) -> Result<ItemMeta, Error> {
        write(&self.shared, key, w).await
    }

    /// Removes `key`; `cas` 0 or the item's version. Ok(false): no such
    /// (live) item; Err(Exists): another version.
    pub async fn delete(&self, key: &[u8], cas: u64) -> Result<bool, Error> {
        delete(&self.shared, key, cas)
    }

    /// A counter operation; returns the new value and the item's meta.
    pub async fn arith(&self, key: &[u8], a: &Arith) -> Result<(u64, ItemMeta), Error> {
        arith(&self.shared, key, a).await
    }

    /// Removes every item stored up to now, after `delay` (memcached's
    /// flush_all; 0: at once). A delayed flush runs on the runtime.
    pub fn flush_all(&self, delay: Duration) {
        if delay.is_zero() {
            self.shared.store.clear_all();
            return;
        }
        let store = Arc::clone(&self.shared.store);
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            // Off the async workers: it walks the whole index.
            let _ = tokio::task::spawn_blocking(move || store.clear_all()).await;
        });
    }
}
