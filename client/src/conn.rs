//! One pipelined connection: any number of requests in flight, matched to
//! replies by id, replies in any order. Senders encode into the
//! connection's [`Outbox`], which a writer task writes whole; a reader task
//! dispatches replies.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::BytesMut;
use dmkv_common::frame::{Decoder, FrameError};
use dmkv_common::limits::DEFAULT_MAX_FRAME_LEN;
use dmkv_common::proto::{Response, request::Op};
use dmkv_common::request::Body;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use crate::error::{ClientError, ConnectReason};
use crate::outbox::{Outbox, Push, write_loop};
use crate::tls::Connector;

const READ_BUF: usize = 64 * 1024;

/// Waiters for replies, by request id.
pub(crate) type PendingMap<T> = Arc<Mutex<HashMap<u64, Waiter<T>, IdHash>>>;

/// Whoever waits for a reply, and until when the connection's watchdog
/// keeps them waiting (`None`: the waiter times itself).
pub(crate) struct Waiter<T> {
    pub tx: oneshot::Sender<T>,
    pub deadline: Option<tokio::time::Instant>,
}

/// How often a connection's watchdog looks for requests past their
/// deadline: how late at most a watched request learns it timed out.
/// One sweep per connection per tick replaces a timer per request.
pub(crate) const WATCHDOG_TICK: Duration = Duration::from_millis(50);

/// Hashes request ids, which are distinct counters chosen by this client
/// (not by a peer, so nobody can aim collisions at the map): a multiply
/// spreads them, where SipHash would cost more than the rest of a lookup.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHash;

/// The hasher of [`IdHash`].
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl std::hash::BuildHasher for IdHash {
    type Hasher = IdHasher;
    fn build_hasher(&self) -> IdHasher {
        IdHasher(0)
    }
}

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
type Pending = PendingMap<Response>;

/// A connection to a server's RPC port.
pub struct Conn {
    outbox: Arc<Outbox>,
    pending: Pending,
    next_id: AtomicU64,
    closed: Arc<AtomicBool>,
    /// The largest frame sent or accepted: the client's ceiling until the
    /// server's HELLO reply says its own ([`Conn::learn_frame_limit`]).
    /// Shared with the reader's decoder.
    max_frame: Arc<AtomicUsize>,
    /// Why the reader stopped, set before any waiter is woken.
    end: Arc<OnceLock<ReadEnd>>,
    /// Wakes the watchdog when a watched request is sent.
    watched: Arc<tokio::sync::Notify>,
}

/// How a connection's reader stopped: what the peer sent last (the start
/// of the bytes no reply was decoded from) and what was wrong with it.
/// Tells a peer that is no dmkv server (or speaks TLS) from one that hung up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ReadEnd {
    /// Up to [`END_HEAD`] bytes left undecoded.
    pub head: Vec<u8>,
    /// The decoder's complaint; `None` when the peer closed (or the read
    /// failed) with no bad frame.
    pub error: Option<String>,
}

/// Bytes of an undecodable reply kept for diagnosis.
const END_HEAD: usize = 16;

/// A request that was sent and whose reply has not been awaited yet.
pub struct InFlight {
    id: u64,
    rx: oneshot::Receiver<Response>,
    pending: Pending,
}

impl InFlight {
    /// Waits for the reply, at most `timeout`.
    pub async fn wait(self, timeout: Duration) -> Result<Response, ClientError> {
        self.wait_until(tokio::time::Instant::now() + timeout, timeout).await
    }

    /// Waits for the reply of a request sent with [`Conn::send_until`]:
    /// the connection's watchdog ends the wait at its deadline (at most
    /// [`WATCHDOG_TICK`] late), so no timer is armed per request. A timeout
    /// reports `timeout`.
    pub(crate) async fn wait_watched(
        self,
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Result<Response, ClientError> {
        match self.rx.await {
            Ok(resp) => Ok(resp),
            Err(_) if tokio::time::Instant::now() >= deadline => Err(ClientError::Timeout(timeout)),
            Err(_) => Err(ClientError::ConnectionClosed),
        }
    }

    /// Waits for the reply until `deadline`; a timeout reports `timeout`
    /// (the request's whole budget, of which this wait is the rest).
    pub(crate) async fn wait_until(
        self,
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Result<Response, ClientError> {
        let InFlight { id, rx, pending } = self;
        match tokio::time::timeout_at(deadline, rx).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(_)) => Err(ClientError::ConnectionClosed),
            Err(_) => {
                pending.lock().expect("pending poisoned").remove(&id);
                Err(ClientError::Timeout(timeout))
            }
        }
    }
}

impl Conn {
    /// Connects (over TLS when `tls` is given) and starts the reader and
    /// writer tasks.
    pub async fn connect(
        addr: &str,
        connect_timeout: Duration,
        max_frame: usize,
        tls: Option<&Connector>,
    ) -> Result<Arc<Conn>, ClientError> {
        let stream = dial(addr, connect_timeout, tls)
            .await
            .map_err(|reason| ClientError::Connect { addr: addr.to_string(), reason })?;
        Ok(match stream {
            Dialed::Plain(s) => {
                let (rd, wr) = s.into_split();
                Conn::start(rd, wr, max_frame)
            }
            Dialed::Tls(s) => {
                let (rd, wr) = tokio::io::split(*s);
                Conn::start(rd, wr, max_frame)
            }
        })
    }

    pub(crate) fn start(
        rd: impl AsyncRead + Unpin + Send + 'static,
        wr: impl AsyncWrite + Unpin + Send + 'static,
        max_frame: usize,
    ) -> Arc<Conn> {
        let outbox = Arc::new(Outbox::default());
        let pending: Pending = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        tokio::spawn(write_loop(wr, Arc::clone(&outbox), Arc::clone(&closed)));
        let watched = Arc::new(tokio::sync::Notify::new());
        tokio::spawn(watchdog(Arc::downgrade(&pending), Arc::clone(&closed), Arc::clone(&watched)));
        let max_frame = Arc::new(AtomicUsize::new(max_frame));
        let limit = Arc::clone(&max_frame);
        let end: Arc<OnceLock<ReadEnd>> = Arc::default();
        let record = Arc::clone(&end);
        tokio::spawn(read_loop(
            rd,
            Arc::clone(&pending),
            Arc::clone(&closed),
            move |buf: &mut BytesMut| {
                let decoder = Decoder::new(limit.load(Ordering::Relaxed));
                let Some(body) = decoder.next_frame(buf).map_err(|e| e.to_string())? else { return Ok(None) };
                // A GET's reply, the common one, skips prost's generic decode.
                let r = dmkv_common::request::decode_response(body)
                    .map_err(|e| FrameError::Malformed(e.to_string()).to_string())?;
                Ok(Some((r.id, r)))
            },
            move |rest: &[u8], error: Option<String>| {
                let head = rest[..rest.len().min(END_HEAD)].to_vec();
                let set = record.set(ReadEnd { head, error }).is_ok();
                debug_assert!(set, "a reader ends once");
            },
        ));
        Arc::new(Conn { outbox, pending, next_id: AtomicU64::new(1), closed, max_frame, end, watched })
    }

    /// Takes the server's frame limit from its HELLO reply (`server`; 0
    /// from a server that does not say): from now on the connection sends
    /// and accepts frames up to the smaller of it and the client's
    /// `ceiling`, so a client need not be configured to match the server.
    pub(crate) fn learn_frame_limit(&self, server: u32, ceiling: usize) {
        let server = match usize::try_from(server) {
            Ok(0) | Err(_) => DEFAULT_MAX_FRAME_LEN,
            Ok(n) => n,
        };
        self.max_frame.store(server.min(ceiling), Ordering::Relaxed);
    }

    /// The largest frame this connection sends or accepts now.
    pub fn max_frame(&self) -> usize {
        self.max_frame.load(Ordering::Relaxed)
    }

    /// How the reader stopped, once it has (before waiters are woken).
    pub(crate) fn read_end(&self) -> Option<&ReadEnd> {
        self.end.get()
    }

    /// Whether the connection has failed or been closed by the peer.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Queues a request; its reply is awaited with [`InFlight::wait`]. A
    /// full send queue is waited on for as long as it takes.
    pub async fn send(&self, op: Op) -> Result<InFlight, ClientError> {
        self.send_with(Body::Op(&op), None, false).await
    }

    /// [`Conn::send`] for a request due by `deadline`: a full send queue is
    /// waited on until then, and a timeout reports `timeout`.
    pub(crate) async fn send_by(
        &self,
        op: Op,
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Result<InFlight, ClientError> {
        self.send_with(Body::Op(&op), Some((deadline, timeout)), false).await
    }

    /// Queues a request whose wait the connection's watchdog ends at
    /// `deadline` (a full send queue is waited on until then too); its reply
    /// is awaited with [`InFlight::wait_watched`]. A timeout reports `timeout`.
    pub(crate) async fn send_until(
        &self,
        body: Body<'_>,
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Result<InFlight, ClientError> {
        let sent = self.send_with(body, Some((deadline, timeout)), true).await;
        self.watched.notify_one();
        sent
    }

    /// [`Conn::send_until`] without an await: `Ok(None)` when the send
    /// queue is full (nothing was queued; wait with `send_until`). The
    /// common case, room in the queue, then costs no future of its own.
    pub(crate) fn try_send_until(
        &self,
        body: Body<'_>,
        deadline: tokio::time::Instant,
    ) -> Result<Option<InFlight>, ClientError> {
        if self.is_closed() {
            return Err(ClientError::ConnectionClosed);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let max = self.max_frame();
        let (otx, orx) = oneshot::channel();
        // As in `send_with`: the waiter is in place before the frame is.
        self.pending.lock().expect("pending poisoned").insert(id, Waiter { tx: otx, deadline: Some(deadline) });
        let pushed = self.outbox.try_push(|b: &mut BytesMut| body.encode_frame(id, max, b));
        let failed = match pushed {
            Ok(Push::Queued) if !self.is_closed() => None,
            Ok(Push::Queued | Push::Closed) => Some(Some(ClientError::ConnectionClosed)),
            Ok(Push::Full) => Some(None),
            Err(_) => Some(Some(ClientError::RequestTooLarge { len: body.encoded_len(id), max })),
        };
        if let Some(error) = failed {
            self.pending.lock().expect("pending poisoned").remove(&id);
            return error.map_or(Ok(None), Err);
        }
        self.watched.notify_one();
        Ok(Some(InFlight { id, rx: orx, pending: Arc::clone(&self.pending) }))
    }

    /// Queues `body`; `due` bounds the wait for room in the send queue, and
    /// `watched` hands the reply's wait to the watchdog, ended at its deadline.
    async fn send_with(
        &self,
        body: Body<'_>,
        due: Option<(tokio::time::Instant, Duration)>,
        watched: bool,
    ) -> Result<InFlight, ClientError> {
        if self.is_closed() {
            return Err(ClientError::ConnectionClosed);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let max = self.max_frame();
        let (otx, orx) = oneshot::channel();
        let deadline = due.map(|(d, _)| d).filter(|_| watched);
        // The waiter is in place before the request can be written, so
        // the reader always finds it.
        self.pending.lock().expect("pending poisoned").insert(id, Waiter { tx: otx, deadline });
        let queued = self.queue(body, id, max, due).await;
        if let Err(e) = queued {
            self.pending.lock().expect("pending poisoned").remove(&id);
            return Err(e);
        }
        // The reader may have failed between the check above and the insert.
        if self.is_closed() {
            self.pending.lock().expect("pending poisoned").remove(&id);
            return Err(ClientError::ConnectionClosed);
        }
        Ok(InFlight { id, rx: orx, pending: Arc::clone(&self.pending) })
    }

    /// Encodes `body` as request `id` into the outbox; a full one is
    /// waited on (until `due`'s deadline, if given).
    async fn queue(
        &self,
        body: Body<'_>,
        id: u64,
        max: usize,
        due: Option<(tokio::time::Instant, Duration)>,
    ) -> Result<(), ClientError> {
        let encode = |b: &mut BytesMut| body.encode_frame(id, max, b);
        let too_large = |_| ClientError::RequestTooLarge { len: body.encoded_len(id), max };
        // Room is the common case, and takes no wait at all.
        match self.outbox.try_push(encode).map_err(too_large)? {
            Push::Queued => return Ok(()),
            Push::Closed => return Err(ClientError::ConnectionClosed),
            Push::Full => {}
        }
        let wait = async {
            loop {
                let room = self.outbox.room();
                tokio::pin!(room);
                // Registered before trying again: a drain in between wakes it.
                room.as_mut().enable();
                match self.outbox.try_push(encode).map_err(too_large)? {
                    Push::Queued => return Ok(()),
                    Push::Closed => return Err(ClientError::ConnectionClosed),
                    Push::Full => room.await,
                }
            }
        };
        match due {
            None => wait.await,
            Some((deadline, timeout)) => {
                tokio::time::timeout_at(deadline, wait).await.unwrap_or(Err(ClientError::Timeout(timeout)))
            }
        }
    }
}

impl Drop for Conn {
    /// The writer writes what is queued and stops (replies still awaited
    /// end at the watchdog or their own timeout).
    fn drop(&mut self) {
        self.outbox.close();
    }
}

/// A connected stream, plain or TLS.
pub(crate) enum Dialed {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

/// Connects to `addr` and runs the TLS handshake if `tls` is given, all
/// within `timeout`.
pub(crate) async fn dial(addr: &str, timeout: Duration, tls: Option<&Connector>) -> Result<Dialed, ConnectReason> {
    let work = async {
        let stream = TcpStream::connect(addr).await.map_err(|e| ConnectReason::io(&e))?;
        let _ = stream.set_nodelay(true);
        match tls {
            None => Ok(Dialed::Plain(stream)),
            Some(c) => {
                c.connect(stream).await.map(|s| Dialed::Tls(Box::new(s))).map_err(|e| ConnectReason::Tls(e.to_string()))
            }
        }
    };
    tokio::time::timeout(timeout, work).await.unwrap_or(Err(ConnectReason::TimedOut(timeout)))
}

/// Ends the waits of requests past their deadline (dropping their
/// senders, which their waiters read as a timeout), every
/// [`WATCHDOG_TICK`] while any are watched; sleeps while none are. Stops
/// once the connection is closed and no watched request is left.
async fn watchdog<T>(
    pending: std::sync::Weak<Mutex<HashMap<u64, Waiter<T>, IdHash>>>,
    closed: Arc<AtomicBool>,
    watched: Arc<tokio::sync::Notify>,
) {
    loop {
        let any = {
            let Some(pending) = pending.upgrade() else { return };
            let now = tokio::time::Instant::now();
            let mut p = pending.lock().expect("pending poisoned");
            p.retain(|_, w| w.deadline.is_none_or(|d| d > now));
            p.values().any(|w| w.deadline.is_some())
        };
        // A closed connection may still have watched waiters: a dropped
        // `Conn` stops its writer while replies are awaited, and a peer that
        // never answers nor closes would keep them waiting forever.
        if closed.load(Ordering::Acquire) && !any {
            return;
        }
        if any {
            tokio::time::sleep(WATCHDOG_TICK).await;
        } else {
            // A permit stored by a send since the sweep wakes this at once.
            tokio::select! {
                _ = watched.notified() => {}
                // The connection may close with nothing watched.
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }
}

/// Reads replies until the peer closes or sends something `next` rejects,
/// handing each `(id, reply)` to whoever waits for that id; then marks the
/// connection closed and wakes every waiter. Shared by every pipelined
/// connection; `next` takes one complete reply off the buffer, if any.
/// Before anyone is woken, `on_end` gets the bytes left undecoded and
/// `next`'s complaint, if that is why it stopped.
pub(crate) async fn read_loop<T>(
    mut rd: impl AsyncRead + Unpin,
    pending: PendingMap<T>,
    closed: Arc<AtomicBool>,
    mut next: impl FnMut(&mut BytesMut) -> Result<Option<(u64, T)>, String>,
    on_end: impl FnOnce(&[u8], Option<String>),
) {
    let mut buf = BytesMut::with_capacity(READ_BUF);
    let mut bad = None;
    'outer: loop {
        if buf.capacity() - buf.len() < READ_BUF / 4 {
            buf.reserve(READ_BUF);
        }
        match rd.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        loop {
            match next(&mut buf) {
                Ok(Some((id, reply))) => {
                    let tx = pending.lock().expect("pending poisoned").remove(&id).map(|w| w.tx);
                    // A reply nobody waits for (timed out) is dropped.
                    if let Some(tx) = tx {
                        let _ = tx.send(reply);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!("closing connection: bad reply from server: {e}");
                    bad = Some(e);
                    break 'outer;
                }
            }
        }
    }
    on_end(&buf, bad);
    closed.store(true, Ordering::Release);
    // Dropping the senders wakes every waiter with "connection closed".
    pending.lock().expect("pending poisoned").clear();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::SEND_QUEUE;
    use dmkv_common::proto;

    /// A peer that takes requests and never answers.
    async fn silent_peer() -> (String, tokio::task::JoinHandle<()>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let h = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut sink = [0u8; 4096];
            while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
        });
        (addr, h)
    }

    /// A peer that takes requests and never answers nor closes, even once
    /// the client has stopped writing.
    async fn stuck_peer() -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut sink = [0u8; 4096];
            while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
            std::future::pending::<()>().await;
            drop(s);
        });
        addr
    }

    #[tokio::test]
    async fn watched_requests_time_out_after_their_connection_is_dropped() {
        let addr = stuck_peer().await;
        let conn = Conn::connect(&addr, Duration::from_secs(5), 1 << 20, None).await.unwrap();
        let timeout = Duration::from_millis(200);
        let deadline = tokio::time::Instant::now() + timeout;
        let mut sent = Vec::new();
        for _ in 0..3 {
            let get = Op::Get(proto::Get { key: bytes::Bytes::from_static(b"k") });
            sent.push(conn.send_until(Body::Op(&get), deadline, timeout).await.unwrap());
        }
        // As a pool slot replaced for congestion drops its connection: the
        // writer stops and marks it closed while the replies are awaited.
        drop(conn);
        let all = futures_util::future::join_all(sent.into_iter().map(|s| s.wait_watched(deadline, timeout)));
        let waits = tokio::time::timeout(Duration::from_secs(10), all).await.expect("the watchdog ended the waits");
        for w in waits {
            assert!(matches!(w, Err(ClientError::Timeout(t)) if t == timeout), "{w:?}");
        }
    }

    #[tokio::test]
    async fn a_full_send_queue_is_waited_on_only_until_the_deadline() {
        // A peer that never reads: the socket's buffers fill, the writer
        // blocks, and the send queue fills behind it.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            std::future::pending::<()>().await;
            drop(s);
        });
        let conn = Conn::connect(&addr, Duration::from_secs(5), 1 << 20, None).await.unwrap();
        let big = bytes::Bytes::from(vec![b'v'; 512 * 1024]);
        for _ in 0..64 {
            let put =
                Op::Put(proto::Put { key: bytes::Bytes::from_static(b"k"), value: big.clone(), ..Default::default() });
            conn.send(put).await.unwrap();
        }
        let timeout = Duration::from_millis(200);
        let fill = async {
            // Bounded: the queue holds SEND_QUEUE requests.
            for n in 0..4 * SEND_QUEUE {
                let deadline = tokio::time::Instant::now() + timeout;
                let get = Op::Get(proto::Get { key: bytes::Bytes::from_static(b"k") });
                if let Err(e) = conn.send_until(Body::Op(&get), deadline, timeout).await {
                    return (n, e);
                }
            }
            panic!("the send queue never filled");
        };
        let (n, e) =
            tokio::time::timeout(Duration::from_secs(20), fill).await.expect("a send waited past its deadline");
        assert!(matches!(e, ClientError::Timeout(t) if t == timeout), "after {n} sends: {e:?}");
    }

    #[tokio::test]
    async fn a_send_without_an_await_leaves_no_trace_when_it_cannot_queue() {
        // A peer that never reads: the send queue fills.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let peer = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            std::future::pending::<()>().await;
            drop(s);
        });
        let conn = Conn::connect(&addr, Duration::from_secs(5), 1 << 20, None).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let big = vec![b'v'; 2 << 20];
        let Err(e) = conn.try_send_until(Body::Put { key: b"k", value: &big, write_id: None }, deadline) else {
            panic!("a request past the frame limit was queued")
        };
        assert!(matches!(e, ClientError::RequestTooLarge { max, .. } if max == 1 << 20), "{e:?}");
        assert!(conn.pending.lock().unwrap().is_empty(), "a refused request left its waiter");
        let value = vec![b'v'; 512 * 1024];
        let mut sent = Vec::new();
        let full = loop {
            assert!(sent.len() < 64 + 4 * SEND_QUEUE, "the send queue never filled");
            match conn.try_send_until(Body::Put { key: b"k", value: &value, write_id: None }, deadline) {
                Ok(Some(s)) => sent.push(s),
                Ok(None) => break sent.len(),
                Err(e) => panic!("{e:?}"),
            }
        };
        assert_eq!(conn.pending.lock().unwrap().len(), full, "a full queue left a waiter behind");
        peer.abort();
        conn.outbox.close();
        let Err(e) = conn.try_send_until(Body::Get { key: b"k" }, deadline) else {
            panic!("a closed connection queued a request")
        };
        assert!(matches!(e, ClientError::ConnectionClosed), "{e:?}");
        assert_eq!(conn.pending.lock().unwrap().len(), full, "a closed queue left a waiter behind");
    }

    #[tokio::test]
    async fn the_watchdog_times_out_watched_requests_and_forgets_them() {
        let (addr, _peer) = silent_peer().await;
        let conn = Conn::connect(&addr, Duration::from_secs(5), 1 << 20, None).await.unwrap();
        let timeout = Duration::from_millis(200);
        let start = tokio::time::Instant::now();
        let deadline = start + timeout;
        let get = || Op::Get(proto::Get { key: bytes::Bytes::from_static(b"k") });
        let all = futures_util::future::join_all((0..3).map(|_| async {
            conn.send_until(Body::Op(&get()), deadline, timeout).await.unwrap().wait_watched(deadline, timeout).await
        }));
        // Without the watchdog these waits never end.
        let waits = tokio::time::timeout(Duration::from_secs(10), all).await.expect("the watchdog ended the waits");
        let took = start.elapsed();
        for w in waits {
            assert!(matches!(w, Err(ClientError::Timeout(t)) if t == timeout), "{w:?}");
        }
        assert!(took >= timeout, "ended before its deadline: {took:?}");
        assert!(took < timeout + 10 * WATCHDOG_TICK, "ended long after its deadline: {took:?}");
        assert!(conn.pending.lock().unwrap().is_empty(), "timed-out waiters are forgotten");
        assert!(!conn.is_closed(), "a timeout leaves the connection open");
    }
}
