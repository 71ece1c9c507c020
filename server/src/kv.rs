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
use crate::compact::{self, Compactor};
use crate::store::Store;
pub use crate::store::item::{Arith, Expiry, Item, ItemMeta, Mode, Write};
use dmkv_common::proto;

/// A handle on the store for a protocol front-end: the store and the
/// compactor that makes room in it (borrowed from their owner, the
/// server's shared state).
#[derive(Clone, Copy)]
pub struct Kv<'a> {
    store: &'a Arc<Store>,
    compactor: &'a Compactor,
}

/// Runs `op` until it stops failing with OUT_OF_MEMORY, for at most
/// [`compact::OUT_OF_MEMORY_WAIT`]: space that finishes its grace period
/// soon, that the compactor can put in one piece, or (`--evict lru`) that
/// eviction frees, is not "full". `units`: the item's size.
pub async fn with_room<T>(kv: &Kv<'_>, units: usize, mut op: impl FnMut() -> Result<T, Error>) -> Result<T, Error> {
    let deadline = tokio::time::Instant::now() + compact::OUT_OF_MEMORY_WAIT;
    loop {
        match op() {
            Err(Error::OutOfMemory) if tokio::time::Instant::now() < deadline => {
                // The write may have needed a new index segment instead
                // (or as well): ask for room for either.
                let units = units.max(SEGMENT_UNITS) as u64;
                if kv.store.evicts_here() {
                    kv.store.evict_bytes(units * UNIT as u64);
                }
                match kv.compactor.after_out_of_memory(units) {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => return Err(Error::OutOfMemory),
                }
            }
            r => return r,
        }
    }
}

/// Runs one write on `kv`'s store; waits (boundedly) for space.
pub async fn write(kv: &Kv<'_>, key: &[u8], w: &Write<'_>) -> Result<ItemMeta, Error> {
    let units = item_units(key.len(), w.value.len());
    with_room(kv, units, || kv.store.write(key, w, clock::now_ms())).await
}

/// Gives `key`'s live item expiry `expires_at` and returns it (touch, gat).
pub async fn touch(kv: &Kv<'_>, key: &[u8], expires_at: u32) -> Result<Option<Item>, Error> {
    // The item is rewritten; `with_room` asks for at least a segment.
    with_room(kv, item_units(key.len(), 0), || kv.store.touch(key, expires_at, clock::now_ms())).await
}

/// A counter operation on `kv`'s store.
pub async fn arith(kv: &Kv<'_>, key: &[u8], a: &Arith) -> Result<(u64, ItemMeta), Error> {
    with_room(kv, item_units(key.len(), 20), || kv.store.arith(key, a, clock::now_ms())).await
}

/// Removes `key` (`cas` 0, or only the item of that version).
pub fn delete(kv: &Kv<'_>, key: &[u8], cas: u64) -> Result<bool, Error> {
    kv.store.delete_if(key, cas, clock::now_ms())
}

impl<'a> Kv<'a> {
    pub fn new(store: &'a Arc<Store>, compactor: &'a Compactor) -> Kv<'a> {
        Kv { store, compactor }
    }

    /// The server's clock (unix ms), as published for one-sided readers.
    pub fn now_ms(&self) -> u64 {
        clock::now_ms()
    }

    /// The live item of `key` (an expired one is none).
    pub fn get(&self, key: &[u8]) -> Result<Option<Item>, Error> {
        Ok(self.store.get_item(key, clock::now_ms())?.map(|(item, _)| item))
    }

    /// The live item of `key`, after giving it expiry `expires_at` (0:
    /// never): memcached's gat and touch. Keeps the item's version.
    pub async fn touch(&self, key: &[u8], expires_at: u32) -> Result<Option<Item>, Error> {
        touch(self, key, expires_at).await
    }

    /// Runs one write; waits (boundedly) for space as the native PUT does.
    pub async fn write(&self, key: &[u8], w: &Write<'_>) -> Result<ItemMeta, Error> {
        write(self, key, w).await
    }

    /// Removes `key`; `cas` 0 or the item's version. Ok(false): no such
    /// (live) item; Err(Exists): another version.
    pub async fn delete(&self, key: &[u8], cas: u64) -> Result<bool, Error> {
        delete(self, key, cas)
    }

    /// A counter operation; returns the new value and the item's meta.
    pub async fn arith(&self, key: &[u8], a: &Arith) -> Result<(u64, ItemMeta), Error> {
        arith(self, key, a).await
    }

    /// Removes every item stored up to now, after `delay` (memcached's
    /// flush_all; 0: at once, done when this returns). A delayed flush
    /// runs on the runtime. Either walks the whole index, off the async
    /// threads: a connection thread serves other connections too.
    pub async fn flush_all(&self, delay: Duration) {
        let store = Arc::clone(self.store);
        let clear = move || async move {
            let _ = tokio::task::spawn_blocking(move || store.clear_all()).await;
        };
        if delay.is_zero() {
            clear().await;
            return;
        }
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            clear().await;
        });
    }
}

/// The store write a PUT asks for.
pub fn write_of(p: &proto::Put, now_ms: u64) -> Write<'_> {
    let mode = match proto::PutMode::try_from(p.mode).unwrap_or(proto::PutMode::Set) {
        proto::PutMode::Set => Mode::Set,
        proto::PutMode::Add => Mode::Add,
        proto::PutMode::Replace => Mode::Replace,
        proto::PutMode::Append => Mode::Append,
        proto::PutMode::Prepend => Mode::Prepend,
    };
    Write {
        value: &p.value,
        mode,
        flags: p.flags,
        expiry: Expiry::At(expiry_of(p.ttl_secs, p.expires_at, now_ms)),
        cas: p.cas,
        vivify: p.vivify,
    }
}

/// The expiry a request asks for: `expires_at` if given, else `ttl_secs`
/// from the server's `now_ms` (both 0: never).
pub fn expiry_of(ttl_secs: u64, expires_at: u32, now_ms: u64) -> u32 {
    if expires_at != 0 { expires_at } else { dmkv_common::expiry::from_ttl(ttl_secs, now_ms) }
}

/// The store counter operation an ARITH asks for: the item keeps its
/// expiry unless the request gives one.
pub fn arith_of(a: &proto::Arith, now_ms: u64) -> Arith {
    let at = expiry_of(a.ttl_secs, a.expires_at, now_ms);
    Arith {
        delta: a.delta,
        incr: !a.decrement,
        cas: a.cas,
        vivify: a.vivify.then_some((a.initial, at)),
        expiry: if at == 0 { Expiry::Keep } else { Expiry::At(at) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;

    /// memcached with `-m 64` stores any value up to its item limit after
    /// smaller values filled the cache; so must a 64 MiB region with
    /// `--evict lru`, though eviction frees items wherever they are and
    /// the free space it leaves is in pieces (values of 515 to 566 KB were
    /// refused before the compactor learned to evict a range).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn eviction_makes_room_in_one_piece_for_any_value() {
        let region = Arc::new(Region::create("kv-evict-large", 64 << 20).unwrap());
        let store = Arc::new(Store::format(region, 4096, 7, 1, Duration::from_millis(5)).unwrap());
        crate::store::evict::start(&store).unwrap();
        let compactor = Compactor::spawn(Arc::clone(&store), compact::Mode::Auto).unwrap();
        let kv = Kv::new(&store, &compactor);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let small: Vec<u8> = vec![b's'; 200_000];
        for i in 0..2000 {
            let len = 100 + (next() % 100_000) as usize;
            write(&kv, format!("small-{i}").as_bytes(), &Write::set(&small[..len])).await.unwrap();
        }
        assert!(store.counters.evictions.load(std::sync::atomic::Ordering::Relaxed) > 0, "the cache never filled");
        let large = vec![b'L'; 600_000];
        for len in (515_000..=566_000).step_by(2_000) {
            let r = write(&kv, format!("large-{len}").as_bytes(), &Write::set(&large[..len])).await;
            let c = &store.counters;
            let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
            assert!(
                r.is_ok(),
                "a value of {len} bytes: {r:?} ({:?}; compactor demands {}, ranges {} done {} abandoned {}, evicted for room {})",
                store.space(),
                n(&compactor.stats().demands),
                n(&c.compactor_ranges),
                n(&c.compactor_ranges_done),
                n(&c.compactor_ranges_abandoned),
                n(&c.evicted_for_room)
            );
        }
        let c = &store.counters;
        let n = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        println!(
            "evictions {}, of them for room {}; compactor ranges {} (abandoned {}), moves {}",
            n(&c.evictions),
            n(&c.evicted_for_room),
            n(&c.compactor_ranges),
            n(&c.compactor_ranges_abandoned),
            n(&c.compactor_moves)
        );
    }
}
