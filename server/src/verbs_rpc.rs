//! The server's verbs RPC (feature `rdma`): requests and replies as RC
//! SEND/RECV messages, the same frames as on the TCP RPC port.
//!
//! A client opens it over its authenticated RPC connection (VERBS_RPC):
//! the node creates a message queue pair on one of its [`VerbsWorker`]s,
//! grants it credits out of that worker's shared receive queue (refused
//! with BUSY when they do not fit), and serves what arrives on it with the
//! connection's role, through the same request code as the TCP port
//! (`framed::serve_connection` over a [`VerbsStream`]). The queue pair is
//! closed with the connection that opened it, and the other way round.
//!
//! Each worker has one completion queue and one shared receive queue of
//! [`SRQ_DEPTH`] slots; one task per worker sleeps on the completion
//! channel and hands each message to its connection's [`MsgLink`]. A
//! message stays in its receive slot until the connection's request code
//! reads it; the slot is then posted again and its credit owed back to the
//! client (in the next reply's immediate data, or alone once idle).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskCx, Poll, Waker};

use dmkv_common::credit::{DEFAULT_CREDITS, MAX_CREDITS_PER_CONN, ServerCredits, SlotPool};
use dmkv_common::msglink::{Arrival, MsgLink, Outgoing};
use dmkv_verbs::{Endpoint, MsgCompletion, MsgCq, MsgOp, MsgQp, RecvInto, Slot, Srq, VerbsError};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::lock::lock;
use crate::rdma::RdmaDevice;

pub use dmkv_common::msglink::SLOT_BYTES;
/// Receive slots of one worker's shared receive queue.
pub const SRQ_DEPTH: u32 = 1024;
/// Slots never granted: they absorb what arrives past a connection's
/// credits (before it is closed) and a closed connection's late messages.
pub const SRQ_SLACK: u32 = 64;
/// Send slots of one connection: replies in flight at once.
pub const SEND_SLOTS: u32 = 32;
/// Connections one worker serves at most (its completion queue is sized
/// for their send slots).
pub const MAX_CONNS_PER_WORKER: usize = 128;
/// Workers (each a shared receive queue, a completion queue and a task).
pub const WORKERS: usize = 2;
/// How long a closed link stays in its worker before its queue pair is
/// destroyed and its grant goes back: in the error state since its close,
/// every completion of it is in the queue long before, and is reaped with
/// its slot posted again; meanwhile its queue pair number cannot be given
/// to a new link, whose stream a late message could otherwise join.
pub const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(1);
/// Completions one pass of a worker takes before it yields.
const POLL_BUDGET: usize = 256;
/// Shortest sleep of a worker waiting for completions or a credit return.
const MIN_WAIT: std::time::Duration = std::time::Duration::from_millis(1);
/// Longest sleep of a worker with nothing due (a safety net: the reader
/// that frees slots wakes it through `timer`).
const IDLE_WAKE: std::time::Duration = std::time::Duration::from_millis(100);

const _: () = assert!(SRQ_SLACK < SRQ_DEPTH && SEND_SLOTS >= 1 && SLOT_BYTES >= 512);

/// The node's verbs RPC: its workers.
pub struct VerbsRpc {
    workers: Vec<Arc<VerbsWorker>>,
    next: AtomicUsize,
}

/// One shared receive queue, its completion queue and its connections.
pub struct VerbsWorker {
    device: Arc<RdmaDevice>,
    cq: Arc<MsgCq>,
    srq: Arc<Srq>,
    pool: Mutex<SlotPool>,
    conns: Mutex<HashMap<u32, Arc<VerbsConn>>>,
    /// Accepts under way (see [`VerbsRpc::accept`]).
    accepting: AtomicUsize,
    /// Wakes the worker to set its timer for a credit return: a reader
    /// freed slots while the worker slept with no return due.
    timer: tokio::sync::Notify,
}

/// One client's queue pair and link.
pub struct VerbsConn {
    qp: MsgQp,
    worker: Arc<VerbsWorker>,
    state: Mutex<ConnLink>,
}

struct ConnLink {
    /// Once closed: when, and its grant, held until the link is reaped
    /// ([`CLOSE_GRACE`]) so that its late messages are posted again before
    /// the credits are granted anew.
    closed: Option<(std::time::Instant, Option<dmkv_common::credit::Grant>)>,
    /// `None` once closed (its credits are back in the pool).
    link: Option<MsgLink<Slot>>,
    /// Why the link failed, for the reader and the writer.
    failed: Option<String>,
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
}

impl VerbsRpc {
    /// Workers on `device`, each with its task on the current runtime.
    pub fn start(device: &Arc<RdmaDevice>) -> Result<Arc<VerbsRpc>, VerbsError> {
        let mut workers = Vec::with_capacity(WORKERS);
        for _ in 0..WORKERS {
            let ctx = device.context();
            let cqe = SRQ_DEPTH + MAX_CONNS_PER_WORKER as u32 * SEND_SLOTS;
            let w = Arc::new(VerbsWorker {
                device: Arc::clone(device),
                cq: MsgCq::create(ctx, cqe)?,
                srq: Srq::create(ctx, SRQ_DEPTH, SLOT_BYTES)?,
                pool: Mutex::new(
                    SlotPool::new(SRQ_DEPTH, SRQ_SLACK).map_err(|e| VerbsError::InvalidRequest(e.to_string()))?,
                ),
                conns: Mutex::new(HashMap::new()),
                timer: tokio::sync::Notify::new(),
                accepting: AtomicUsize::new(0),
            });
            let events = crate::rdma::watch(&w.cq)
                .map_err(|e| VerbsError::Verb { verb: "epoll_ctl", errno: e.raw_os_error().unwrap_or(libc::EIO) })?;
            tokio::spawn(Arc::clone(&w).run(events));
            workers.push(w);
        }
        Ok(Arc::new(VerbsRpc { workers, next: AtomicUsize::new(0) }))
    }

    /// Accepts a client's queue pair `client` asking for `credits` (0: the
    /// default): the connection and what the client needs back.
    pub fn accept(&self, client: &[u8], credits: u32) -> Result<(Arc<VerbsConn>, Endpoint, u32), Refused> {
        let remote = Endpoint::from_bytes(client).map_err(|e| Refused::Bad(e.to_string()))?;
        let want = if credits == 0 { DEFAULT_CREDITS } else { credits.min(MAX_CREDITS_PER_CONN) };
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len();
        let worker = &self.workers[i];
        // Counted in the map (closed ones until reaped) plus those being
        // accepted now, so concurrent accepts cannot pass the bound together.
        let reserved = worker.accepting.fetch_add(1, Ordering::AcqRel);
        let _unreserve = Unreserve(&worker.accepting);
        if lock(&worker.conns).len() + reserved >= MAX_CONNS_PER_WORKER {
            return Err(Refused::Busy(format!("{MAX_CONNS_PER_WORKER} verbs RPC connections on this worker")));
        }
        let grant = lock(&worker.pool).grant(want).map_err(|e| Refused::Busy(e.to_string()))?;
        let granted = grant.credits();
        let made =
            MsgQp::create(worker.device.context(), &worker.cq, RecvInto::Shared(&worker.srq), SEND_SLOTS, SLOT_BYTES)
                .and_then(|(qp, tx, _)| qp.connect(&remote).map(|()| (qp, tx)));
        let (qp, tx) = match made {
            Ok(m) => m,
            Err(e) => {
                lock(&worker.pool).release(grant);
                return Err(Refused::Bad(format!("verbs RPC queue pair: {e}")));
            }
        };
        let endpoint = qp.endpoint();
        let link = MsgLink::server(ServerCredits::new(grant), SLOT_BYTES, tx);
        let conn = Arc::new(VerbsConn {
            qp,
            worker: Arc::clone(worker),
            state: Mutex::new(ConnLink {
                closed: None,
                link: Some(link),
                failed: None,
                read_waker: None,
                write_waker: None,
            }),
        });
        lock(&worker.conns).insert(conn.qp.qp_num(), Arc::clone(&conn));
        Ok((conn, endpoint, granted))
    }
}

/// Takes back an accept's reservation when the accept ends.
struct Unreserve<'a>(&'a AtomicUsize);

impl Drop for Unreserve<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a VERBS_RPC was refused.
#[derive(Debug)]
pub enum Refused {
    /// No room for its credits or its connection: retry later, or use TCP.
    Busy(String),
    /// A bad endpoint, or the device refused the queue pair.
    Bad(String),
}

/// Nanoseconds on the credit clock.
fn now_ns() -> u64 {
    crate::clock::mono_ns()
}

impl VerbsWorker {
    /// Reaps completions for as long as the node runs.
    async fn run(self: Arc<Self>, events: AsyncFd<std::os::fd::OwnedFd>) {
        let mut done = Vec::with_capacity(POLL_BUDGET);
        loop {
            if let Err(e) = self.cq.arm() {
                tracing::error!("verbs RPC worker stops: {e}");
                return;
            }
            // Completions before the arming raise no event: take them now.
            loop {
                done.clear();
                match self.cq.poll(&mut done, POLL_BUDGET) {
                    Ok(_) => {}
                    Err(e) => {
                        tracing::error!("verbs RPC worker stops: {e}");
                        return;
                    }
                }
                let n = done.len();
                for c in done.drain(..) {
                    self.complete(c);
                }
                if n < POLL_BUDGET {
                    break;
                }
                tokio::task::yield_now().await;
            }
            // At least the timer's granularity: a return due now is sent
            // below, and a zero wait would spin without yielding.
            let wait =
                self.next_return().map(|at| std::time::Duration::from_nanos(at.saturating_sub(now_ns())).max(MIN_WAIT));
            let readable = events.readable();
            let guard = tokio::select! {
                r = readable => Some(r),
                () = self.timer.notified() => None,
                () = tokio::time::sleep(wait.unwrap_or(IDLE_WAKE)) => None,
            };
            match guard {
                Some(Ok(mut g)) => {
                    g.clear_ready();
                    if let Err(e) = self.cq.take_events() {
                        tracing::error!("verbs RPC worker stops: {e}");
                        return;
                    }
                }
                Some(Err(e)) => {
                    tracing::error!("verbs RPC worker stops: {e}");
                    return;
                }
                None => {}
            }
            self.send_returns();
            self.reap();
        }
    }

    fn complete(&self, c: MsgCompletion) {
        let conn = lock(&self.conns).get(&c.qp_num).cloned();
        match (c.op, conn) {
            (MsgOp::Recv { len, imm }, Some(conn)) if c.status.is_ok() => conn.arrived(c.slot, len, imm),
            (MsgOp::Recv { .. }, conn) => {
                // A failed receive (its queue pair broke) or one for a
                // connection gone: the slot goes back to the queue.
                self.repost(vec![c.slot]);
                if let (Some(conn), Err((_, why))) = (conn, c.status) {
                    conn.fail(format!("receive failed: {why}"));
                }
            }
            (MsgOp::Send, Some(conn)) => conn.sent(c.slot, c.status.err().map(|(_, why)| why)),
            // A closed connection's send slots die with its queue pair.
            (MsgOp::Send, None) => {}
        }
    }

    fn repost(&self, slots: Vec<Slot>) {
        if let Err((e, lost)) = self.srq.post(slots) {
            tracing::error!("verbs RPC: {} receive slots lost: {e}", lost.len());
        }
    }

    /// Drops the connections closed [`CLOSE_GRACE`] ago (destroying their
    /// queue pairs) and gives their grants back to the pool.
    fn reap(&self) {
        let mut reaped = Vec::new();
        lock(&self.conns).retain(|_, c| {
            let mut st = lock(&c.state);
            match &mut st.closed {
                Some((at, grant)) if at.elapsed() >= CLOSE_GRACE => {
                    reaped.extend(grant.take());
                    false
                }
                _ => true,
            }
        });
        let mut pool = lock(&self.pool);
        for grant in reaped {
            pool.release(grant);
        }
    }

    /// The earliest time a connection owes an explicit credit return.
    fn next_return(&self) -> Option<u64> {
        lock(&self.conns).values().filter_map(|c| lock(&c.state).link.as_ref().and_then(|l| l.poll_timeout())).min()
    }

    fn send_returns(&self) {
        let conns: Vec<_> = lock(&self.conns).values().cloned().collect();
        let now = now_ns();
        for c in conns {
            c.send_return(now);
        }
    }
}

impl VerbsConn {
    fn arrived(&self, slot: Slot, len: u32, imm: Option<u32>) {
        let mut st = lock(&self.state);
        let Some(link) = st.link.as_mut() else {
            drop(st);
            return self.worker.repost(vec![slot]);
        };
        match link.handle_arrival(slot, len, imm) {
            Ok(Arrival::Queued) => {
                if let Some(w) = st.read_waker.take() {
                    w.wake();
                }
            }
            Ok(Arrival::Spent(slot)) => {
                drop(st);
                self.worker.repost(vec![slot]);
            }
            Err((e, slot)) => {
                drop(st);
                self.worker.repost(vec![slot]);
                tracing::warn!("verbs RPC connection closed: {e}");
                self.fail(e.to_string());
            }
        }
    }

    fn sent(&self, slot: Slot, failed: Option<String>) {
        let mut st = lock(&self.state);
        if let Some(link) = st.link.as_mut() {
            link.handle_sent(slot);
        }
        if let Some(w) = st.write_waker.take() {
            w.wake();
        }
        drop(st);
        if let Some(why) = failed {
            self.fail(format!("send failed: {why}"));
        }
    }

    fn send_return(&self, now: u64) {
        let mut st = lock(&self.state);
        let Some(Outgoing { slot, imm }) = st.link.as_mut().and_then(|l| l.poll_return(now)) else { return };
        if let Err((e, slot)) = self.qp.send(slot, 0, imm) {
            if let Some(link) = st.link.as_mut() {
                link.handle_sent(slot);
            }
            drop(st);
            self.fail(format!("credit return: {e}"));
        }
    }

    /// Whether the link still serves (has not failed nor closed).
    pub fn is_open(&self) -> bool {
        lock(&self.state).link.is_some()
    }

    /// Breaks the link: reads and writes fail from now on, the queue pair
    /// goes to the error state (the client sees its requests fail), and
    /// the credits go back to the pool.
    pub fn fail(&self, why: String) {
        let mut st = lock(&self.state);
        if st.failed.is_none() {
            st.failed = Some(why);
        }
        for w in [st.read_waker.take(), st.write_waker.take()].into_iter().flatten() {
            w.wake();
        }
        let link = st.link.take();
        drop(st);
        let _ = self.qp.fail();
        let Some(link) = link else { return };
        let (unread, credits) = link.close();
        let n = unread.len() as u32;
        self.worker.repost(unread);
        let grant = credits.and_then(|credits| {
            let mut draining = credits.close(0);
            // The unread slots were the only ones held: every other was
            // posted again when it was read.
            let freed = draining.handle_freed(n);
            debug_assert!(freed.is_ok(), "a closed link held more slots than it had unread");
            match draining.finish() {
                Ok(grant) => Some(grant),
                Err(d) => {
                    tracing::error!("verbs RPC: {} slots of a closed connection never came back", d.held());
                    None
                }
            }
        });
        // The connection stays in the worker's map (its queue pair alive,
        // so its number is not reused) until reaped: completions still in
        // the queue find it closed and post their slots again.
        lock(&self.state).closed = Some((std::time::Instant::now(), grant));
    }
}

/// A connection's messages as a byte stream, for `framed`.
pub struct VerbsStream {
    conn: Arc<VerbsConn>,
    freed: Vec<Slot>,
}

impl VerbsStream {
    pub fn new(conn: Arc<VerbsConn>) -> VerbsStream {
        VerbsStream { conn, freed: Vec::new() }
    }
}

impl Drop for VerbsStream {
    fn drop(&mut self) {
        self.conn.fail("the connection ended".into());
    }
}

fn broken(why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionAborted, why.to_string())
}

impl AsyncRead for VerbsStream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut TaskCx<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let conn = &this.conn;
        let mut st = lock(&conn.state);
        if let Some(why) = &st.failed {
            return Poll::Ready(Err(broken(why)));
        }
        let Some(link) = st.link.as_mut() else { return Poll::Ready(Err(broken("closed"))) };
        if !link.readable() {
            st.read_waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let slots = conn.worker.srq.slots();
        let dst = buf.initialize_unfilled();
        let n = link.read(dst, now_ns(), &mut this.freed, |slot, off, into| {
            // A slot read here arrived complete: its bounds were checked
            // against the slot size on arrival.
            let copied = slots.copy_out(slot, off, into);
            debug_assert!(copied.is_ok(), "an arrived slot is the queue's own");
        });
        buf.advance(n);
        // Posted before the lock goes: the credits now owed for these
        // slots must not reach the client before the slots are back.
        let freed = std::mem::take(&mut this.freed);
        conn.worker.repost(freed);
        drop(st);
        // Half a grant owed goes back without waiting for a reply; less
        // waits for one, or for the worker's timer, which learns of it now
        // (a client out of credits sends nothing that would wake it).
        conn.send_return(now_ns());
        conn.worker.timer.notify_one();
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for VerbsStream {
    fn poll_write(self: std::pin::Pin<&mut Self>, cx: &mut TaskCx<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let conn = &self.conn;
        let mut st = lock(&conn.state);
        if let Some(why) = &st.failed {
            return Poll::Ready(Err(broken(why)));
        }
        let Some(link) = st.link.as_mut() else { return Poll::Ready(Err(broken("closed"))) };
        let Some(Outgoing { slot, imm }) = link.take_send() else {
            st.write_waker = Some(cx.waker().clone());
            return Poll::Pending;
        };
        let n = buf.len().min(SLOT_BYTES as usize);
        let sent = match conn.qp.send_slots().copy_in(&slot, &buf[..n]) {
            Ok(()) => conn.qp.send(slot, n as u32, imm),
            Err(e) => Err((e, slot)),
        };
        if let Err((e, slot)) = sent {
            link.handle_sent(slot);
            drop(st);
            conn.fail(format!("send: {e}"));
            return Poll::Ready(Err(broken("send failed")));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: std::pin::Pin<&mut Self>, _: &mut TaskCx<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: std::pin::Pin<&mut Self>, _: &mut TaskCx<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
