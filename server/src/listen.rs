//! The accept loop every listener shares: RPC and the engine (TCP), the
//! shared-memory handoff (Unix socket).
//!
//! Each listener serves at most a fixed number of connections; at the cap
//! it stops accepting, so further connections wait in the kernel's accept
//! queue instead of costing the server memory and descriptors. Accept
//! errors that come from the server's own limits (out of descriptors or
//! memory) do not go away by retrying at once, so the loop backs off; the
//! policy is [`AcceptBackoff`], pure code with time passed in.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

/// First pause after an accept error caused by the server's resources.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(10);
/// Longest pause between accept attempts while such errors last.
pub const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// At most one warning about failing accepts per listener per this long;
/// it counts the errors since the previous one.
pub const ACCEPT_WARN_INTERVAL: Duration = Duration::from_secs(10);
/// Largest connection cap a listener takes (the semaphore's permits are
/// bounded, and no host serves more sockets than this usefully).
pub const MAX_CONNECTION_CAP: usize = 1 << 20;

/// A listening socket the accept loop can drive.
///
/// Only the raw accept lives here: a handshake (TLS, authentication)
/// belongs in the per-connection future, where a slow peer holds up only
/// its own connection and not the accept loop.
pub trait Listener: Send + 'static {
    /// What one accept yields.
    type Conn: Send + 'static;

    /// Accepts the next connection.
    fn accept(&self) -> impl Future<Output = io::Result<Self::Conn>> + Send;
}

impl Listener for TcpListener {
    type Conn = (TcpStream, SocketAddr);

    fn accept(&self) -> impl Future<Output = io::Result<Self::Conn>> + Send {
        TcpListener::accept(self)
    }
}

/// A TCP listener whose connections leave its runtime's reactor as they
/// are accepted, to be registered (`TcpStream::from_std`) on the runtime
/// that serves them: a [`crate::workers::Workers`] thread.
pub struct Rehomed(pub TcpListener);

impl Listener for Rehomed {
    type Conn = (std::net::TcpStream, SocketAddr);

    async fn accept(&self) -> io::Result<Self::Conn> {
        let (stream, peer) = self.0.accept().await?;
        Ok((stream.into_std()?, peer))
    }
}

/// Serves a [`Rehomed`] connection: registers `stream` with the runtime
/// polling this future (its worker's) and hands it to `serve`. A socket
/// that cannot be registered is closed, with a warning naming `kind`.
pub async fn serve_rehomed<Fut: Future<Output = ()>>(
    kind: &str,
    stream: std::net::TcpStream,
    serve: impl FnOnce(TcpStream) -> Fut,
) {
    match TcpStream::from_std(stream) {
        Ok(s) => serve(s).await,
        Err(e) => warn!("{kind}: cannot serve an accepted connection: {e}"),
    }
}

impl Listener for UnixListener {
    type Conn = UnixStream;

    async fn accept(&self) -> io::Result<UnixStream> {
        UnixListener::accept(self).await.map(|(s, _)| s)
    }
}

/// Accepts connections on `listener` until `shutdown` turns true (or its
/// sender is gone), running `handle(conn)` as a task per connection with
/// at most `max_connections` at once. `stats` names the listener in logs
/// and counts its connections.
///
/// Returns the connections still running, for the caller to drain or
/// abort; the listener is closed by then.
pub async fn serve<L, F, Fut>(
    listener: L,
    stats: Arc<crate::counters::ListenerStats>,
    max_connections: usize,
    shutdown: watch::Receiver<bool>,
    handle: F,
) -> JoinSet<()>
where
    L: Listener,
    F: FnMut(L::Conn) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    serve_placed(listener, stats, max_connections, shutdown, None, handle).await
}

/// [`serve`], with each connection's task on the next of `workers`'
/// threads (its socket registered there: see [`Rehomed`]).
pub async fn serve_on<F, Fut>(
    listener: Rehomed,
    stats: Arc<crate::counters::ListenerStats>,
    max_connections: usize,
    shutdown: watch::Receiver<bool>,
    workers: &crate::workers::Workers,
    handle: F,
) -> JoinSet<()>
where
    F: FnMut((std::net::TcpStream, SocketAddr)) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    serve_placed(listener, stats, max_connections, shutdown, Some(workers), handle).await
}

async fn serve_placed<L, F, Fut>(
    listener: L,
    stats: Arc<crate::counters::ListenerStats>,
    max_connections: usize,
    mut shutdown: watch::Receiver<bool>,
    workers: Option<&crate::workers::Workers>,
    mut handle: F,
) -> JoinSet<()>
where
    L: Listener,
    F: FnMut(L::Conn) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let kind = stats.name;
    assert!((1..=MAX_CONNECTION_CAP).contains(&max_connections), "{kind}: connection cap {max_connections}");
    let permits = Arc::new(Semaphore::new(max_connections));
    let mut conns = JoinSet::new();
    let mut backoff = AcceptBackoff::default();
    'accept: loop {
        // At the cap nothing is accepted: the kernel's queue holds the rest.
        let permit = tokio::select! {
            p = Arc::clone(&permits).acquire_owned() => p.expect("the semaphore is never closed"),
            _ = stopped(&mut shutdown) => break,
        };
        let conn = loop {
            let accepted = tokio::select! {
                r = listener.accept() => r,
                _ = stopped(&mut shutdown) => break 'accept,
            };
            match accepted {
                Ok(conn) => {
                    if let Some(errors) = backoff.on_accept() {
                        info!("{kind}: accepting again after {errors} failed accepts");
                    }
                    break conn;
                }
                // The peer's doing (it reset before we accepted): the next
                // connection in the queue is unaffected.
                Err(e) if is_per_connection(&e) => debug!("{kind}: accept: {e}"),
                Err(e) => {
                    let (pause, report) = backoff.on_error(Instant::now());
                    if let Some(n) = report {
                        warn!("{kind}: {n} failed accepts since the last warning, latest: {e}; pausing accepts");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = stopped(&mut shutdown) => break 'accept,
                    }
                }
            }
        };
        let conn = handle(conn);
        stats.accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        stats.open.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let open = Arc::clone(&stats);
        // Made before the task and moved into it: counted closed also when
        // the task is aborted at shutdown, even before its first poll.
        let closed = OnDrop(move || {
            open.open.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        });
        let task = async move {
            let _closed = closed;
            conn.await;
            drop(permit);
        };
        match workers {
            Some(w) => conns.spawn_on(task, w.pick()),
            None => conns.spawn(task),
        };
        while conns.try_join_next().is_some() {}
    }
    drop(listener);
    conns
}

/// Runs its closure when dropped.
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Resolves once the server is shutting down.
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    // A dropped sender means the server is gone: stop as well.
    let _ = shutdown.wait_for(|&stop| stop).await;
}

/// Whether an accept error concerns only the connection being accepted
/// (see accept(2): Linux passes pending network errors on the new socket
/// to accept), so the next accept may succeed at once.
pub fn is_per_connection(e: &io::Error) -> bool {
    use io::ErrorKind::*;
    if matches!(e.kind(), ConnectionAborted | ConnectionReset | Interrupted | WouldBlock) {
        return true;
    }
    matches!(
        e.raw_os_error(),
        Some(
            libc::EPROTO
                | libc::ENOPROTOOPT
                | libc::ENETDOWN
                | libc::ENETUNREACH
                | libc::EHOSTDOWN
                | libc::EHOSTUNREACH
                | libc::ENONET
                | libc::EOPNOTSUPP
                | libc::EPERM
        )
    )
}

/// When to retry after accept errors that are not the peer's doing
/// (EMFILE, ENFILE, ENOBUFS, ENOMEM and anything unknown), and when to say
/// so. Retrying those at once would spin a core (the listener stays
/// readable while connections wait) and write a log line per attempt.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    /// The pause after the next error; `None` after a successful accept.
    next_pause: Option<Duration>,
    /// Errors since the last successful accept.
    failing: u64,
    /// Errors not yet counted in a warning.
    unreported: u64,
    /// When the last warning went out.
    last_warn: Option<Instant>,
    /// Whether a warning went out since the last recovery was reported.
    warned: bool,
}

impl AcceptBackoff {
    /// An accept failed at `now`: returns how long to pause, and the
    /// error count to put in a warning if one is due.
    pub fn on_error(&mut self, now: Instant) -> (Duration, Option<u64>) {
        let pause = self.next_pause.unwrap_or(FIRST_BACKOFF);
        self.next_pause = Some((pause * 2).min(MAX_BACKOFF));
        self.failing += 1;
        self.unreported += 1;
        let due = self.last_warn.is_none_or(|at| now.saturating_duration_since(at) >= ACCEPT_WARN_INTERVAL);
        if !due {
            return (pause, None);
        }
        self.last_warn = Some(now);
        self.warned = true;
        (pause, Some(std::mem::take(&mut self.unreported)))
    }

    /// An accept succeeded: the next error starts the schedule over.
    /// Returns the number of errors before it if the failure was warned
    /// about (so the log says it is over, at most once per warning).
    pub fn on_accept(&mut self) -> Option<u64> {
        self.next_pause = None;
        let failing = std::mem::take(&mut self.failing);
        std::mem::take(&mut self.warned).then_some(failing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn pauses_double_up_to_the_cap_and_restart_after_an_accept() {
        let mut b = AcceptBackoff::default();
        let t0 = Instant::now();
        let pauses: Vec<Duration> = (0..10).map(|i| b.on_error(t0 + ms(i)).0).collect();
        let want = [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000].map(ms);
        assert_eq!(pauses, want);
        assert_eq!(b.on_accept(), Some(10));
        assert_eq!(b.on_error(t0 + ms(20)).0, FIRST_BACKOFF);
    }

    #[test]
    fn one_warning_per_interval_counts_the_errors_since_the_last() {
        let mut b = AcceptBackoff::default();
        let t0 = Instant::now();
        assert_eq!(b.on_error(t0).1, Some(1));
        // A minute of failures at the longest pause: one warning per interval.
        let mut t = t0;
        let mut warnings = Vec::new();
        for _ in 0..60 {
            t += MAX_BACKOFF;
            if let (_, Some(n)) = b.on_error(t) {
                warnings.push(n);
            }
        }
        let per_interval = (ACCEPT_WARN_INTERVAL.as_secs_f64() / MAX_BACKOFF.as_secs_f64()) as u64;
        assert_eq!(warnings.len() as u64, 60 / per_interval);
        assert!(warnings.iter().all(|&n| n == per_interval), "{warnings:?}");
        assert_eq!(b.on_accept(), Some(61));
    }

    #[test]
    fn flapping_does_not_warn_per_flap() {
        // Descriptors freed and used up again and again: every accept ends
        // the backoff, but warnings stay one per interval and so do the
        // "accepting again" lines.
        let mut b = AcceptBackoff::default();
        let t0 = Instant::now();
        let (mut warns, mut recoveries) = (0, 0);
        for i in 0..1000 {
            let now = t0 + ms(i * 10);
            warns += usize::from(b.on_error(now).1.is_some());
            recoveries += usize::from(b.on_accept().is_some());
        }
        // 10 s of flapping: the first warning and one an interval later.
        assert_eq!((warns, recoveries), (1, 1));
        assert_eq!(b.on_error(t0 + ms(10_000)).1, Some(1000));
    }

    #[test]
    fn accepts_without_errors_report_nothing() {
        let mut b = AcceptBackoff::default();
        assert_eq!(b.on_accept(), None);
        assert_eq!(b.on_accept(), None);
    }

    #[test]
    fn peer_errors_are_retried_at_once_resource_errors_are_not() {
        let os = io::Error::from_raw_os_error;
        assert!(is_per_connection(&os(libc::ECONNABORTED)));
        assert!(is_per_connection(&os(libc::EPROTO)));
        assert!(is_per_connection(&os(libc::EINTR)));
        for errno in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM, libc::EINVAL] {
            assert!(!is_per_connection(&os(errno)), "errno {errno}");
        }
    }
}
