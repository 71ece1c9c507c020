//! The client's verbs RPC (feature `rdma`): a pooled RPC connection whose
//! requests and replies travel as RC SEND/RECV messages instead of TCP.
//!
//! It is opened over an authenticated TCP connection (VERBS_RPC), which it
//! keeps: the server serves the queue pair with that connection's role and
//! closes it with that connection. The messages carry the same frames as
//! TCP, so the link is a byte stream under the ordinary [`Conn`] (pipelined
//! requests, replies by id); credits ([`MsgLink`]) decide when a message
//! may go, so the server's shared receive queue never runs dry.
//!
//! One task per link sleeps on the queue pair's completion channel and
//! hands arrivals to the reader and send slots back to the writer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context as TaskCx, Poll, Waker};
use std::time::Duration;

use dmkv_common::credit::ClientCredits;
use dmkv_common::msglink::{Arrival, MsgLink, Outgoing, SLOT_BYTES};
use dmkv_common::proto::{self, request::Op, response::Result as R};
use dmkv_verbs::{Context, Endpoint, MsgCompletion, MsgCq, MsgOp, MsgQp, RecvInto, Slot};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::conn::Conn;

/// Receive slots of one link: replies in flight (a reply of several
/// slots waits in the server's NIC, receiver-not-ready, until read).
pub const RECV_SLOTS: u32 = 64;
/// Send slots of one link.
pub const SEND_SLOTS: u32 = 32;
/// Credits asked of the server.
pub const CREDITS: u32 = dmkv_common::credit::DEFAULT_CREDITS;
/// How often an idle link looks whether its TCP connection is gone.
const CONTROL_CHECK: Duration = Duration::from_millis(500);
/// Longest a link lives on once its connection is dropped, for the
/// replies in flight (a dropped link holds the node's credits).
const LINGER: Duration = Duration::from_secs(2);
/// Completions taken per pass.
const POLL_BUDGET: usize = 128;

static MESSAGES_SENT: AtomicU64 = AtomicU64::new(0);
static LINKS_OPENED: AtomicU64 = AtomicU64::new(0);

/// Messages this process sent over verbs RPC links, and links it opened
/// (so a test can tell requests went over verbs and not over TCP).
pub fn counts() -> (u64, u64) {
    (MESSAGES_SENT.load(Ordering::Relaxed), LINKS_OPENED.load(Ordering::Relaxed))
}

/// The process's RDMA device, opened once.
fn device() -> Result<Arc<Context>, String> {
    static DEVICE: OnceLock<Result<Arc<Context>, String>> = OnceLock::new();
    DEVICE.get_or_init(|| Context::open(None).map_err(|e| format!("no usable RDMA device here: {e}"))).clone()
}

struct Shared {
    qp: MsgQp,
    state: Mutex<LinkState>,
    /// Wakes the completion task when the link is closed from this side.
    closed: tokio::sync::Notify,
}

struct LinkState {
    link: MsgLink<Slot>,
    failed: Option<String>,
    read_waker: Option<Waker>,
    write_waker: Option<Waker>,
}

fn lock(m: &Mutex<LinkState>) -> std::sync::MutexGuard<'_, LinkState> {
    // A panic while holding it leaves counts that are still counts: go on.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn fail(&self, why: String) {
        let mut st = lock(&self.state);
        if st.failed.is_none() {
            st.failed = Some(why);
        }
        for w in [st.read_waker.take(), st.write_waker.take()].into_iter().flatten() {
            w.wake();
        }
        drop(st);
        let _ = self.qp.fail();
        self.closed.notify_one();
    }

    fn complete(&self, c: MsgCompletion) {
        if let Err((_, why)) = &c.status {
            return self.fail(format!("verbs RPC: {why}"));
        }
        let mut st = lock(&self.state);
        match c.op {
            MsgOp::Recv { len, imm } => match st.link.handle_arrival(c.slot, len, imm) {
                Ok(Arrival::Queued) => {
                    if let Some(w) = st.read_waker.take() {
                        w.wake();
                    }
                    // Credits may have come with it.
                    if let Some(w) = st.write_waker.take() {
                        w.wake();
                    }
                }
                Ok(Arrival::Spent(slot)) => {
                    if let Some(w) = st.write_waker.take() {
                        w.wake();
                    }
                    drop(st);
                    if let Err((e, _)) = self.qp.post_recv(vec![slot]) {
                        self.fail(format!("verbs RPC: posting a receive: {e}"));
                    }
                }
                Err((e, _)) => {
                    drop(st);
                    self.fail(format!("verbs RPC: the server broke the link: {e}"));
                }
            },
            MsgOp::Send => {
                st.link.handle_sent(c.slot);
                if let Some(w) = st.write_waker.take() {
                    w.wake();
                }
            }
        }
    }
}

/// Opens a verbs RPC link over `control` (authenticated, HELLO done) and
/// returns it as a connection. `Err` says why not (no device, the server
/// offers none or has no room): the caller stays on TCP.
pub async fn open(control: Arc<Conn>, timeout: Duration) -> Result<Arc<Conn>, String> {
    let ctx = device()?;
    let verbs = |e: dmkv_verbs::VerbsError| format!("verbs RPC: {e}");
    let cq = MsgCq::create(&ctx, RECV_SLOTS + SEND_SLOTS).map_err(verbs)?;
    let own = RecvInto::Own { count: RECV_SLOTS, slot_bytes: SLOT_BYTES };
    let (qp, tx, rx) = MsgQp::create(&ctx, &cq, own, SEND_SLOTS, SLOT_BYTES).map_err(verbs)?;
    qp.post_recv(rx).map_err(|(e, _)| verbs(e))?;
    let op = Op::VerbsRpc(proto::VerbsRpc { endpoint: qp.endpoint().to_bytes().to_vec().into(), credits: CREDITS });
    let reply = control.send(op).await.map_err(|e| e.to_string())?.wait(timeout).await.map_err(|e| e.to_string())?;
    let reply = match crate::error::unwrap(reply).map_err(|e| e.to_string())? {
        R::VerbsRpc(r) => r,
        other => return Err(format!("verbs RPC: unexpected reply {other:?}")),
    };
    if !(512..=SLOT_BYTES).contains(&reply.slot_bytes) {
        return Err(format!("verbs RPC: the server's {} byte slots do not fit this client's", reply.slot_bytes));
    }
    let credits = ClientCredits::new(reply.credits).map_err(|e| format!("verbs RPC: {e}"))?;
    let remote = Endpoint::from_bytes(&reply.endpoint).map_err(verbs)?;
    qp.connect(&remote).map_err(verbs)?;
    let events = watch(&cq).map_err(|e| format!("verbs RPC completion channel: {e}"))?;
    let link = MsgLink::client(credits, reply.slot_bytes, tx);
    let shared = Arc::new(Shared {
        qp,
        state: Mutex::new(LinkState { link, failed: None, read_waker: None, write_waker: None }),
        closed: tokio::sync::Notify::new(),
    });
    let max_frame = control.max_frame();
    tokio::spawn(run(Arc::clone(&shared), cq, events, control));
    LINKS_OPENED.fetch_add(1, Ordering::Relaxed);
    let rd = ReadHalf { shared: Arc::clone(&shared), freed: Vec::new() };
    let wr = WriteHalf { shared, linger: timeout.min(LINGER) };
    Ok(Conn::start(rd, wr, max_frame))
}

fn watch(cq: &MsgCq) -> std::io::Result<AsyncFd<std::os::fd::OwnedFd>> {
    let dup = cq.dup_event_fd()?;
    // SAFETY: `dup` is an open descriptor owned by the AsyncFd for its whole
    // life, and OwnedFd::as_raw_fd always returns that same descriptor.
    unsafe { AsyncFd::register_with_interest(dup, Interest::READABLE) }.map_err(|e| e.into_parts().1)
}

/// Reaps the link's completions until it fails or closes; holds the TCP
/// connection that keeps the server's side open.
async fn run(shared: Arc<Shared>, cq: Arc<MsgCq>, events: AsyncFd<std::os::fd::OwnedFd>, control: Arc<Conn>) {
    let mut done = Vec::with_capacity(POLL_BUDGET);
    loop {
        if lock(&shared.state).failed.is_some() {
            return;
        }
        if let Err(e) = cq.arm() {
            return shared.fail(format!("verbs RPC: {e}"));
        }
        loop {
            done.clear();
            if let Err(e) = cq.poll(&mut done, POLL_BUDGET) {
                return shared.fail(format!("verbs RPC: {e}"));
            }
            let n = done.len();
            for c in done.drain(..) {
                shared.complete(c);
            }
            if n < POLL_BUDGET {
                break;
            }
            tokio::task::yield_now().await;
        }
        tokio::select! {
            r = events.readable() => match r {
                Ok(mut g) => {
                    g.clear_ready();
                    if let Err(e) = cq.take_events() {
                        return shared.fail(format!("verbs RPC: {e}"));
                    }
                }
                Err(e) => return shared.fail(format!("verbs RPC: {e}")),
            },
            () = shared.closed.notified() => {}
            () = tokio::time::sleep(CONTROL_CHECK) => {
                if control.is_closed() {
                    return shared.fail("verbs RPC: its TCP connection closed".into());
                }
            }
        }
    }
}

/// The link's incoming byte stream, for [`Conn`]'s reader.
struct ReadHalf {
    shared: Arc<Shared>,
    freed: Vec<Slot>,
}

/// The link's outgoing byte stream, for [`Conn`]'s writer.
struct WriteHalf {
    shared: Arc<Shared>,
    /// How long replies may still come once the writer is gone.
    linger: Duration,
}

impl Drop for ReadHalf {
    fn drop(&mut self) {
        self.shared.fail("closed".into());
    }
}

impl Drop for WriteHalf {
    /// The connection was dropped (its writer stops with it): as a TCP
    /// half-close lets the replies in flight come, the link lives on for
    /// `linger`, then closes, and the node frees its credits.
    fn drop(&mut self) {
        let (shared, linger) = (Arc::clone(&self.shared), self.linger);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                tokio::time::sleep(linger).await;
                shared.fail("closed by this client".into());
            });
        } else {
            shared.fail("closed by this client".into());
        }
    }
}

fn broken(why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionAborted, why.to_string())
}

impl AsyncRead for ReadHalf {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut TaskCx<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let shared = &this.shared;
        let mut st = lock(&shared.state);
        if let Some(why) = &st.failed {
            return Poll::Ready(Err(broken(why)));
        }
        if !st.link.readable() {
            st.read_waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let Some(slots) = shared.qp.recv_slots() else { return Poll::Ready(Err(broken("no receive slots"))) };
        let dst = buf.initialize_unfilled();
        let n = st.link.read(dst, 0, &mut this.freed, |slot, off, into| {
            let copied = slots.copy_out(slot, off, into);
            debug_assert!(copied.is_ok(), "an arrived slot is the link's own");
        });
        buf.advance(n);
        drop(st);
        let freed = std::mem::take(&mut this.freed);
        if let Err((e, _)) = shared.qp.post_recv(freed) {
            shared.fail(format!("verbs RPC: posting receives: {e}"));
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for WriteHalf {
    fn poll_write(self: std::pin::Pin<&mut Self>, cx: &mut TaskCx<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let shared = &self.shared;
        let mut st = lock(&shared.state);
        if let Some(why) = &st.failed {
            return Poll::Ready(Err(broken(why)));
        }
        let Some(Outgoing { slot, imm }) = st.link.take_send() else {
            st.write_waker = Some(cx.waker().clone());
            return Poll::Pending;
        };
        let n = buf.len().min(st.link.slot_bytes() as usize);
        let sent = match shared.qp.send_slots().copy_in(&slot, &buf[..n]) {
            Ok(()) => shared.qp.send(slot, n as u32, imm),
            Err(e) => Err((e, slot)),
        };
        if let Err((e, slot)) = sent {
            st.link.handle_sent(slot);
            drop(st);
            shared.fail(format!("verbs RPC send: {e}"));
            return Poll::Ready(Err(broken("send failed")));
        }
        MESSAGES_SENT.fetch_add(1, Ordering::Relaxed);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: std::pin::Pin<&mut Self>, _: &mut TaskCx<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: std::pin::Pin<&mut Self>, _: &mut TaskCx<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
