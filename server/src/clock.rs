//! The server's clock for item expiry: unix time in milliseconds, never
//! moving back, published in every store's region header (at
//! `layout::CLOCK_OFFSET`) for one-sided readers.
//!
//! One thread refreshes it every [`CLOCK_INTERVAL`]. Expiry is in whole
//! seconds (memcached's), so an item expires at most one interval late
//! by the wall clock, 1 % of its last second; and every reader, the
//! server's own and one-sided ones, judges by the same published value.
//! Each refresh is one 8-byte store per region, which also costs a
//! one-sided reader's cache one line refill per interval: nothing next
//! to a GET. The server's own reads use the value last published (it is
//! written to the regions before it is used here), so a server read
//! never calls live an item a one-sided reader could already call
//! expired... within one refresh, both agree.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dmkv_common::layout::CLOCK_OFFSET;

use crate::lock::lock;
use crate::region::Region;

/// How often the published clock is refreshed.
pub const CLOCK_INTERVAL: Duration = Duration::from_millis(10);
/// Most regions the clock publishes to (a node's shard replicas and its
/// own store); more are refused registration, and their readers fall back
/// to RPC for items that can expire.
pub const MAX_REGIONS: usize = 4096;

struct Clock {
    now_ms: AtomicU64,
    regions: Mutex<Vec<Weak<Region>>>,
}

fn clock() -> &'static Clock {
    static CLOCK: OnceLock<Clock> = OnceLock::new();
    CLOCK.get_or_init(|| {
        let c = Clock { now_ms: AtomicU64::new(wall_ms()), regions: Mutex::new(Vec::new()) };
        // The thread lives as long as the process; it holds no region.
        let spawned = std::thread::Builder::new().name("dmkv-clock".into()).spawn(|| {
            loop {
                std::thread::sleep(CLOCK_INTERVAL);
                tick();
            }
        });
        if let Err(e) = spawned {
            tracing::error!("cannot start the clock thread ({e}); item expiry follows writes only");
        }
        c
    })
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Publishes the wall clock (never back) to every region, then to
/// [`now_ms`].
fn tick() {
    let c = clock();
    let t = wall_ms().max(c.now_ms.load(Ordering::Relaxed));
    {
        let mut regions = lock(&c.regions);
        regions.retain(|w| match w.upgrade() {
            Some(r) => {
                r.store_slot(CLOCK_OFFSET, t);
                true
            }
            None => false,
        });
    }
    c.now_ms.store(t, Ordering::Release);
}

/// The node's `CLOCK_MONOTONIC` in nanoseconds: the clock of shard leases
/// and of the engine's batch stamps. Readers on this host read the same
/// clock (`Instant` reads it too, but does not say its value), and it does
/// not move when the wall clock is stepped.
pub fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
}

/// The server's clock, unix ms, as last published.
pub fn now_ms() -> u64 {
    clock().now_ms.load(Ordering::Acquire)
}

/// Publishes the clock in `region` from now on (until it is dropped).
pub fn publish_to(region: &Arc<Region>) {
    let c = clock();
    let mut regions = lock(&c.regions);
    regions.retain(|w| w.strong_count() > 0);
    if regions.len() >= MAX_REGIONS {
        tracing::warn!("the clock is published to {MAX_REGIONS} regions already; not to one more");
        return;
    }
    region.store_slot(CLOCK_OFFSET, c.now_ms.load(Ordering::Acquire));
    regions.push(Arc::downgrade(region));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_monotonic_clock_is_instants_clock() {
        // Readers compare it with their own CLOCK_MONOTONIC: it must be
        // that clock, not one with another origin.
        let a = mono_ns();
        let i = std::time::Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        let took = i.elapsed().as_nanos() as u64;
        let b = mono_ns();
        assert!(b - a >= took && b - a < took + 5_000_000, "{} vs {took}", b - a);
    }

    #[test]
    fn regions_get_the_clock_and_it_never_goes_back() {
        let r = Arc::new(Region::create("clock", 4 << 20).unwrap());
        publish_to(&r);
        let first = r.load_slot(CLOCK_OFFSET);
        assert!(first > 1_600_000_000_000, "{first}");
        std::thread::sleep(CLOCK_INTERVAL * 5);
        let later = r.load_slot(CLOCK_OFFSET);
        assert!(later > first, "{later} after {first}");
        assert!(now_ms() >= later);
        drop(r);
        tick();
        assert!(lock(&clock().regions).iter().all(|w| w.strong_count() > 0));
    }
}
