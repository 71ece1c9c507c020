//! The connection loop of the server's framed request/reply listeners: the
//! RPC service and the one-sided engine differ only in what one request
//! means, not in how a connection is read and answered.
//!
//! Every request read is answered, and the replies to everything one socket
//! read brought go out in one write (reply coalescing): a client that
//! pipelines then costs one write per batch, not one per request.
//!
//! What one connection can hold is bounded: time by [`Limits`] (a peer that
//! goes quiet, or trickles a frame, is dropped), memory by the handler's
//! largest frame on the way in and [`MAX_PENDING_REPLY_BYTES`] on the way
//! out, with both buffers shrunk back once a large frame is done.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, warn};

/// Read buffer size per connection; frames larger than this grow it.
const READ_BUF: usize = 64 * 1024;
/// Reply bytes a connection gathers before it writes them, even in the
/// middle of a batch of requests: many small requests can ask for many
/// large values, and what one connection holds must stay bounded.
pub const MAX_PENDING_REPLY_BYTES: usize = 4 * 1024 * 1024;
/// A buffer left larger than this once it is empty is given back, so an
/// idle connection that once moved a large frame does not keep megabytes.
const SHRINK_ABOVE: usize = 4 * READ_BUF;

/// How long a connection may keep the server waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// No bytes from the peer for this long closes the connection; a reply
    /// the peer does not take within it too.
    pub idle_timeout: Duration,
    /// Once part of a frame has arrived, the rest must arrive within this,
    /// however it trickles in.
    pub frame_timeout: Duration,
}

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

    /// Bytes were just read, at `at`: the requests they complete arrived
    /// then (for latency accounting; one clock read per read, not per
    /// request).
    fn on_read(&mut self, _at: std::time::Instant) {}

    /// The requests completed by the last read were handled by `at`, and
    /// their replies are about to be written: for latency accounting, one
    /// clock read per batch. Not called when the loop ends early (a close,
    /// a failed write): a handler that keeps counts flushes them on drop.
    fn on_handled(&mut self, _at: std::time::Instant) {}

    /// Whether closing for `e` was logged already (authentication failures
    /// are, rate-limited), so the loop need not warn again.
    fn logged(_e: &Self::Error) -> bool {
        false
    }

    /// Whether the connection is in use elsewhere though quiet here (it
    /// opened a verbs RPC link that carries its requests): its idle
    /// timeout then waits another round instead of closing it.
    fn busy_elsewhere(&self) -> bool {
        false
    }

    /// Requests still being worked on (their replies come later, from
    /// [`Handler::next_deferred`]).
    fn deferred_len(&self) -> usize {
        0
    }

    /// The next reply of a request still being worked on, encoded; `None`
    /// when there is none.
    fn next_deferred(&mut self) -> impl Future<Output = Option<BytesMut>> + Send {
        std::future::ready(None)
    }
}

/// What woke a connection's loop.
enum Woke {
    Read(usize),
    Replies(BytesMut),
}

/// A peer's address for logs: plain (not `Some(..)`), for grep and JSON
/// logs, or "-" when unknown.
pub fn display_peer(peer: Option<std::net::SocketAddr>) -> String {
    peer.map_or_else(|| "-".into(), |p| p.to_string())
}

/// Serves one connection until the peer closes, sends a request `handler`
/// rejects, overstays `limits`, or the server shuts down (after answering
/// every request already read). `stats` names the listener in logs and
/// counts its bytes.
/// `stream` is TCP, or TLS over TCP: reads and writes take turns, so it
/// need not be split.
pub async fn serve_connection<H: Handler>(
    mut stream: impl AsyncRead + AsyncWrite + Unpin + Send,
    peer: Option<std::net::SocketAddr>,
    stats: std::sync::Arc<crate::counters::ListenerStats>,
    mut handler: H,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) {
    let kind = stats.name;
    let peer_s = display_peer(peer);
    let peer = peer_s.as_str();
    let mut inbuf = BytesMut::with_capacity(READ_BUF);
    let mut out = BytesMut::new();
    let mut clock = ReadClock::new(limits, Instant::now());
    // One timer for the connection's life, moved only when a deadline comes
    // earlier than the one armed: arming a timer per read costs more than
    // the read. When it fires early (the deadline moved later since), it
    // is armed again for the real one.
    let mut armed = clock.deadline().0;
    let timer = tokio::time::sleep_until(armed);
    tokio::pin!(timer);
    loop {
        if inbuf.capacity() - inbuf.len() < READ_BUF / 4 {
            inbuf.reserve(READ_BUF);
        }
        let (deadline, waiting_for) = clock.deadline();
        if deadline < armed {
            armed = deadline;
            timer.as_mut().reset(armed);
        }
        let deferred = handler.deferred_len() > 0;
        let woke = tokio::select! {
            r = stream.read_buf(&mut inbuf) => match r {
                Ok(n) => {
                    stats.received.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                    Woke::Read(n)
                }
                Err(e) => { debug!(peer, listener = kind, "{kind} read error: {e}"); return; }
            },
            Some(b) = handler.next_deferred(), if deferred => Woke::Replies(b),
            _ = &mut timer, if !deferred => {
                if deadline > Instant::now() {
                    armed = deadline;
                    timer.as_mut().reset(armed);
                    continue;
                }
                if matches!(waiting_for, Waiting::Idle) && handler.busy_elsewhere() {
                    clock.on_read(Instant::now(), false, false);
                    continue;
                }
                debug!(peer, listener = kind, bytes = inbuf.len(), "closing {kind} connection: {waiting_for:?} timed out");
                return;
            }
            _ = shutdown.changed() => {
                // Requests already read are answered, as in-line ones are.
                while handler.deferred_len() > 0 {
                    if let Some(b) = handler.next_deferred().await {
                        out.extend_from_slice(&b);
                    }
                }
                if !out.is_empty() {
                    let _ = write_out(&mut stream, &mut out, limits, &stats).await;
                }
                return;
            }
        };
        let n = match woke {
            Woke::Read(n) => n,
            Woke::Replies(b) => {
                out.extend_from_slice(&b);
                // Whatever else is done goes in the same write.
                while handler.deferred_len() > 0 {
                    match futures_util::FutureExt::now_or_never(handler.next_deferred()) {
                        Some(Some(b)) => out.extend_from_slice(&b),
                        _ => break,
                    }
                }
                if let Err(e) = write_out(&mut stream, &mut out, limits, &stats).await {
                    debug!(peer, listener = kind, "{kind} write error: {e}");
                    return;
                }
                continue;
            }
        };
        let read_at = Instant::now();
        handler.on_read(read_at.into_std());
        if n == 0 {
            if !inbuf.is_empty() {
                warn!(peer, listener = kind, bytes = inbuf.len(), "{kind} connection closed in the middle of a frame");
            }
            return;
        }
        let mut close_reason = None;
        let mut completed = false;
        loop {
            match handler.handle_next(&mut inbuf, &mut out).await {
                Ok(true) => completed = true,
                Ok(false) => break,
                Err(e) => {
                    close_reason = Some(e);
                    break;
                }
            }
            if out.len() >= MAX_PENDING_REPLY_BYTES
                && let Err(e) = write_out(&mut stream, &mut out, limits, &stats).await
            {
                debug!(peer, listener = kind, "{kind} write error: {e}");
                return;
            }
        }
        handler.on_handled(Instant::now().into_std());
        if !out.is_empty()
            && let Err(e) = write_out(&mut stream, &mut out, limits, &stats).await
        {
            debug!(peer, listener = kind, "{kind} write error: {e}");
            return;
        }
        if let Some(e) = close_reason {
            if H::logged(&e) {
                debug!(peer, listener = kind, "closing {kind} connection: {e}");
            } else {
                warn!(peer, listener = kind, "closing {kind} connection: {e}");
            }
            return;
        }
        // Timed from now, not from `read_at`: handling (a PUT waiting for
        // room, a reply written to a slow reader) may have taken longer than
        // the frame timeout, and the rest of a frame left in the buffer is
        // then due from now on, not overdue already.
        clock.on_read(Instant::now(), completed, !inbuf.is_empty());
        if inbuf.is_empty() && inbuf.capacity() > SHRINK_ABOVE {
            inbuf = BytesMut::with_capacity(READ_BUF);
        }
        if out.capacity() > SHRINK_ABOVE {
            out = BytesMut::new();
        }
    }
}

/// Writes, flushes and clears `out`; a peer that does not take it within
/// the idle timeout is given up on, as one that sends nothing would be.
/// Flushing matters for TLS, which holds written bytes until flushed.
async fn write_out<W: AsyncWrite + Unpin>(
    wr: &mut W,
    out: &mut BytesMut,
    limits: Limits,
    stats: &crate::counters::ListenerStats,
) -> std::io::Result<()> {
    let write = async {
        wr.write_all(out).await?;
        wr.flush().await
    };
    tokio::pin!(write);
    // Most writes complete at once (the socket buffer has room): only a
    // write that must wait is timed, so the common case arms no timer.
    match futures_util::FutureExt::now_or_never(write.as_mut()) {
        Some(r) => r?,
        None => match tokio::time::timeout(limits.idle_timeout, write).await {
            Ok(r) => r?,
            Err(_) => return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "peer not reading replies")),
        },
    }
    stats.sent.fetch_add(out.len() as u64, std::sync::atomic::Ordering::Relaxed);
    out.clear();
    Ok(())
}

/// What a connection's wait for bytes is timed against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiting {
    /// Any bytes at all ([`Limits::idle_timeout`]).
    Idle,
    /// The rest of a frame that has begun ([`Limits::frame_timeout`]).
    RestOfFrame,
}

/// When a connection's wait for bytes ends: pure, time passed in.
#[derive(Debug)]
struct ReadClock {
    limits: Limits,
    last_read: Instant,
    /// When the frame that is partly in the buffer began to arrive.
    frame_started: Option<Instant>,
}

impl ReadClock {
    fn new(limits: Limits, now: Instant) -> Self {
        ReadClock { limits, last_read: now, frame_started: None }
    }

    /// Bytes arrived at `now` and were handled: `completed` if at least one
    /// whole frame was taken, `partial` if bytes of an unfinished frame are
    /// left. Only a completed frame restarts the frame deadline, so bytes
    /// that trickle in do not.
    fn on_read(&mut self, now: Instant, completed: bool, partial: bool) {
        self.last_read = now;
        self.frame_started = match self.frame_started {
            _ if !partial => None,
            Some(started) if !completed => Some(started),
            _ => Some(now),
        };
    }

    /// When to give up waiting, and for what.
    fn deadline(&self) -> (Instant, Waiting) {
        let idle = self.last_read + self.limits.idle_timeout;
        match self.frame_started {
            Some(started) if started + self.limits.frame_timeout < idle => {
                (started + self.limits.frame_timeout, Waiting::RestOfFrame)
            }
            _ => (idle, Waiting::Idle),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { idle_timeout: Duration::from_secs(300), frame_timeout: Duration::from_secs(10) };

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_quiet_connection_times_out_when_idle() {
        let t0 = Instant::now();
        let mut c = ReadClock::new(LIMITS, t0);
        assert_eq!(c.deadline(), (t0 + secs(300), Waiting::Idle));
        c.on_read(t0 + secs(7), true, false);
        assert_eq!(c.deadline(), (t0 + secs(307), Waiting::Idle));
    }

    #[test]
    fn a_trickled_frame_keeps_its_first_deadline() {
        let t0 = Instant::now();
        let mut c = ReadClock::new(LIMITS, t0);
        c.on_read(t0 + secs(1), false, true);
        for s in 2..10 {
            c.on_read(t0 + secs(s), false, true);
            assert_eq!(c.deadline(), (t0 + secs(11), Waiting::RestOfFrame));
        }
    }

    #[test]
    fn a_completed_frame_restarts_the_frame_deadline() {
        let t0 = Instant::now();
        let mut c = ReadClock::new(LIMITS, t0);
        c.on_read(t0, false, true);
        // The frame completes and the next one begins in the same read.
        c.on_read(t0 + secs(5), true, true);
        assert_eq!(c.deadline(), (t0 + secs(15), Waiting::RestOfFrame));
        c.on_read(t0 + secs(6), true, false);
        assert_eq!(c.deadline(), (t0 + secs(306), Waiting::Idle));
    }

    /// Requests of four bytes, each answered "OK"; "SLOW" takes `delay`.
    struct Slow {
        delay: Duration,
    }

    impl Handler for Slow {
        type Error = String;

        async fn handle_next(&mut self, inbuf: &mut BytesMut, out: &mut BytesMut) -> Result<bool, String> {
            if inbuf.len() < 4 {
                return Ok(false);
            }
            if &inbuf.split_to(4)[..] == b"SLOW" {
                tokio::time::sleep(self.delay).await;
            }
            out.extend_from_slice(b"OK");
            Ok(true)
        }
    }

    #[tokio::test]
    async fn the_rest_of_a_frame_is_due_from_when_handling_ended() {
        let limits = Limits { idle_timeout: secs(60), frame_timeout: secs(1) };
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (_stop, shutdown) = watch::channel(false);
        let server = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let stats = crate::counters::ListenerStats::new("test");
            serve_connection(s, None, stats, Slow { delay: Duration::from_millis(1500) }, limits, shutdown).await;
        });
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        // A slow request and half of the next, in one read.
        c.write_all(b"SLOWpi").await.unwrap();
        let mut reply = [0u8; 2];
        c.read_exact(&mut reply).await.unwrap();
        // Handling took longer than the frame timeout; the rest comes well
        // within it of the reply.
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.write_all(b"ng").await.unwrap();
        let got = tokio::time::timeout(secs(10), c.read_exact(&mut reply)).await.expect("an answer or a close");
        assert!(got.is_ok() && &reply == b"OK", "the connection was closed under a frame still due: {got:?}");
        drop(c);
        server.await.unwrap();
    }

    #[test]
    fn the_earlier_deadline_wins() {
        let limits = Limits { idle_timeout: secs(2), frame_timeout: secs(10) };
        let t0 = Instant::now();
        let mut c = ReadClock::new(limits, t0);
        c.on_read(t0, false, true);
        assert_eq!(c.deadline(), (t0 + secs(2), Waiting::Idle));
    }
}
