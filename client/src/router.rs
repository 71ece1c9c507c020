//! The cluster router: which node a key's request goes to, and what to do
//! when a node answers NOT_LEADER or cannot be reached. [`Routes`] is the
//! decision logic with no sockets (testable alone); [`Router`] drives it
//! over one [`Session`] per node.
//!
//! A GET goes router → node session → transport: the router picks the
//! shard's leader, the session sends the request, and a NOT_LEADER answer
//! or a lost node sends the router to the next candidate, within the
//! request's deadline.
//!
//! A write goes the same way with a write id, so a shard applies it once
//! however often it is sent — as long as the shard still remembers it: for
//! twice the write's retry window after applying it. The window is the
//! request timeout, at most [`MAX_WRITE_RETRY_WINDOW`]; the id names it,
//! and once a try may have reached a shard the write is sent again only
//! within that window of the try ([`Resend`]), and reported UNCERTAIN
//! after.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use dmkv_common::cluster::map::{ClusterMap, NodeId, ShardId};
use dmkv_common::limits::MAX_WRITE_RETRY_WINDOW;
use dmkv_common::proto::ErrorCode;
use dmkv_common::proto::request::Op;
use std::sync::atomic::Ordering;
use tokio::time::Instant;

use crate::config::ClientConfig;
use crate::error::{ClientError, ConnectReason};
use crate::onesided::ReadCounters;
use crate::read_path::ReadPath;
use crate::route_view::RouteView;
use crate::session::Session;
use crate::value::Versioned;

/// First pause before retrying a shard with no known leader; doubles up
/// to [`MAX_PAUSE`].
pub const MIN_PAUSE: Duration = Duration::from_millis(5);
/// Longest pause between tries of one request.
pub const MAX_PAUSE: Duration = Duration::from_millis(100);
/// A try gets this share of a request's timeout ...
pub const TRIES_PER_TIMEOUT: u32 = 4;
/// ... but at least this long.
pub const MIN_TRY_TIMEOUT: Duration = Duration::from_millis(100);
/// NOT_LEADER answers that name a leader are followed at once this many
/// times in a row; then the router pauses as after a failure (two nodes
/// that each name the other must not be asked in a tight loop).
pub const MAX_FREE_REDIRECTS: u32 = 3;

/// What to do after a try of a request (see [`Attempts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Try again at once.
    Now,
    /// Try again after this pause.
    After(Duration),
    /// The deadline leaves no room for another try.
    GiveUp,
}

/// The tries of one request, with its deadline: when to try again and
/// when to give up. Pure (time passed in), so its rules are tested on a
/// virtual clock; [`Router::run`] drives it.
#[derive(Debug, Clone)]
pub struct Attempts {
    deadline: Instant,
    pause: Duration,
    tries: u32,
    redirects: u32,
}

impl Attempts {
    /// A request started at `now` with `budget` for all its tries.
    pub fn new(now: Instant, budget: Duration) -> Attempts {
        Attempts { deadline: now + budget, pause: MIN_PAUSE, tries: 0, redirects: 0 }
    }

    /// A try starts at `now`; how long it may take to connect to its node
    /// (`connect`, but never past the deadline); `None`: no time is left.
    pub fn start(&mut self, now: Instant, connect: Duration) -> Option<Duration> {
        let left = self.deadline.checked_duration_since(now).filter(|d| !d.is_zero())?;
        self.tries += 1;
        Some(connect.min(left))
    }

    /// A node said who leads: follow it at once, unless the deadline has
    /// passed or redirects keep coming (then pause as after a failure).
    pub fn after_redirect(&mut self, now: Instant) -> Next {
        self.redirects += 1;
        if now >= self.deadline {
            return Next::GiveUp;
        }
        if self.redirects <= MAX_FREE_REDIRECTS {
            return Next::Now;
        }
        self.after_failure(now)
    }

    /// A try failed in a way worth another: pause (doubling, up to
    /// [`MAX_PAUSE`]) unless the pause would pass the deadline.
    pub fn after_failure(&mut self, now: Instant) -> Next {
        self.redirects = 0;
        if now + self.pause > self.deadline {
            return Next::GiveUp;
        }
        let p = self.pause;
        self.pause = (self.pause * 2).min(MAX_PAUSE);
        Next::After(p)
    }

    /// Whether the map should be asked for again before the next try.
    pub fn refresh_due(&self) -> bool {
        self.tries > 0 && self.tries.is_multiple_of(4)
    }

    /// Tries so far.
    pub fn tries(&self) -> u32 {
        self.tries
    }
}

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
        // A newer map taken meanwhile may have fewer shards.
        let Some(replicas) = self.map.shards().get(shard as usize).map(|s| &s.replicas) else { return false };
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
        let Some(replicas) = self.map.shards().get(shard as usize).map(|s| &s.replicas) else { return };
        let at = replicas.iter().position(|&n| n == tried).unwrap_or(0);
        self.hint.insert(shard, replicas[(at + 1) % replicas.len()]);
    }

    /// Takes what a node's map says of leaders (newer terms win); a map
    /// with a newer placement replaces ours, one with an older is ignored.
    pub fn merge(&mut self, theirs: &ClusterMap) {
        if theirs.version < self.map.version {
            return;
        }
        if theirs.version > self.map.version
            || theirs.shards().len() != self.map.shards().len()
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
    /// How long a write is sent again once a try of it may have reached a
    /// shard; its id tells the shard, which remembers it for twice that.
    write_window: Duration,
    /// GETs try the key's shard region one-sided first.
    one_sided: bool,
    /// Write ids: this router's random client id, and the next sequence.
    client_id: u64,
    next_seq: std::sync::atomic::AtomicU64,
    counters: std::sync::Arc<ReadCounters>,
    routes: std::sync::Mutex<Routes>,
    /// The newest map, as shard paths check their batches against it.
    view: std::sync::Arc<RouteView>,
    sessions: tokio::sync::Mutex<HashMap<NodeId, Session>>,
}

/// Whether a request may be sent again after it may have reached a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryPolicy {
    /// Reads: any failure may be retried.
    Always,
    /// A read of keys split by shard: as `Always`, but a WRONG_SHARD
    /// answer is returned (after the map is asked for again), for the
    /// caller to split the keys anew.
    Resplit,
    /// Writes with an id: any failure may be retried (the shard applies
    /// the write once), but once a try may have reached the shard, only
    /// within this window of it (see [`Resend`]).
    Identified(Duration),
}

/// The retry window of a write under a request timeout of `timeout`.
pub fn write_window(timeout: Duration) -> Duration {
    timeout.min(MAX_WRITE_RETRY_WINDOW)
}

/// Whether a try that failed with `e` may have taken effect.
fn may_have_applied(e: &ClientError) -> bool {
    e.code() == Some(ErrorCode::Uncertain) || (e.is_transport() && e.may_have_been_sent())
}

/// When an identified write may be sent again. While every try so far
/// surely changed nothing (NOT_LEADER, BUSY, no connection), at any time
/// within the request's deadline: the next try is as good as a first. Once
/// one may have reached a shard (no reply, UNCERTAIN), only within the
/// write's retry window of that try's start: the shard applied it after
/// the try started and remembers it for twice the window from then; the
/// second window is margin for a try's time in transit and queues, and for
/// leaders' clocks. Pure (time passed in), so it is tested alone.
#[derive(Debug, Clone)]
pub struct Resend {
    window: Duration,
    /// Until when, and the failure that may have taken effect.
    uncertain: Option<(Instant, ClientError)>,
}

impl Resend {
    pub fn new(window: Duration) -> Resend {
        Resend { window, uncertain: None }
    }

    /// A try that started at `started` failed with `e`.
    pub fn failed(&mut self, started: Instant, e: &ClientError) {
        if self.uncertain.is_none() && may_have_applied(e) {
            self.uncertain = Some((started + self.window, e.clone()));
        }
    }

    /// Whether a try may start at `now`; if not, what to report.
    pub fn check(&self, now: Instant) -> Result<(), ClientError> {
        match &self.uncertain {
            Some((until, first)) if now >= *until => Err(uncertain(format!(
                "the write may or may not have taken effect ({first}); not sent again past its retry window of {:?}",
                self.window
            ))),
            _ => Ok(()),
        }
    }

    /// What a write that stops trying reports, its last failure `last`:
    /// UNCERTAIN if any try may have taken effect (a later refusal does
    /// not say the earlier try did nothing), else `last`.
    pub fn report(&self, last: ClientError) -> ClientError {
        match &self.uncertain {
            None => last,
            Some((_, first)) => {
                uncertain(format!("the write may or may not have taken effect ({first}); then: {last}"))
            }
        }
    }
}

fn uncertain(message: String) -> ClientError {
    ClientError::Server { code: ErrorCode::Uncertain, message }
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
        // Each session prices its node's paths with a selector of its own.
        let sessions = ClientConfig { request_timeout: per_try, ..cfg.clone() };
        Router {
            cfg: sessions,
            deadline: cfg.request_timeout,
            write_window: write_window(cfg.request_timeout),
            one_sided,
            client_id: random_client_id(),
            next_seq: std::sync::atomic::AtomicU64::new(1),
            counters,
            view: std::sync::Arc::new(RouteView::new(map.clone())),
            routes: std::sync::Mutex::new(Routes::new(map)),
            sessions: Default::default(),
        }
    }

    /// How each open session's GETs have been routed, by node.
    pub async fn path_stats(&self) -> Vec<(NodeId, crate::session::PathStats)> {
        let sessions = self.sessions.lock().await;
        let mut out: Vec<_> = sessions.iter().map(|(n, s)| (*n, s.path_stats())).collect();
        out.sort_by_key(|(n, _)| *n);
        out
    }

    /// The routes as they stand.
    pub fn routes(&self) -> Routes {
        self.routes.lock().expect("routes lock poisoned").clone()
    }

    /// The session with `node`, opened within `connect` if there is none.
    async fn session(&self, node: NodeId, connect: Duration) -> Result<Session, ClientError> {
        if let Some(s) = self.sessions.lock().await.get(&node) {
            return Ok(s.clone());
        }
        let addr = self
            .routes()
            .addr(node)
            .map(str::to_string)
            .ok_or_else(|| ClientError::Connect { addr: format!("node {node}"), reason: ConnectReason::UnknownNode })?;
        let open = Session::open(addr.clone(), self.cfg.clone(), std::sync::Arc::clone(&self.counters));
        let s = match tokio::time::timeout(connect, open).await {
            Ok(s) => s?,
            Err(_) => return Err(ClientError::Connect { addr, reason: ConnectReason::TimedOut(connect) }),
        };
        s.set_routes(std::sync::Arc::clone(&self.view));
        Ok(self.sessions.lock().await.entry(node).or_insert(s).clone())
    }

    async fn forget(&self, node: NodeId) {
        self.sessions.lock().await.remove(&node);
    }

    /// Asks any reachable node for its map and merges it.
    pub async fn refresh(&self) -> Result<(), ClientError> {
        self.refresh_past(0).await
    }

    /// [`Router::refresh`], for a map found stale at `version`: the node
    /// asks the metadata group first unless its map is newer (0: never).
    async fn refresh_past(&self, version: u64) -> Result<(), ClientError> {
        let nodes: Vec<NodeId> = self.routes().map().nodes.keys().copied().collect();
        let mut last = None;
        for n in nodes {
            match self.session(n, self.cfg.connect_timeout).await {
                Ok(s) => match s.cluster_map_past(version).await {
                    Ok(m) => {
                        let mut routes = self.routes.lock().expect("routes lock poisoned");
                        routes.merge(&m);
                        self.view.update(routes.map());
                        return Ok(());
                    }
                    Err(e) => last = Some(e),
                },
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(ClientError::ConnectionClosed))
    }

    /// Asks for the map again if a shard's lease block showed it stale
    /// (rate-limited: `RouteView::refresh_due`).
    async fn refresh_if_stale(&self) {
        if self.view.refresh_due(std::time::Instant::now()) {
            // Within one try's time: a map that does not come now comes
            // with a later request.
            let stale = self.view.version();
            let _ = tokio::time::timeout(self.cfg.request_timeout, self.refresh_past(stale)).await;
        }
    }

    /// Runs `op` against the node that should serve `key`, following
    /// NOT_LEADER answers and failed nodes until the request's deadline
    /// (for an identified write, see [`Resend`]).
    pub async fn run<T, F, Fut>(&self, key: &[u8], retry: RetryPolicy, op: F) -> Result<T, ClientError>
    where
        F: Fn(Session) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        self.run_within(key, retry, self.deadline, op).await
    }

    /// [`Router::run`] within `budget` (what is left of a request that
    /// runs several).
    async fn run_within<T, F, Fut>(
        &self,
        key: &[u8],
        retry: RetryPolicy,
        budget: Duration,
        op: F,
    ) -> Result<T, ClientError>
    where
        F: Fn(Session) -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let mut attempts = Attempts::new(Instant::now(), budget);
        let mut last: Option<ClientError> = None;
        let mut resend = match retry {
            RetryPolicy::Identified(window) => Some(Resend::new(window)),
            _ => None,
        };
        let report = |resend: &Option<Resend>, e| match resend {
            Some(r) => r.report(e),
            None => e,
        };
        loop {
            let Some(connect) = attempts.start(Instant::now(), self.cfg.connect_timeout) else {
                return Err(report(&resend, last.unwrap_or(ClientError::Timeout(self.deadline))));
            };
            let (shard, node) = self.routes.lock().expect("routes lock poisoned").target(key);
            let failure = match self.session(node, connect).await {
                Err(e) => {
                    self.routes.lock().expect("routes lock poisoned").on_unreachable(shard, node);
                    e
                }
                Ok(s) => {
                    let started = Instant::now();
                    if let Some(r) = &resend {
                        r.check(started)?;
                    }
                    // `redirect`: a refusal that changed nothing and says
                    // where to go (not a try of a write that may have
                    // applied): followed at once, a few times.
                    let (redirect, failure) = match op(s).await {
                        Err(ClientError::NotLeader { leader, .. }) => {
                            let helped =
                                self.routes.lock().expect("routes lock poisoned").on_not_leader(shard, node, leader);
                            (helped, ClientError::NotLeader { leader, map_version: 0 })
                        }
                        // The key's partition moved: nothing changed. The
                        // map is asked for again, and the next try goes
                        // where it says.
                        Err(e) if e.code() == Some(ErrorCode::WrongShard) => {
                            self.view.mark_stale();
                            self.refresh_if_stale().await;
                            if retry == RetryPolicy::Resplit {
                                return Err(e);
                            }
                            (true, e)
                        }
                        Err(e) if e.code() == Some(ErrorCode::Busy) => (false, e),
                        // The write may or may not have committed: sent
                        // again with its id, it applies at most once.
                        // Every request this router sends may be sent again:
                        // reads, and writes with an id.
                        Err(e) if e.code() == Some(ErrorCode::Uncertain) => (false, e),
                        Err(e) if e.is_transport() => {
                            self.forget(node).await;
                            self.routes.lock().expect("routes lock poisoned").on_unreachable(shard, node);
                            (false, e)
                        }
                        r => return r.map_err(|e| report(&resend, e)),
                    };
                    if redirect {
                        match attempts.after_redirect(Instant::now()) {
                            Next::Now => {}
                            Next::After(p) => tokio::time::sleep(p).await,
                            Next::GiveUp => return Err(report(&resend, failure)),
                        }
                        last = Some(failure);
                        continue;
                    }
                    if let Some(r) = &mut resend {
                        r.failed(started, &failure);
                    }
                    failure
                }
            };
            match attempts.after_failure(Instant::now()) {
                Next::GiveUp => {
                    tracing::debug!(tries = attempts.tries(), "cluster request gave up: {failure}");
                    return Err(report(&resend, failure));
                }
                Next::Now => {}
                Next::After(p) => tokio::time::sleep(p).await,
            }
            last = Some(failure);
            if attempts.refresh_due() {
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
        self.refresh_if_stale().await;
        // The shard as the map says on each try (a partition may move).
        self.run(key, RetryPolicy::Always, |s| async move {
            // Under the lock: a GET need not copy the whole map.
            let shard = self.routes.lock().expect("routes lock poisoned").map().shard_of(key).id;
            s.shard_get(shard, key, one_sided).await
        })
        .await
    }

    /// The id of a new write: the same on every try of it, so the shard
    /// applies it once however often it is sent within its window.
    fn write_id(&self) -> dmkv_common::proto::WriteId {
        dmkv_common::proto::WriteId {
            client: self.client_id,
            seq: self.next_seq.fetch_add(1, Ordering::Relaxed),
            retry_window_ms: u32::try_from(self.write_window.as_millis()).unwrap_or(u32::MAX).max(1),
        }
    }

    /// Writes `key` through its shard's leader; sent again after a lost
    /// reply or a leader change (it applies once) within its window.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<u64, ClientError> {
        let id = self.write_id();
        let retry = RetryPolicy::Identified(self.write_window);
        self.run(key, retry, |s| async move { s.put_with(key, value, Some(id)).await }).await
    }

    /// Deletes `key` through its shard's leader (applied once, as `put`).
    pub async fn delete(&self, key: &[u8]) -> Result<bool, ClientError> {
        let id = self.write_id();
        let retry = RetryPolicy::Identified(self.write_window);
        self.run(key, retry, |s| async move { s.delete_with(key, Some(id)).await }).await
    }

    /// Any other write of `key` (a mode, flags, TTL, CAS, a counter, a
    /// touch) through its shard's leader: `op` makes the request with the
    /// write's id, the same on every try, so it applies once within its
    /// window however often it is sent.
    pub async fn write_call(
        &self,
        key: &[u8],
        op: impl Fn(dmkv_common::proto::WriteId) -> Op,
    ) -> Result<dmkv_common::proto::response::Result, ClientError> {
        let id = self.write_id();
        let retry = RetryPolicy::Identified(self.write_window);
        let op = &op;
        self.run(key, retry, |s| async move { s.call(op(id)).await }).await
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
        self.refresh_if_stale().await;
        let mut out = vec![None; keys.len()];
        let mut todo: Vec<usize> = (0..keys.len()).collect();
        // Keys whose partition moved are split again by the map asked for
        // since, until the one deadline of the whole request.
        let mut attempts = Attempts::new(Instant::now(), self.deadline);
        loop {
            let Some(left) = attempts.start(Instant::now(), self.deadline) else {
                return Err(ClientError::Timeout(self.deadline));
            };
            let routes = self.routes();
            let mut split: std::collections::BTreeMap<ShardId, Vec<usize>> = Default::default();
            for &i in &todo {
                split.entry(routes.map().shard_of(keys[i].as_ref()).id).or_default().push(i);
            }
            let parts = split.into_iter().map(|(shard, idx)| async move {
                let first = keys[idx[0]].as_ref();
                let ks: Vec<&[u8]> = idx.iter().map(|&i| keys[i].as_ref()).collect();
                let ks = &ks;
                let got = self.run_within(first, RetryPolicy::Resplit, left, |s| async move {
                    s.shard_multi_get(shard, ks, one_sided).await
                });
                (idx, got.await)
            });
            todo = Vec::new();
            let mut moved = None;
            for (idx, r) in futures_util::future::join_all(parts).await {
                match r {
                    Ok(values) => {
                        for (i, v) in idx.into_iter().zip(values) {
                            out[i] = v;
                        }
                    }
                    Err(e) if e.code() == Some(ErrorCode::WrongShard) => {
                        todo.extend(idx);
                        moved = Some(e);
                    }
                    Err(e) => return Err(e),
                }
            }
            let Some(moved) = moved else { return Ok(out) };
            match attempts.after_redirect(Instant::now()) {
                Next::Now => {}
                Next::After(p) => tokio::time::sleep(p).await,
                Next::GiveUp => return Err(moved),
            }
        }
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
    fn tries_stop_at_the_deadline_and_redirects_do_not_spin() {
        let t0 = Instant::now();
        let mut a = Attempts::new(t0, Duration::from_millis(100));
        // A connect gets the time left, not the whole connect timeout.
        assert_eq!(a.start(t0, Duration::from_secs(3)), Some(Duration::from_millis(100)));
        assert_eq!(a.start(t0 + Duration::from_millis(90), Duration::from_secs(3)), Some(Duration::from_millis(10)));
        assert_eq!(a.start(t0 + Duration::from_millis(100), Duration::from_secs(3)), None, "no time left");
        // Helpful redirects are followed at once a few times, then paused.
        let mut a = Attempts::new(t0, Duration::from_millis(100));
        for _ in 0..MAX_FREE_REDIRECTS {
            assert_eq!(a.after_redirect(t0), Next::Now);
        }
        assert_eq!(a.after_redirect(t0), Next::After(MIN_PAUSE));
        // Past the deadline a redirect is not followed (it looped until
        // the deadline before, and past it when nodes kept naming each
        // other).
        assert_eq!(a.after_redirect(t0 + Duration::from_millis(100)), Next::GiveUp);
        // Failures back off and give up when the pause would pass it.
        let mut a = Attempts::new(t0, Duration::from_millis(100));
        assert_eq!(a.after_failure(t0), Next::After(MIN_PAUSE));
        assert_eq!(a.after_failure(t0), Next::After(MIN_PAUSE * 2));
        assert_eq!(a.after_failure(t0 + Duration::from_millis(95)), Next::GiveUp);
    }

    #[test]
    fn a_write_is_sent_again_only_within_its_window_of_a_try_that_may_have_applied() {
        let t0 = Instant::now();
        let w = Duration::from_secs(5);
        let mut r = Resend::new(w);
        // Refusals change nothing: the next try is as good as a first.
        let busy = ClientError::Server { code: ErrorCode::Busy, message: "busy".into() };
        r.failed(t0, &ClientError::NotLeader { leader: None, map_version: 0 });
        r.failed(
            t0,
            &ClientError::Connect { addr: "a".into(), reason: ConnectReason::TimedOut(Duration::from_secs(1)) },
        );
        r.failed(t0, &busy);
        assert!(r.check(t0 + 100 * w).is_ok());
        assert_eq!(r.report(busy.clone()).code(), Some(ErrorCode::Busy));
        // A try with no reply opens the window, from when it started.
        let s = t0 + Duration::from_secs(1);
        r.failed(s, &ClientError::Timeout(Duration::from_secs(1)));
        assert!(r.check(s + w - Duration::from_millis(1)).is_ok());
        let e = r.check(s + w).unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::Uncertain), "{e}");
        // A later uncertain try does not move it on.
        r.failed(s + Duration::from_secs(4), &ClientError::Server { code: ErrorCode::Uncertain, message: "".into() });
        assert!(r.check(s + w).is_err());
        // Whatever a later try says, the write may have taken effect.
        assert_eq!(r.report(busy).code(), Some(ErrorCode::Uncertain));
    }

    #[test]
    fn a_write_window_is_the_timeout_at_most_the_maximum() {
        assert_eq!(write_window(Duration::from_secs(2)), Duration::from_secs(2));
        assert_eq!(write_window(Duration::from_secs(600)), MAX_WRITE_RETRY_WINDOW);
    }

    /// A node that answers HELLO, every PUT with UNCERTAIN and everything
    /// else with BUSY, and notes when each PUT came and the window its id
    /// named.
    async fn uncertain_node() -> (String, std::sync::Arc<std::sync::Mutex<Vec<(Instant, u32)>>>) {
        use dmkv_common::frame::{Decoder, encode};
        use dmkv_common::proto::{self, request::Op, response::Result as R};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let puts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = std::sync::Arc::clone(&puts);
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let seen = std::sync::Arc::clone(&seen);
                tokio::spawn(async move {
                    let max = dmkv_common::limits::DEFAULT_MAX_FRAME_LEN;
                    let (dec, mut buf, mut out) = (Decoder::new(max), bytes::BytesMut::new(), bytes::BytesMut::new());
                    while s.read_buf(&mut buf).await.is_ok_and(|n| n > 0) {
                        while let Ok(Some(req)) = dec.next_message::<proto::Request>(&mut buf) {
                            let error = |code: ErrorCode| {
                                R::Error(proto::Error { code: code.into(), message: "".into(), ..Default::default() })
                            };
                            let result = match req.op {
                                Some(Op::Hello(_)) => R::Hello(proto::HelloReply {
                                    protocol_version: dmkv_common::PROTOCOL_VERSION,
                                    ..Default::default()
                                }),
                                Some(Op::Put(p)) => {
                                    let window = p.write_id.map_or(0, |w| w.retry_window_ms);
                                    seen.lock().unwrap().push((Instant::now(), window));
                                    error(ErrorCode::Uncertain)
                                }
                                _ => error(ErrorCode::Busy),
                            };
                            encode(&proto::Response { id: req.id, result: Some(result) }, max, &mut out).unwrap();
                        }
                        if s.write_all(&out.split()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, puts)
    }

    #[tokio::test]
    async fn the_router_sends_a_write_again_only_within_its_window_and_reads_for_the_whole_timeout() {
        let (addr, puts) = uncertain_node().await;
        let map = ClusterMap::initial([(1, addr)].into_iter().collect(), 1, 1).unwrap();
        let cfg = ClientConfig { request_timeout: Duration::from_millis(1500), ..Default::default() };
        let mut router = Router::new(map, &cfg, Default::default());
        // As if the most a write may be sent again were 300 ms.
        let window = Duration::from_millis(300);
        router.write_window = window;
        let start = Instant::now();
        let e = router.put(b"k", b"v").await.unwrap_err();
        let took = start.elapsed();
        assert_eq!(e.code(), Some(ErrorCode::Uncertain), "{e}");
        let puts = puts.lock().unwrap().clone();
        assert!(puts.len() >= 2, "sent again within its window: {puts:?}");
        assert!(puts.iter().all(|&(_, w)| w == 300), "the id names the window: {puts:?}");
        // A try starts before the window ends; it reaches the node a
        // moment later (loopback, so the slack is generous).
        let last = puts.last().unwrap().0.duration_since(puts[0].0);
        assert!(last < window + Duration::from_millis(150), "a try {last:?} after the first");
        assert!(took < Duration::from_millis(1000), "reported when its window ended: {took:?}");
        // Reads on the same router retry for the whole request timeout.
        let start = Instant::now();
        let e = router.rpc_get(b"k").await.unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::Busy), "{e}");
        assert!(start.elapsed() >= Duration::from_millis(1200), "{:?}", start.elapsed());
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
