//! The RPC service: one task per TCP connection runs each request against
//! the store; [`framed`] reads the requests and coalesces the replies.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::BytesMut;
use dmkv_common::error::Error as StoreError;
use dmkv_common::frame::{self, Decoder, FrameError};
use dmkv_common::limits::MAX_MULTI_GET_KEYS;
use dmkv_common::proto::{self, ErrorCode, Request, Response, request::Op, response::Result as R};
use dmkv_common::{PROTOCOL_VERSION, layout::LAYOUT_VERSION};
use tokio::net::TcpStream;
use tokio::sync::watch;

use dmkv_common::auth::{Purpose, Role};

use crate::access::Gate;
use crate::cluster::identity::{self, PeerIps, Sender};
use crate::cluster::node::{ClusterError, ClusterNode};
use crate::compact::Compactor;
use crate::counters::EngineCounters;
use crate::framed;
use crate::kv;
use crate::registration::Registration;
use crate::store::Store;

/// What the service shares between connections.
pub struct Shared {
    pub store: Arc<Store>,
    /// Defragments the store's memory, and frees room for a PUT that needs it.
    pub compactor: Compactor,
    pub max_frame: usize,
    pub registration: Arc<Registration>,
    pub region_id: u32,
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
    #[cfg(feature = "rdma")]
    pub rdma: Option<crate::rdma::RdmaRegion>,
    /// This process's time namespace (see `dmkv_common::host`), for
    /// region info.
    pub time_namespace: u64,
    /// Where peers' raft messages go; `None` on a node outside a cluster.
    pub raft: Option<Arc<dyn crate::cluster::wire::RaftSink>>,
    /// Without secrets, which node a peer-port connection is, by its
    /// source IP (see `cluster::identity`).
    pub peer_ips: PeerIps,
    /// This node's shard replicas; `None` outside a cluster (then `store`
    /// holds the data; in a cluster the shards' stores do).
    pub cluster: Option<Arc<ClusterNode>>,
    /// Request counts and latencies, per-listener bytes and connections.
    pub metrics: Arc<crate::counters::Metrics>,
}

impl Shared {
    /// The store's semantics (expiry, conditional writes, waiting for
    /// room) over this server's store and compactor.
    pub fn kv(&self) -> crate::kv::Kv<'_> {
        crate::kv::Kv::new(&self.store, &self.compactor)
    }
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
    /// RDMA queue pairs set up over this connection; destroyed with it.
    #[cfg(feature = "rdma")]
    qps: Vec<dmkv_verbs::QueuePair>,
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
        #[cfg(feature = "rdma")]
        qps: Vec::new(),
    };
    // The peer port speaks plain TCP: peers prove their node secret on
    // every connection, but what they replicate is not encrypted (peer TLS
    // is not built; docs/replication.md).
    let (tls, limits) = (if peer_port { None } else { shared.tls.clone() }, shared.limits);
    let stats = Arc::clone(if peer_port { &shared.metrics.peer } else { &shared.metrics.rpc });
    let requests =
        Requests { decoder: Decoder::new(shared.max_frame), shared, state, deferred: Deferred::new(), read_at: None };
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
}

/// Requests of one connection a cluster node works on at once (each
/// waits for raft); more wait for the oldest's reply first.
pub const MAX_DEFERRED_PER_CONNECTION: usize = 256;

type Deferred = futures_util::stream::FuturesUnordered<std::pin::Pin<Box<dyn Future<Output = BytesMut> + Send>>>;

impl Requests {
    /// A cluster node's data request: answered when raft has done its
    /// part, while the connection reads and starts the next ones. Started
    /// in the order read (the first poll proposes or queues the read), so
    /// a connection's writes reach the shard in order; replies may come
    /// back out of order (they carry the request's id).
    fn deferrable(&self, req: &Request) -> bool {
        self.shared.cluster.is_some()
            && !self.state.peer_port
            && self.state.role.is_none_or(|r| r.allows(Role::Data))
            && matches!(req.op, Some(Op::Put(_) | Op::Delete(_) | Op::Get(_) | Op::MultiGet(_)))
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
            let node = shared.cluster.as_ref().expect("deferrable: a cluster node");
            let op = req.op.expect("deferrable: a data op");
            let resp = match cluster_request(node, max_frame, &op).await {
                Some(Ok(result)) => Response { id, result: Some(result) },
                Some(Err(e)) => Response { id, result: Some(R::Error(e)) },
                None => error(id, ErrorCode::UnknownOp, "not a data request".into()),
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
        let Some(req) = self.decoder.next_message::<Request>(inbuf).map_err(Close::Frame)? else { return Ok(false) };
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
            self.shared.metrics.record(op, &resp, started.elapsed());
        }
        encode_reply(&resp, self.shared.max_frame, out);
        Ok(true)
    }

    fn logged(e: &Close) -> bool {
        matches!(e, Close::Unauthenticated)
    }

    fn on_read(&mut self, at: std::time::Instant) {
        self.read_at = Some(at);
    }
}

/// The role a request needs on the client port.
fn needed_role(op: &Op) -> Role {
    match op {
        // Never served on the client port (`misplaced`); admin all the
        // same, should that check ever go.
        Op::Raft(_) | Op::JoinShard(_) | Op::SnapshotChunk(_) => Role::Admin,
        Op::Reregister(_) | Op::ReplaceReplica(_) => Role::Admin,
        _ => Role::Data,
    }
}

/// Why `op` is not served on this connection's port, if it is not: raft
/// traffic (and joins, which change a shard's members) only on the peer
/// port, from the node it says it is from; the peer port serves nothing
/// else. Checked before roles: no role's secret makes raft traffic right.
fn misplaced(shared: &Shared, conn: &ConnState, op: &Op) -> Option<String> {
    let cluster_traffic = matches!(op, Op::Raft(_) | Op::GetMap(_) | Op::JoinShard(_) | Op::SnapshotChunk(_));
    if !conn.peer_port {
        return matches!(op, Op::Raft(_) | Op::JoinShard(_) | Op::SnapshotChunk(_)).then(|| {
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

fn store_error(id: u64, e: StoreError) -> Response {
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
    error(id, code, e.to_string())
}

/// A GET's reply with the item and where its slot is (see `GetReply`).
fn found(item: crate::kv::Item, at: crate::store::Location) -> proto::GetReply {
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

async fn handle(shared: &Shared, conn: &mut ConnState, req: Request) -> Response {
    let id = req.id;
    let store = &shared.store;
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
    if let (Some(node), Some(op)) = (&shared.cluster, &req.op)
        && let Some(r) = cluster_request(node, shared.max_frame, op).await
    {
        return match r {
            Ok(result) => Response { id, result: Some(result) },
            Err(e) => Response { id, result: Some(R::Error(e)) },
        };
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
                cluster: shared.cluster.is_some(),
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
        Some(Op::Put(p)) => {
            let w = write_of(&p, crate::clock::now_ms());
            match kv::write(&shared.kv(), &p.key, &w).await {
                Ok(meta) => R::Put(proto::PutReply { version: meta.version }),
                Err(e) => return store_error(id, e),
            }
        }
        Some(Op::Get(g)) => match store.get_item(&g.key, crate::clock::now_ms()) {
            Ok(Some((item, at))) => R::Get(found(item, at)),
            Ok(None) => R::Get(proto::GetReply::default()),
            Err(e) => return store_error(id, e),
        },
        Some(Op::Delete(d)) => match kv::delete(&shared.kv(), &d.key, d.cas) {
            Ok(existed) => R::Delete(proto::DeleteReply { existed }),
            Err(e) => return store_error(id, e),
        },
        Some(Op::Arith(a)) => {
            let arith = arith_of(&a, crate::clock::now_ms());
            match kv::arith(&shared.kv(), &a.key, &arith).await {
                Ok((value, meta)) => R::Arith(proto::ArithReply { value, version: meta.version }),
                Err(e) => return store_error(id, e),
            }
        }
        Some(Op::Touch(t)) => {
            let at = expiry_of(t.ttl_secs, t.expires_at, crate::clock::now_ms());
            match kv::touch(&shared.kv(), &t.key, at).await {
                Ok(Some(item)) => {
                    let mut r = found(item, crate::store::Location { which: 0, index: 0, slot: 0 });
                    if !t.get {
                        r.value = Default::default();
                    }
                    R::Touch(r)
                }
                Ok(None) => R::Touch(proto::GetReply::default()),
                Err(e) => return store_error(id, e),
            }
        }
        Some(Op::AccessReport(r)) => {
            store.note_remote_accesses(&r.units);
            R::AccessReport(proto::AccessReportReply {})
        }
        Some(Op::MultiGet(m)) => {
            if m.keys.len() > MAX_MULTI_GET_KEYS {
                return error(
                    id,
                    ErrorCode::BadRequest,
                    format!("multi-get of {} keys exceeds the limit of {MAX_MULTI_GET_KEYS}", m.keys.len()),
                );
            }
            let mut values = Vec::with_capacity(m.keys.len());
            let mut value_bytes = 0usize;
            for k in &m.keys {
                match store.get_item(k, crate::clock::now_ms()) {
                    Ok(Some((item, at))) => {
                        // Values past the frame limit cannot be sent: refuse as
                        // soon as they are, rather than first gathering up to
                        // MAX_MULTI_GET_KEYS maximum values (a gigabyte) that
                        // one small request can ask for.
                        value_bytes += item.value.len();
                        if value_bytes > shared.max_frame {
                            return too_large(id, shared.max_frame);
                        }
                        values.push(found(item, at))
                    }
                    Ok(None) => values.push(proto::GetReply::default()),
                    Err(e) => return store_error(id, e),
                }
            }
            R::MultiGet(proto::MultiGetReply { values })
        }
        Some(Op::Stats(_)) => R::Stats(proto::StatsReply { counters: stats(shared) }),
        Some(Op::RegionInfo(_)) => R::RegionInfo(region_info(shared)),
        Some(Op::RdmaConnect(c)) => match rdma_connect(shared, conn, &c.endpoint) {
            Ok(r) => R::RdmaConnect(r),
            Err(e) => return e.with_id(id),
        },
        Some(Op::Raft(batch)) => match &shared.raft {
            None => return error(id, ErrorCode::BadRequest, "this node is not part of a cluster".into()),
            Some(sink) => match crate::cluster::wire::decode(&batch) {
                Ok(msgs) => R::Raft(proto::RaftReply { accepted: sink.deliver(batch.from_node, msgs) as u32 }),
                Err(e) => return error(id, ErrorCode::BadRequest, e.to_string()),
            },
        },
        Some(Op::GetMap(_) | Op::JoinShard(_) | Op::ReplaceReplica(_) | Op::SnapshotChunk(_)) => {
            return error(id, ErrorCode::BadRequest, "this node is not part of a cluster".into());
        }
        Some(Op::Reregister(_)) => match reregister(shared) {
            Ok(_) => R::Reregister(region_info(shared)),
            Err(e) => return error(id, ErrorCode::Internal, e),
        },
    };
    Response { id, result: Some(result) }
}

/// The expiry a request asks for: `expires_at` if given, else `ttl_secs`
/// from the server's `now_ms` (both 0: never).
pub fn expiry_of(ttl_secs: u64, expires_at: u32, now_ms: u64) -> u32 {
    if expires_at != 0 { expires_at } else { dmkv_common::expiry::from_ttl(ttl_secs, now_ms) }
}

/// The store write a PUT asks for.
fn write_of(p: &proto::Put, now_ms: u64) -> kv::Write<'_> {
    let mode = match proto::PutMode::try_from(p.mode).unwrap_or(proto::PutMode::Set) {
        proto::PutMode::Set => kv::Mode::Set,
        proto::PutMode::Add => kv::Mode::Add,
        proto::PutMode::Replace => kv::Mode::Replace,
        proto::PutMode::Append => kv::Mode::Append,
        proto::PutMode::Prepend => kv::Mode::Prepend,
    };
    kv::Write {
        value: &p.value,
        mode,
        flags: p.flags,
        expiry: kv::Expiry::At(expiry_of(p.ttl_secs, p.expires_at, now_ms)),
        cas: p.cas,
        vivify: p.vivify,
    }
}

/// The store counter operation an ARITH asks for: the item keeps its
/// expiry unless the request gives one.
fn arith_of(a: &proto::Arith, now_ms: u64) -> kv::Arith {
    let at = expiry_of(a.ttl_secs, a.expires_at, now_ms);
    kv::Arith {
        delta: a.delta,
        incr: !a.decrement,
        cas: a.cas,
        vivify: a.vivify.then_some((a.initial, at)),
        expiry: if at == 0 { kv::Expiry::Keep } else { kv::Expiry::At(at) },
    }
}

/// What a cluster node answers to a write it cannot replicate.
const NOT_REPLICATED: &str =
    "flags, expiry, CAS, write modes, counters and touch are not replicated yet: use a single node for them";

/// Whether a PUT asks for nothing but key, value (and write id).
fn plain_put(p: &proto::Put) -> bool {
    p.flags == 0 && p.ttl_secs == 0 && p.expires_at == 0 && p.cas == 0 && p.mode == 0 && !p.vivify
}

/// A GET reply of a cluster shard's item (no flags or expiry there yet).
fn found_plain(value: bytes::Bytes, version: u64, at: crate::store::Location) -> proto::GetReply {
    found(kv::Item { value, meta: kv::ItemMeta { version, ..Default::default() } }, at)
}

/// Runs a data request on a cluster node (`None`: not a data request).
async fn cluster_request(node: &ClusterNode, max_frame: usize, op: &Op) -> Option<Result<R, proto::Error>> {
    Some(
        match op {
            Op::Put(p) if !plain_put(p) => return Some(Err(plain(ErrorCode::BadRequest, NOT_REPLICATED.into()))),
            Op::Delete(d) if d.cas != 0 => return Some(Err(plain(ErrorCode::BadRequest, NOT_REPLICATED.into()))),
            Op::Arith(_) | Op::Touch(_) => return Some(Err(plain(ErrorCode::BadRequest, NOT_REPLICATED.into()))),
            // Cluster shards do not evict (an eviction would have to go
            // through raft): nothing to report to.
            Op::AccessReport(_) => return Some(Ok(R::AccessReport(proto::AccessReportReply {}))),
            Op::Put(p) => {
                node.put(&p.key, &p.value, p.write_id).await.map(|version| R::Put(proto::PutReply { version }))
            }
            Op::Delete(d) => {
                node.delete(&d.key, d.write_id).await.map(|existed| R::Delete(proto::DeleteReply { existed }))
            }
            Op::Get(g) => node.get(&g.key).await.map(|v| {
                R::Get(v.map_or_else(proto::GetReply::default, |(value, version, at)| found_plain(value, version, at)))
            }),
            Op::MultiGet(m) => {
                if m.keys.len() > MAX_MULTI_GET_KEYS {
                    return Some(Err(plain(
                        ErrorCode::BadRequest,
                        format!("multi-get of {} keys exceeds the limit of {MAX_MULTI_GET_KEYS}", m.keys.len()),
                    )));
                }
                let got = match node.multi_get(&m.keys).await {
                    Ok(got) => got,
                    Err(e) => return Some(Err(cluster_refusal(e))),
                };
                let mut values = Vec::with_capacity(got.len());
                let mut bytes = 0usize;
                for v in got {
                    match v {
                        Some((value, version, at)) => {
                            bytes += value.len();
                            if bytes > max_frame {
                                return Some(Err(plain(
                                    ErrorCode::ResponseTooLarge,
                                    format!("reply exceeds the maximum frame of {max_frame} bytes"),
                                )));
                            }
                            values.push(found_plain(value, version, at));
                        }
                        None => values.push(proto::GetReply::default()),
                    }
                }
                return Some(Ok(R::MultiGet(proto::MultiGetReply { values })));
            }
            Op::GetMap(_) => return Some(Ok(R::Map(node.map_reply()))),
            Op::JoinShard(j) => node.join_shard(j.shard, j.replica_id).await.map(|step| {
                R::JoinShard(proto::JoinShardReply {
                    done: step == crate::cluster::shard::JoinStep::Done,
                    step: format!("{step:?}"),
                })
            }),
            Op::ReplaceReplica(r) => node
                .replace_replica(r.shard)
                .await
                .map(|replica_id| R::ReplaceReplica(proto::ReplaceReplicaReply { replica_id })),
            Op::SnapshotChunk(c) => node.receive_snapshot(c.clone()).await.map(R::SnapshotChunk),
            _ => return None,
        }
        .map_err(cluster_refusal),
    )
}

fn plain(code: ErrorCode, message: String) -> proto::Error {
    proto::Error { code: code as i32, message, ..Default::default() }
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
        ClusterError::Busy => plain(ErrorCode::Busy, "too many requests wait for this shard; retry".into()),
        ClusterError::Uncertain => plain(
            ErrorCode::Uncertain,
            "leadership changed before the write committed: it may or may not have taken effect".into(),
        ),
        ClusterError::Store(e) => match store_error(0, e).result {
            Some(R::Error(e)) => e,
            _ => plain(ErrorCode::Internal, "store error".into()),
        },
        ClusterError::Failed(m) => plain(ErrorCode::Internal, m),
    }
}

/// Registers the region anew (new rkey, next epoch) on every transport;
/// returns the new epoch.
pub fn reregister(shared: &Shared) -> Result<u64, String> {
    #[cfg(feature = "rdma")]
    if let Some(r) = &shared.rdma {
        r.reregister().map_err(|e| format!("RDMA re-registration failed: {e}"))?;
    }
    let epoch = shared.registration.reregister(shared.store.region());
    tracing::info!(epoch, "region registered anew");
    Ok(epoch)
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
    let rdma = shared.rdma.as_ref().ok_or(Refusal(ErrorCode::BadRequest, "this server offers no RDMA".into()))?;
    if conn.qps.len() >= crate::rdma::MAX_QPS_PER_CONNECTION {
        return Err(Refusal(ErrorCode::BadRequest, "too many RDMA queue pairs on this connection".into()));
    }
    let a = rdma.accept(endpoint).map_err(|e| Refusal(ErrorCode::BadRequest, format!("RDMA connect: {e}")))?;
    conn.qps.push(a.qp);
    Ok(proto::RdmaConnectReply {
        endpoint: a.endpoint.to_bytes().to_vec().into(),
        addr: a.addr,
        length: a.len,
        rkey: a.rkey,
        epoch: shared.registration.epoch(),
    })
}

#[cfg(not(feature = "rdma"))]
fn rdma_connect(_: &Shared, _: &mut ConnState, _: &[u8]) -> Result<proto::RdmaConnectReply, Refusal> {
    Err(Refusal(ErrorCode::BadRequest, "this server was built without RDMA support".into()))
}

fn descriptor(reg: &crate::registration::Registration, store: &Store, region_id: u32) -> proto::RegionDescriptor {
    let h = reg.header();
    proto::RegionDescriptor {
        region_id,
        epoch: h.epoch,
        length: h.region_len,
        rkey: reg.rkey(),
        directory_depth: h.dir_depth,
        hash_seed: h.hash_seed,
        index_offset: h.index_offset,
        data_offset: h.data_offset,
        data_length: h.data_len,
        layout_version: LAYOUT_VERSION,
        grace_nanos: h.grace_nanos,
        base_addr: store.region().base_ptr() as u64,
        shard: 0,
        leased: false,
        evicts: store.evicts(),
    }
}

fn region_info(shared: &Shared) -> proto::RegionInfoReply {
    let regions = match &shared.cluster {
        // Every local replica's region: readers tell the leader's by its
        // lease (a follower's has none), so leadership changes need no
        // new descriptors.
        Some(node) => node
            .regions()
            .into_iter()
            .map(|(shard, store, reg)| proto::RegionDescriptor {
                shard,
                leased: true,
                ..descriptor(&reg, &store, shard + 1)
            })
            .collect(),
        None => vec![descriptor(&shared.registration, &shared.store, shared.region_id)],
    };
    proto::RegionInfoReply {
        regions,
        shm_socket: shared.shm_socket.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
        engine_addr: shared.engine_addr.map(|a| a.to_string()).unwrap_or_default(),
        host_id: shared.host_id.clone(),
        #[cfg(feature = "rdma")]
        rdma_device: shared.rdma.as_ref().map(|r| r.device_name().to_string()).unwrap_or_default(),
        #[cfg(not(feature = "rdma"))]
        rdma_device: String::new(),
        engine_tls: shared.engine_tls,
        monotonic_ns: crate::clock::mono_ns(),
        time_namespace: shared.time_namespace,
    }
}

fn stats(shared: &Shared) -> HashMap<String, u64> {
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let cs = shared.compactor.stats();
    let mut out: HashMap<String, u64> = HashMap::new();
    match &shared.cluster {
        // A cluster node's data is in its shard replicas' stores: sums
        // (largest for depths and ratios, which do not add up).
        Some(node) => {
            let mut replicas = 0;
            for store in node.stores() {
                replicas += 1;
                for (k, v) in store_stats(store) {
                    let e = out.entry(k.to_string()).or_default();
                    *e = if k.ends_with("_permille") || k.ends_with("_depth") { (*e).max(v) } else { *e + v };
                }
            }
            out.insert("shard_replicas".into(), replicas);
            out.extend(node.replica_counters().into_iter().map(|(k, v)| (k.to_string(), v)));
        }
        None => out.extend(store_stats(&shared.store).into_iter().map(|(k, v)| (k.to_string(), v))),
    }
    let node = [
        ("compactor_active", load(&cs.active)),
        ("compactor_demands", load(&cs.demands)),
        ("compactor_cpu_micros", load(&cs.cpu_nanos) / 1000),
        ("region_epoch", shared.registration.epoch()),
        ("engine_batches", load(&shared.engine_counters.batches)),
        ("engine_reads", load(&shared.engine_counters.reads)),
        ("engine_bytes", load(&shared.engine_counters.bytes)),
        ("engine_rejected_reads", load(&shared.engine_counters.rejected)),
    ];
    out.extend(node.into_iter().map(|(k, v)| (k.to_string(), v)));
    shared.metrics.stats_into(&mut out);
    out
}

/// One store's counters.
fn store_stats(s: &Store) -> Vec<(&'static str, u64)> {
    let c = &s.counters;
    let space = s.space();
    let unit = dmkv_common::limits::UNIT as u64;
    let index = s.index_stats();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    vec![
        ("gets", load(&c.gets)),
        ("get_hits", load(&c.get_hits)),
        ("get_expired", load(&c.get_expired)),
        ("evictions", load(&c.evictions)),
        ("puts", load(&c.puts)),
        ("deletes", load(&c.deletes)),
        ("items", load(&c.items)),
        ("out_of_memory_errors", load(&c.out_of_memory)),
        ("index_full_errors", load(&c.index_full)),
        ("corrupt_reads", load(&c.corrupt_reads)),
        ("foreign_slots", load(&c.foreign_slots)),
        ("live_bytes", load(&c.used_bytes)),
        ("allocated_bytes", space.used * unit),
        ("data_bytes", s.header().data_len),
        ("free_bytes", (space.free + space.parked) * unit),
        ("largest_free_bytes", space.largest_free * unit),
        ("fragmentation_permille", space.fragmentation_permille()),
        ("compactor_moves", load(&c.compactor_moves)),
        ("compactor_moved_bytes", load(&c.compactor_moved_bytes)),
        ("compactor_windows", load(&c.compactor_ranges)),
        ("compactor_windows_done", load(&c.compactor_ranges_done)),
        ("compactor_windows_abandoned", load(&c.compactor_ranges_abandoned)),
        ("region_bytes", s.header().region_len),
        ("index_slots", index.slots),
        ("index_segments", index.segments),
        ("index_splits", index.splits),
        ("index_bytes", load(&c.index_bytes)),
        ("index_load_permille", (load(&c.items) * 1000).checked_div(index.slots).unwrap_or(0)),
        ("index_depth", index.max_depth),
        ("directory_depth", index.dir_depth),
    ]
}
