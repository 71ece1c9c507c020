//! The RPC pool of one node: a few pipelined connections, each opened on
//! demand (single-flight, with backoff after a failure), with the HELLO
//! handshake and authentication. Sessions send their RPCs here; the
//! one-sided backends get their control connections here.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dmkv_common::PROTOCOL_VERSION;
use dmkv_common::auth::{Purpose, Token};
use dmkv_common::limits::DEFAULT_MAX_FRAME_LEN;
use dmkv_common::proto::{self, ErrorCode, request::Op, response::Result as R};
use dmkv_common::request::Body;
use tokio::sync::Mutex;

use dmkv_common::path::rpc_price::{RpcPrice, RpcWay};

use crate::config::{ClientConfig, TOKEN_ENV};
use crate::conn::{Conn, InFlight};
use crate::error::{ClientError, ConnectReason, unexpected, unwrap};
use crate::tls::Connector;

/// First wait after a failed connect before a pool slot tries again; it
/// doubles per failure up to [`MAX_CONNECT_BACKOFF`]. Meanwhile requests on
/// that slot fail at once with the connect's error.
const CONNECT_BACKOFF: Duration = Duration::from_millis(50);
/// How long a pool on `RpcTransport::Auto` stays on TCP after a verbs RPC
/// link could not be opened (no device, or the node had no room).
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
const VERBS_RETRY: Duration = Duration::from_secs(10);
/// Longest wait between connects of one pool slot.
const MAX_CONNECT_BACKOFF: Duration = Duration::from_secs(2);

/// One pooled RPC connection, opened on demand. Connects are single-flight:
/// one caller connects while the others wait for the slot, and after a
/// failure they get its error at once until the backoff has passed, so no
/// caller waits for more than one connect (and never past its deadline).
#[derive(Default)]
struct PoolSlot {
    conn: Option<Pair>,
    failure: Option<ConnectFailure>,
}

/// A pool slot's connections: TCP, and the verbs RPC link opened over it
/// (which lives as long as the TCP connection; both carry requests).
#[derive(Clone)]
struct Pair {
    tcp: Arc<Conn>,
    verbs: Option<Arc<Conn>>,
}

impl Pair {
    /// Either closed closes the pair: the link dies with its TCP
    /// connection, and a broken link is opened again with a fresh one.
    fn is_closed(&self) -> bool {
        self.tcp.is_closed() || self.verbs.as_ref().is_some_and(|v| v.is_closed())
    }
}

struct ConnectFailure {
    at: Instant,
    backoff: Duration,
    error: ClientError,
}

/// The RPC connections to one node.
pub struct RpcPool {
    addr: String,
    cfg: ClientConfig,
    token: Option<Arc<Token>>,
    tls: Option<Connector>,
    slots: Vec<Mutex<PoolSlot>>,
    /// Each slot's open connection, as its connect left it: what nearly
    /// every request takes, read without the slot's async lock (whose
    /// release costs a second lock on its waiter list). Written only while
    /// that slot's lock is held.
    open: Vec<std::sync::RwLock<Option<Pair>>>,
    next: AtomicUsize,
    /// The server said (in HELLO) that it is a cluster node.
    cluster_node: AtomicBool,
    /// A verbs RPC link could not be opened (`RpcTransport::Auto`): this
    /// pool's new connections stay on TCP until then.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    verbs_off_until: std::sync::Mutex<Option<Instant>>,
    /// Which of a slot's connections a request takes, where it has both.
    price: std::sync::Mutex<RpcPrice>,
}

impl RpcPool {
    /// A pool of `cfg.pool_size` connections to `addr`, none open yet.
    pub fn new(addr: String, cfg: ClientConfig) -> Result<RpcPool, ClientError> {
        let tls = cfg.tls.as_ref().map(|o| Connector::new(o, &addr)).transpose().map_err(ClientError::Config)?;
        Ok(RpcPool {
            slots: (0..cfg.pool_size.max(1)).map(|_| Mutex::default()).collect(),
            open: (0..cfg.pool_size.max(1)).map(|_| std::sync::RwLock::default()).collect(),
            token: cfg.token.clone(),
            tls,
            addr,
            cfg,
            next: AtomicUsize::new(0),
            cluster_node: AtomicBool::new(false),
            verbs_off_until: std::sync::Mutex::new(None),
            price: std::sync::Mutex::default(),
        })
    }

    /// How many connections the pool keeps.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Never: a pool has at least one slot.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The server address.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Settings in use.
    pub fn config(&self) -> &ClientConfig {
        &self.cfg
    }

    /// The secret this pool proves, if any.
    pub fn token(&self) -> Option<&Arc<Token>> {
        self.token.as_ref()
    }

    /// The TLS connector, if the pool speaks TLS.
    pub fn tls(&self) -> Option<&Connector> {
        self.tls.as_ref()
    }

    /// Whether the server said (in HELLO) that it is a cluster node.
    pub fn is_cluster_node(&self) -> bool {
        self.cluster_node.load(Ordering::Relaxed)
    }

    /// When a request that starts now must have its reply.
    pub fn deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.cfg.request_timeout
    }

    /// The open connection of pool slot `i`, connecting it if needed (see
    /// `PoolSlot`); gives up at `deadline`.
    pub async fn conn_at(&self, i: usize, deadline: tokio::time::Instant) -> Result<Arc<Conn>, ClientError> {
        self.pair_at(i, deadline).await.map(|p| self.pick(&p).0)
    }

    async fn pair_at(&self, i: usize, deadline: tokio::time::Instant) -> Result<Pair, ClientError> {
        // The common case, an open connection, takes no timer, no wait
        // and no async lock.
        if let Some(c) = self.open_at(i) {
            return Ok(c);
        }
        let timeout = ClientError::Timeout(self.cfg.request_timeout);
        let mut slot = tokio::time::timeout_at(deadline, self.slots[i].lock()).await.map_err(|_| timeout)?;
        if let Some(c) = &slot.conn
            && !c.is_closed()
        {
            return Ok(c.clone());
        }
        if let Some(f) = &slot.failure
            && f.at.elapsed() < f.backoff
        {
            return Err(f.error.clone());
        }
        let result = match self.open_conn(deadline).await {
            Ok(tcp) => self.over_verbs(tcp).await,
            Err(e) => Err(e),
        };
        match &result {
            Ok(conn) => {
                *slot = PoolSlot { conn: Some(conn.clone()), failure: None };
                self.publish(i, Some(conn.clone()));
            }
            Err(e) => {
                let backoff =
                    slot.failure.as_ref().map_or(CONNECT_BACKOFF, |f| (f.backoff * 2).min(MAX_CONNECT_BACKOFF));
                slot.conn = None;
                self.publish(i, None);
                slot.failure = Some(ConnectFailure { at: Instant::now(), backoff, error: e.clone() });
            }
        }
        result
    }

    /// Slot `i`'s open connections, if it has them and they have not closed.
    fn open_at(&self, i: usize) -> Option<Pair> {
        // A panic while the lock was held left an `Option` either set or
        // not, never torn: the value is usable.
        let open = self.open[i].read().unwrap_or_else(std::sync::PoisonError::into_inner);
        open.as_ref().filter(|c| !c.is_closed()).cloned()
    }

    /// The connection of `pair` a request takes, and the way to credit
    /// its round trip to when it is measured (`ClientConfig::rpc_transport`:
    /// `Auto` prices the two, `Verbs` takes the link, `Tcp` has none).
    fn pick(&self, pair: &Pair) -> (Arc<Conn>, Option<RpcWay>) {
        let Some(verbs) = &pair.verbs else { return (Arc::clone(&pair.tcp), None) };
        if self.cfg.rpc_transport == crate::config::RpcTransport::Verbs {
            return (Arc::clone(verbs), None);
        }
        let pick = self.price.lock().unwrap_or_else(std::sync::PoisonError::into_inner).pick();
        let conn = match pick.way {
            RpcWay::Verbs => Arc::clone(verbs),
            RpcWay::Tcp => Arc::clone(&pair.tcp),
        };
        (conn, pick.sample.then_some(pick.way))
    }

    /// How this pool's requests were split between TCP and verbs messages,
    /// and what each way costs (all on TCP where it never had both).
    pub fn rpc_price(&self) -> RpcPrice {
        self.price.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Makes `conn` slot `i`'s open connection; called with the slot's
    /// lock held, so it agrees with `PoolSlot::conn`.
    fn publish(&self, i: usize, conn: Option<Pair>) {
        *self.open[i].write().unwrap_or_else(std::sync::PoisonError::into_inner) = conn;
    }

    /// Connects, says HELLO, and authenticates if the server asks, all by
    /// `deadline`. A peer that answers HELLO as no dmkv server would is
    /// [`ClientError::NotDmkv`] (or a TLS server met without TLS).
    async fn open_conn(&self, deadline: tokio::time::Instant) -> Result<Arc<Conn>, ClientError> {
        let cfg = &self.cfg;
        let addr = &self.addr;
        // Until the server names its limit, no more than the default: a
        // peer that is no dmkv server cannot make this client buffer more.
        let before_hello = cfg.max_frame.min(DEFAULT_MAX_FRAME_LEN);
        let dial = Conn::connect(addr, cfg.connect_timeout, before_hello, self.tls.as_ref());
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
                return Err(hello_refused(addr, conn.read_end(), self.tls.is_some()));
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
                self.cluster_node.store(h.cluster, Ordering::Relaxed);
                conn.learn_frame_limit(h.max_frame, cfg.max_frame);
                h.auth_nonce
            }
            other => return Err(unexpected(&other)),
        };
        if nonce.is_empty() {
            return Ok(conn);
        }
        let Some(token) = &self.token else {
            return Err(ClientError::Server {
                code: ErrorCode::Unauthenticated,
                message: format!(
                    "{} requires authentication: give a token (ClientConfig::token; the dmkv CLI and dmkv-ycsb take \
                     {TOKEN_ENV} or --token-file)",
                    self.addr
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

    /// A pooled connection's transport: `tcp` itself, or a verbs RPC link
    /// opened over it (`ClientConfig::rpc_transport`).
    #[cfg(feature = "rdma")]
    async fn over_verbs(&self, tcp: Arc<Conn>) -> Result<Pair, ClientError> {
        use crate::config::RpcTransport as T;
        match self.cfg.rpc_transport {
            T::Tcp => return Ok(Pair { tcp, verbs: None }),
            T::Auto
                if self.tls.is_some()
                    || self
                        .verbs_off_until
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .is_some_and(|t| Instant::now() < t) =>
            {
                return Ok(Pair { tcp, verbs: None });
            }
            T::Auto | T::Verbs => {}
        }
        match crate::verbs_rpc::open(Arc::clone(&tcp), self.cfg.request_timeout).await {
            Ok(link) => Ok(Pair { tcp, verbs: Some(link) }),
            Err(why) if self.cfg.rpc_transport == T::Auto => {
                tracing::debug!(addr = %self.addr, "RPCs stay on TCP: {why}");
                *self.verbs_off_until.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now() + VERBS_RETRY);
                Ok(Pair { tcp, verbs: None })
            }
            Err(reason) => Err(ClientError::TransportUnavailable { transport: crate::Transport::Rdma, reason }),
        }
    }

    #[cfg(not(feature = "rdma"))]
    async fn over_verbs(&self, tcp: Arc<Conn>) -> Result<Pair, ClientError> {
        match self.cfg.rpc_transport {
            crate::config::RpcTransport::Verbs => Err(ClientError::TransportUnavailable {
                transport: crate::Transport::Rdma,
                reason: "this client was built without RDMA support".into(),
            }),
            _ => Ok(Pair { tcp, verbs: None }),
        }
    }

    /// A connection outside the pool, for state that must live as long as
    /// a one-sided path (the server's RDMA queue pairs live as long as the
    /// connection that set them up, and pooled connections get replaced).
    pub async fn dedicated_conn(&self) -> Result<Arc<Conn>, ClientError> {
        self.open_conn(self.deadline()).await
    }

    /// Closes every pooled RPC connection, as the path controller does to a
    /// congested one; later requests open fresh ones. For tests.
    #[doc(hidden)]
    pub async fn replace_rpc_connections(&self) {
        for (i, slot) in self.slots.iter().enumerate() {
            let mut slot = slot.lock().await;
            slot.conn = None;
            self.publish(i, None);
        }
    }

    /// Drops connection `slot` (congested): its next request opens a fresh
    /// one, and requests on the old one drain.
    pub async fn replace(&self, slot: usize) {
        let mut s = self.slots[slot].lock().await;
        s.conn = None;
        self.publish(slot, None);
    }

    /// Sends a request on the next pooled connection without waiting for
    /// its reply: the building block of pipelining.
    pub async fn send(&self, op: Op) -> Result<InFlight, ClientError> {
        self.send_on(self.next_slot(), op, self.deadline()).await
    }

    /// The pooled connection the next request goes on.
    pub fn next_slot(&self) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len()
    }

    pub async fn send_on(&self, slot: usize, op: Op, deadline: tokio::time::Instant) -> Result<InFlight, ClientError> {
        self.conn_at(slot, deadline).await?.send_by(op, deadline, self.cfg.request_timeout).await
    }

    /// Sends `op` on connection `slot` and waits for its result; connecting
    /// counts against the request's timeout, which the connection's
    /// watchdog enforces (no timer per request).
    pub async fn call_on(&self, slot: usize, op: Op) -> Result<R, ClientError> {
        self.call_body(slot, Body::Op(&op), self.deadline()).await
    }

    pub async fn call(&self, op: Op) -> Result<R, ClientError> {
        self.call_on(self.next_slot(), op).await
    }

    /// [`RpcPool::call_on`] of a request that may borrow its key and value
    /// (encoded once, into the connection's send buffer), due by
    /// `deadline`: the caller's clock read, so a GET reads the clock once
    /// for its start, its send and its deadline.
    pub(crate) async fn call_body(
        &self,
        slot: usize,
        body: Body<'_>,
        deadline: tokio::time::Instant,
    ) -> Result<R, ClientError> {
        let timeout = self.cfg.request_timeout;
        // An open connection with room in its queue (nearly every call)
        // sends without an await: each nested future polled costs more
        // than the rest of the send.
        let pair = match self.open_at(slot) {
            Some(c) => c,
            None => self.pair_at(slot, deadline).await?,
        };
        let (conn, measured) = self.pick(&pair);
        drop(pair);
        let started = measured.map(|way| (way, Instant::now()));
        let sent = match conn.try_send_until(body, deadline)? {
            Some(sent) => sent,
            None => conn.send_until(body, deadline, timeout).await?,
        };
        drop(conn);
        let reply = sent.wait_watched(deadline, timeout).await?;
        if let Some((way, t)) = started {
            let rtt = t.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
            self.price.lock().unwrap_or_else(std::sync::PoisonError::into_inner).handle_rtt(way, rtt);
        }
        unwrap(reply)
    }

    /// The server's regions and the one-sided endpoints it offers.
    pub async fn region_info(&self) -> Result<proto::RegionInfoReply, ClientError> {
        match self.call(Op::RegionInfo(proto::RegionInfo {})).await? {
            R::RegionInfo(r) => Ok(*r),
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
        return ClientError::Connect { addr: addr.to_string(), reason: ConnectReason::ServerSpeaksTls };
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
