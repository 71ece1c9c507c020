//! Raft traffic to peer nodes: one connection per peer, dialed by this
//! node, authenticated with the admin secret, carrying batches of raft
//! messages as `Raft` requests of the framed protocol. Shard threads hand
//! messages over without blocking: each peer has a bounded queue, and a
//! message that finds it full (or the peer unreachable) is dropped: raft
//! retransmits.
//!
//! Dials leave from the IP of this node's own peer address in the cluster
//! file (unless that is unspecified, `0.0.0.0` or `::`), so peers, and
//! firewalls between nodes, see node traffic come from the address the
//! file names for the node, not whichever address the route picks.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use bytes::BytesMut;
use dmkv_common::PROTOCOL_VERSION;
use dmkv_common::auth::{Purpose, Token};
use dmkv_common::frame::{self, Decoder};
use dmkv_common::proto::{self, Request, request::Op, response::Result as R};
use raft::prelude::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use super::wire::{self, MAX_BATCH_MESSAGES};

/// Raft messages queued for one peer at most.
pub const MAX_PEER_QUEUE: usize = 16384;
/// First wait before redialing a peer; doubles up to [`MAX_REDIAL`].
pub const MIN_REDIAL: Duration = Duration::from_millis(50);
/// Longest wait between dials of an unreachable peer.
pub const MAX_REDIAL: Duration = Duration::from_secs(1);
/// How long connecting and authenticating to a peer may take.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(2);

/// The node's queues towards its peers.
pub struct Peers {
    queues: HashMap<u64, mpsc::Sender<(u32, Message)>>,
}

/// Who this node is to its peers.
#[derive(Clone)]
pub struct Dialer {
    pub me: u64,
    /// The admin secret (`None`: the cluster runs without authentication).
    pub token: Option<Token>,
    pub max_frame: usize,
    /// Where dials leave from: the IP of this node's peer address, or
    /// `None` to let the route pick (see [`Dialer::source_of`]).
    pub source: Option<IpAddr>,
}

impl Dialer {
    /// The source for dials of a node whose peer address is `own`: its IP,
    /// unless unspecified (the node listens on every address; any will do).
    pub fn source_of(own: SocketAddr) -> Option<IpAddr> {
        Some(own.ip()).filter(|ip| !ip.is_unspecified())
    }
}

impl Peers {
    /// Starts a sender task per peer on the current runtime; they stop
    /// when `stop` turns true.
    pub fn start(dialer: Dialer, peers: Vec<(u64, SocketAddr)>, stop: watch::Receiver<bool>) -> Peers {
        let mut queues = HashMap::new();
        for (id, addr) in peers {
            let (tx, rx) = mpsc::channel(MAX_PEER_QUEUE);
            queues.insert(id, tx);
            tokio::spawn(send_loop(dialer.clone(), id, addr, rx, stop.clone()));
        }
        Peers { queues }
    }

    /// Queues `m` (of `shard`) for its addressee; drops it if the queue is
    /// full or the peer is unknown.
    pub fn send(&self, shard: u32, m: Message) {
        if let Some(q) = self.queues.get(&dmkv_common::cluster::map::node_of(m.to)) {
            let _ = q.try_send((shard, m));
        }
    }
}

async fn send_loop(
    d: Dialer,
    peer: u64,
    addr: SocketAddr,
    mut rx: mpsc::Receiver<(u32, Message)>,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = MIN_REDIAL;
    let mut warned = false;
    loop {
        let dialed = tokio::select! {
            r = tokio::time::timeout(DIAL_TIMEOUT, dial(&d, addr)) => r.unwrap_or_else(|_| Err("timed out".into())),
            _ = stop.changed() => return,
        };
        match dialed {
            Ok(stream) => {
                info!(peer, %addr, "connected to peer");
                backoff = MIN_REDIAL;
                warned = false;
                tokio::select! {
                    r = pump(&d, stream, &mut rx) => match r {
                        Ok(()) => return,
                        Err(e) => warn!(peer, %addr, "peer connection lost: {e}"),
                    },
                    _ = stop.changed() => return,
                }
            }
            Err(e) if !warned => {
                // Peers start in any order: say it once, not per redial.
                warn!(peer, %addr, "cannot reach peer (will keep trying): {e}");
                warned = true;
            }
            Err(e) => debug!(peer, %addr, "cannot reach peer: {e}"),
        }
        // Messages queued while the peer was away are stale: raft resends
        // what still matters.
        while rx.try_recv().is_ok() {}
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(MAX_REDIAL);
    }
}

/// Connects and authenticates as admin.
async fn dial(d: &Dialer, addr: SocketAddr) -> Result<TcpStream, String> {
    let mut s = connect_from(d.source, addr).await?;
    let _ = s.set_nodelay(true);
    let mut buf = BytesMut::new();
    let hello = Op::Hello(proto::Hello { protocol_version: PROTOCOL_VERSION, client_name: format!("node-{}", d.me) });
    let nonce = match call(&mut s, &mut buf, d.max_frame, 1, hello).await? {
        R::Hello(h) => h.auth_nonce,
        other => return Err(format!("unexpected reply to HELLO: {other:?}")),
    };
    if nonce.is_empty() {
        return Ok(s);
    }
    let token = d.token.as_ref().ok_or("the peer requires authentication and this node has no admin secret")?;
    let proof = token.prove(Purpose::Rpc, &nonce).to_vec().into();
    match call(&mut s, &mut buf, d.max_frame, 2, Op::Authenticate(proto::Authenticate { proof })).await? {
        R::Authenticate(a) if a.role == "admin" => Ok(s),
        R::Authenticate(a) => Err(format!("the peer granted role {}, raft needs admin", a.role)),
        other => Err(format!("authentication refused: {other:?}")),
    }
}

/// Connects to `addr` from `source` (port picked by the OS), when it is
/// of the same family; from wherever the route says otherwise.
async fn connect_from(source: Option<IpAddr>, addr: SocketAddr) -> Result<TcpStream, String> {
    let Some(ip) = source.filter(|ip| ip.is_ipv4() == addr.is_ipv4()) else {
        return TcpStream::connect(addr).await.map_err(|e| e.to_string());
    };
    let socket = if addr.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }.map_err(|e| e.to_string())?;
    socket.bind(SocketAddr::new(ip, 0)).map_err(|e| format!("cannot bind to this node's peer address {ip}: {e}"))?;
    socket.connect(addr).await.map_err(|e| e.to_string())
}

/// Sends one request to a peer's peer port (authenticated as admin) and
/// returns its answer; bounded by [`DIAL_TIMEOUT`] in all.
pub async fn ask(d: &Dialer, addr: SocketAddr, op: Op) -> Result<R, String> {
    let once = async {
        let mut s = dial(d, addr).await?;
        let mut buf = BytesMut::new();
        call(&mut s, &mut buf, d.max_frame, 3, op).await
    };
    tokio::time::timeout(DIAL_TIMEOUT, once).await.unwrap_or_else(|_| Err("timed out".into()))
}

async fn call(s: &mut TcpStream, buf: &mut BytesMut, max_frame: usize, id: u64, op: Op) -> Result<R, String> {
    let mut out = BytesMut::new();
    frame::encode(&Request { id, op: Some(op) }, max_frame, &mut out).map_err(|e| e.to_string())?;
    s.write_all(&out).await.map_err(|e| e.to_string())?;
    let dec = Decoder::new(max_frame);
    loop {
        if let Some(r) = dec.next_message::<proto::Response>(buf).map_err(|e| e.to_string())? {
            return match r.result {
                Some(R::Error(e)) => Err(format!("{:?}: {}", e.code(), e.message)),
                Some(r) => Ok(r),
                None => Err("empty reply".into()),
            };
        }
        if s.read_buf(buf).await.map_err(|e| e.to_string())? == 0 {
            return Err("connection closed".into());
        }
    }
}

/// Sends batches until the queue closes (`Ok`) or the connection fails.
async fn pump(d: &Dialer, stream: TcpStream, rx: &mut mpsc::Receiver<(u32, Message)>) -> Result<(), String> {
    let (mut rd, mut wr) = stream.into_split();
    // Replies only count accepted messages: read and discard them, so the
    // peer's writes never block.
    let mut drain = tokio::spawn(async move { tokio::io::copy(&mut rd, &mut tokio::io::sink()).await });
    // A batch's messages must fit one frame, with room for framing.
    let budget = d.max_frame.saturating_sub(64 << 10).max(1);
    let mut id = 10u64;
    let mut out = BytesMut::new();
    let mut next: Option<(u32, Message)> = None;
    loop {
        let first = match next.take() {
            Some(m) => m,
            None => tokio::select! {
                m = rx.recv() => match m {
                    Some(m) => m,
                    None => return Ok(()),
                },
                _ = &mut drain => return Err("connection closed by the peer".into()),
            },
        };
        let mut size = protobuf::Message::compute_size(&first.1) as usize;
        if size > budget {
            // A snapshot: in parts, each alone in its frame.
            for part in wire::encode_parts(d.me, first.0, &first.1, budget) {
                id += 1;
                out.clear();
                let req = Request { id, op: Some(Op::Raft(part)) };
                frame::encode(&req, d.max_frame, &mut out).map_err(|e| e.to_string())?;
                wr.write_all(&out).await.map_err(|e| e.to_string())?;
            }
            continue;
        }
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH_MESSAGES {
            let Ok(m) = rx.try_recv() else { break };
            let n = protobuf::Message::compute_size(&m.1) as usize;
            if size + n > budget {
                next = Some(m);
                break;
            }
            size += n;
            batch.push(m);
        }
        id += 1;
        let req = Request { id, op: Some(Op::Raft(wire::encode(d.me, &batch))) };
        out.clear();
        if let Err(e) = frame::encode(&req, d.max_frame, &mut out) {
            // Within the budget, so never expected: say so loudly.
            warn!("raft batch of {size} bytes does not fit a frame: {e}");
            continue;
        }
        wr.write_all(&out).await.map_err(|e| e.to_string())?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dials_leave_from_the_nodes_peer_address() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let to = l.local_addr().unwrap();
        let own: SocketAddr = "127.0.0.7:7170".parse().unwrap();
        let _s = connect_from(Dialer::source_of(own), to).await.unwrap();
        let (_, from) = l.accept().await.unwrap();
        assert_eq!(from.ip(), own.ip());
        // Unspecified: no binding, the route's source.
        assert_eq!(Dialer::source_of("0.0.0.0:7170".parse().unwrap()), None);
        let _s = connect_from(Dialer::source_of("0.0.0.0:7170".parse().unwrap()), to).await.unwrap();
        assert_eq!(l.accept().await.unwrap().1.ip().to_string(), "127.0.0.1");
        // Another family: the route's source too.
        let _s = connect_from(Some("::1".parse().unwrap()), to).await.unwrap();
        assert_eq!(l.accept().await.unwrap().1.ip().to_string(), "127.0.0.1");
    }
}
