//! A cluster node session's reads: one-sided on the region of the key's
//! shard replica on that node while the replica leads and holds its lease,
//! over RPC (a linearizable read on the leader) otherwise.
//!
//! The router picks the node; this picks the path. A follower's or a
//! deposed leader's region has no lease that covers the reads, so reading
//! it ends in [`BackendError::Unleased`] and the read goes over RPC, where
//! NOT_LEADER sends the router on: never to a follower's stale memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::client::{Client, Versioned};
use crate::error::ClientError;
use crate::onesided::{self, AttachOptions, BackendError, OneSided, OneSidedGet};

/// How long after a failed attach a shard's region is tried again; reads
/// go over RPC meanwhile.
pub const SHARD_REATTACH_INTERVAL: Duration = Duration::from_millis(200);

/// One shard region's path on a node.
enum ShardPath {
    Attached(Arc<OneSided>),
    /// Someone is attaching it now.
    Attaching,
    Failed(Instant),
}

/// A session's one-sided paths, by shard.
#[derive(Default)]
pub struct ShardPaths(Mutex<HashMap<u32, ShardPath>>);

impl ShardPaths {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, ShardPath>> {
        // The map holds no invariant a panic could break midway.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Client {
    /// The path to `shard`'s region on this node: attached now by this
    /// caller if no one is attaching it and it did not just fail.
    async fn shard_path(&self, shard: u32) -> Option<Arc<OneSided>> {
        {
            let mut paths = self.shard_paths().lock();
            match paths.get(&shard) {
                Some(ShardPath::Attached(p)) => return Some(Arc::clone(p)),
                Some(ShardPath::Attaching) => return None,
                Some(ShardPath::Failed(t)) if t.elapsed() < SHARD_REATTACH_INTERVAL => return None,
                _ => {}
            }
            paths.insert(shard, ShardPath::Attaching);
        }
        let attached = self.attach_shard(shard).await;
        let mut paths = self.shard_paths().lock();
        match attached {
            Ok(p) => {
                let p = Arc::new(p);
                paths.insert(shard, ShardPath::Attached(Arc::clone(&p)));
                Some(p)
            }
            Err(e) => {
                tracing::debug!(shard, "one-sided reads of the shard's region unavailable: {e}");
                paths.insert(shard, ShardPath::Failed(Instant::now()));
                None
            }
        }
    }

    async fn attach_shard(&self, shard: u32) -> Result<OneSided, BackendError> {
        let cfg = self.config();
        let (info, sample) = onesided::clock_sample(self).await.map_err(|e| BackendError::Attach(e.to_string()))?;
        let opts = AttachOptions {
            forced: cfg.transport,
            timeout: cfg.connect_timeout,
            hint_entries: cfg.hint_cache_entries,
            counters: self.read_counters(),
            enforce_grace: cfg.enforce_grace,
            engine_connections: cfg.engine_connections,
            path_config: cfg.path,
            repaths: Arc::default(),
            token: self.token().cloned(),
            shard: Some(shard),
            clock: Some(sample),
            check_leases: cfg.check_leases,
        };
        onesided::attach(self, &info, opts).await
    }

    /// A path that failed (not for want of a lease) is attached anew later.
    fn shard_path_failed(&self, shard: u32, failed: &Arc<OneSided>, why: &BackendError) {
        tracing::debug!(shard, "one-sided path to the shard's region failed: {why}");
        let mut paths = self.shard_paths().lock();
        if matches!(paths.get(&shard), Some(ShardPath::Attached(p)) if Arc::ptr_eq(p, failed)) {
            paths.insert(shard, ShardPath::Failed(Instant::now()));
        }
    }

    /// Reads `key` of `shard` from this node: one-sided if `one_sided` and
    /// the region's lease covers the reads, else over RPC.
    pub(crate) async fn shard_get(
        &self,
        shard: u32,
        key: &[u8],
        one_sided: bool,
    ) -> Result<Option<Versioned>, ClientError> {
        // The path the RPC reply's address hint is for: the server says
        // where the item is in this very region.
        let mut hinted = None;
        if one_sided {
            if let Some(p) = self.shard_path(shard).await {
                match p.get(key).await {
                    Ok(OneSidedGet::Found(v)) => return Ok(Some(v)),
                    Ok(OneSidedGet::Missing) => return Ok(None),
                    Ok(OneSidedGet::GiveUp) | Err(BackendError::Unleased) => hinted = Some(p),
                    Err(e) => self.shard_path_failed(shard, &p, &e),
                }
            }
        } else {
            hinted = self.attached_shard_path(shard);
        }
        self.node_rpc_get_hinting(key, hinted.as_deref()).await
    }

    /// The path to `shard`'s region on this node, if it is attached now.
    fn attached_shard_path(&self, shard: u32) -> Option<Arc<OneSided>> {
        match self.shard_paths().lock().get(&shard) {
            Some(ShardPath::Attached(p)) => Some(Arc::clone(p)),
            _ => None,
        }
    }

    /// Reads `keys` (all of `shard`) from this node, as [`Client::shard_get`].
    pub(crate) async fn shard_multi_get<K: AsRef<[u8]>>(
        &self,
        shard: u32,
        keys: &[K],
        one_sided: bool,
    ) -> Result<Vec<Option<Bytes>>, ClientError> {
        if one_sided && let Some(p) = self.shard_path(shard).await {
            match self.one_sided_multi_get(&p, keys).await? {
                Ok(values) => return Ok(values),
                Err(BackendError::Unleased) => {}
                Err(e) => self.shard_path_failed(shard, &p, &e),
            }
        }
        self.node_rpc_multi_get(keys).await
    }
}
