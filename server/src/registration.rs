//! The region's registration: the rkey that one-sided readers must present
//! and the epoch that says which registration is current. A new
//! registration (restart, or the REREGISTER admin request) picks a new
//! random rkey and bumps the epoch, so every old rkey, cached address and
//! shared-memory handoff stops working.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dmkv_common::layout::RegionHeader;
use tokio::sync::watch;

use crate::lock::lock;
use crate::region::Region;

/// Current rkey and epoch of the region.
pub struct Registration {
    rkey: AtomicU64,
    /// Recovers from poisoning (`crate::lock`): `reregister` cannot panic
    /// between bumping the epoch and publishing it (the header write is
    /// in bounds by construction), so the header is always one that was
    /// or is about to be current.
    header: Mutex<RegionHeader>,
    epoch_tx: watch::Sender<u64>,
    /// Registrations of the region so far, the first included (metrics).
    count: AtomicU64,
}

impl Registration {
    /// The first registration of a freshly formatted region.
    pub fn new(header: RegionHeader) -> Registration {
        let (epoch_tx, _) = watch::channel(header.epoch);
        Registration {
            rkey: AtomicU64::new(new_rkey()),
            header: Mutex::new(header),
            epoch_tx,
            count: AtomicU64::new(1),
        }
    }

    /// The rkey readers must present.
    pub fn rkey(&self) -> u64 {
        self.rkey.load(Ordering::Acquire)
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        *self.epoch_tx.borrow()
    }

    /// The header as currently written (with the current epoch).
    pub fn header(&self) -> RegionHeader {
        *lock(&self.header)
    }

    /// Registrations so far: the first, and one per [`Registration::reregister`]
    /// (REREGISTER, rkey rotation, a cluster leader's fence).
    pub fn registrations(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Wakes when the epoch changes.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.epoch_tx.subscribe()
    }

    /// Registers the region anew: new rkey, next epoch, written into the
    /// region's header so that shared-memory readers see it too.
    pub fn reregister(&self, region: &Region) -> u64 {
        let mut h = lock(&self.header);
        h.epoch += 1;
        self.count.fetch_add(1, Ordering::Relaxed);
        // Invalidate the old rkey before the epoch is visible, so nothing
        // can pair the new epoch with the old key.
        self.rkey.store(new_rkey(), Ordering::Release);
        region.write(0, &h.encode());
        self.epoch_tx.send_replace(h.epoch);
        h.epoch
    }
}

/// A region one-sided readers may read, with its registration: the
/// node's one region, or each shard replica's in a cluster. The engine and
/// the shared-memory handoff find the region by the rkey presented.
#[derive(Clone)]
pub struct Served {
    pub region: Arc<Region>,
    pub reg: Arc<Registration>,
}

/// The regions a node serves one-sided readers. A cluster node's change
/// while it runs (a replica opens or closes as the map places shards), so
/// the engine and the handoff take the list as it is for each batch and
/// each handoff.
#[derive(Clone)]
pub struct ServedSet(Arc<std::sync::RwLock<Arc<[Served]>>>);

impl ServedSet {
    pub fn new(served: Vec<Served>) -> ServedSet {
        ServedSet(Arc::new(std::sync::RwLock::new(served.into())))
    }

    /// The regions served now.
    pub fn current(&self) -> Arc<[Served]> {
        Arc::clone(&self.0.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Serves `served` from now on (readers of a region no longer listed
    /// are refused as for a wrong rkey).
    pub fn set(&self, served: Vec<Served>) {
        *self.0.write().unwrap_or_else(std::sync::PoisonError::into_inner) = served.into();
    }
}

/// The served region whose current rkey is `rkey` (compared in constant
/// time per region).
pub fn find_by_rkey(served: &[Served], rkey: u64) -> Option<&Served> {
    served.iter().find(|s| dmkv_common::shm_handoff::rkey_matches(rkey, s.reg.rkey()))
}

fn new_rkey() -> u64 {
    // 64 random bits: guessing one takes ~2^63 tries, each a round trip
    // the engine counts. Never zero, which readers treat as "none".
    rand::random::<u64>().max(1)
}
