//! The RPC service: one task per TCP connection runs each request against
//! the [`Node`] (a single node's store or a cluster node's shards, through
//! one dispatch); [`framed`] reads the requests and coalesces the replies.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::{Buf, BytesMut};
use dmkv_common::PROTOCOL_VERSION;
use dmkv_common::error::Error as StoreError;
use dmkv_common::frame::{self, Decoder, FrameError};
use dmkv_common::limits::FRAME_HEADER_LEN;
use dmkv_common::proto::{self, ErrorCode, Request, Response, request::Op, response::Result as R};
use tokio::net::TcpStream;
use tokio::sync::watch;

use dmkv_common::auth::{Purpose, Role};

use crate::access::Gate;
use crate::cluster::identity::{self, PeerIps, Sender};
use crate::cluster::node::ClusterError;
use crate::cluster::shard::JoinStep;
use crate::counters::EngineCounters;
use crate::framed;
use crate::node::{Found, Node, NodeError};

/// What the service shares between connections.
pub struct Shared {
    /// What the node serves: a store of its own, or shard replicas.
    pub node: Node,
    pub max_frame: usize,
    pub engine_addr: Option<std::net::SocketAddr>,
    pub shm_socket: Option<std::path::PathBuf>,
    pub host_id: String,
    pub engine_counters: Arc<EngineCounters>,
    /// Authentication, shared with the engine.
    pub gate: Arc<Gate>,
    /// Whether the engine speaks TLS (clients learn it from REGION_INFO).
    pub engine_tls: bool,
    /// TLS for RPC and the engine, when configured.
    pub tls: Option<tokio_rustls::TlsAcceptor>,
    /// How long a connection may keep the server waiting.
    pub limits: framed::Limits,
    /// This process's time namespace (see `dmkv_common::host`), for
    /// region info.
    pub time_namespace: u64,
    /// Where peers' raft messages go; `None` on a node outside a cluster.
    pub raft: Option<Arc<dyn crate::cluster::wire::RaftSink>>,
    /// Without secrets, which node a peer-port connection is, by its
    /// source IP (see `cluster::identity`).
    pub peer_ips: PeerIps,
    /// Request counts and latencies, per-listener bytes and connections.
    pub metrics: Arc<crate::counters::Metrics>,
    /// The verbs RPC, where the node has an RDMA device.
    #[cfg(feature = "rdma")]
    pub verbs_rpc: Option<Arc<crate::verbs_rpc::VerbsRpc>>,
}

/// What a connection owns besides its socket.
struct ConnState {
    peer: Option<std::net::IpAddr>,
    /// What the connection may do on the client port; `None` until it
    /// authenticates, and always on the peer port (no role sends raft).
    role: Option<Role>,
    /// The node a peer-port connection speaks for; `None` until it proves
    /// a node's secret (or, without secrets, when its address is no
    /// node's), and always on the client port.
    node: Option<Sender>,
    /// Whether a refusal on the peer port was logged: its sender reads no
    /// replies (`peer::pump`), so only this node's log can say why its
    /// traffic goes nowhere; once per connection, not per batch.
    refusal_logged: bool,
    /// The challenge sent in this connection's HELLO reply.
    nonce: Option<[u8; dmkv_common::auth::NONCE_LEN]>,
    /// Accepted on the peer port: raft traffic only.
    peer_port: bool,
    /// The node a peer-port connection's TLS certificate names (peer
    /// TLS): a node secret proved on it must be that node's.
    tls_node: Option<dmkv_common::cluster::map::NodeId>,
    /// RDMA queue pairs set up over this connection; destroyed with it.
    #[cfg(feature = "rdma")]
    qps: Vec<dmkv_verbs::QueuePair>,
    /// The verbs RPC link opened over this connection; closed with it.
    #[cfg(feature = "rdma")]
    verbs: Option<VerbsLink>,
    /// This connection is a verbs RPC link itself (opens no other).
    #[cfg(feature = "rdma")]
    over_verbs: bool,
    /// The server's shutdown signal, for a verbs RPC link's own loop.
    #[cfg(feature = "rdma")]
    shutdown: watch::Receiver<bool>,
}

/// Closes a verbs RPC link when the connection that opened it ends.
#[cfg(feature = "rdma")]
struct VerbsLink(Arc<crate::verbs_rpc::VerbsConn>);

#[cfg(feature = "rdma")]
impl Drop for VerbsLink {
    fn drop(&mut self) {
        self.0.fail("the connection that opened it ended".into());
    }
}

/// Why an RPC connection is closed.
#[derive(Debug)]
pub enum Close {
    /// A frame that cannot be decoded.
    Frame(FrameError),
    /// A failed or missing authentication (answered, then closed).
    Unauthenticated,
}

impl std::fmt::Display for Close {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Close::Frame(e) => e.fmt(f),
            Close::Unauthenticated => f.write_str("not authenticated"),
        }
    }
}

/// Serves one connection until the peer closes, sends a malformed frame,
/// or the server shuts down (after answering every request already read).
pub async fn serve_connection(stream: TcpStream, shared: Arc<Shared>, shutdown: watch::Receiver<bool>) {
    serve(stream, shared, shutdown, false).await
}

/// Serves one connection of the peer port: like [`serve_connection`], but
/// only HELLO, AUTHENTICATE and cluster traffic (RAFT, GET_MAP, JOIN_SHARD)
/// are answered, and only for a node: one that proved its node secret, or
/// without secrets one the source address names (`cluster::identity`).
pub async fn serve_peer_connection(stream: TcpStream, shared: Arc<Shared>, shutdown: watch::Receiver<bool>) {
    serve(stream, shared, shutdown, true).await
}

async fn serve(stream: TcpStream, shared: Arc<Shared>, shutdown: watch::Receiver<bool>, peer_port: bool) {
    let peer = stream.peer_addr().ok();
    let _ = stream.set_nodelay(true);
    let ip = peer.map(|a| a.ip());
    let state = ConnState {
        peer: ip,
        role: if peer_port { None } else { shared.gate.initial_role() },
        node: (peer_port && !shared.gate.enabled()).then(|| shared.peer_ips.sender(ip)).flatten(),
        refusal_logged: false,
        nonce: None,
        peer_port,
        tls_node: None,
        #[cfg(feature = "rdma")]
        qps: Vec::new(),
        #[cfg(feature = "rdma")]
        verbs: None,
        #[cfg(feature = "rdma")]
        over_verbs: false,
        #[cfg(feature = "rdma")]
        shutdown: shutdown.clone(),
    };
    // The peer port has TLS of its own (`cluster::peer_tls`), or none:
    // the client port's certificate is not a node's.
    let peer_tls = if peer_port { shared.node.cluster().and_then(|n| n.peer_tls.clone()) } else { None };
    let (tls, limits) = (if peer_port { None } else { shared.tls.clone() }, shared.limits);
    let stats = Arc::clone(if peer_port { &shared.metrics.peer } else { &shared.metrics.rpc });
    let mut requests = Requests {
        decoder: Decoder::new(shared.max_frame),
        shared,
        state,
        deferred: Deferred::new(),
        read_at: None,
        done: Vec::new(),
    };
    if let Some(peer_tls) = peer_tls {
        let handshake = tokio::time::timeout(crate::access::handshake_timeout(&limits), peer_tls.accept(stream));
        match handshake.await {
            Ok(Ok((s, node))) => {
                // The certificate is the node's identity; with secrets, the
                // proof must be that node's too (`admit`).
                requests.state.tls_node = Some(node);
                if !requests.shared.gate.enabled() {
                    requests.state.node = Some(Sender::Node(node));
                }
                framed::serve_connection(s, peer, stats, requests, limits, shutdown).await
            }
            // A node with the wrong certificate would retry forever:
            // say it where the operator looks.
            Ok(Err(e)) => tracing::warn!(peer = %framed::display_peer(peer), "peer TLS refused: {e}"),
            Err(_) => tracing::debug!(peer = %framed::display_peer(peer), "peer TLS handshake timed out"),
        }
        return;
    }
    match tls {
        None => framed::serve_connection(stream, peer, stats, requests, limits, shutdown).await,
        Some(acceptor) => {
            match tokio::time::timeout(crate::access::handshake_timeout(&limits), acceptor.accept(stream)).await {
                Ok(Ok(s)) => framed::serve_connection(s, peer, stats, requests, limits, shutdown).await,
                Ok(Err(e)) => tracing::debug!(peer = %framed::display_peer(peer), "TLS handshake failed: {e}"),
                Err(_) => tracing::debug!(peer = %framed::display_peer(peer), "TLS handshake timed out"),
            }
        }
    }
}

/// One RPC connection's requests, run against the store.
struct Requests {
    decoder: Decoder,
    shared: Arc<Shared>,
    state: ConnState,
    /// A cluster node's requests waiting for raft.
    deferred: Deferred,
    /// When the bytes being handled were read (requests' latency starts
    /// there).
    read_at: Option<std::time::Instant>,
    /// Requests answered in line since `read_at`, as (op, result) indexes:
    /// counted when their batch is handled, by one clock read (before a
    /// STATS, whose counts include them).
    done: Vec<(u8, u8)>,
}

/// Most answered requests a connection holds uncounted: past it they are
/// counted at once (a read of small requests can hold thousands).
const MAX_UNCOUNTED: usize = 256;

impl Requests {
    /// Counts the requests answered in line, all as answered at `at`.
    fn count_done(&mut self, at: std::time::Instant) {
        if self.done.is_empty() {
            return;
        }
        let started = self.read_at.unwrap_or(at);
        self.shared.metrics.record_batch(&self.done, at.saturating_duration_since(started));
        self.done.clear();
    }
}

impl Requests {
    /// Whether this connection's GETs may be answered by [`Requests::plain_get`]:
    /// a single node's client port, a connection whose role reads (so
    /// `admit`, `misplaced` and the role check would all pass a GET).
    fn plain_gets(&self) -> bool {
        !self.state.peer_port
            && self.state.role.is_some_and(|r| r.allows(needed_role(&Op::Get(proto::Get::default()))))
            && self.shared.node.cluster().is_none()
    }

    /// Answers `body` if it is a plain GET (`request::parse_get`), as
    /// `handle` would, without decoding it into an owned request: the
    /// most common request, and the decode was a good part of its cost.
    /// False, having done nothing, for any other request.
    fn plain_get(&mut self, body: &[u8], out: &mut BytesMut) -> bool {
        let Some((id, key)) = dmkv_common::request::parse_get(body) else { return false };
        let Some(got) = self.shared.node.get_now(key) else { return false };
        let resp = reply(id, get_reply(got));
        self.note_done(crate::counters::GET, crate::counters::result_index(&resp));
        encode_reply(&resp, self.shared.max_frame, out);
        true
    }

    /// Notes an answered request, to be counted with its batch.
    fn note_done(&mut self, op: usize, result: usize) {
        // Both below 256 (asserted where the tables are sized).
        self.done.push((op as u8, result as u8));
        if self.done.len() >= MAX_UNCOUNTED {
            self.count_done(std::time::Instant::now());
        }
    }
}

impl Drop for Requests {
    /// A connection that ends mid-batch still counts what it answered.
    fn drop(&mut self) {
        self.count_done(std::time::Instant::now());
    }
}

/// Requests of one connection a cluster node works on at once (each
/// waits for raft); more wait for the oldest's reply first.
pub const MAX_DEFERRED_PER_CONNECTION: usize = 256;

type Deferred = futures_util::stream::FuturesUnordered<std::pin::Pin<Box<dyn Future<Output = BytesMut> + Send>>>;

impl Requests {
    /// A cluster node's data request: answered when raft has done its
    /// part, while the connection reads and starts the next ones. Started
    /// in the order read (the first poll proposes or queues the read), so
    /// a connection's writes reach the shard in order, except that one
    /// waiting for eviction to make room (a full shard) lets later ones of
    /// the same connection that fit go first; replies may come back out
    /// of order (they carry the request's id).
    fn deferrable(&self, req: &Request) -> bool {
        // Each of these waits on raft (or a lease): run aside, so that
        // one of them does not hold up the connection's others (a node
        // passes many clients' requests on over one connection).
        let data = matches!(
            req.op,
            Some(Op::Put(_) | Op::Delete(_) | Op::Get(_) | Op::MultiGet(_) | Op::Arith(_) | Op::Touch(_))
        ) || (self.state.peer_port && matches!(req.op, Some(Op::FlushAll(_))))
            // A stale map's: the node may ask the metadata group first.
            || matches!(&req.op, Some(Op::GetMap(g)) if g.newer_than > 0);
        // Skips `handle`'s checks: only what they would pass. On the peer
        // port, a node's forwarded requests (`misplaced` takes them from a
        // node only).
        let allowed = if self.state.peer_port {
            self.state.node.is_some()
        } else {
            self.state.role.is_none_or(|r| r.allows(Role::Data))
        };
        self.shared.node.cluster().is_some() && allowed && data
    }

    async fn defer(&mut self, req: Request, started: std::time::Instant, out: &mut BytesMut) {
        use futures_util::StreamExt;
        if self.deferred.len() >= MAX_DEFERRED_PER_CONNECTION
            && let Some(b) = self.deferred.next().await
        {
            out.extend_from_slice(&b);
        }
        let shared = Arc::clone(&self.shared);
        self.deferred.push(Box::pin(async move {
            let (id, max_frame) = (req.id, shared.max_frame);
            let op_index = crate::counters::op_index(req.op.as_ref());
            let resp = match req.op {
                Some(op) => reply(id, node_op(&shared, op).await),
                // `deferrable` takes data ops only.
                None => error(id, ErrorCode::UnknownOp, "request has no operation this server knows".into()),
            };
            shared.metrics.record(op_index, &resp, started.elapsed());
            let mut b = BytesMut::new();
            encode_reply(&resp, max_frame, &mut b);
            b
        }));
    }
}

impl framed::Handler for Requests {
    type Error = Close;

    fn deferred_len(&self) -> usize {
        self.deferred.len()
    }

    async fn next_deferred(&mut self) -> Option<BytesMut> {
        futures_util::StreamExt::next(&mut self.deferred).await
    }

    async fn handle_next(&mut self, inbuf: &mut BytesMut, out: &mut BytesMut) -> Result<bool, Close> {
        if self.plain_gets() {
            let Some(len) = self.decoder.frame_len(inbuf).map_err(Close::Frame)? else { return Ok(false) };
            if self.plain_get(&inbuf[FRAME_HEADER_LEN..FRAME_HEADER_LEN + len], out) {
                inbuf.advance(FRAME_HEADER_LEN + len);
                return Ok(true);
            }
        }
        let Some(req) = self.decoder.next_message::<Request>(inbuf).map_err(Close::Frame)? else { return Ok(false) };
        if matches!(req.op, Some(Op::Stats(_))) {
            // A STATS counts the requests answered before it.
            self.count_done(std::time::Instant::now());
        }
        let started = self.read_at.unwrap_or_else(std::time::Instant::now);
        let op = crate::counters::op_index(req.op.as_ref());
        // The peer port's raft traffic is not client requests.
        let counted = !self.state.peer_port;
        let resp = match admit(&self.shared, &mut self.state, &req) {
            Ok(()) if self.deferrable(&req) => {
                self.defer(req, started, out).await;
                return Ok(true);
            }
            Ok(()) => handle(&self.shared, &mut self.state, req).await,
            Err(refusal) => {
                if counted {
                    self.shared.metrics.record_error(op, refusal.0, started.elapsed());
                }
                encode_reply(&refusal.with_id(req.id), self.shared.max_frame, out);
                return Err(Close::Unauthenticated);
            }
        };
        if counted {
            self.note_done(op, crate::counters::result_index(&resp));
        }
        encode_reply(&resp, self.shared.max_frame, out);
        Ok(true)
    }

    fn logged(e: &Close) -> bool {
        matches!(e, Close::Unauthenticated)
    }

    #[cfg(feature = "rdma")]
    fn busy_elsewhere(&self) -> bool {
        self.state.verbs.as_ref().is_some_and(|v| v.0.is_open())
    }

    fn on_read(&mut self, at: std::time::Instant) {
        // A safety net: every batch of the loop ends in `on_handled`.
        self.count_done(at);
        self.read_at = Some(at);
    }

    fn on_handled(&mut self, at: std::time::Instant) {
        self.count_done(at);
    }
}

/// The role a request needs on the client port.
fn needed_role(op: &Op) -> Role {
    match op {
        // Never served on the client port (`misplaced`); admin all the
        // same, should that check ever go.
        Op::Raft(_) | Op::JoinShard(_) | Op::SnapshotChunk(_) => Role::Admin,
        Op::Reregister(_)
        | Op::ReplaceReplica(_)
        | Op::MovePartition(_)
        | Op::MoveWork(_)
        | Op::TransferLeader(_)
        | Op::MoveReplica(_) => Role::Admin,
        // Walks every store under its writer lock: a diagnosis, not data.
        Op::Stats(s) if s.digests => Role::Admin,
        _ => Role::Data,
    }
}

/// Why `op` is not served on this connection's port, if it is not: raft
/// traffic (and joins, which change a shard's members) only on the peer
/// port, from the node it says it is from; the peer port serves nothing
/// else. Checked before roles: no role's secret makes raft traffic right.
fn misplaced(shared: &Shared, conn: &ConnState, op: &Op) -> Option<String> {
    let cluster_traffic = matches!(
        op,
        Op::Raft(_) | Op::GetMap(_) | Op::MetaMap(_) | Op::JoinShard(_) | Op::SnapshotChunk(_) | Op::MoveWork(_)
    ) || forwarded(op);
    if !conn.peer_port {
        let peer_only =
            matches!(op, Op::Raft(_) | Op::JoinShard(_) | Op::SnapshotChunk(_) | Op::FlushAll(_) | Op::MoveWork(_));
        return peer_only.then(|| {
            "raft traffic and joins are taken on a cluster node's peer port only (the cluster file's `peer` \
             address), from a node proving its own node secret"
                .into()
        });
    }
    if !cluster_traffic {
        return (!matches!(op, Op::Hello(_) | Op::Authenticate(_)))
            .then(|| "the peer port carries raft traffic only".into());
    }
    let Some(sender) = conn.node else {
        return Some(match shared.gate.enabled() {
            // `admit` closes such connections; kept for clarity.
            true => "the peer port takes cluster traffic from nodes only: prove a node secret first".into(),
            false => format!(
                "this cluster has no secrets, and its peer port takes cluster traffic only from the cluster \
                 file's peer addresses; {} is none of them",
                conn.peer.map_or_else(|| "this connection's address".to_string(), |ip| ip.to_string())
            ),
        });
    };
    match op {
        Op::Raft(batch) => identity::check_batch(sender, batch.from_node).err(),
        Op::SnapshotChunk(c) => identity::check_batch(sender, c.from_node).err(),
        Op::JoinShard(j) => identity::check_join(sender, j.replica_id).err(),
        _ => None,
    }
}

/// Data requests another node passes on to this one's peer port (its
/// memcached port serves every key: `cluster::forward`); taken only from
/// a node, as raft traffic is.
fn forwarded(op: &Op) -> bool {
    matches!(
        op,
        Op::Put(_) | Op::Get(_) | Op::Delete(_) | Op::Arith(_) | Op::Touch(_) | Op::MultiGet(_) | Op::FlushAll(_)
    )
}

/// Lets `req` through, or answers it with the refusal after which the
/// connection is closed: a connection that has not authenticated may only
/// say HELLO and AUTHENTICATE, and a failed AUTHENTICATE ends it. Wrong-role
/// requests are answered PERMISSION_DENIED and the connection stays.
fn admit(shared: &Shared, conn: &mut ConnState, req: &Request) -> Result<(), Refusal> {
    let unauthenticated = || {
        Refusal(
            ErrorCode::Unauthenticated,
            "this server requires authentication: HELLO, then AUTHENTICATE with a token (see docs/security.md)".into(),
        )
    };
    let Some(op) = &req.op else {
        // An operation this server does not know: answered UNKNOWN_OP, but
        // only to a connection that may send requests at all.
        return if conn.role.is_some() { Ok(()) } else { Err(unauthenticated()) };
    };
    if let Op::Authenticate(a) = op {
        if !shared.gate.enabled() {
            return Ok(());
        }
        let Some(nonce) = conn.nonce.take() else {
            return Err(Refusal(ErrorCode::Unauthenticated, "say HELLO first: its reply carries the challenge".into()));
        };
        // The peer port knows nodes by their node secrets, the client
        // port roles by theirs: neither kind of secret opens the other port.
        if conn.peer_port {
            return match shared.gate.check_node(conn.peer, &nonce, &a.proof) {
                Ok(node) if conn.tls_node.is_some_and(|t| t != node) => Err(Refusal(
                    ErrorCode::Unauthenticated,
                    format!(
                        "node {node}'s secret on a connection whose certificate is node {}'s",
                        conn.tls_node.unwrap_or_default()
                    ),
                )),
                Ok(node) => {
                    conn.node = Some(Sender::Node(node));
                    Ok(())
                }
                Err(denied) => Err(Refusal(ErrorCode::Unauthenticated, denied.to_string())),
            };
        }
        return match shared.gate.check(Purpose::Rpc, conn.peer, &nonce, &a.proof, Role::Data) {
            Ok(role) => {
                conn.role = Some(role);
                Ok(())
            }
            Err(denied) => Err(Refusal(ErrorCode::Unauthenticated, denied.to_string())),
        };
    }
    if matches!(op, Op::Hello(_)) {
        return Ok(());
    }
    match conn.authenticated() {
        // Without secrets a peer-port connection from an address that is
        // no node's gets PERMISSION_DENIED from `handle`, not a request
        // to authenticate that it could not follow.
        false if conn.peer_port && !shared.gate.enabled() => Ok(()),
        false => Err(unauthenticated()),
        // A role too weak for the request is answered PERMISSION_DENIED by
        // `handle`, without closing: the client is who it said it is.
        true => Ok(()),
    }
}

impl ConnState {
    /// Whether the connection has an identity on its port.
    fn authenticated(&self) -> bool {
        if self.peer_port { self.node.is_some() } else { self.role.is_some() }
    }
}

fn encode_reply(resp: &Response, max_frame: usize, out: &mut BytesMut) {
    if frame::encode(resp, max_frame, out).is_err() {
        // At most ~100 bytes, and max_frame is at least MIN_MAX_FRAME_LEN.
        frame::encode(&too_large(resp.id, max_frame), max_frame, out).expect("an error reply fits any frame");
    }
}

fn too_large(id: u64, max_frame: usize) -> Response {
    error(id, ErrorCode::ResponseTooLarge, format!("reply exceeds the maximum frame of {max_frame} bytes"))
}

fn error(id: u64, code: ErrorCode, message: String) -> Response {
    Response { id, result: Some(R::Error(proto::Error { code: code as i32, message, ..Default::default() })) }
}

fn store_refusal(e: StoreError) -> proto::Error {
    let code = match e {
        StoreError::EmptyKey => ErrorCode::BadRequest,
        StoreError::KeyTooLarge(_) => ErrorCode::KeyTooLarge,
        StoreError::ValueTooLarge(_) => ErrorCode::ValueTooLarge,
        StoreError::OutOfMemory => ErrorCode::OutOfMemory,
        StoreError::IndexFull => ErrorCode::IndexFull,
        StoreError::NotStored => ErrorCode::NotStored,
        StoreError::Exists => ErrorCode::Exists,
        StoreError::NotFound => ErrorCode::NotFound,
        StoreError::NotNumeric => ErrorCode::NotNumeric,
    };
    plain(code, e.to_string())
}

/// A GET's reply with the item and where its slot is (see `GetReply`).
fn found(Found { item, at }: Found) -> proto::GetReply {
    proto::GetReply {
        found: true,
        value: item.value,
        version: item.meta.version,
        hint_slot: at.slot,
        hint_bucket: u32::from(at.which),
        hint_index: u32::from(at.index),
        flags: item.meta.flags,
        expires_at: item.meta.expires_at,
    }
}

async fn handle(shared: &Arc<Shared>, conn: &mut ConnState, req: Request) -> Response {
    let id = req.id;
    if let Some(why) = req.op.as_ref().and_then(|op| misplaced(shared, conn, op)) {
        if conn.peer_port && !std::mem::replace(&mut conn.refusal_logged, true) {
            let peer = conn.peer.map_or_else(|| "unknown".to_string(), |ip| ip.to_string());
            tracing::warn!(%peer, "peer port request refused: {why}");
        }
        return error(id, ErrorCode::PermissionDenied, why);
    }
    if conn.peer_port && req.op.is_none() {
        return error(id, ErrorCode::PermissionDenied, "the peer port carries raft traffic only".into());
    }
    if let (Some(op), Some(role)) = (&req.op, conn.role)
        && !role.allows(needed_role(op))
    {
        return error(
            id,
            ErrorCode::PermissionDenied,
            format!("the {} role may not do this; it needs {}", role.name(), needed_role(op).name()),
        );
    }
    let result = match req.op {
        None => return error(id, ErrorCode::UnknownOp, "request has no operation this server knows".into()),
        Some(Op::Hello(h)) => {
            if h.protocol_version != PROTOCOL_VERSION {
                return error(
                    id,
                    ErrorCode::UnsupportedVersion,
                    format!(
                        "protocol version {} is not supported; this server speaks {PROTOCOL_VERSION}",
                        h.protocol_version
                    ),
                );
            }
            let auth_nonce = if shared.gate.enabled() && !conn.authenticated() {
                let n = shared.gate.nonce();
                conn.nonce = Some(n);
                n.to_vec().into()
            } else {
                Default::default()
            };
            R::Hello(proto::HelloReply {
                protocol_version: PROTOCOL_VERSION,
                server_version: env!("CARGO_PKG_VERSION").into(),
                auth_nonce,
                cluster: shared.node.cluster().is_some(),
                max_frame: u32::try_from(shared.max_frame).unwrap_or(u32::MAX),
            })
        }
        Some(Op::Authenticate(_)) => match (conn.role, conn.node) {
            // `admit` checked the proof when authentication is on.
            (Some(role), _) if shared.gate.enabled() => {
                R::Authenticate(proto::AuthenticateReply { role: role.name().into() })
            }
            (_, Some(Sender::Node(node))) if shared.gate.enabled() => {
                R::Authenticate(proto::AuthenticateReply { role: dmkv_common::auth::node_name(node) })
            }
            _ => return error(id, ErrorCode::BadRequest, "this server has no authentication configured".into()),
        },
        Some(Op::RdmaConnect(c)) => match rdma_connect(shared, conn, &c.endpoint) {
            Ok(r) => R::RdmaConnect(r),
            Err(e) => return e.with_id(id),
        },
        Some(Op::VerbsRpc(v)) => match verbs_connect(shared, conn, &v) {
            Ok(r) => R::VerbsRpc(r),
            Err(e) => return e.with_id(id),
        },
        Some(op) => return reply(id, node_op(shared, op).await),
    };
    Response { id, result: Some(result) }
}

fn reply(id: u64, r: Result<R, proto::Error>) -> Response {
    Response { id, result: Some(r.unwrap_or_else(R::Error)) }
}

/// Runs an op of what the node serves (every op but the connection's own:
/// HELLO, AUTHENTICATE, RDMA setup), single or cluster alike.
pub(crate) async fn node_op(shared: &Shared, op: Op) -> Result<R, proto::Error> {
    let node = &shared.node;
    let r = match op {
        Op::Put(p) => node.put(&p).await.map(|version| R::Put(proto::PutReply { version })),
        Op::Get(g) => return get_reply(node.get(&g.key).await),
        Op::Delete(d) => node.delete(&d).await.map(|existed| R::Delete(proto::DeleteReply { existed })),
        Op::Arith(a) => {
            node.arith(&a).await.map(|(value, meta)| R::Arith(proto::ArithReply { value, version: meta.version }))
        }
        Op::Touch(t) => node.touch(&t).await.map(|item| {
            R::Touch(item.map_or_else(proto::GetReply::default, |item| {
                let at = crate::store::Location { which: 0, index: 0, slot: 0 };
                let mut r = found(Found { item, at });
                if !t.get {
                    r.value = Default::default();
                }
                r
            }))
        }),
        Op::AccessReport(r) => {
            node.note_accesses(r);
            Ok(R::AccessReport(proto::AccessReportReply {}))
        }
        Op::MultiGet(m) => node.multi_get(&m.keys, shared.max_frame).await.map(|values| {
            let values = values.into_iter().map(|f| f.map_or_else(proto::GetReply::default, found)).collect();
            R::MultiGet(proto::MultiGetReply { values })
        }),
        Op::Stats(s) => {
            let mut counters = stats(shared);
            if s.digests {
                // A walk of every store (holding each one's writes, and a
                // shard's applies, while it runs): off the async workers,
                // and one at a time.
                static DIGESTING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
                if DIGESTING.swap(true, std::sync::atomic::Ordering::Acquire) {
                    return Err(plain(ErrorCode::Busy, "another STATS with digests is running".into()));
                }
                let node = shared.node.clone();
                let rows = tokio::task::spawn_blocking(move || node.digests()).await;
                DIGESTING.store(false, std::sync::atomic::Ordering::Release);
                counters.extend(rows.map_err(|e| plain(ErrorCode::Internal, e.to_string()))?);
            }
            Ok(R::Stats(proto::StatsReply { counters }))
        }
        Op::RegionInfo(_) => Ok(R::RegionInfo(Box::new(region_info(shared)))),
        Op::Reregister(_) => node.reregister().map(|_| R::Reregister(Box::new(region_info(shared)))),
        Op::GetMap(g) => node.map_reply_past(g.newer_than).await.map(|m| R::Map(Box::new(m))),
        Op::MetaMap(_) => node.meta_map().await.map(|m| R::Map(Box::new(m))),
        Op::JoinShard(j) if j.leave => node.leave_shard(j.shard, j.replica_id).await.map(|step| {
            R::JoinShard(proto::JoinShardReply { done: step == JoinStep::Done, step: format!("{step:?}") })
        }),
        Op::JoinShard(j) => node.join_shard(j.shard, j.replica_id).await.map(|step| {
            R::JoinShard(proto::JoinShardReply { done: step == JoinStep::Done, step: format!("{step:?}") })
        }),
        Op::ReplaceReplica(r) => node
            .replace_replica(r.shard)
            .await
            .map(|replica_id| R::ReplaceReplica(proto::ReplaceReplicaReply { replica_id })),
        Op::SnapshotChunk(c) => node.receive_snapshot(c).await.map(R::SnapshotChunk),
        Op::MoveWork(w) => node.move_work(w).await.map(R::MoveWork),
        Op::MovePartition(m) => node.move_partition(m).await.map(R::MovePartition),
        Op::TransferLeader(t) => node.transfer_leader(t.shard, t.to).await.map(R::TransferLeader),
        Op::MoveReplica(m) => node.move_replica(m).await.map(R::MoveReplica),
        Op::FlushAll(_) => node.flush_led().await.map(|items| R::FlushAll(proto::FlushAllReply { items })),
        Op::Raft(batch) => {
            return match &shared.raft {
                None => Err(plain(ErrorCode::BadRequest, "this node is not part of a cluster".into())),
                Some(sink) => match crate::cluster::wire::decode(&batch) {
                    Ok(msgs) => Ok(R::Raft(proto::RaftReply { accepted: sink.deliver(batch.from_node, msgs) as u32 })),
                    Err(e) => Err(plain(ErrorCode::BadRequest, e.to_string())),
                },
            };
        }
        // The connection's own ops: `handle` answers them.
        Op::Hello(_) | Op::Authenticate(_) | Op::RdmaConnect(_) | Op::VerbsRpc(_) => {
            return Err(plain(ErrorCode::BadRequest, "not an operation of the node".into()));
        }
    };
    r.map_err(node_refusal)
}

/// A GET's result as its reply.
fn get_reply(got: Result<Option<Found>, NodeError>) -> Result<R, proto::Error> {
    got.map(|f| R::Get(f.map_or_else(proto::GetReply::default, found))).map_err(node_refusal)
}

fn plain(code: ErrorCode, message: String) -> proto::Error {
    proto::Error { code: code as i32, message, ..Default::default() }
}

fn node_refusal(e: NodeError) -> proto::Error {
    match e {
        NodeError::Store(e) => store_refusal(e),
        NodeError::Cluster(e) => cluster_refusal(e),
        NodeError::BadRequest(m) => plain(ErrorCode::BadRequest, m),
        NodeError::TooLarge(max_frame) => {
            plain(ErrorCode::ResponseTooLarge, format!("reply exceeds the maximum frame of {max_frame} bytes"))
        }
        NodeError::Internal(m) => plain(ErrorCode::Internal, m),
    }
}

fn cluster_refusal(e: ClusterError) -> proto::Error {
    match e {
        ClusterError::NotLeader { leader, map_version } => proto::Error {
            code: ErrorCode::NotLeader as i32,
            message: match leader {
                Some(l) => format!("this node does not lead the key's shard; node {l} does"),
                None => "this node does not lead the key's shard; no leader is known yet".into(),
            },
            leader: leader.unwrap_or(0),
            map_version,
        },
        ClusterError::WrongShard { map_version } => proto::Error {
            code: ErrorCode::WrongShard as i32,
            message: format!(
                "the key's partition has moved off the shard map version {map_version} names: ask for the map again"
            ),
            leader: 0,
            map_version,
        },
        ClusterError::Busy => plain(ErrorCode::Busy, "too many requests wait for this shard; retry".into()),
        ClusterError::Uncertain => plain(
            ErrorCode::Uncertain,
            "leadership changed before the write committed: it may or may not have taken effect".into(),
        ),
        ClusterError::Store(e) => store_refusal(e),
        ClusterError::Failed(m) => plain(ErrorCode::Internal, m),
    }
}

/// An error reply waiting for its request id.
struct Refusal(ErrorCode, String);

impl Refusal {
    fn with_id(self, id: u64) -> Response {
        error(id, self.0, self.1)
    }
}

#[cfg(feature = "rdma")]
fn rdma_connect(shared: &Shared, conn: &mut ConnState, endpoint: &[u8]) -> Result<proto::RdmaConnectReply, Refusal> {
    let Some(device) = shared.node.rdma_device() else {
        return Err(Refusal(ErrorCode::BadRequest, "this server offers no RDMA".into()));
    };
    if conn.qps.len() >= crate::rdma::MAX_QPS_PER_CONNECTION {
        return Err(Refusal(ErrorCode::BadRequest, "too many RDMA queue pairs on this connection".into()));
    }
    let refused = |e: dmkv_verbs::VerbsError| Refusal(ErrorCode::BadRequest, format!("RDMA connect: {e}"));
    let (qp, endpoint) = device.accept(endpoint).map_err(refused)?;
    // A single node's one region comes with the queue pair; a cluster
    // node's regions are in REGION_INFO (each descriptor's rdma_rkey).
    let (remote, epoch) = match shared.node.single().and_then(|s| s.rdma().map(|r| (s, r))) {
        Some((single, r)) => (Some(r.remote().map_err(refused)?), single.registration().epoch()),
        None => (None, 0),
    };
    conn.qps.push(qp);
    Ok(proto::RdmaConnectReply {
        endpoint: endpoint.to_bytes().to_vec().into(),
        addr: remote.map_or(0, |r| r.addr),
        length: remote.map_or(0, |r| r.len),
        rkey: remote.map_or(0, |r| r.rkey),
        epoch,
    })
}

/// Opens the verbs RPC link of this connection and starts serving it.
#[cfg(feature = "rdma")]
fn verbs_connect(
    shared: &Arc<Shared>,
    conn: &mut ConnState,
    v: &proto::VerbsRpc,
) -> Result<proto::VerbsRpcReply, Refusal> {
    use crate::verbs_rpc::Refused;
    let Some(rpc) = &shared.verbs_rpc else {
        return Err(Refusal(ErrorCode::BadRequest, "this server offers no verbs RPC (no RDMA device)".into()));
    };
    if conn.over_verbs || conn.peer_port || conn.verbs.is_some() {
        return Err(Refusal(ErrorCode::BadRequest, "one verbs RPC link per client RPC connection".into()));
    }
    let (link, endpoint, credits) = rpc.accept(&v.endpoint, v.credits).map_err(|e| match e {
        Refused::Busy(m) => Refusal(ErrorCode::Busy, format!("no room for another verbs RPC link: {m}")),
        Refused::Bad(m) => Refusal(ErrorCode::BadRequest, m),
    })?;
    conn.verbs = Some(VerbsLink(Arc::clone(&link)));
    let state = ConnState {
        peer: conn.peer,
        role: conn.role,
        node: None,
        refusal_logged: false,
        nonce: None,
        peer_port: false,
        tls_node: None,
        qps: Vec::new(),
        verbs: None,
        over_verbs: true,
        shutdown: conn.shutdown.clone(),
    };
    let requests = Requests {
        decoder: Decoder::new(shared.max_frame),
        shared: Arc::clone(shared),
        state,
        deferred: Deferred::new(),
        read_at: None,
        done: Vec::new(),
    };
    let stats = Arc::clone(&shared.metrics.verbs);
    stats.accepted.fetch_add(1, Ordering::Relaxed);
    let (limits, shutdown) = (shared.limits, conn.shutdown.clone());
    tokio::spawn(async move {
        stats.open.fetch_add(1, Ordering::Relaxed);
        let stream = crate::verbs_rpc::VerbsStream::new(link);
        framed::serve_connection(stream, None, Arc::clone(&stats), requests, limits, shutdown).await;
        stats.open.fetch_sub(1, Ordering::Relaxed);
    });
    Ok(proto::VerbsRpcReply {
        endpoint: endpoint.to_bytes().to_vec().into(),
        credits,
        slot_bytes: crate::verbs_rpc::SLOT_BYTES,
    })
}

#[cfg(not(feature = "rdma"))]
fn verbs_connect(_: &Arc<Shared>, _: &mut ConnState, _: &proto::VerbsRpc) -> Result<proto::VerbsRpcReply, Refusal> {
    Err(Refusal(ErrorCode::BadRequest, "this server was built without RDMA support".into()))
}

#[cfg(not(feature = "rdma"))]
fn rdma_connect(_: &Shared, _: &mut ConnState, _: &[u8]) -> Result<proto::RdmaConnectReply, Refusal> {
    Err(Refusal(ErrorCode::BadRequest, "this server was built without RDMA support".into()))
}

fn region_info(shared: &Shared) -> proto::RegionInfoReply {
    proto::RegionInfoReply {
        regions: shared.node.descriptors(),
        shm_socket: shared.shm_socket.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
        engine_addr: shared.engine_addr.map(|a| a.to_string()).unwrap_or_default(),
        host_id: shared.host_id.clone(),
        #[cfg(feature = "rdma")]
        rdma_device: shared.node.rdma_device().map(|d| d.device_name().to_string()).unwrap_or_default(),
        #[cfg(not(feature = "rdma"))]
        rdma_device: String::new(),
        engine_tls: shared.engine_tls,
        monotonic_ns: crate::clock::mono_ns(),
        time_namespace: shared.time_namespace,
    }
}

fn stats(shared: &Shared) -> HashMap<String, u64> {
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let mut out: HashMap<String, u64> = shared.node.stats().into_iter().collect();
    let engine = [
        ("engine_batches", load(&shared.engine_counters.batches)),
        ("engine_reads", load(&shared.engine_counters.reads)),
        ("engine_bytes", load(&shared.engine_counters.bytes)),
        ("engine_rejected_reads", load(&shared.engine_counters.rejected)),
    ];
    out.extend(engine.into_iter().map(|(k, v)| (k.to_string(), v)));
    shared.metrics.stats_into(&mut out);
    out
}
