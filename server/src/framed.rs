//! The connection loop of the server's framed request/reply listeners: the
//! RPC service and the one-sided engine differ only in what one request
//! means, not in how a connection is read and answered.
//!
//! Every request read is answered, and the replies to everything one socket
//! read brought go out in one write (reply coalescing): a client that
//! pipelines then costs one write per batch, not one per request.

use std::fmt::Display;
use std::future::Future;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tracing::{debug, warn};

/// Read buffer size per connection; frames larger than this grow it.
const READ_BUF: usize = 64 * 1024;
/// Reply bytes a connection gathers before it writes them, even in the
/// middle of a batch of requests: many small requests can ask for many
/// large values, and what one connection holds must stay bounded.
pub const MAX_PENDING_REPLY_BYTES: usize = 4 * 1024 * 1024;

/// What a listener does with one request. Async because an RPC may wait
/// (a PUT waits for space finishing its grace period); a handler that
/// never waits simply never awaits.
pub trait Handler: Send {
    /// Why a connection's input cannot be served; the connection is then
    /// closed and this is logged.
    type Error: Display + Send;

    /// Takes one request off the front of `inbuf` and appends its reply to
    /// `out`. Returns `Ok(false)`, taking nothing, when `inbuf` does not yet
    /// hold a whole request.
    fn handle_next(
        &mut self,
        inbuf: &mut BytesMut,
        out: &mut BytesMut,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send;
}

/// Serves one connection until the peer closes, sends a request `handler`
/// rejects, or the server shuts down (after answering every request already
/// read). `kind` names the listener in logs. `stream` is TCP, or TLS over
/// TCP: reads and writes take turns, so it need not be split.
pub async fn serve_connection<H: Handler>(
    mut stream: impl AsyncRead + AsyncWrite + Unpin + Send,
    peer: Option<std::net::SocketAddr>,
    kind: &str,
    mut handler: H,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut inbuf = BytesMut::with_capacity(READ_BUF);
    let mut out = BytesMut::new();
    loop {
        if inbuf.capacity() - inbuf.len() < READ_BUF / 4 {
            inbuf.reserve(READ_BUF);
        }
        let n = tokio::select! {
            r = stream.read_buf(&mut inbuf) => match r {
                Ok(n) => n,
                Err(e) => { debug!(?peer, "{kind} read error: {e}"); return; }
            },
            _ = shutdown.changed() => return,
        };
        if n == 0 {
            if !inbuf.is_empty() {
                warn!(?peer, bytes = inbuf.len(), "{kind} connection closed in the middle of a frame");
            }
            return;
        }
        let mut close_reason = None;
        loop {
            match handler.handle_next(&mut inbuf, &mut out).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    close_reason = Some(e);
                    break;
                }
            }
            if out.len() >= MAX_PENDING_REPLY_BYTES {
                if let Err(e) = write_out(&mut stream, &out).await {
                    debug!(?peer, "{kind} write error: {e}");
                    return;
                }
                out.clear();
            }
        }
        if !out.is_empty() {
            if let Err(e) = write_out(&mut stream, &out).await {
                debug!(?peer, "{kind} write error: {e}");
                return;
            }
            out.clear();
        }
        if let Some(e) = close_reason {
            warn!(?peer, "closing {kind} connection: {e}");
            return;
        }
    }
}

/// Writes `out` and flushes it: TLS holds written bytes in its session
/// until flushed (a no-op for plain TCP).
async fn write_out(stream: &mut (impl AsyncWrite + Unpin), out: &[u8]) -> std::io::Result<()> {
    stream.write_all(out).await?;
    stream.flush().await
}
