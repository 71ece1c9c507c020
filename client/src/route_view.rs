//! The cluster map as one-sided readers check their batches against it.
//!
//! A shard's leader publishes, in its lease block, the map version at which
//! the shard's partitions last changed; a batch is believed only if the
//! reader knows a map of at least that version that gives every key of the
//! batch to this shard (`dmkv_common::cluster::lease::judge`,
//! docs/elasticity.md). Any map the reader holds is one the cluster
//! published, so the check may use the newest one at the attempt's start,
//! whatever map routed the request: the router keeps this view current.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dmkv_common::cluster::map::{ClusterMap, ShardId};

/// A map found stale by a shard's lease block is asked for again at most
/// this often (every GET of the shard finds it so until the new one comes).
pub const STALE_MAP_REFRESH: Duration = Duration::from_millis(20);

/// The router's current map, shared with its sessions' shard paths.
#[derive(Debug)]
pub struct RouteView {
    map: Mutex<Arc<ClusterMap>>,
    /// A shard's lease block named a newer placement than the map's.
    stale: AtomicBool,
    /// When the map was last asked for on that account.
    asked: Mutex<Option<Instant>>,
}

impl RouteView {
    pub fn new(map: ClusterMap) -> RouteView {
        RouteView { map: Mutex::new(Arc::new(map)), stale: AtomicBool::new(false), asked: Mutex::new(None) }
    }

    /// The version of the map held.
    pub fn version(&self) -> u64 {
        self.map().version
    }

    fn map(&self) -> Arc<ClusterMap> {
        // A whole-value swap: nothing a panic could leave half-written.
        Arc::clone(&self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Takes `map` if it is newer than the one held.
    pub fn update(&self, map: &ClusterMap) {
        let mut held = self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.version > held.version {
            *held = Arc::new(map.clone());
        }
    }

    /// A shard's lease block named a placement newer than this map: its
    /// batches are read over RPC until the map is asked for again.
    pub fn mark_stale(&self) {
        self.stale.store(true, Ordering::Relaxed);
    }

    /// Whether the map should be asked for again now, at `now`: it was
    /// found stale, and was not asked for within [`STALE_MAP_REFRESH`].
    pub fn refresh_due(&self, now: Instant) -> bool {
        if !self.stale.load(Ordering::Relaxed) {
            return false;
        }
        let mut asked = self.asked.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if asked.is_some_and(|t| now.saturating_duration_since(t) < STALE_MAP_REFRESH) {
            return false;
        }
        *asked = Some(now);
        self.stale.store(false, Ordering::Relaxed);
        true
    }

    /// The version of the map held if it gives every one of `keys` to
    /// `shard`; else 0, which no lease block accepts (a key that moved is
    /// read over RPC, which says where it went).
    pub fn routed_by<'a>(&self, shard: ShardId, mut keys: impl Iterator<Item = &'a [u8]>) -> u64 {
        let map = self.map();
        if keys.all(|k| map.shard_of(k).id == shard) { map.version } else { 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn a_batch_is_routed_by_the_map_only_if_every_key_is_the_shards() {
        let nodes: BTreeMap<u64, String> = (1..=3).map(|i| (i, format!("127.0.0.1:{}", 7070 + i))).collect();
        let map = ClusterMap::initial(nodes, 4, 3).unwrap();
        let view = RouteView::new(map.clone());
        let keys: Vec<Vec<u8>> = (0..50).map(|i| format!("k{i}").into_bytes()).collect();
        let m = &map;
        let of = |s: ShardId| keys.iter().filter(move |k| m.shard_of(k).id == s).map(Vec::as_slice);
        assert_eq!(view.routed_by(2, of(2)), map.version);
        assert_eq!(view.routed_by(2, of(2).chain(of(3))), 0, "a key of another shard");
        let mut newer = map.clone();
        newer.version += 1;
        view.update(&newer);
        assert_eq!(view.routed_by(1, of(1)), newer.version);
        view.update(&map);
        assert_eq!(view.routed_by(1, of(1)), newer.version, "an older map is not taken");
        // A stale map is asked for again once, then not until the pause
        // passed, however often it is found stale meanwhile.
        let t = Instant::now();
        assert!(!view.refresh_due(t));
        view.mark_stale();
        assert!(view.refresh_due(t));
        assert!(!view.refresh_due(t), "asked once");
        view.mark_stale();
        assert!(!view.refresh_due(t + STALE_MAP_REFRESH / 2));
        assert!(view.refresh_due(t + STALE_MAP_REFRESH));
    }
}
