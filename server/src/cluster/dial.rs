//! Connecting to a peer node's peer port as this node: dialed from this
//! node's own peer address (see [`Dialer::source_of`]), authenticated with
//! this node's own secret. Raft's connections (`peer`) and snapshot
//! transfers (`transfer`) both dial this way.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use dmkv_common::PROTOCOL_VERSION;
use dmkv_common::auth::{Purpose, Token, node_name};
use dmkv_common::cluster::map::NodeId;
use dmkv_common::frame::{self, Decoder};
use dmkv_common::proto::{self, Request, request::Op, response::Result as R};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use super::peer_tls::PeerTls;

/// How long connecting and authenticating to a peer may take.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(2);

/// Who this node is to its peers.
#[derive(Clone)]
pub struct Dialer {
    pub me: u64,
    /// This node's own secret, which makes it node `me` to its peers
    /// (`None`: the cluster runs without authentication).
    pub token: Option<Token>,
    pub max_frame: usize,
    /// Where dials leave from: the IP of this node's peer address, or
    /// `None` to let the route pick (see [`Dialer::source_of`]).
    pub source: Option<IpAddr>,
    /// TLS to peers, if the node has it.
    pub tls: Option<Arc<PeerTls>>,
}

/// A connection to a peer: TCP, or TLS over it.
pub trait PeerIo: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> PeerIo for T {}
pub type PeerStream = Box<dyn PeerIo>;

impl Dialer {
    /// The source for dials of a node whose peer address is `own`: its IP,
    /// unless unspecified (the node listens on every address; any will do).
    pub fn source_of(own: SocketAddr) -> Option<IpAddr> {
        Some(own.ip()).filter(|ip| !ip.is_unspecified())
    }
}

/// Connects to node `to` at `addr` and authenticates as node `d.me`.
pub(super) async fn dial(d: &Dialer, to: NodeId, addr: SocketAddr) -> Result<PeerStream, String> {
    let tcp = connect_from(d.source, addr).await?;
    let _ = tcp.set_nodelay(true);
    let mut s: PeerStream = match &d.tls {
        Some(tls) => Box::new(tls.connect(to, tcp).await?),
        None => Box::new(tcp),
    };
    let mut buf = BytesMut::new();
    let hello = Op::Hello(proto::Hello { protocol_version: PROTOCOL_VERSION, client_name: format!("node-{}", d.me) });
    let nonce = match call(&mut s, &mut buf, d.max_frame, 1, hello).await? {
        R::Hello(h) => h.auth_nonce,
        other => return Err(format!("unexpected reply to HELLO: {other:?}")),
    };
    if nonce.is_empty() {
        return Ok(s);
    }
    let me = node_name(d.me);
    let token = d.token.as_ref().ok_or_else(|| {
        format!(
            "the peer requires authentication and this node has no secret of its own (`{me} SECRET` in the auth file)"
        )
    })?;
    let proof = token.prove(Purpose::Peer, &nonce).to_vec().into();
    match call(&mut s, &mut buf, d.max_frame, 2, Op::Authenticate(proto::Authenticate { proof })).await? {
        R::Authenticate(a) if a.role == me => Ok(s),
        // Another node's secret under this node's name: its batches would
        // all be refused, so say so here, once.
        R::Authenticate(a) => Err(format!("the peer knows this node's secret as {}'s, not {me}'s", a.role)),
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

/// Sends one request to node `to`'s peer port (authenticated as this
/// node) and returns its answer; bounded by [`DIAL_TIMEOUT`] in all.
pub async fn ask(d: &Dialer, to: NodeId, addr: SocketAddr, op: Op) -> Result<R, String> {
    ask_within(d, to, addr, op, DIAL_TIMEOUT).await
}

/// [`ask`], for a request that may take up to `limit` in all.
pub async fn ask_within(d: &Dialer, to: NodeId, addr: SocketAddr, op: Op, limit: Duration) -> Result<R, String> {
    let once = async {
        let mut s = dial(d, to, addr).await?;
        let mut buf = BytesMut::new();
        call(&mut s, &mut buf, d.max_frame, 3, op).await
    };
    tokio::time::timeout(limit, once).await.unwrap_or_else(|_| Err("timed out".into()))
}

async fn call(s: &mut PeerStream, buf: &mut BytesMut, max_frame: usize, id: u64, op: Op) -> Result<R, String> {
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
