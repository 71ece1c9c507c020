//! The cluster router: which node a key's request goes to, and what to do
//! when a node answers NOT_LEADER or cannot be reached. [`Routes`] is the
//! decision logic with no sockets (testable alone); [`Router`] drives it
//! over one session ([`Client`] in RPC mode) per node.
//!
//! A GET goes router → node session → transport: the router picks the
//! shard's leader, the session sends the request, and a NOT_LEADER answer
//! or a lost node sends the router to the next candidate, within the
//! request's deadline.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use dmkv_common::cluster::map::{ClusterMap, NodeId, ShardId};
use dmkv_common::proto::ErrorCode;
use std::sync::atomic::Ordering;
use tokio::time::Instant;

use crate::client::{Client, ClientConfig, ReadPath, Versioned};
use crate::error::ClientError;
use crate::onesided::ReadCounters;

/// First pause before retrying a shard with no known leader; doubles up
/// to [`MAX_PAUSE`].
pub const MIN_PAUSE: Duration = Duration::from_millis(5);
/// Longest pause between tries of one request.
pub const MAX_PAUSE: Duration = Duration::from_millis(100);
/// A try gets this share of a request's timeout ...
pub const TRIES_PER_TIMEOUT: u32 = 4;
/// ... but at least this long.
pub const MIN_TRY_TIMEOUT: Duration = Duration::from_millis(100);

/// Where requests for each shard go: the map, and leaders learned since.
#[derive(Debug, Clone)]
pub struct Routes {
    map: ClusterMap,
    /// Leaders learned from NOT_LEADER answers and failures, newer than
    /// the map's.
    hint: HashMap<ShardId, NodeId>,
}

impl Routes {
    pub fn new(map: ClusterMap) -> Routes {
        Routes { map, hint: HashMap::new() }
    }

    pub fn map(&self) -> &ClusterMap {
        &self.map
    }

    /// The shard of `key` and the node to ask: the leader last learned,
    /// else the map's, else the first replica.
    pub fn target(&self, key: &[u8]) -> (ShardId, NodeId) {
        let sh = self.map.shard_of(key);
        let node = self.hint.get(&sh.id).copied().or(sh.leader).unwrap_or(sh.replicas[0]);
        (sh.id, node)
    }

    /// The RPC address of `node`.
    pub fn addr(&self, node: NodeId) -> Option<&str> {
        self.map.nodes.get(&node).map(String::as_str)
    }

    /// `tried` said it does not lead `shard`, naming `leader` if it knows
    /// one; returns whether the answer helped (else: pause, then go on).
    pub fn on_not_leader(&mut self, shard: ShardId, tried: NodeId, leader: Option<NodeId>) -> bool {
        let replicas = &self.map.shards()[shard as usize].replicas;
        match leader {
            Some(l) if l != tried && replicas.contains(&l) => {
                self.hint.insert(shard, l);
                true
            }
            _ => {
                self.next_replica(shard, tried);
                false
            }
        }
    }

    /// `tried` could not be reached: try the next replica.
    pub fn on_unreachable(&mut self, shard: ShardId, tried: NodeId) {
        self.next_replica(shard, tried);
    }

    fn next_replica(&mut self, shard: ShardId, tried: NodeId) {
        let replicas = &self.map.shards()[shard as usize].replicas;
        let at = replicas.iter().position(|&n| n == tried).unwrap_or(0);
        self.hint.insert(shard, replicas[(at + 1) % replicas.len()]);
    }

    /// Takes what a node's map says of leaders (newer terms win); a map
    /// with another placement replaces ours.
    pub fn merge(&mut self, theirs: &ClusterMap) {
        if theirs.shards().len() != self.map.shards().len()
            || theirs.shards().iter().zip(self.map.shards()).any(|(a, b)| a.replicas != b.replicas)
        {
            self.map = theirs.clone();
            self.hint.clear();
            return;
        }
        for sh in theirs.shards() {
            if let Some(l) = sh.leader
                && self.map.set_leader(sh.id, l, sh.term) == Ok(true)
            {
                self.hint.remove(&sh.id);
            }
        }
    }
}

/// Routes requests to the nodes of a cluster.
pub struct Router {
    /// Sessions' settings: RPC for their own reads (a node's regions are
    /// read per shard, under leases, by `session`).
    cfg: ClientConfig,
    /// A request's whole time, over every try.
    deadline: Duration,
    /// GETs try the key's shard region one-sided first.
    one_sided: bool,
    /// Write ids: this router's random client id, and the next sequence.
    client_id: u64,
    next_seq: std::sync::atomic::AtomicU64,
    counters: std::sync::Arc<ReadCounters>,
    routes: std::sync::Mutex<Routes>,
    sessions: tokio::sync::Mutex<HashMap<NodeId, Client>>,
}

/// Whether a request may be sent again after it may have reached a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Reads: any failure may be retried.
    Always,
    /// Writes without an id: only a refusal that changed nothing
    /// (NOT_LEADER, BUSY, no connection) is retried; a lost reply is the
    /// caller's to judge.
    IfUnsent,
}

impl Router {
    /// A router from a map a node gave; sessions are opened on demand.
    /// One-sided reads are counted in `counters`.
    pub fn new(map: ClusterMap, cfg: &ClientConfig, counters: std::sync::Arc<ReadCounters>) -> Router {
        // `Auto` and `OneSided` both read one-sided where a lease allows
        // and over RPC elsewhere: in a cluster a lease can lapse at any
        // time, and the read must still be answered.
        let one_sided = cfg.read_path != ReadPath::Rpc;
        // A node that stopped answering (stalled, partitioned away) costs
        // one try, not the whole request: the rest is left for the others.
        let per_try = (cfg.request_timeout / TRIES_PER_TIMEOUT).max(MIN_TRY_TIMEOUT);
        let sessions = ClientConfig { read_path: ReadPath::Rpc, request_timeout: per_try, ..cfg.clone() };
        Router {
            cfg: sessions,
            deadline: cfg.request_timeout,
            one_sided,
            client_id: random_client_id(),
            next_seq: std::sync::atomic::AtomicU64::new(1),
            counters,
            routes: std::sync::Mutex::new(Routes::new(map)),
            sessions: Default::default(),
        }
    }

    /// The routes as they stand.
    pub fn routes(&self) -> Routes {
        self.routes.lock().expect("routes lock poisoned").clone()
    }

    async fn session(&self, node: NodeId) -> Result<Client, ClientError> {
        if let Some(s) = self.sessions.lock().await.get(&node) {
            return Ok(s.clone());
        }
        let addr = self.routes().addr(node).map(str::to_string).ok_or_else(|| ClientError::Connect {
            addr: format!("node {node}"),
            reason: "not in the cluster map".into(),
        })?;
        let s = Client::connect_session(addr, self.cfg.clone(), std::sync::Arc::clone(&self.counters)).await?;
        Ok(self.sessions.lock().await.entry(node).or_insert(s).clone())
    }

    async fn forget(&self, node: NodeId) {
        self.sessions.lock().await.remove(&node);
    }

    /// Asks any reachable node for its map and merges it.
    pub async fn refresh(&self) -> Result<(), ClientError> {
        let nodes: Vec<NodeId> = self.routes().map().nodes.keys().copied().collect();
        let mut last = None;
        for n in nodes {
            match self.session(n).await {
                Ok(s) => match s.cluster_map().await {
                    Ok(m) => {
                        self.routes.lock().expect("routes lock poisoned").merge(&m);
                        return Ok(());
                    }
                    Err(e) => last = Some(e),
                },
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(ClientError::ConnectionClosed))
    }

    /// Runs `op` against the node that should serve `key`, following
    /// NOT_LEADER answers and failed nodes until the request's deadline.
    pub async fn run<T, F, Fut>(&self, key: &[u8], retry: Retry, op: F) -> Result<T, ClientError>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let deadline = Instant::now() + self.deadline;
        let mut pause = MIN_PAUSE;
        let mut tries = 0u32;
        loop {
            tries += 1;
            let (shard, node) = self.routes.lock().expect("routes lock poisoned").target(key);
            let failure = match self.session(node).await {
                Err(e) => {
                    self.routes.lock().expect("routes lock poisoned").on_unreachable(shard, node);
                    e
                }
                Ok(s) => match op(s).await {
                    Err(ClientError::NotLeader { leader, .. }) => {
                        let helped =
                            self.routes.lock().expect("routes lock poisoned").on_not_leader(shard, node, leader);
                        if helped {
                            continue;
                        }
                        ClientError::NotLeader { leader, map_version: 0 }
                    }
                    Err(e) if e.code() == Some(ErrorCode::Busy) => e,
                    // The write may or may not have committed: sent again
                    // with its id, it applies at most once.
                    Err(e) if e.code() == Some(ErrorCode::Uncertain) && retry == Retry::Always => e,
                    Err(e) if e.is_transport() && (retry == Retry::Always || !e.may_have_been_sent()) => {
                        self.forget(node).await;
                        self.routes.lock().expect("routes lock poisoned").on_unreachable(shard, node);
                        e
                    }
                    Err(e) if e.is_transport() => {
                        self.forget(node).await;
                        self.routes.lock().expect("routes lock poisoned").on_unreachable(shard, node);
                        return Err(e);
                    }
                    r => return r,
                },
            };
            if Instant::now() + pause > deadline {
                tracing::debug!(tries, "cluster request gave up: {failure}");
                return Err(failure);
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(MAX_PAUSE);
            if tries.is_multiple_of(4) {
                let _ = self.refresh().await;
            }
        }
    }

    /// Reads `key` from its shard's leader (one-sided when the client's
    /// read path allows and the leader's lease covers the reads).
    pub async fn get(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        self.get_via(key, self.one_sided).await
    }

    /// Reads `key` from its shard's leader over RPC.
    pub async fn rpc_get(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        self.get_via(key, false).await
    }

    async fn get_via(&self, key: &[u8], one_sided: bool) -> Result<Option<Versioned>, ClientError> {
        let shard = self.routes().map().shard_of(key).id;
        self.run(key, Retry::Always, |s| async move { s.shard_get(shard, key, one_sided).await }).await
    }

    /// The id of a new write: the same on every try of it, so the shard
    /// applies it once however often it is sent.
    fn write_id(&self) -> dmkv_common::proto::WriteId {
        dmkv_common::proto::WriteId { client: self.client_id, seq: self.next_seq.fetch_add(1, Ordering::Relaxed) }
    }

    /// Writes `key` through its shard's leader; sent again after a lost
    /// reply or a leader change (it applies once).
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<u64, ClientError> {
        let id = self.write_id();
        self.run(key, Retry::Always, |s| async move { s.node_put_with(key, value, Some(id)).await }).await
    }

    /// Deletes `key` through its shard's leader (applied once, as `put`).
    pub async fn delete(&self, key: &[u8]) -> Result<bool, ClientError> {
        let id = self.write_id();
        self.run(key, Retry::Always, |s| async move { s.node_delete_with(key, Some(id)).await }).await
    }

    /// Reads many keys: split per shard, the shards asked in parallel.
    pub async fn multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, ClientError> {
        self.multi_get_via(keys, self.one_sided).await
    }

    /// [`Router::multi_get`] over RPC only.
    pub async fn rpc_multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, ClientError> {
        self.multi_get_via(keys, false).await
    }

    async fn multi_get_via<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        one_sided: bool,
    ) -> Result<Vec<Option<Bytes>>, ClientError> {
        let split = self.routes().map().split_by_shard(keys);
        let parts = split.into_iter().map(|(shard, idx)| async move {
            let first = keys[idx[0]].as_ref();
            let ks: Vec<&[u8]> = idx.iter().map(|&i| keys[i].as_ref()).collect();
            let ks = &ks;
            let values = self
                .run(first, Retry::Always, |s| async move { s.shard_multi_get(shard, ks, one_sided).await })
                .await?;
            Ok::<_, ClientError>((idx, values))
        });
        let mut out = vec![None; keys.len()];
        for r in futures_util::future::join_all(parts).await {
            let (idx, values) = r?;
            for (i, v) in idx.into_iter().zip(values) {
                out[i] = v;
            }
        }
        Ok(out)
    }
}

/// 64 random bits for a router's write ids: std's hasher keys are seeded
/// from the OS once per process and differ per `RandomState`; the time and
/// process id are mixed in too.
fn random_client_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn routes() -> Routes {
        let nodes: BTreeMap<NodeId, String> = (1..=3).map(|i| (i, format!("127.0.0.1:{}", 7000 + i))).collect();
        Routes::new(ClusterMap::initial(nodes, 4, 3).unwrap())
    }

    fn key_of(r: &Routes, shard: ShardId) -> Vec<u8> {
        (0..).map(|i: u32| format!("k{i}").into_bytes()).find(|k| r.target(k).0 == shard).unwrap()
    }

    #[test]
    fn not_leader_answers_and_failures_move_the_route() {
        let mut r = routes();
        let k = key_of(&r, 1);
        let (shard, first) = r.target(&k);
        assert_eq!(first, r.map().shards()[1].replicas[0], "no leader known: the first replica");
        // Told who leads: go there.
        let other = r.map().shards()[1].replicas[2];
        assert!(r.on_not_leader(shard, first, Some(other)));
        assert_eq!(r.target(&k), (shard, other));
        // A leader that is not a replica, or the node itself, does not help.
        assert!(!r.on_not_leader(shard, other, Some(99)));
        assert!(!r.on_not_leader(shard, other, Some(other)));
        // Each unhelpful answer or failure moves on round the replicas.
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..3 {
            let (_, n) = r.target(&k);
            seen.insert(n);
            r.on_unreachable(shard, n);
        }
        assert_eq!(seen.len(), 3, "every replica is tried");
    }

    #[test]
    fn merged_maps_bring_newer_leaders_only() {
        let mut r = routes();
        let k = key_of(&r, 2);
        let mut theirs = r.map().clone();
        let l = theirs.shards()[2].replicas[1];
        theirs.set_leader(2, l, 5).unwrap();
        r.merge(&theirs);
        assert_eq!(r.target(&k).1, l);
        // An older term's leader is old news.
        let mut old = r.map().clone();
        let mut older = ClusterMap::initial(old.nodes.clone(), 4, 3).unwrap();
        older.set_leader(2, old.shards()[2].replicas[2], 4).unwrap();
        r.merge(&older);
        assert_eq!(r.target(&k).1, l);
        old.set_leader(2, old.shards()[2].replicas[0], 6).unwrap();
        r.merge(&old);
        assert_eq!(r.target(&k).1, old.shards()[2].replicas[0]);
    }
}
