//! The async client: a small pool of pipelined connections to one server.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dmkv_common::PROTOCOL_VERSION;
use dmkv_common::error::{check_key, check_value};
use dmkv_common::limits::{DEFAULT_MAX_FRAME_LEN, MAX_CLIENT_FRAME_LEN, MAX_MULTI_GET_KEYS};
use dmkv_common::path::{ControllerStats, Path, PathConfig};
use dmkv_common::proto::{self, ErrorCode, Response, request::Op, response::Result as R};
use tokio::sync::Mutex;

use crate::conn::{Conn, InFlight};
use crate::error::ClientError;
use crate::onesided::{
    self, AttachOptions, BackendError, ItemMeta, LocalGet, OneSided, OneSidedGet, ReadCounters, ReadStats,
};
use crate::path::{Admission, ConnHealth, PathSelector, key_hash};
use crate::router::Router;
use crate::tls::{Connector, TlsOptions};
use dmkv_common::auth::{Purpose, Token};

/// Environment variable a client takes its secret from when its config
/// gives none.
pub const TOKEN_ENV: &str = "DMKV_TOKEN";

/// Which way GETs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadPath {
    /// Chosen per GET from measured delay, window and retries (see
    /// [`crate::path`]): one-sided where that is cheaper, else RPC.
    #[default]
    Auto,
    /// One-sided reads only: `get` and `multi_get` fail with
    /// [`ClientError::OneSidedUnavailable`] when no one-sided path works
    /// (after one try on a fresh path). Keys whose reads keep failing
    /// verification (a writer racing the reader) are still answered over
    /// RPC, never with unverified bytes.
    OneSided,
    /// RPC only.
    Rpc,
}

impl ReadPath {
    /// The name the CLI and config take (`auto`, `one-sided`, `rpc`).
    pub fn name(self) -> &'static str {
        match self {
            ReadPath::Auto => "auto",
            ReadPath::OneSided => "one-sided",
            ReadPath::Rpc => "rpc",
        }
    }
}

impl std::str::FromStr for ReadPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ReadPath::Auto),
            "one-sided" | "onesided" => Ok(ReadPath::OneSided),
            "rpc" => Ok(ReadPath::Rpc),
            _ => Err(format!("unknown path {s:?}: expected auto, one-sided or rpc")),
        }
    }
}

/// Backends of one-sided reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// The server's region mapped read-only (same host only).
    Shm,
    /// The server's software one-sided engine over TCP.
    Tcp,
    /// RDMA READs by the NIC.
    Rdma,
}

impl Transport {
    /// The name the CLI and config take (`shm`, `tcp`, `rdma`).
    pub fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "shm" => Ok(Transport::Shm),
            "tcp" => Ok(Transport::Tcp),
            "rdma" => Ok(Transport::Rdma),
            _ => Err(format!("unknown transport {s:?}: expected shm, tcp or rdma")),
        }
    }
}

/// Client settings. The defaults suit a server on the same network.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Which way GETs go.
    pub read_path: ReadPath,
    /// Force one one-sided backend (default: the best one available).
    /// With `ReadPath::Auto` or `OneSided`, connecting fails with
    /// [`ClientError::TransportUnavailable`] when it cannot be attached,
    /// rather than reading over RPC. Should the attached path break later,
    /// `OneSided` GETs fail and `Auto` ones go over RPC while it is
    /// attached again. `ReadPath::Rpc` never uses it.
    pub transport: Option<Transport>,
    /// RPC connections kept to the server; requests are spread over them,
    /// and one that stays congested is replaced.
    pub pool_size: usize,
    /// Connections to the server's one-sided engine (TCP transport).
    pub engine_connections: usize,
    /// Congestion control and path selection settings.
    pub path: PathConfig,
    /// Longest wait for a reply. In a cluster, a request's whole time
    /// over every try; a write is sent again only within its retry window
    /// (this, at most `limits::MAX_WRITE_RETRY_WINDOW`) of a try that may
    /// have reached a shard, and is reported `Uncertain` after.
    pub request_timeout: Duration,
    /// Longest wait for a TCP connection.
    pub connect_timeout: Duration,
    /// Ceiling on the largest frame sent or accepted. Each connection
    /// learns the server's limit in its HELLO and uses the smaller of the
    /// two (the default ceiling, 64 MiB, lets the server decide); until
    /// then, and with a server that does not say, it is the default 2 MiB.
    pub max_frame: usize,
    /// Keys whose item address is cached for one-round-trip GETs.
    pub hint_cache_entries: usize,
    /// Abandon one-sided attempts that outlast the server's grace period.
    /// Only tests that provoke torn reads turn this off, to show that
    /// verification alone catches them.
    pub enforce_grace: bool,
    /// The secret to prove when the server requires authentication
    /// (default: none). The SDK never reads the environment for it: an
    /// application that wants `DMKV_TOKEN` asks
    /// [`ClientConfig::token_from_env`], as the `dmkv` CLI and `dmkv-ycsb`
    /// do.
    pub token: Option<Arc<Token>>,
    /// TLS for RPC and engine connections (the server must serve TLS).
    pub tls: Option<TlsOptions>,
    /// Check cluster leases (always, but for tests that show the check
    /// is needed).
    #[doc(hidden)]
    pub check_leases: bool,
}

impl ClientConfig {
    /// The token in the `DMKV_TOKEN` environment variable, if it is set;
    /// an error if it is set but no valid token. For applications that
    /// take their secret from the environment, as the `dmkv` CLI and
    /// `dmkv-ycsb` do: the SDK never looks there itself.
    pub fn token_from_env() -> Result<Option<Arc<Token>>, ClientError> {
        match std::env::var(TOKEN_ENV) {
            Ok(v) => {
                Token::new(&v).map(|t| Some(Arc::new(t))).map_err(|e| ClientError::Config(format!("{TOKEN_ENV}: {e}")))
            }
            Err(_) => Ok(None),
        }
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            read_path: ReadPath::Auto,
            transport: None,
            pool_size: 2,
            engine_connections: 2,
            path: PathConfig::default(),
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            max_frame: MAX_CLIENT_FRAME_LEN,
            hint_cache_entries: onesided::DEFAULT_HINT_ENTRIES,
            enforce_grace: true,
            token: None,
            tls: None,
            check_leases: true,
        }
    }
}

/// A value read with the version the server gave its write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub value: Bytes,
    pub version: u64,
    /// The item's client flags (memcached's).
    pub flags: u32,
    /// Unix second the item expires at, by the server's clock; 0: never.
    pub expires_at: u32,
}

/// An async dmkv client. Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    addr: String,
    cfg: ClientConfig,
    /// `cfg.token`.
    token: Option<Arc<Token>>,
    tls: Option<Connector>,
    pool: Vec<Mutex<PoolSlot>>,
    next: AtomicUsize,
    path: std::sync::Mutex<PathState>,
    read_counters: Arc<ReadCounters>,
    selector: Arc<PathSelector>,
    rpc_health: ConnHealth,
    rpc_repaths: Arc<AtomicU64>,
    engine_repaths: Arc<AtomicU64>,
    /// Set when the server is a cluster node: requests then go through
    /// the router to each key's shard leader.
    router: std::sync::OnceLock<Router>,
    /// The server said (in HELLO) that it is a cluster node.
    cluster_node: std::sync::atomic::AtomicBool,
    /// A cluster session's one-sided paths, per shard region of its node.
    pub(crate) shard_paths: crate::session::ShardPaths,
}

/// A [`Client`] that may have been dropped (see [`Client::downgrade`]).
#[derive(Debug, Clone)]
pub(crate) struct WeakClient(std::sync::Weak<Inner>);

impl WeakClient {
    /// The client, while some clone of it is alive.
    pub(crate) fn upgrade(&self) -> Option<Client> {
        self.0.upgrade().map(|inner| Client { inner })
    }
}

/// How this client's GETs have been routed (see [`Client::path_stats`]).
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

/// The one-sided path, if attached, and when attaching was last tried.
#[derive(Default)]
struct PathState {
    attached: Option<Arc<OneSided>>,
    last_try: Option<Instant>,
    /// A background attach is under way.
    attaching: bool,
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

/// How often a client in `ReadPath::Auto` retries attaching one-sided reads
/// after a failure; GETs go over RPC meanwhile.
const REATTACH_INTERVAL: Duration = Duration::from_millis(500);
/// First wait after a failed connect before a pool slot tries again; it
/// doubles per failure up to [`MAX_CONNECT_BACKOFF`]. Meanwhile requests on
/// that slot fail at once with the connect's error.
const CONNECT_BACKOFF: Duration = Duration::from_millis(50);
/// Most seed addresses [`Client::connect_seeds`] takes: tried one after
/// another, each within the connect timeout.
pub const MAX_SEEDS: usize = 64;
/// Longest wait between connects of one pool slot.
const MAX_CONNECT_BACKOFF: Duration = Duration::from_secs(2);

/// One pooled RPC connection, opened on demand. Connects are single-flight:
/// one caller connects while the others wait for the slot, and after a
/// failure they get its error at once until the backoff has passed, so no
/// caller waits for more than one connect (and never past its deadline).
#[derive(Default)]
struct PoolSlot {
    conn: Option<Arc<Conn>>,
    failure: Option<ConnectFailure>,
}

struct ConnectFailure {
    at: Instant,
    backoff: Duration,
    error: ClientError,
}

impl Client {
    /// Connects to a server with default settings.
    pub async fn connect(addr: impl Into<String>) -> Result<Client, ClientError> {
        Client::connect_with(addr, ClientConfig::default()).await
    }

    /// Connects with the given settings. Opens one connection now (so a
    /// wrong address fails here) and checks the protocol version. If the
    /// server is a cluster node, loads the cluster map: requests then go to
    /// each key's shard leader, wherever it is.
    pub async fn connect_with(addr: impl Into<String>, cfg: ClientConfig) -> Result<Client, ClientError> {
        Client::open(addr.into(), cfg, None).await
    }

    /// Connects to the first of `seeds` that answers, in order, as
    /// [`Client::connect_with`] does to one: give a cluster's nodes, and
    /// the client connects while any of them is up (it then learns the
    /// map, and with it every node). Fails with the last seed's error
    /// (each seed's in its message) if none answers; at most
    /// [`MAX_SEEDS`] seeds.
    pub async fn connect_seeds<A: AsRef<str>>(seeds: &[A], cfg: ClientConfig) -> Result<Client, ClientError> {
        if seeds.is_empty() || seeds.len() > MAX_SEEDS {
            return Err(ClientError::Config(format!("{} seed addresses: give 1 to {MAX_SEEDS}", seeds.len())));
        }
        let mut failed = Vec::new();
        for seed in seeds {
            match Client::connect_with(seed.as_ref(), cfg.clone()).await {
                Ok(c) => return Ok(c),
                Err(e) => failed.push(e),
            }
        }
        let last = failed.pop().expect("one failure per seed, and there is a seed");
        if failed.is_empty() {
            return Err(last);
        }
        let all: Vec<String> = failed.iter().map(ToString::to_string).collect();
        Err(match last {
            ClientError::Connect { addr, reason } => ClientError::Connect {
                addr,
                reason: format!("{reason} (and every other seed failed: {})", all.join("; ")),
            },
            other => other,
        })
    }

    /// A session with one node, as the cluster router keeps: no map, no
    /// routing of its own.
    /// Its one-sided reads are counted in `counters` (the routing client's).
    pub(crate) async fn connect_session(
        addr: String,
        cfg: ClientConfig,
        counters: Arc<ReadCounters>,
    ) -> Result<Client, ClientError> {
        Client::open(addr, cfg, Some(counters)).await
    }

    async fn open(
        addr: String,
        cfg: ClientConfig,
        session_of: Option<Arc<ReadCounters>>,
    ) -> Result<Client, ClientError> {
        let detect_cluster = session_of.is_none();
        let pool: Vec<_> = (0..cfg.pool_size.max(1)).map(|_| Mutex::default()).collect();
        let selector = PathSelector::new(cfg.path);
        selector.set_usable(Path::Rpc, true);
        let rpc_repaths = Arc::new(AtomicU64::new(0));
        let token = cfg.token.clone();
        let tls = cfg.tls.as_ref().map(|o| Connector::new(o, &addr)).transpose().map_err(ClientError::Config)?;
        let inner = Inner {
            token,
            tls,
            addr,
            rpc_health: ConnHealth::new(pool.len(), cfg.path, Arc::clone(&rpc_repaths)),
            cfg,
            pool,
            next: AtomicUsize::new(0),
            path: Default::default(),
            read_counters: session_of.unwrap_or_default(),
            selector,
            rpc_repaths,
            engine_repaths: Arc::default(),
            router: Default::default(),
            cluster_node: Default::default(),
            shard_paths: Default::default(),
        };
        let client = Client { inner: Arc::new(inner) };
        client.conn_at(0, client.deadline()).await?;
        if detect_cluster && client.inner.cluster_node.load(Ordering::Relaxed) {
            // Shard regions are attached on first read, and a failure then
            // sends reads over RPC: a forced transport the seed node does
            // not offer is refused here, before anything goes anywhere.
            if let (Some(transport), true) = (client.inner.cfg.transport, client.inner.cfg.read_path != ReadPath::Rpc) {
                let info = client.region_info_full().await?;
                onesided::offered(&info, transport)
                    .map_err(|reason| ClientError::TransportUnavailable { transport, reason })?;
            }
            let map = client.cluster_map().await?;
            let counters = Arc::clone(&client.inner.read_counters);
            let _ = client.inner.router.set(Router::new(map, &client.inner.cfg, counters));
            return Ok(client);
        }
        match (client.inner.cfg.read_path, client.inner.cfg.transport) {
            (ReadPath::Rpc, _) => {}
            // A forced transport is what the caller asked for: failing to
            // attach it is an error, not a reason to read over RPC.
            (ReadPath::Auto | ReadPath::OneSided, Some(transport)) => {
                client.attach().await.map_err(|e| match e {
                    ClientError::OneSidedUnavailable(reason) => ClientError::TransportUnavailable { transport, reason },
                    other => other,
                })?;
            }
            (ReadPath::Auto, None) => {
                if let Err(e) = client.attach().await {
                    tracing::debug!("one-sided reads unavailable, using RPC: {e}");
                }
            }
            (ReadPath::OneSided, None) => {
                client.attach().await?;
            }
        }
        Ok(client)
    }

    /// The one-sided path, attaching it if needed (rate-limited in `Auto`).
    async fn one_sided(&self) -> Result<Option<Arc<OneSided>>, ClientError> {
        match self.inner.cfg.read_path {
            ReadPath::Rpc => Ok(None),
            ReadPath::OneSided => self.attach().await.map(Some),
            ReadPath::Auto => {
                {
                    let mut st = self.inner.path.lock().expect("path lock poisoned");
                    if let Some(p) = &st.attached {
                        return Ok(Some(Arc::clone(p)));
                    }
                    if st.attaching || st.last_try.is_some_and(|t| t.elapsed() < REATTACH_INTERVAL) {
                        return Ok(None);
                    }
                    st.last_try = Some(Instant::now());
                    st.attaching = true;
                }
                // Attach in the background: a GET must not wait for a
                // connect that may time out; it goes over RPC meanwhile.
                let client = self.clone();
                tokio::spawn(async move {
                    if let Err(e) = client.attach().await {
                        tracing::debug!("one-sided reads unavailable, using RPC: {e}");
                    }
                    client.inner.path.lock().expect("path lock poisoned").attaching = false;
                });
                Ok(None)
            }
        }
    }

    async fn attach(&self) -> Result<Arc<OneSided>, ClientError> {
        {
            let mut st = self.inner.path.lock().expect("path lock poisoned");
            if let Some(p) = &st.attached {
                return Ok(Arc::clone(p));
            }
            st.last_try = Some(Instant::now());
        }
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
                token: self.inner.token.clone(),
                shard: None,
                clock: None,
                check_leases: cfg.check_leases,
            };
            tries += 1;
            match onesided::attach(self, &info, opts).await {
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
        let path = Arc::new(path);
        let mut st = self.inner.path.lock().expect("path lock poisoned");
        let path = Arc::clone(st.attached.get_or_insert(path));
        self.inner.selector.set_usable(Path::OneSided, true);
        Ok(path)
    }

    /// Forgets a path that failed, so the next GET attaches anew.
    fn detach(&self, failed: &Arc<OneSided>, why: &BackendError) {
        tracing::debug!("one-sided path failed: {why}");
        let mut st = self.inner.path.lock().expect("path lock poisoned");
        if st.attached.as_ref().is_some_and(|p| Arc::ptr_eq(p, failed)) {
            st.attached = None;
            st.last_try = None;
            self.inner.selector.set_usable(Path::OneSided, false);
        }
    }

    /// The one-sided backend GETs use now, if any.
    pub fn one_sided_transport(&self) -> Option<Transport> {
        // Read-only, and called from metrics collectors inside the
        // application's scrape handler: a poisoned lock still says which
        // path is attached, and must not panic there.
        let st = self.inner.path.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        st.attached.as_ref().map(|p| p.transport())
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

    /// A handle that does not keep the client (and its connections) alive,
    /// for metrics collectors that outlive it.
    pub(crate) fn downgrade(&self) -> WeakClient {
        WeakClient(Arc::downgrade(&self.inner))
    }

    /// The server address.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// Settings in use.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.cfg
    }

    /// When a request that starts now must have its reply.
    fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.inner.cfg.request_timeout
    }

    /// The open connection of pool slot `i`, connecting it if needed (see
    /// [`PoolSlot`]); gives up at `deadline`.
    async fn conn_at(&self, i: usize, deadline: tokio::time::Instant) -> Result<Arc<Conn>, ClientError> {
        // The common case, an open connection and nobody connecting, takes
        // no timer and no wait.
        if let Ok(slot) = self.inner.pool[i].try_lock()
            && let Some(c) = &slot.conn
            && !c.is_closed()
        {
            return Ok(Arc::clone(c));
        }
        let timeout = ClientError::Timeout(self.inner.cfg.request_timeout);
        let mut slot = tokio::time::timeout_at(deadline, self.inner.pool[i].lock()).await.map_err(|_| timeout)?;
        if let Some(c) = &slot.conn
            && !c.is_closed()
        {
            return Ok(Arc::clone(c));
        }
        if let Some(f) = &slot.failure
            && f.at.elapsed() < f.backoff
        {
            return Err(f.error.clone());
        }
        let result = self.open_conn(deadline).await;
        match &result {
            Ok(conn) => *slot = PoolSlot { conn: Some(Arc::clone(conn)), failure: None },
            Err(e) => {
                let backoff =
                    slot.failure.as_ref().map_or(CONNECT_BACKOFF, |f| (f.backoff * 2).min(MAX_CONNECT_BACKOFF));
                slot.conn = None;
                slot.failure = Some(ConnectFailure { at: Instant::now(), backoff, error: e.clone() });
            }
        }
        result
    }

    /// Connects, says HELLO, and authenticates if the server asks, all by
    /// `deadline`. A peer that answers HELLO as no dmkv server would is
    /// [`ClientError::NotDmkv`] (or a TLS server met without TLS).
    async fn open_conn(&self, deadline: tokio::time::Instant) -> Result<Arc<Conn>, ClientError> {
        let cfg = &self.inner.cfg;
        let addr = &self.inner.addr;
        // Until the server names its limit, no more than the default: a
        // peer that is no dmkv server cannot make this client buffer more.
        let before_hello = cfg.max_frame.min(DEFAULT_MAX_FRAME_LEN);
        let dial = Conn::connect(addr, cfg.connect_timeout, before_hello, self.inner.tls.as_ref());
        let conn =
            tokio::time::timeout_at(deadline, dial).await.map_err(|_| ClientError::Timeout(cfg.request_timeout))??;
        let hello = Op::Hello(proto::Hello { protocol_version: PROTOCOL_VERSION, client_name: "dmkv-client".into() });
        let sent = tokio::time::Instant::now();
        let answer = match conn.send(hello).await {
            Ok(inflight) => inflight.wait_until(deadline, cfg.request_timeout).await,
            Err(e) => Err(e),
        };
        let resp = match answer {
            Ok(resp) => resp,
            Err(ClientError::ConnectionClosed) => {
                return Err(hello_refused(addr, conn.read_end(), self.inner.tls.is_some()));
            }
            // A HELLO left only a sliver of a request's budget proves nothing.
            Err(ClientError::Timeout(t)) if sent.elapsed() < cfg.request_timeout / 2 => {
                return Err(ClientError::Timeout(t));
            }
            Err(ClientError::Timeout(_)) => {
                let waited = sent.elapsed();
                return Err(ClientError::NotDmkv {
                    addr: addr.clone(),
                    detail: format!(
                        "no answer to HELLO within {waited:.0?} (a dmkvd too busy or stalled to answer would not \
                         either); is it dmkvd's RPC address?"
                    ),
                });
            }
            Err(e) => return Err(e),
        };
        let nonce = match unwrap(resp)? {
            R::Hello(h) => {
                self.inner.cluster_node.store(h.cluster, Ordering::Relaxed);
                conn.learn_frame_limit(h.max_frame, cfg.max_frame);
                h.auth_nonce
            }
            other => return Err(unexpected(&other)),
        };
        if nonce.is_empty() {
            return Ok(conn);
        }
        let Some(token) = &self.inner.token else {
            return Err(ClientError::Server {
                code: ErrorCode::Unauthenticated,
                message: format!(
                    "{} requires authentication: give a token (ClientConfig::token; the dmkv CLI and dmkv-ycsb take \
                     {TOKEN_ENV} or --token-file)",
                    self.inner.addr
                ),
            });
        };
        let proof = token.prove(Purpose::Rpc, &nonce).to_vec().into();
        let resp = conn
            .send(Op::Authenticate(proto::Authenticate { proof }))
            .await?
            .wait_until(deadline, cfg.request_timeout)
            .await?;
        match unwrap(resp)? {
            R::Authenticate(_) => Ok(conn),
            other => Err(unexpected(&other)),
        }
    }

    /// The secret this client proves, if any.
    pub(crate) fn shard_paths(&self) -> &crate::session::ShardPaths {
        &self.inner.shard_paths
    }

    pub(crate) fn read_counters(&self) -> Arc<ReadCounters> {
        Arc::clone(&self.inner.read_counters)
    }

    pub(crate) fn token(&self) -> Option<&Arc<Token>> {
        self.inner.token.as_ref()
    }

    /// The TLS connector, if this client speaks TLS.
    pub(crate) fn tls(&self) -> Option<&Connector> {
        self.inner.tls.as_ref()
    }

    /// A connection outside the pool, for state that must live as long as
    /// a one-sided path (the server's RDMA queue pairs live as long as the
    /// connection that set them up, and pooled connections get replaced).
    #[cfg(feature = "rdma")]
    pub(crate) async fn dedicated_conn(&self) -> Result<Arc<Conn>, ClientError> {
        self.open_conn(self.deadline()).await
    }

    /// Closes every pooled RPC connection, as the path controller does to a
    /// congested one; later requests open fresh ones. For tests.
    #[doc(hidden)]
    pub async fn replace_rpc_connections(&self) {
        for slot in &self.inner.pool {
            slot.lock().await.conn = None;
        }
    }

    /// Sends a request on the next pooled connection without waiting for
    /// its reply: the building block of pipelining.
    pub async fn send(&self, op: Op) -> Result<InFlight, ClientError> {
        self.send_on(self.next_slot(), op, self.deadline()).await
    }

    /// The pooled connection the next request goes on.
    fn next_slot(&self) -> usize {
        self.inner.next.fetch_add(1, Ordering::Relaxed) % self.inner.pool.len()
    }

    async fn send_on(&self, slot: usize, op: Op, deadline: tokio::time::Instant) -> Result<InFlight, ClientError> {
        self.conn_at(slot, deadline).await?.send_by(op, deadline, self.inner.cfg.request_timeout).await
    }

    /// Sends `op` on connection `slot` and waits for its result; connecting
    /// counts against the request's timeout, which the connection's
    /// watchdog enforces (no timer per request).
    async fn call_on(&self, slot: usize, op: Op) -> Result<R, ClientError> {
        let deadline = self.deadline();
        let timeout = self.inner.cfg.request_timeout;
        let sent = self.conn_at(slot, deadline).await?.send_until(op, deadline, timeout).await?;
        unwrap(sent.wait_watched(deadline, timeout).await?)
    }

    pub(crate) async fn call(&self, op: Op) -> Result<R, ClientError> {
        self.call_on(self.next_slot(), op).await
    }

    /// Reads `key`; `None` if it is not stored.
    pub async fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Bytes>, ClientError> {
        Ok(self.get_versioned(key).await?.map(|v| v.value))
    }

    /// Reads `key` with its version, down the path [`ReadPath`] says: in
    /// `Auto`, the one the path controller prices cheaper for this key now.
    pub async fn get_versioned(&self, key: impl AsRef<[u8]>) -> Result<Option<Versioned>, ClientError> {
        let key = key.as_ref();
        check_key(key)?;
        if let Some(r) = self.inner.router.get() {
            return r.get(key).await;
        }
        self.node_get(key).await
    }

    /// [`Client::get_versioned`] on this node, without routing.
    pub(crate) async fn node_get(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        let sel = &self.inner.selector;
        match self.inner.cfg.read_path {
            ReadPath::Rpc => self.measured_rpc_get(key, sel.admit_sampled(Path::Rpc, key)).await,
            ReadPath::Auto => self.auto_get(key).await,
            ReadPath::OneSided => {
                let mut failure = None;
                for _ in 0..FORCED_ONE_SIDED_TRIES {
                    let path = self.attach().await?;
                    let adm = sel.admit_sampled(Path::OneSided, key);
                    match self.measured_one_sided_get(&path, key, adm).await {
                        Ok(Measured::Done(r)) => return Ok(r),
                        Ok(Measured::AskServer(gave_up)) => return self.ask_server(key, gave_up).await,
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
        if self.inner.cfg.read_path == ReadPath::Rpc || self.inner.router.get().is_some() {
            return None;
        }
        let path = self.inner.path.lock().expect("path lock poisoned").attached.clone()?;
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

    async fn auto_get(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        let attached = self.one_sided().await?;
        // Shared memory is not priced against RPC: a copy from local
        // memory has no link or server queue to congest, and costs a
        // fraction of any round trip (docs/path-selection.md).
        if let Some(path) = attached.as_ref().filter(|p| p.is_local()) {
            let adm = self.inner.selector.admit_sampled(Path::OneSided, key);
            return self.one_sided_or_rpc(path, key, adm).await;
        }
        let h = key_hash(key);
        let deadline = tokio::time::Instant::now() + self.inner.cfg.request_timeout;
        let rounds = attached.as_ref().map(|p| if p.has_hint(key) { 1.0 } else { 2.0 });
        let Some((adm, probes)) = self.inner.selector.admit(h, rounds, deadline).await else {
            return Err(ClientError::Timeout(self.inner.cfg.request_timeout));
        };
        for p in probes {
            self.spawn_probe(p, key);
        }
        match (adm.path, attached) {
            (Path::OneSided, Some(path)) => self.one_sided_or_rpc(&path, key, Some(adm)).await,
            (Path::Rpc, None) => self.measured_rpc_get(key, Some(adm)).await,
            // Detached since the choice: dropping the admission cancels it.
            (Path::OneSided, None) => {
                drop(adm);
                self.node_rpc_get(key).await
            }
            (Path::Rpc, Some(path)) => match self.measured_rpc_get(key, Some(adm)).await {
                // The RPC path broke under this GET: answer it one-sided.
                Err(e) if e.is_transport() => match path.get(key).await {
                    Ok(OneSidedGet::Found(v)) => Ok(Some(v)),
                    Ok(OneSidedGet::Missing) => Ok(None),
                    Ok(OneSidedGet::GiveUp) => Err(e),
                    Err(be) => {
                        self.detach(&path, &be);
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
    /// the caller sends that RPC ([`Client::ask_server`]), and its failure
    /// is the RPC's, not this path's (run in here, it became a backend
    /// failure that detached a healthy path).
    async fn measured_one_sided_get(
        &self,
        path: &Arc<OneSided>,
        key: &[u8],
        adm: Option<Admission>,
    ) -> Result<Measured, BackendError> {
        self.report_accesses(path);
        let (got, t) = match path.get_traced(key).await {
            Ok(r) => r,
            Err(e) => {
                if let Some(adm) = adm {
                    adm.fail();
                }
                return Err(e);
            }
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
    async fn ask_server(&self, key: &[u8], gave_up: GaveUp) -> Result<Option<Versioned>, ClientError> {
        let r = self.node_rpc_get(key).await;
        gave_up.asked();
        r
    }

    /// [`Client::measured_one_sided_get`], then what it leaves to RPC: a
    /// GET that gave up, or one whose path failed (detached here).
    async fn one_sided_or_rpc(
        &self,
        path: &Arc<OneSided>,
        key: &[u8],
        adm: Option<Admission>,
    ) -> Result<Option<Versioned>, ClientError> {
        match self.measured_one_sided_get(path, key, adm).await {
            Ok(Measured::Done(r)) => Ok(r),
            Ok(Measured::AskServer(gave_up)) => self.ask_server(key, gave_up).await,
            Err(e) => {
                // The failure moved traffic to RPC; this GET goes there too.
                self.detach(path, &e);
                self.node_rpc_get(key).await
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
            let _ = this.call(Op::AccessReport(proto::AccessReport { region_id, units })).await;
        });
    }

    /// An RPC GET on the next pooled connection whose delay is reported to
    /// the path controller and to that connection's congestion detector.
    /// `adm`: the controller's admission, when it steers this client.
    async fn measured_rpc_get(&self, key: &[u8], adm: Option<Admission>) -> Result<Option<Versioned>, ClientError> {
        let i = self.next_slot();
        let start = adm.as_ref().map_or_else(Instant::now, Admission::started);
        // A probe's admission was taken before it was spawned (and before
        // its GET waited for a window): the connection's detector times the
        // request alone, or it would see congestion that is not there.
        let sent = if adm.as_ref().is_some_and(Admission::is_probe) { Instant::now() } else { start };
        let result = self.call_on(i, Op::Get(proto::Get { key: Bytes::copy_from_slice(key) })).await;
        match &result {
            Err(e) if e.is_transport() => {
                if let Some(adm) = adm {
                    adm.fail();
                }
            }
            _ => {
                let end = Instant::now();
                let took = end.saturating_duration_since(start).as_nanos() as u64;
                if let Some(adm) = adm {
                    adm.complete_after(took, 1, 0);
                }
                let on_conn = end.saturating_duration_since(sent).as_nanos() as u64;
                if self.inner.rpc_health.record_ended(end, i, on_conn) {
                    // Congested for several rounds: later requests of this
                    // slot open a fresh connection; this one drains.
                    tracing::debug!(conn = i, "RPC connection congested: moving to a new one");
                    self.inner.pool[i].lock().await.conn = None;
                }
            }
        }
        match result? {
            R::Get(g) => Ok(self.learn(key, g)),
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
            let attached = self.inner.path.lock().expect("path lock poisoned").attached.clone();
            if let Some(p) = attached {
                p.learn_hint(key, g.hint_bucket, g.hint_index, g.hint_slot);
            }
        }
        Some(Versioned { value: g.value, version: g.version, flags: g.flags, expires_at: g.expires_at })
    }

    /// Sends a background copy of a GET down the path of `probe`, to keep
    /// that path's estimates fresh; its answer is dropped.
    fn spawn_probe(&self, probe: Admission, key: &[u8]) {
        let client = self.clone();
        let key = Bytes::copy_from_slice(key);
        tokio::spawn(async move {
            let timeout = client.inner.cfg.request_timeout;
            match probe.path {
                Path::Rpc => {
                    let _ = client.measured_rpc_get(&key, Some(probe)).await;
                }
                Path::OneSided => {
                    let attached = client.inner.path.lock().expect("path lock poisoned").attached.clone();
                    // Not attached any more: dropping the probe cancels it.
                    let Some(path) = attached else { return };
                    match tokio::time::timeout(timeout, path.get_traced(&key)).await {
                        Ok(Ok((_, t))) => probe.complete(t.round_trips, t.retries),
                        Ok(Err(e)) => {
                            probe.fail();
                            client.detach(&path, &e);
                        }
                        Err(_) => probe.fail(),
                    }
                }
            }
        });
    }

    /// Reads `key` over RPC, whatever the read path.
    pub async fn rpc_get(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        check_key(key)?;
        if let Some(r) = self.inner.router.get() {
            return r.rpc_get(key).await;
        }
        self.node_rpc_get(key).await
    }

    pub(crate) async fn node_rpc_get(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        self.node_rpc_get_hinting(key, None).await
    }

    /// [`Client::node_rpc_get`]; where the server says the key's slot is,
    /// `path` (the region the reply's hint is about: a cluster shard's)
    /// caches it for its next one-sided GET of the key.
    pub(crate) async fn node_rpc_get_hinting(
        &self,
        key: &[u8],
        path: Option<&OneSided>,
    ) -> Result<Option<Versioned>, ClientError> {
        match self.call(Op::Get(proto::Get { key: Bytes::copy_from_slice(key) })).await? {
            R::Get(g) => {
                if let Some(p) = path.filter(|_| g.found && g.hint_slot != 0) {
                    p.learn_hint(key, g.hint_bucket, g.hint_index, g.hint_slot);
                }
                Ok(self.learn(key, g))
            }
            other => Err(unexpected(&other)),
        }
    }

    /// Stores `value` under `key`; returns the version of this write.
    pub async fn put(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<u64, ClientError> {
        let (key, value) = (key.as_ref(), value.as_ref());
        check_key(key)?;
        check_value(value)?;
        if let Some(r) = self.inner.router.get() {
            return r.put(key, value).await;
        }
        self.node_put(key, value).await
    }

    /// [`Client::put`] on this node, without routing.
    pub(crate) async fn node_put(&self, key: &[u8], value: &[u8]) -> Result<u64, ClientError> {
        self.node_put_with(key, value, None).await
    }

    /// [`Client::node_put`] with a write id (cluster writes, so one sent
    /// again applies once).
    pub(crate) async fn node_put_with(
        &self,
        key: &[u8],
        value: &[u8],
        write_id: Option<proto::WriteId>,
    ) -> Result<u64, ClientError> {
        let op = Op::Put(proto::Put {
            key: Bytes::copy_from_slice(key),
            value: Bytes::copy_from_slice(value),
            write_id,
            ..Default::default()
        });
        match self.call(op).await? {
            R::Put(p) => Ok(p.version),
            other => Err(unexpected(&other)),
        }
    }

    /// Removes `key`; returns whether it existed.
    pub async fn delete(&self, key: impl AsRef<[u8]>) -> Result<bool, ClientError> {
        let key = key.as_ref();
        check_key(key)?;
        if let Some(r) = self.inner.router.get() {
            return r.delete(key).await;
        }
        self.node_delete(key).await
    }

    /// [`Client::delete`] on this node, without routing.
    pub(crate) async fn node_delete(&self, key: &[u8]) -> Result<bool, ClientError> {
        self.node_delete_with(key, None).await
    }

    /// [`Client::node_delete`] with a write id.
    pub(crate) async fn node_delete_with(
        &self,
        key: &[u8],
        write_id: Option<proto::WriteId>,
    ) -> Result<bool, ClientError> {
        match self.call(Op::Delete(proto::Delete { key: Bytes::copy_from_slice(key), write_id, cas: 0 })).await? {
            R::Delete(d) => Ok(d.existed),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads many keys; the result is in the order of `keys`. Large batches
    /// are split into requests of at most [`MAX_MULTI_GET_KEYS`] keys, all
    /// in flight at once.
    pub async fn multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, ClientError> {
        for k in keys {
            check_key(k.as_ref())?;
        }
        if let Some(r) = self.inner.router.get() {
            return r.multi_get(keys).await;
        }
        self.node_multi_get(keys).await
    }

    /// [`Client::multi_get`] on this node, without routing.
    pub(crate) async fn node_multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, ClientError> {
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
        self.node_rpc_multi_get(keys).await
    }

    /// A multi-get over `path`; keys whose reads kept failing verification
    /// are asked over RPC. The outer error is that RPC's; the inner one, the
    /// path's failure (nothing returned).
    pub(crate) async fn one_sided_multi_get<K: AsRef<[u8]>>(
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
            for (i, v) in rest.into_iter().zip(self.node_rpc_multi_get(&rest_keys).await?) {
                out[i] = v;
            }
        }
        Ok(Ok(out))
    }

    /// Multi-get over RPC, whatever the read path.
    pub async fn rpc_multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, ClientError> {
        if let Some(r) = self.inner.router.get() {
            return r.rpc_multi_get(keys).await;
        }
        self.node_rpc_multi_get(keys).await
    }

    pub(crate) async fn node_rpc_multi_get<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<Option<Bytes>>, ClientError> {
        let mut sent = Vec::new();
        for chunk in keys.chunks(MAX_MULTI_GET_KEYS) {
            let ks = chunk.iter().map(|k| Bytes::copy_from_slice(k.as_ref())).collect();
            sent.push((chunk, self.send(Op::MultiGet(proto::MultiGet { keys: ks })).await?));
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
                        out.push(self.node_rpc_get(k.as_ref()).await?.map(|v| v.value));
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
        match self.call(Op::GetMap(proto::GetMap {})).await? {
            R::Map(m) => Ok(m),
            other => Err(unexpected(&other)),
        }
    }

    /// Admin: replaces this node's replica of `shard` by a new one with no
    /// state, which joins the shard and catches up from its leader (the
    /// old one is removed from the members). Returns the new raft id.
    pub async fn replace_replica(&self, shard: u32) -> Result<u64, ClientError> {
        match self.call(Op::ReplaceReplica(proto::ReplaceReplica { shard })).await? {
            R::ReplaceReplica(r) => Ok(r.replica_id),
            other => Err(unexpected(&other)),
        }
    }

    /// The cluster map as this node knows it, checked.
    pub async fn cluster_map(&self) -> Result<dmkv_common::cluster::map::ClusterMap, ClientError> {
        let m = self.cluster_status().await?;
        dmkv_common::cluster::map::ClusterMap::from_proto(&m)
            .map_err(|e| ClientError::Protocol(format!("the node sent a bad cluster map: {e}")))
    }

    /// The cluster router, when the server is a cluster node.
    pub fn router(&self) -> Option<&Router> {
        self.inner.router.get()
    }

    /// The server's counters.
    pub async fn stats(&self) -> Result<HashMap<String, u64>, ClientError> {
        match self.call(Op::Stats(proto::Stats {})).await? {
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
        match self.call(Op::RegionInfo(proto::RegionInfo {})).await? {
            R::RegionInfo(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }

    /// Sets up the server's end of an RDMA queue pair (see the `rdma`
    /// backend); the server's queue pair lives as long as the connection.
    pub async fn rdma_connect(&self, endpoint: Vec<u8>) -> Result<proto::RdmaConnectReply, ClientError> {
        match self.call(Op::RdmaConnect(proto::RdmaConnect { endpoint: endpoint.into() })).await? {
            R::RdmaConnect(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }

    /// Admin: makes the server register its region anew (new epoch and
    /// rkey). Every client's one-sided path then fails over and re-attaches.
    pub async fn reregister(&self) -> Result<proto::RegionInfoReply, ClientError> {
        match self.call(Op::Reregister(proto::Reregister {})).await? {
            R::Reregister(r) => Ok(r),
            other => Err(unexpected(&other)),
        }
    }
}

/// The error for a peer at `addr` that closed the connection instead of
/// answering HELLO; `end` says what it sent before, if anything.
fn hello_refused(addr: &str, end: Option<&crate::conn::ReadEnd>, tls: bool) -> ClientError {
    let not_dmkv = |detail: String| ClientError::NotDmkv { addr: addr.to_string(), detail };
    let Some(end) = end else {
        // The write failed before the reader noticed anything.
        return not_dmkv("it closed the connection on HELLO; is it dmkvd's RPC address?".into());
    };
    let head = end.head.as_slice();
    // A TLS record header: content type 20..=23, then version 3.x.
    if !tls && head.len() >= 2 && (20..=23).contains(&head[0]) && head[1] == 3 {
        return ClientError::Connect {
            addr: addr.to_string(),
            reason: "the server speaks TLS: give the CA that signed its certificate (ClientConfig::tls, --tls-ca)"
                .into(),
        };
    }
    if head.starts_with(&dmkv_common::onesided::ENGINE_MAGIC) {
        return not_dmkv(
            "it greets like dmkvd's one-sided engine: that is the engine port; give the RPC address (dmkvd prints \
             rpc=ADDR)"
                .into(),
        );
    }
    match &end.error {
        Some(e) => not_dmkv(format!(
            "it answered HELLO with bytes that are no dmkv reply ({}: {e}); is it dmkvd's RPC address?",
            hex_head(head)
        )),
        None if !head.is_empty() => not_dmkv(format!(
            "it answered HELLO with {} bytes that are no dmkv reply ({}) and closed; is it dmkvd's RPC address?",
            head.len(),
            hex_head(head)
        )),
        None => not_dmkv("it closed the connection on HELLO without a word; is it dmkvd's RPC address?".into()),
    }
}

/// The first bytes of a bad reply, as hex and as text where printable.
fn hex_head(head: &[u8]) -> String {
    let hex: Vec<String> = head.iter().take(8).map(|b| format!("{b:02x}")).collect();
    let text: String = head.iter().take(8).map(|&b| if b.is_ascii_graphic() { b as char } else { '.' }).collect();
    format!("{} {text:?}", hex.join(" "))
}

/// Why a forced transport could not be attached, without the wrapping
/// that [`ClientError::TransportUnavailable`] adds itself.
fn attach_reason(e: BackendError) -> String {
    match e {
        BackendError::Attach(why) => why,
        other => other.to_string(),
    }
}

/// Turns a reply into its result, or the server's error into ours.
pub fn unwrap(resp: Response) -> Result<R, ClientError> {
    match resp.result {
        Some(R::Error(e)) if e.code == ErrorCode::NotLeader as i32 => {
            Err(ClientError::NotLeader { leader: (e.leader != 0).then_some(e.leader), map_version: e.map_version })
        }
        Some(R::Error(e)) => Err(ClientError::Server {
            code: ErrorCode::try_from(e.code).unwrap_or(ErrorCode::Unspecified),
            message: e.message,
        }),
        Some(r) => Ok(r),
        None => Err(ClientError::Protocol("reply without a result".into())),
    }
}

pub(crate) fn unexpected(r: &R) -> ClientError {
    ClientError::Protocol(format!("unexpected reply {r:?}"))
}
