//! A session with one node: its RPC pool, its one-sided paths (the
//! node's own region, or its shard regions in a cluster) and the path
//! selector that prices them against RPC. One `get` plans (the
//! selector), executes (a one-sided read or an RPC) and reports; a
//! one-sided read that gives up returns that as an outcome, and the RPC
//! that answers instead is sent by the caller, outside the measurement.

use std::collections::HashMap;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dmkv_common::error::check_key;
use dmkv_common::limits::MAX_MULTI_GET_KEYS;
use dmkv_common::path::{ControllerStats, Path};
use dmkv_common::proto::{self, ErrorCode, request::Op, response::Result as R};
use dmkv_common::request::Body;

use crate::attach_state::{AttachPolicy, AttachState, AttachTicket, Generation};
use crate::config::ClientConfig;
use crate::conn::InFlight;
use crate::error::{ClientError, unexpected, unwrap};
use crate::onesided::{
    self, AttachOptions, BackendError, ItemMeta, LocalGet, OneSided, OneSidedGet, ReadCounters, ReadStats,
};
use crate::path::{Admission, ConnHealth, PathSelector, selector_hash};
use crate::pool::RpcPool;
use crate::read_path::{ReadPath, Transport};
use crate::value::Versioned;

/// A session with one node. Cheap to clone; clones share it.
#[derive(Clone)]
pub struct Session {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: ClientConfig,
    pool: Arc<RpcPool>,
    /// The node's own region (a single node).
    path: Mutex<AttachState<Arc<OneSided>>>,
    /// Held by a forced attach (`ReadPath::OneSided`, and `open`), so the
    /// GETs that need the path at once wait for the one attaching it and
    /// then read that one, instead of each attaching its own.
    attach_gate: tokio::sync::Mutex<()>,
    read_counters: Arc<ReadCounters>,
    selector: Arc<PathSelector>,
    rpc_health: ConnHealth,
    rpc_repaths: Arc<AtomicU64>,
    engine_repaths: Arc<AtomicU64>,
    /// A cluster session's one-sided paths, per shard region of its node.
    shard_paths: ShardPaths,
    /// The RDMA queue pairs those shard paths share.
    node_rdma: Arc<onesided::NodeRdma>,
    /// The cluster router's map, which shard paths check batches against
    /// (set once by the router that opened the session).
    routes: std::sync::OnceLock<Arc<crate::route_view::RouteView>>,
}

/// Which of a session's regions a GET reads: the node's own (a single
/// node), or a cluster shard's replica on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Region {
    Node,
    Shard(u32),
}

impl Region {
    /// The path an RPC reply's address hint is for, when the session does
    /// not find it itself: a shard's (a single node's is the attached one).
    fn hinted(self, path: &OneSided) -> Option<&OneSided> {
        match self {
            Region::Node => None,
            Region::Shard(_) => Some(path),
        }
    }
}

/// How this client's GETs have been routed (see [`Session::path_stats`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PathStats {
    /// Windows, delays and counters of both paths, and the switches
    /// between them.
    pub controller: ControllerStats,
    /// The one-sided backend attached now, if any.
    pub transport: Option<Transport>,
    /// Congested RPC connections replaced by fresh ones.
    pub rpc_repaths: u64,
    /// Congested engine connections replaced by fresh ones.
    pub engine_repaths: u64,
}

impl std::fmt::Display for PathStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.controller;
        let transport = self.transport.map_or("none", Transport::name);
        writeln!(f, "preferred {} switches {} transport {transport}", c.preferred.name(), c.switches)?;
        writeln!(
            f,
            "{:<10} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9} {:>6} {:>7}",
            "path",
            "requests",
            "probes",
            "failures",
            "retries",
            "diverted",
            "window",
            "base_us",
            "delay_us",
            "target_us",
            "rounds",
            "repaths"
        )?;
        for (p, s, repaths) in
            [(Path::OneSided, &c.one_sided, self.engine_repaths), (Path::Rpc, &c.rpc, self.rpc_repaths)]
        {
            writeln!(
                f,
                "{:<10} {:>9} {:>7} {:>8} {:>8} {:>8} {:>8.1} {:>9.1} {:>9.1} {:>9.1} {:>6.2} {:>7}",
                p.name(),
                s.requests,
                s.probes,
                s.failures,
                s.retries,
                s.diverted,
                s.window,
                s.base_delay_ns as f64 / 1e3,
                s.delay_ns as f64 / 1e3,
                s.target_ns as f64 / 1e3,
                s.round_trips,
                repaths
            )?;
        }
        Ok(())
    }
}

/// A path as a GET got it from its region's state: its failure is
/// reported by the generation, so a GET that read a path since replaced
/// does not detach the new one.
#[derive(Clone)]
struct Held {
    generation: Generation,
    path: Arc<OneSided>,
}

impl Held {
    fn of(st: &AttachState<Arc<OneSided>>) -> Option<Held> {
        st.attached().map(|(generation, path)| Held { generation, path: Arc::clone(path) })
    }
}

impl Deref for Held {
    type Target = OneSided;

    fn deref(&self) -> &OneSided {
        &self.path
    }
}

/// A try at attaching a region, handed back to the region's state
/// whatever becomes of it. Dropped unfinished (the GET that was attaching
/// was cancelled, or the runtime shut down) it counts as a failed try:
/// a region left attaching would never be tried again.
struct Pending {
    session: Session,
    region: Region,
    ticket: Option<AttachTicket>,
}

impl Pending {
    fn new(session: &Session, region: Region, ticket: AttachTicket) -> Self {
        Pending { session: session.clone(), region, ticket: Some(ticket) }
    }

    /// The try attached `path`: GETs read it from now on. `None` only if
    /// the ticket was not its region's try in flight (a bug).
    fn attached(mut self, path: OneSided) -> Option<Held> {
        let ticket = self.ticket.take()?;
        let path = Arc::new(path);
        let selector = &self.session.inner.selector;
        let generation = self.session.with_state(self.region, |st| {
            let generation = st.handle_attached(ticket, Arc::clone(&path), Instant::now())?;
            selector.set_usable(Path::OneSided, true);
            Some(generation)
        })?;
        Some(Held { generation, path })
    }

    fn failed(mut self) {
        self.hand_back_failed();
    }

    fn hand_back_failed(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            self.session.with_state(self.region, |st| st.handle_failed(ticket, Instant::now()));
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.hand_back_failed();
    }
}

/// Paths a `ReadPath::OneSided` GET or multi-get tries (the one attached,
/// then a fresh one) before it fails: it never answers over RPC because its
/// path broke, only for keys whose reads keep failing verification.
const FORCED_ONE_SIDED_TRIES: usize = 2;
/// Attempts to attach a region whose registration changed under the
/// attempt (an rkey rotation between its descriptor and the first read):
/// each asks for the descriptor again.
const STALE_ATTACH_TRIES: usize = 3;

/// What a measured one-sided GET came to.
enum Measured {
    /// Found or missing.
    Done(Option<Versioned>),
    /// Verification kept failing: the server must answer over RPC.
    AskServer(GaveUp),
}

/// A one-sided GET that gave up, still to be priced: its RPC is part of
/// what choosing the one-sided path cost this GET, so the admission is
/// completed after that RPC ([`GaveUp::asked`]), whatever the RPC's
/// outcome (its failure is the RPC's, not the path's).
#[must_use = "complete the admission once the server has been asked"]
struct GaveUp {
    adm: Option<Admission>,
    round_trips: u32,
    retries: u32,
}

impl GaveUp {
    /// The server was asked: the RPC counts as one more round trip.
    fn asked(self) {
        if let Some(adm) = self.adm {
            adm.complete(self.round_trips + 1, self.retries);
        }
    }
}

impl Session {
    /// Opens a session with the node at `addr`: one connection now (so a
    /// wrong address fails here), with the protocol version checked. On a
    /// single node the one-sided path is attached as `cfg.read_path` and
    /// `cfg.transport` say; a cluster node's shard regions are attached on
    /// first read. Its one-sided reads are counted in `counters`.
    pub async fn open(addr: String, cfg: ClientConfig, counters: Arc<ReadCounters>) -> Result<Session, ClientError> {
        let session = Session::unconnected(addr, cfg, counters)?;
        let pool = &session.inner.pool;
        pool.conn_at(0, pool.deadline()).await?;
        if pool.is_cluster_node() {
            return Ok(session);
        }
        match (session.inner.cfg.read_path, session.inner.cfg.transport) {
            (ReadPath::Rpc, _) => {}
            // A forced transport is what the caller asked for: failing to
            // attach it is an error, not a reason to read over RPC.
            (ReadPath::Auto | ReadPath::OneSided, Some(transport)) => {
                session.attach().await.map_err(|e| match e {
                    ClientError::OneSidedUnavailable(reason) => ClientError::TransportUnavailable { transport, reason },
                    other => other,
                })?;
            }
            (ReadPath::Auto, None) => {
                if let Err(e) = session.attach().await {
                    tracing::debug!("one-sided reads unavailable, using RPC: {e}");
                }
            }
            (ReadPath::OneSided, None) => {
                session.attach().await?;
            }
        }
        Ok(session)
    }

    /// Gives a cluster session the router's map, for its shard paths to
    /// check their batches against (once; a later call changes nothing).
    pub(crate) fn set_routes(&self, routes: Arc<crate::route_view::RouteView>) {
        let _ = self.inner.routes.set(routes);
    }

    /// A session with no connection yet (the first request opens one).
    fn unconnected(addr: String, cfg: ClientConfig, counters: Arc<ReadCounters>) -> Result<Session, ClientError> {
        let pool = Arc::new(RpcPool::new(addr, cfg.clone())?);
        let selector = PathSelector::new(cfg.path);
        selector.set_usable(Path::Rpc, true);
        let rpc_repaths = Arc::new(AtomicU64::new(0));
        let inner = Inner {
            rpc_health: ConnHealth::new(pool.len(), cfg.path, Arc::clone(&rpc_repaths)),
            cfg,
            pool,
            path: Mutex::new(AttachState::new(AttachPolicy::NODE)),
            attach_gate: tokio::sync::Mutex::new(()),
            read_counters: counters,
            selector,
            rpc_repaths,
            engine_repaths: Arc::default(),
            shard_paths: Default::default(),
            node_rdma: Arc::default(),
            routes: std::sync::OnceLock::new(),
        };
        Ok(Session { inner: Arc::new(inner) })
    }

    /// The one-sided path, attaching it if needed (rate-limited in `Auto`).
    async fn one_sided(&self) -> Result<Option<Held>, ClientError> {
        match self.inner.cfg.read_path {
            ReadPath::Rpc => Ok(None),
            ReadPath::OneSided => self.attach().await.map(Some),
            ReadPath::Auto => {
                let ticket = {
                    let mut st = self.node_state();
                    if let Some(held) = Held::of(&st) {
                        return Ok(Some(held));
                    }
                    st.poll_attach(Instant::now())
                };
                let Some(ticket) = ticket else { return Ok(None) };
                let pending = Pending::new(self, Region::Node, ticket);
                // Attach in the background: a GET must not wait for a
                // connect that may time out; it goes over RPC meanwhile.
                let session = self.clone();
                tokio::spawn(async move {
                    match session.attach_node().await {
                        Ok(path) => drop(pending.attached(path)),
                        Err(e) => {
                            tracing::debug!("one-sided reads unavailable, using RPC: {e}");
                            pending.failed();
                        }
                    }
                });
                Ok(None)
            }
        }
    }

    /// The node's region, attached now if it is not (a caller that needs
    /// it: no interval after a failure).
    async fn attach(&self) -> Result<Held, ClientError> {
        // Attached is the common case: no gate, no wait.
        if let Some(held) = Held::of(&self.node_state()) {
            return Ok(held);
        }
        let waited_from = Instant::now();
        let _gate = self.inner.attach_gate.lock().await;
        let ticket = {
            let mut st = self.node_state();
            if let Some(held) = Held::of(&st) {
                return Ok(held);
            }
            // A try that failed while this caller waited for the gate is
            // its answer too: trying again, one waiter after another, would
            // queue each behind the last one's timeout.
            if let crate::attach_state::Phase::Failed { at } = st.phase()
                && at >= waited_from
            {
                return Err(ClientError::OneSidedUnavailable(
                    "the try to attach the region that this GET waited for failed".into(),
                ));
            }
            st.poll_forced_attach(Instant::now())
        };
        // Forced attaches hold the gate, and background ones run only in
        // `Auto`, where this is called by `open` alone, before any GET.
        let busy = || ClientError::OneSidedUnavailable("another attach of the region is under way".into());
        let pending = Pending::new(self, Region::Node, ticket.ok_or_else(busy)?);
        match self.attach_node().await {
            Ok(path) => pending.attached(path).ok_or_else(busy),
            Err(e) => {
                pending.failed();
                Err(e)
            }
        }
    }

    /// Attaches the node's region: the IO of an attach, the state left to
    /// the caller.
    async fn attach_node(&self) -> Result<OneSided, ClientError> {
        let cfg = &self.inner.cfg;
        let mut tries = 0;
        let attached = loop {
            let info = self.region_info_full().await?;
            let opts = AttachOptions {
                forced: cfg.transport,
                timeout: cfg.connect_timeout,
                hint_entries: cfg.hint_cache_entries,
                counters: Arc::clone(&self.inner.read_counters),
                enforce_grace: cfg.enforce_grace,
                engine_connections: cfg.engine_connections,
                path_config: cfg.path,
                repaths: Arc::clone(&self.inner.engine_repaths),
                token: self.inner.pool.token().cloned(),
                shard: None,
                clock: None,
                check_leases: cfg.check_leases,
                node_rdma: Arc::default(),
                routes: None,
            };
            tries += 1;
            match onesided::attach(&self.inner.pool, &info, opts).await {
                // The region was registered anew (an rkey rotation) while
                // attaching: its new descriptor is asked for again.
                Err(BackendError::Stale) if tries < STALE_ATTACH_TRIES => {}
                r => break r,
            }
        };
        let path = attached.map_err(|e| {
            // A forced transport's reason is the whole story (see `open`).
            ClientError::OneSidedUnavailable(if cfg.transport.is_some() { attach_reason(e) } else { e.to_string() })
        })?;
        debug_assert!(cfg.transport.is_none_or(|t| t == path.transport()), "a forced transport is the only one");
        Ok(path)
    }

    /// Forgets a path that failed, so the next GET attaches anew.
    fn detach(&self, failed: &Held, why: &BackendError) {
        tracing::debug!("one-sided path failed: {why}");
        let mut st = self.node_state();
        if st.handle_detach(failed.generation, Instant::now()) {
            self.inner.selector.set_usable(Path::OneSided, false);
        }
    }

    /// The node region's state. Its transitions are whole assignments, so a
    /// panic elsewhere cannot leave it half changed; and the metrics
    /// collectors that read it inside an application's scrape handler must
    /// not panic there.
    fn node_state(&self) -> std::sync::MutexGuard<'_, AttachState<Arc<OneSided>>> {
        self.inner.path.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Runs `f` on `region`'s state.
    fn with_state<R>(&self, region: Region, f: impl FnOnce(&mut AttachState<Arc<OneSided>>) -> R) -> R {
        match region {
            Region::Node => f(&mut self.node_state()),
            Region::Shard(s) => f(self.shard_paths().lock().entry(s).or_insert_with(ShardPaths::new_state)),
        }
    }

    /// `region`'s path attached now, if any.
    fn attached_path(&self, region: Region) -> Option<Held> {
        match region {
            Region::Node => Held::of(&self.node_state()),
            Region::Shard(s) => self.attached_shard_path(s),
        }
    }

    /// The one-sided backend GETs use now, if any.
    pub fn one_sided_transport(&self) -> Option<Transport> {
        self.node_state().attached().map(|(_, p)| p.transport())
    }

    /// Counters of this client's reads: one-sided ones, their retries and
    /// fallbacks, and the keys read over RPC.
    pub fn read_stats(&self) -> ReadStats {
        self.inner.read_counters.snapshot()
    }

    /// How this client's GETs have been routed: per path the requests,
    /// retries, window and delay estimates, and the switches and repaths.
    pub fn path_stats(&self) -> PathStats {
        PathStats {
            controller: self.inner.selector.stats(),
            transport: self.one_sided_transport(),
            rpc_repaths: self.inner.rpc_repaths.load(Ordering::Relaxed),
            engine_repaths: self.inner.engine_repaths.load(Ordering::Relaxed),
        }
    }

    /// The node's address.
    pub fn addr(&self) -> &str {
        self.inner.pool.addr()
    }

    /// The node's RPC pool.
    pub fn pool(&self) -> &Arc<RpcPool> {
        &self.inner.pool
    }

    /// Whether the node said (in HELLO) that it is a cluster node.
    pub fn is_cluster_node(&self) -> bool {
        self.inner.pool.is_cluster_node()
    }

    /// Settings in use.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.cfg
    }

    pub(crate) fn shard_paths(&self) -> &ShardPaths {
        &self.inner.shard_paths
    }

    pub(crate) fn read_counters(&self) -> Arc<ReadCounters> {
        Arc::clone(&self.inner.read_counters)
    }

    /// Reads `key` with its version, down the path [`ReadPath`] says: in
    /// `Auto`, the one the path controller prices cheaper for this key now.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        let sel = &self.inner.selector;
        match self.inner.cfg.read_path {
            ReadPath::Rpc => self.measured_rpc_get(key, sel.admit_sampled(Path::Rpc, key), None).await,
            ReadPath::Auto => self.auto_get(Region::Node, key).await,
            ReadPath::OneSided => {
                let mut failure = None;
                for _ in 0..FORCED_ONE_SIDED_TRIES {
                    let path = self.attach().await?;
                    let adm = sel.admit_sampled(Path::OneSided, key);
                    match self.measured_one_sided_get(&path, key, adm).await {
                        Ok(Measured::Done(r)) => return Ok(r),
                        Ok(Measured::AskServer(gave_up)) => return self.ask_server(key, gave_up, None).await,
                        Err(e) => {
                            self.detach(&path, &e);
                            failure = Some(e);
                        }
                    }
                }
                Err(ClientError::OneSidedUnavailable(failure.map(|e| e.to_string()).unwrap_or_default()))
            }
        }
    }

    /// Reads `key` on the calling thread from a region mapped in this
    /// process (shared memory), without a runtime or any allocation once
    /// `out` has grown: the value replaces `out`'s contents. `None` when
    /// the GET needs the runtime: no local path is attached (yet), the
    /// read path is RPC, the client routes a cluster, the server evicts
    /// (reads are reported from the runtime), or the server must answer
    /// this key (see [`crate::blocking::Client::get_into`]).
    pub fn get_local(&self, key: &[u8], out: &mut Vec<u8>) -> Option<Result<Option<ItemMeta>, ClientError>> {
        if let Err(e) = check_key(key) {
            return Some(Err(e.into()));
        }
        if self.inner.cfg.read_path == ReadPath::Rpc || self.is_cluster_node() {
            return None;
        }
        let path = Held::of(&self.node_state())?;
        if !path.is_local() || path.accesses.is_on() {
            return None;
        }
        self.inner.selector.count_unmeasured(Path::OneSided);
        match onesided::with_scratch(|s| path.get_local(key, s, out)) {
            Ok((LocalGet::Found(m), _)) => Some(Ok(Some(m))),
            Ok((LocalGet::Missing, _)) => Some(Ok(None)),
            Ok((LocalGet::GiveUp, _)) => None,
            Err(e) => {
                self.detach(&path, &e);
                None
            }
        }
    }

    /// A GET in `ReadPath::Auto` of `region`: the selector chooses the
    /// path (shared memory excepted), the read runs and reports its cost,
    /// and what it leaves to RPC is asked after the measurement.
    async fn auto_get(&self, region: Region, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        let attached = match region {
            Region::Node => self.one_sided().await?,
            Region::Shard(s) => self.shard_path(s).await,
        };
        // Shared memory is not priced against RPC: a copy from local
        // memory has no link or server queue to congest, and costs a
        // fraction of any round trip (docs/path-selection.md).
        if let Some(path) = attached.as_ref().filter(|p| p.is_local()) {
            let adm = self.inner.selector.admit_sampled(Path::OneSided, key);
            return self.one_sided_or_rpc(region, path, key, adm).await;
        }
        let h = selector_hash(key);
        let timeout = self.inner.cfg.request_timeout;
        let (wait, no_window) = window_wait(region, timeout);
        let rounds = attached.as_ref().map(|p| if p.has_hint(key) { 1.0 } else { 2.0 });
        let Some((adm, probes)) = self.inner.selector.admit(h, rounds, tokio::time::Instant::now() + wait).await else {
            return match no_window {
                NoWindow::TimedOut => Err(ClientError::Timeout(timeout)),
                NoWindow::AskRpc => self.rpc_get_hinting(key, attached.as_deref()).await,
            };
        };
        for p in probes {
            self.spawn_probe(p, key, region);
        }
        match (adm.path, attached) {
            (Path::OneSided, Some(path)) => self.one_sided_or_rpc(region, &path, key, Some(adm)).await,
            (Path::Rpc, None) => self.measured_rpc_get(key, Some(adm), None).await,
            // Detached since the choice: dropping the admission cancels it.
            (Path::OneSided, None) => {
                drop(adm);
                self.rpc_get(key).await
            }
            (Path::Rpc, Some(path)) => match self.measured_rpc_get(key, Some(adm), region.hinted(&path)).await {
                // The RPC path broke under this GET: answer it one-sided.
                Err(e) if e.is_transport() => match path.get(key).await {
                    Ok(OneSidedGet::Found(v)) => Ok(Some(v)),
                    Ok(OneSidedGet::Missing) => Ok(None),
                    Ok(OneSidedGet::GiveUp) => Err(e),
                    Err(be) => {
                        self.path_failed(region, &path, &be);
                        Err(e)
                    }
                },
                r => r,
            },
        }
    }

    /// A one-sided GET whose cost is reported to the path controller, if
    /// admitted by it (`adm`). A backend failure is reported and returned.
    /// When verification keeps failing the outcome says to ask the server;
    /// the caller sends that RPC ([`Session::ask_server`]), and its failure
    /// is the RPC's, not this path's (run in here, it became a backend
    /// failure that detached a healthy path).
    async fn measured_one_sided_get(
        &self,
        path: &OneSided,
        key: &[u8],
        adm: Option<Admission>,
    ) -> Result<Measured, BackendError> {
        self.report_accesses(path);
        let (got, t) = match path.get_traced(key).await {
            Ok(r) => r,
            Err(e) => return priced_read_error(e, adm),
        };
        let value = match got {
            OneSidedGet::Found(v) => Some(v),
            OneSidedGet::Missing => None,
            OneSidedGet::GiveUp => {
                return Ok(Measured::AskServer(GaveUp { adm, round_trips: t.round_trips, retries: t.retries }));
            }
        };
        if let Some(adm) = adm {
            adm.complete(t.round_trips, t.retries);
        }
        Ok(Measured::Done(value))
    }

    /// The RPC GET a one-sided GET that gave up ends with; then its price.
    /// `hinted`: the region the reply's address hint is for.
    async fn ask_server(
        &self,
        key: &[u8],
        gave_up: GaveUp,
        hinted: Option<&OneSided>,
    ) -> Result<Option<Versioned>, ClientError> {
        let r = self.rpc_get_hinting(key, hinted).await;
        gave_up.asked();
        r
    }

    /// Forgets `region`'s path that failed, so a later GET attaches anew.
    /// A shard region read outside its lease has not failed: it is read
    /// again once the lease covers it.
    fn path_failed(&self, region: Region, path: &Held, why: &BackendError) {
        match (region, why) {
            (Region::Shard(_), BackendError::Unleased) => {}
            (Region::Node, _) => self.detach(path, why),
            (Region::Shard(s), _) => self.shard_path_failed(s, path, why),
        }
    }

    /// [`Session::measured_one_sided_get`], then what it leaves to RPC: a
    /// GET that gave up, or one whose path failed (detached here).
    async fn one_sided_or_rpc(
        &self,
        region: Region,
        path: &Held,
        key: &[u8],
        adm: Option<Admission>,
    ) -> Result<Option<Versioned>, ClientError> {
        match self.measured_one_sided_get(path, key, adm).await {
            Ok(Measured::Done(r)) => Ok(r),
            Ok(Measured::AskServer(gave_up)) => self.ask_server(key, gave_up, region.hinted(path)).await,
            Err(e) => {
                // The failure moved traffic to RPC; this GET goes there too.
                self.path_failed(region, path, &e);
                self.rpc_get(key).await
            }
        }
    }

    /// Sends the items `path` read one-sidedly to its server, if it evicts
    /// and a batch is ready; in the background, and a lost report only
    /// costs recency.
    fn report_accesses(&self, path: &OneSided) {
        let Some(units) = path.take_accesses() else { return };
        let this = self.clone();
        let region_id = path.region_id;
        tokio::spawn(async move {
            let _ = this.inner.pool.call(Op::AccessReport(proto::AccessReport { region_id, units })).await;
        });
    }

    /// An RPC GET on the next pooled connection whose delay is reported to
    /// the path controller and to that connection's congestion detector.
    /// `adm`: the controller's admission, when it steers this client.
    /// `hinted`: a cluster shard's region the reply's address hint is for.
    async fn measured_rpc_get(
        &self,
        key: &[u8],
        adm: Option<Admission>,
        hinted: Option<&OneSided>,
    ) -> Result<Option<Versioned>, ClientError> {
        let i = self.inner.pool.next_slot();
        // One clock read is the GET's start (unless admitted earlier), its
        // send and its deadline's base: each read costs more than a cached
        // value, and a forced-RPC GET is little else.
        let now = Instant::now();
        let start = adm.as_ref().map_or(now, Admission::started);
        // A probe's admission was taken before it was spawned (and before
        // its GET waited for a window): the connection's detector times the
        // request alone, or it would see congestion that is not there.
        let sent = if adm.as_ref().is_some_and(Admission::is_probe) { now } else { start };
        let deadline = tokio::time::Instant::from_std(now) + self.inner.cfg.request_timeout;
        let sample = self.inner.rpc_health.sample_next(i);
        let result = self.inner.pool.call_body(i, Body::Get { key }, deadline).await;
        match &result {
            Err(e) if e.is_transport() => {
                if let Some(adm) = adm {
                    adm.fail();
                }
            }
            // Only a GET the controller admitted, or one of the
            // connection's samples, reads the clock again.
            _ if adm.is_none() && !sample => {}
            _ => {
                let end = Instant::now();
                let took = end.saturating_duration_since(start).as_nanos() as u64;
                if let Some(adm) = adm {
                    adm.complete_after(took, 1, 0);
                }
                let on_conn = end.saturating_duration_since(sent).as_nanos() as u64;
                if sample && self.inner.rpc_health.record_ended(end, i, on_conn) {
                    // Congested for several rounds: later requests of this
                    // slot open a fresh connection; this one drains.
                    tracing::debug!(conn = i, "RPC connection congested: moving to a new one");
                    self.inner.pool.replace(i).await;
                }
            }
        }
        match result? {
            R::Get(g) => {
                if let Some(p) = hinted.filter(|_| g.found && g.hint_slot != 0) {
                    p.learn_hint(key, g.hint_bucket, g.hint_index, g.hint_slot);
                }
                Ok(self.learn(key, g))
            }
            other => Err(unexpected(&other)),
        }
    }

    /// The value of an RPC GET's reply; where the server says the key's
    /// slot is, the one-sided path caches it for its next GET of the key.
    /// Every key answered over RPC passes here, so it is counted here.
    fn learn(&self, key: &[u8], g: proto::GetReply) -> Option<Versioned> {
        self.inner.read_counters.rpc_gets.fetch_add(1, Ordering::Relaxed);
        if !g.found {
            return None;
        }
        // A client that reads only over RPC never attaches a one-sided path.
        if g.hint_slot != 0 && self.inner.cfg.read_path != ReadPath::Rpc {
            let attached = self.node_state().attached().map(|(_, p)| Arc::clone(p));
            if let Some(p) = attached {
                p.learn_hint(key, g.hint_bucket, g.hint_index, g.hint_slot);
            }
        }
        Some(Versioned { value: g.value, version: g.version, flags: g.flags, expires_at: g.expires_at })
    }

    /// Sends a background copy of a GET down the path of `probe`, to keep
    /// that path's estimates fresh; its answer is dropped.
    /// The probe reads `region`'s path attached when it runs (one attached
    /// since its admission is the one to price).
    fn spawn_probe(&self, probe: Admission, key: &[u8], region: Region) {
        let session = self.clone();
        let key = Bytes::copy_from_slice(key);
        tokio::spawn(async move {
            let timeout = session.inner.cfg.request_timeout;
            let attached = session.attached_path(region);
            match probe.path {
                Path::Rpc => {
                    let hinted = attached.as_deref().and_then(|p| region.hinted(p));
                    let _ = session.measured_rpc_get(&key, Some(probe), hinted).await;
                }
                Path::OneSided => {
                    // Not attached: dropping the probe cancels it.
                    let Some(path) = attached else { return };
                    let read = tokio::time::timeout(timeout, path.get_traced(&key)).await;
                    if let Some(e) = settle_probe(probe, read.ok().map(|r| r.map(|(_, t)| t))) {
                        session.path_failed(region, &path, &e);
                    }
                }
            }
        });
    }

    pub async fn rpc_get(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        self.rpc_get_hinting(key, None).await
    }

    /// [`Session::rpc_get`]; where the server says the key's slot is,
    /// `path` (the region the reply's hint is about: a cluster shard's)
    /// caches it for its next one-sided GET of the key.
    pub async fn rpc_get_hinting(&self, key: &[u8], path: Option<&OneSided>) -> Result<Option<Versioned>, ClientError> {
        let pool = &self.inner.pool;
        match pool.call_body(pool.next_slot(), Body::Get { key }, pool.deadline()).await? {
            R::Get(g) => {
                if let Some(p) = path.filter(|_| g.found && g.hint_slot != 0) {
                    p.learn_hint(key, g.hint_bucket, g.hint_index, g.hint_slot);
                }
                Ok(self.learn(key, g))
            }
            other => Err(unexpected(&other)),
        }
    }

    /// Stores `value` under `key` on this node; returns the write's version.
    pub async fn put(&self, key: &[u8], value: &[u8]) -> Result<u64, ClientError> {
        self.put_with(key, value, None).await
    }

    /// [`Session::put`] with a write id (cluster writes, so one sent
    /// again applies once).
    pub async fn put_with(
        &self,
        key: &[u8],
        value: &[u8],
        write_id: Option<proto::WriteId>,
    ) -> Result<u64, ClientError> {
        let pool = &self.inner.pool;
        let body = Body::Put { key, value, write_id: write_id.as_ref() };
        match pool.call_body(pool.next_slot(), body, pool.deadline()).await? {
            R::Put(p) => Ok(p.version),
            other => Err(unexpected(&other)),
        }
    }

    /// A request to this node, answered as it comes (no routing).
    pub(crate) async fn call(&self, op: Op) -> Result<R, ClientError> {
        self.inner.pool.call(op).await
    }

    /// Removes `key` on this node; returns whether it existed.
    pub async fn delete(&self, key: &[u8]) -> Result<bool, ClientError> {
        self.delete_with(key, None).await
    }

    /// [`Session::delete`] with a write id.
    pub async fn delete_with(&self, key: &[u8], write_id: Option<proto::WriteId>) -> Result<bool, ClientError> {
        match self
            .inner
            .pool
            .call(Op::Delete(proto::Delete { key: Bytes::copy_from_slice(key), write_id, cas: 0 }))
            .await?
        {
            R::Delete(d) => Ok(d.existed),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads many keys from this node, in the order of `keys`, down the
    /// path [`ReadPath`] says (a batch follows the path single GETs
    /// prefer now).
    pub async fn multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, ClientError> {
        match self.inner.cfg.read_path {
            ReadPath::Rpc => {}
            ReadPath::OneSided => {
                let mut failure = None;
                for _ in 0..FORCED_ONE_SIDED_TRIES {
                    let path = self.attach().await?;
                    match self.one_sided_multi_get(&path, keys).await? {
                        Ok(values) => return Ok(values),
                        Err(e) => {
                            self.detach(&path, &e);
                            failure = Some(e);
                        }
                    }
                }
                let why = failure.map(|e| e.to_string()).unwrap_or_default();
                return Err(ClientError::OneSidedUnavailable(why));
            }
            // A batch follows the path single GETs prefer now.
            ReadPath::Auto => {
                if self.inner.selector.preferred() != Path::Rpc
                    && let Some(path) = self.one_sided().await?
                {
                    match self.one_sided_multi_get(&path, keys).await? {
                        Ok(values) => return Ok(values),
                        Err(e) => self.detach(&path, &e),
                    }
                }
            }
        }
        self.rpc_multi_get(keys).await
    }

    /// A multi-get over `path`; keys whose reads kept failing verification
    /// are asked over RPC. The outer error is that RPC's; the inner one, the
    /// path's failure (nothing returned).
    pub async fn one_sided_multi_get<K: AsRef<[u8]>>(
        &self,
        path: &OneSided,
        keys: &[K],
    ) -> Result<Result<Vec<Option<Bytes>>, BackendError>, ClientError> {
        self.report_accesses(path);
        let res = match path.multi_get(keys).await {
            Ok(res) => res,
            Err(e) => return Ok(Err(e)),
        };
        let mut out = Vec::with_capacity(keys.len());
        let mut rest = Vec::new();
        for (i, r) in res.into_iter().enumerate() {
            match r {
                OneSidedGet::Found(v) => out.push(Some(v.value)),
                OneSidedGet::Missing => out.push(None),
                OneSidedGet::GiveUp => {
                    out.push(None);
                    rest.push(i);
                }
            }
        }
        if !rest.is_empty() {
            let rest_keys: Vec<&[u8]> = rest.iter().map(|&i| keys[i].as_ref()).collect();
            for (i, v) in rest.into_iter().zip(self.rpc_multi_get(&rest_keys).await?) {
                out[i] = v;
            }
        }
        Ok(Ok(out))
    }

    pub async fn rpc_multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, ClientError> {
        let mut sent = Vec::new();
        for chunk in keys.chunks(MAX_MULTI_GET_KEYS) {
            let ks = chunk.iter().map(|k| Bytes::copy_from_slice(k.as_ref())).collect();
            sent.push((chunk, self.inner.pool.send(Op::MultiGet(proto::MultiGet { keys: ks })).await?));
        }
        let mut out = Vec::with_capacity(keys.len());
        for (chunk, inflight) in sent {
            match unwrap(inflight.wait(self.inner.cfg.request_timeout).await?) {
                Ok(R::MultiGet(m)) if m.values.len() == chunk.len() => {
                    for (k, g) in chunk.iter().zip(m.values) {
                        out.push(self.learn(k.as_ref(), g).map(|v| v.value));
                    }
                }
                Ok(other) => return Err(unexpected(&other)),
                // Too many large values for one reply: fetch them one by one.
                Err(ClientError::Server { code: ErrorCode::ResponseTooLarge, .. }) => {
                    for k in chunk {
                        out.push(self.rpc_get(k.as_ref()).await?.map(|v| v.value));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// The cluster map as this node knows it, with its replicas' state
    /// (`BAD_REQUEST` from a server outside a cluster).
    pub async fn cluster_status(&self) -> Result<proto::ClusterMapReply, ClientError> {
        self.cluster_status_past(0).await
    }

    /// [`Session::cluster_status`], from a node that first asks the
    /// metadata group if its map is not newer than `version` (0: never).
    pub async fn cluster_status_past(&self, version: u64) -> Result<proto::ClusterMapReply, ClientError> {
        match self.inner.pool.call(Op::GetMap(proto::GetMap { newer_than: version })).await? {
            R::Map(m) => Ok(*m),
            other => Err(unexpected(&other)),
        }
    }

    /// Admin: replaces this node's replica of `shard` by a new one with no
    /// state, which joins the shard and catches up from its leader (the
    /// old one is removed from the members). Returns the new raft id.
    pub async fn replace_replica(&self, shard: u32) -> Result<u64, ClientError> {
        match self.inner.pool.call(Op::ReplaceReplica(proto::ReplaceReplica { shard })).await? {
            R::ReplaceReplica(r) => Ok(r.replica_id),
            other => Err(unexpected(&other)),
        }
    }

    /// Admin: moves partition `partition` to shard `to` while clients use
    /// it; the node must lead the cluster's metadata group (else
    /// NOT_LEADER naming the node that does). Answers once the map flipped.
    /// `rate_mib`: most MiB/s its copy sends before the cut-over (`None`:
    /// the node's default; `Some(0)`: as fast as it can).
    pub async fn move_partition(
        &self,
        partition: u32,
        to: u32,
        rate_mib: Option<u32>,
    ) -> Result<proto::MovePartitionReply, ClientError> {
        let m = proto::MovePartition {
            partition,
            to,
            rate_mib: rate_mib.unwrap_or(0),
            unpaced: rate_mib == Some(0),
            control: 0,
        };
        match self.inner.pool.call(Op::MovePartition(m)).await? {
            R::MovePartition(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }

    /// Admin: moves shard `shard`'s replica from node `from` to node `to`
    /// (asked of the node leading the metadata group): answered once the
    /// new replica votes and the old one left.
    pub async fn move_replica(&self, shard: u32, from: u64, to: u64) -> Result<proto::MoveReplicaReply, ClientError> {
        match self.inner.pool.call(Op::MoveReplica(proto::MoveReplica { shard, from, to })).await? {
            R::MoveReplica(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }

    /// Admin: plans a rebalance of the cluster (partition moves that even
    /// out the shards' fill, leader transfers that even out the leaders);
    /// unless `dry_run`, the node starts the moves in the background, one
    /// at a time at `rate_mib` (as [`Session::move_partition`]), and
    /// answers with the plan. The leader transfers are the caller's to ask
    /// (`dmkv cluster rebalance` does). The node must lead the metadata
    /// group.
    pub async fn rebalance(
        &self,
        dry_run: bool,
        rate_mib: Option<u32>,
    ) -> Result<proto::MovePartitionReply, ClientError> {
        let m = proto::MovePartition {
            control: if dry_run { 4 } else { 3 },
            rate_mib: rate_mib.unwrap_or(0),
            unpaced: rate_mib == Some(0),
            ..Default::default()
        };
        match self.inner.pool.call(Op::MovePartition(m)).await? {
            R::MovePartition(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }

    /// Admin: pauses (`cancel` false) or cancels the move of `partition`
    /// under way; the node must lead the metadata group. Only a move before
    /// its cut-over can be; a paused one goes on when moved again to the
    /// same shard, a cancelled one is undone before this answers.
    pub async fn control_move(&self, partition: u32, cancel: bool) -> Result<proto::MovePartitionReply, ClientError> {
        let m = proto::MovePartition { partition, control: if cancel { 2 } else { 1 }, ..Default::default() };
        match self.inner.pool.call(Op::MovePartition(m)).await? {
            R::MovePartition(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }

    /// Admin: hands shard `shard`'s leadership to node `to`; this node
    /// must lead the shard (else NOT_LEADER naming the leader). Answers
    /// once the leadership moved, which may take the node up to 8 s (5 for
    /// the voter to catch up, 2 for it to take over): give the client a
    /// `request_timeout` above that, as `dmkv cluster transfer-leader` does.
    pub async fn transfer_leader(&self, shard: u32, to: u64) -> Result<proto::TransferLeaderReply, ClientError> {
        match self.inner.pool.call(Op::TransferLeader(proto::TransferLeader { shard, to })).await? {
            R::TransferLeader(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }

    /// The cluster map as this node knows it, checked.
    pub async fn cluster_map(&self) -> Result<dmkv_common::cluster::map::ClusterMap, ClientError> {
        self.cluster_map_past(0).await
    }

    /// [`Session::cluster_map`] (see [`Session::cluster_status_past`]).
    pub async fn cluster_map_past(&self, version: u64) -> Result<dmkv_common::cluster::map::ClusterMap, ClientError> {
        let m = self.cluster_status_past(version).await?;
        dmkv_common::cluster::map::ClusterMap::from_proto(&m)
            .map_err(|e| ClientError::Protocol(format!("the node sent a bad cluster map: {e}")))
    }

    /// The server's counters.
    pub async fn stats(&self) -> Result<HashMap<String, u64>, ClientError> {
        self.stats_with(false).await
    }

    /// [`Session::stats`], with `digests` also each of the node's shard
    /// replicas' item count, checksum and applied index
    /// (`shard<S>_items`, `_digest`, `_applied`): it walks every store, so
    /// it is for tests and diagnostics.
    pub async fn stats_with(&self, digests: bool) -> Result<HashMap<String, u64>, ClientError> {
        match self.inner.pool.call(Op::Stats(proto::Stats { digests })).await? {
            R::Stats(s) => Ok(s.counters),
            other => Err(unexpected(&other)),
        }
    }

    /// Descriptors of the server's remote-memory regions.
    pub async fn region_info(&self) -> Result<Vec<proto::RegionDescriptor>, ClientError> {
        Ok(self.region_info_full().await?.regions)
    }

    /// The server's regions and the one-sided endpoints it offers.
    pub async fn region_info_full(&self) -> Result<proto::RegionInfoReply, ClientError> {
        self.inner.pool.region_info().await
    }

    /// Sends a request on the next pooled connection without waiting for
    /// its reply: the building block of pipelining.
    pub async fn send(&self, op: Op) -> Result<InFlight, ClientError> {
        self.inner.pool.send(op).await
    }

    /// Closes every pooled RPC connection, as the path controller does to a
    /// congested one; later requests open fresh ones. For tests.
    #[doc(hidden)]
    pub async fn replace_rpc_connections(&self) {
        self.inner.pool.replace_rpc_connections().await;
    }

    /// Admin: makes the server register its region anew (new epoch and
    /// rkey). Every client's one-sided path then fails over and re-attaches.
    pub async fn reregister(&self) -> Result<proto::RegionInfoReply, ClientError> {
        match self.inner.pool.call(Op::Reregister(proto::Reregister {})).await? {
            R::Reregister(r) => Ok(*r),
            other => Err(unexpected(&other)),
        }
    }
}

/// What a GET does when no window slot freed up in time.
#[derive(Debug, PartialEq, Eq)]
enum NoWindow {
    TimedOut,
    AskRpc,
}

/// How long a GET of `region` waits for a window slot, and what then.
/// A cluster session's wait is this client's own queue, not the node
/// failing to answer: it is bounded by half a try, and the GET then goes
/// over RPC unmeasured. A timeout there made the router drop a node that
/// was never asked.
fn window_wait(region: Region, timeout: Duration) -> (Duration, NoWindow) {
    match region {
        Region::Node => (timeout, NoWindow::TimedOut),
        Region::Shard(_) => (timeout / 2, NoWindow::AskRpc),
    }
}

/// What a measured one-sided read that failed with `e` comes to.
/// Outside its lease a shard's region is not broken: the read cost a round
/// trip and the leader answers over RPC, priced as a GET that gave up.
/// Failing the admission marked one-sided reads down for every shard of
/// the node.
fn priced_read_error(e: BackendError, adm: Option<Admission>) -> Result<Measured, BackendError> {
    if matches!(e, BackendError::Unleased) {
        return Ok(Measured::AskServer(GaveUp { adm, round_trips: 1, retries: 0 }));
    }
    if let Some(adm) = adm {
        adm.fail();
    }
    Err(e)
}

/// Prices a one-sided probe by its read (`None`: it timed out); returns
/// the path's failure, for the caller to detach it. A region unleased for
/// now is not a failure: dropping the probe cancels it.
fn settle_probe(probe: Admission, read: Option<Result<onesided::Trace, BackendError>>) -> Option<BackendError> {
    match read {
        Some(Ok(t)) => probe.complete(t.round_trips, t.retries),
        Some(Err(BackendError::Unleased)) => drop(probe),
        Some(Err(e)) => {
            probe.fail();
            return Some(e);
        }
        None => probe.fail(),
    }
    None
}

/// Why a forced transport could not be attached, without the wrapping
/// that [`ClientError::TransportUnavailable`] adds itself.
fn attach_reason(e: BackendError) -> String {
    match e {
        BackendError::Attach(why) => why,
        other => other.to_string(),
    }
}

// A cluster node session's reads: one-sided on the region of the key's
// shard replica on that node while the replica leads and holds its lease,
// over RPC (a linearizable read on the leader) otherwise.
//
// The router picks the node; this picks the path. A follower's or a
// deposed leader's region has no lease that covers the reads, so reading
// it ends in [`BackendError::Unleased`] and the read goes over RPC, where
// NOT_LEADER sends the router on: never to a follower's stale memory.

pub use crate::attach_state::SHARD_REATTACH_INTERVAL;

/// A session's one-sided paths, by shard: each region's attach state.
#[derive(Default)]
pub struct ShardPaths(Mutex<HashMap<u32, AttachState<Arc<OneSided>>>>);

impl ShardPaths {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, AttachState<Arc<OneSided>>>> {
        // The states' transitions are whole assignments: a panic cannot
        // leave one half changed.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn new_state() -> AttachState<Arc<OneSided>> {
        AttachState::new(AttachPolicy::SHARD)
    }
}

impl Session {
    /// The path to `shard`'s region on this node: attached now by this
    /// caller if no one is attaching it and it did not just fail.
    async fn shard_path(&self, shard: u32) -> Option<Held> {
        let ticket = {
            let mut paths = self.shard_paths().lock();
            let st = paths.entry(shard).or_insert_with(ShardPaths::new_state);
            if let Some(held) = Held::of(st) {
                return Some(held);
            }
            st.poll_attach(Instant::now())?
        };
        let pending = Pending::new(self, Region::Shard(shard), ticket);
        match self.attach_shard(shard).await {
            Ok(p) => pending.attached(p),
            Err(e) => {
                tracing::debug!(shard, "one-sided reads of the shard's region unavailable: {e}");
                pending.failed();
                None
            }
        }
    }

    async fn attach_shard(&self, shard: u32) -> Result<OneSided, BackendError> {
        let cfg = self.config();
        let (info, sample) =
            onesided::clock_sample(self.pool()).await.map_err(|e| BackendError::Attach(e.to_string()))?;
        let opts = AttachOptions {
            forced: cfg.transport,
            timeout: cfg.connect_timeout,
            hint_entries: cfg.hint_cache_entries,
            counters: self.read_counters(),
            enforce_grace: cfg.enforce_grace,
            engine_connections: cfg.engine_connections,
            path_config: cfg.path,
            repaths: Arc::default(),
            token: self.pool().token().cloned(),
            shard: Some(shard),
            clock: Some(sample),
            check_leases: cfg.check_leases,
            node_rdma: Arc::clone(&self.inner.node_rdma),
            routes: self.inner.routes.get().cloned(),
        };
        onesided::attach(self.pool(), &info, opts).await
    }

    /// A path that failed (not for want of a lease) is attached anew later.
    fn shard_path_failed(&self, shard: u32, failed: &Held, why: &BackendError) {
        tracing::debug!(shard, "one-sided path to the shard's region failed: {why}");
        if let Some(st) = self.shard_paths().lock().get_mut(&shard) {
            st.handle_detach(failed.generation, Instant::now());
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
        if one_sided && self.inner.cfg.read_path == ReadPath::Auto {
            return self.auto_get(Region::Shard(shard), key).await;
        }
        // The path the RPC reply's address hint is for: the server says
        // where the item is in this very region.
        let mut hinted = None;
        if one_sided {
            if let Some(p) = self.shard_path(shard).await {
                // To this node, whose region the path reads: the shard's
                // leader, which chooses what an evicting shard drops.
                self.report_accesses(&p);
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
        self.rpc_get_hinting(key, hinted.as_deref()).await
    }

    /// The path to `shard`'s region on this node, if it is attached now.
    fn attached_shard_path(&self, shard: u32) -> Option<Held> {
        self.shard_paths().lock().get(&shard).and_then(Held::of)
    }

    /// Reads `keys` (all of `shard`) from this node, as [`Session::shard_get`].
    pub(crate) async fn shard_multi_get<K: AsRef<[u8]>>(
        &self,
        shard: u32,
        keys: &[K],
        one_sided: bool,
    ) -> Result<Vec<Option<Bytes>>, ClientError> {
        // In `Auto` a batch follows the path single GETs prefer now.
        let one_sided =
            one_sided && (self.inner.cfg.read_path != ReadPath::Auto || self.inner.selector.preferred() != Path::Rpc);
        if one_sided && let Some(p) = self.shard_path(shard).await {
            match self.one_sided_multi_get(&p, keys).await? {
                Ok(values) => return Ok(values),
                Err(BackendError::Unleased) => {}
                Err(e) => self.shard_path_failed(shard, &p, &e),
            }
        }
        self.rpc_multi_get(keys).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_common::path::PathConfig;

    fn selector() -> Arc<PathSelector> {
        let sel = PathSelector::new(PathConfig::default());
        sel.set_usable(Path::OneSided, true);
        sel.set_usable(Path::Rpc, true);
        sel
    }

    /// An unleased shard region is priced as a GET that gave up, one round
    /// trip before its RPC, and is no failure of the one-sided path.
    #[test]
    fn an_unleased_read_is_priced_as_a_get_that_gave_up() {
        let sel = selector();
        let adm = sel.admit_fixed(Path::OneSided, 1);
        let Ok(Measured::AskServer(gave_up)) = priced_read_error(BackendError::Unleased, Some(adm)) else {
            panic!("an unleased read was not priced as a GET that gave up");
        };
        assert_eq!((gave_up.round_trips, gave_up.retries), (1, 0));
        gave_up.asked();
        let st = sel.stats().one_sided;
        assert_eq!(st.failures, 0, "an unleased read failed the path: {st:?}");
        assert!(st.usable, "an unleased read marked one-sided reads down: {st:?}");
        // A broken path still is a failure.
        let adm = sel.admit_fixed(Path::OneSided, 2);
        assert!(matches!(priced_read_error(BackendError::Closed, Some(adm)), Err(BackendError::Closed)));
        assert_eq!(sel.stats().one_sided.failures, 1);
    }

    /// A one-sided probe of a region unleased for now is dropped: neither a
    /// failure of the path nor a reason to detach it.
    #[test]
    fn an_unleased_probe_is_dropped() {
        let sel = selector();
        let probe = sel.admit_fixed(Path::OneSided, 1);
        assert!(settle_probe(probe, Some(Err(BackendError::Unleased))).is_none(), "an unleased probe detached");
        let st = sel.stats().one_sided;
        assert_eq!(st.failures, 0, "an unleased probe failed the path: {st:?}");
        assert!(st.usable && st.in_flight == 0, "{st:?}");
        let probe = sel.admit_fixed(Path::OneSided, 2);
        assert!(matches!(settle_probe(probe, Some(Err(BackendError::Closed))), Some(BackendError::Closed)));
        assert_eq!(sel.stats().one_sided.failures, 1);
    }

    #[test]
    fn only_a_cluster_sessions_wait_for_a_window_is_bounded_by_half_a_try() {
        let t = Duration::from_millis(800);
        assert_eq!(window_wait(Region::Node, t), (t, NoWindow::TimedOut));
        assert_eq!(window_wait(Region::Shard(3), t), (t / 2, NoWindow::AskRpc));
    }

    /// A cluster GET that finds every RPC window slot taken waits half a
    /// try and then asks the node over RPC; it used to fail with a Timeout,
    /// and the router dropped a node that was never asked.
    #[tokio::test]
    async fn a_cluster_get_without_a_window_asks_the_node_over_rpc() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&accepted);
        // A node that hangs up: whether the GET reached it is what counts.
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                drop(conn);
            }
        });
        let cfg = ClientConfig::default().request_timeout(Duration::from_millis(100));
        let slots = cfg.path.window.max as u64 + 1;
        let session = Session::unconnected(addr, cfg, Arc::default()).unwrap();
        // The shard's region just failed to attach: the GET does not try it.
        {
            let mut paths = session.shard_paths().lock();
            let st = paths.entry(0).or_insert_with(ShardPaths::new_state);
            let ticket = st.poll_attach(Instant::now()).unwrap();
            st.handle_failed(ticket, Instant::now());
        }
        let sel = &session.inner.selector;
        let taken: Vec<Admission> = (0..slots).map(|k| sel.admit_fixed(Path::Rpc, k)).collect();
        let r = session.auto_get(Region::Shard(0), b"k").await;
        assert!(!matches!(r, Err(ClientError::Timeout(_))), "the GET timed out in its own queue: {r:?}");
        assert!(accepted.load(Ordering::SeqCst) > 0, "the GET never asked the node: {r:?}");
        drop(taken);
    }
}
