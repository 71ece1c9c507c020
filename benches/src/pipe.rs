//! A pipelined connection for protocols that answer in request order
//! (memcached's text protocol, Redis' RESP): any number of requests in
//! flight from concurrent tasks, one writer task that coalesces queued
//! requests into few writes, one reader task that hands each parsed reply
//! to the oldest waiting request.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

/// Most bytes the writer gathers into one write.
const MAX_COALESCE: usize = 256 * 1024;
/// Read buffer growth step.
const READ_BUF: usize = 64 * 1024;
/// Longest wait for a TCP connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest wait for a reply.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A reply format: parses one reply off the front of a buffer.
pub trait Protocol: Send + Sync + 'static {
    /// A parsed reply.
    type Reply: Send + 'static;
    /// `Ok(Some)` consumes one complete reply, `Ok(None)` means more bytes
    /// are needed (nothing is consumed), `Err` means the stream is broken.
    fn parse(buf: &mut BytesMut) -> Result<Option<Self::Reply>, String>;
}

/// Feeds `stream` to `P`'s parser in two parts split at `cut` and collects
/// every reply, as a socket may deliver it; no bytes may be left over.
#[cfg(test)]
pub(crate) fn parse_split<P: Protocol>(stream: &[u8], cut: usize) -> Result<Vec<P::Reply>, String> {
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    for part in [&stream[..cut], &stream[cut..]] {
        buf.extend_from_slice(part);
        while let Some(r) = P::parse(&mut buf)? {
            out.push(r);
        }
    }
    assert!(buf.is_empty(), "bytes left over: {buf:?}");
    Ok(out)
}

type Waiters<R> = Arc<Mutex<Queue<R>>>;

struct Queue<R> {
    waiting: VecDeque<oneshot::Sender<R>>,
    tx: mpsc::UnboundedSender<Bytes>,
}

/// A connection to a server speaking protocol `P`.
pub struct Pipe<P: Protocol> {
    queue: Waiters<P::Reply>,
    closed: Arc<AtomicBool>,
}

impl<P: Protocol> Pipe<P> {
    /// Connects and starts the reader and writer tasks on the current runtime.
    pub async fn connect(addr: &str) -> Result<Pipe<P>, String> {
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(format!("cannot connect to {addr}: {e}")),
            Err(_) => return Err(format!("cannot connect to {addr}: timed out after {CONNECT_TIMEOUT:?}")),
        };
        let _ = stream.set_nodelay(true);
        let (rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::unbounded_channel();
        let queue: Waiters<P::Reply> = Arc::new(Mutex::new(Queue { waiting: VecDeque::new(), tx }));
        let closed = Arc::new(AtomicBool::new(false));
        tokio::spawn(write_loop(wr, rx, Arc::clone(&closed)));
        tokio::spawn(read_loop::<P>(rd, Arc::clone(&queue), Arc::clone(&closed)));
        Ok(Pipe { queue, closed })
    }

    /// Sends an encoded request and waits for its reply.
    pub async fn call(&self, req: Bytes) -> Result<P::Reply, String> {
        let rx = {
            // Queueing the bytes and the waiter under one lock keeps the
            // waiters in the order the requests are written.
            let mut q = self.queue.lock().expect("queue poisoned");
            if self.closed.load(Ordering::Acquire) {
                return Err("connection closed".into());
            }
            let (otx, orx) = oneshot::channel();
            if q.tx.send(req).is_err() {
                return Err("connection closed".into());
            }
            q.waiting.push_back(otx);
            orx
        };
        // A reply that arrives after the timeout still pops its own waiter
        // (dropped here), so later replies stay matched.
        match tokio::time::timeout(REQUEST_TIMEOUT, rx).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(_)) => Err("connection closed".into()),
            Err(_) => Err(format!("no reply within {REQUEST_TIMEOUT:?}")),
        }
    }
}

async fn write_loop(mut wr: OwnedWriteHalf, mut rx: mpsc::UnboundedReceiver<Bytes>, closed: Arc<AtomicBool>) {
    let mut batch = BytesMut::new();
    while let Some(first) = rx.recv().await {
        batch.clear();
        batch.extend_from_slice(&first);
        while batch.len() < MAX_COALESCE {
            match rx.try_recv() {
                Ok(more) => batch.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        if wr.write_all(&batch).await.is_err() {
            break;
        }
    }
    closed.store(true, Ordering::Release);
}

async fn read_loop<P: Protocol>(mut rd: OwnedReadHalf, queue: Waiters<P::Reply>, closed: Arc<AtomicBool>) {
    let mut buf = BytesMut::with_capacity(READ_BUF);
    'outer: loop {
        if buf.capacity() - buf.len() < READ_BUF / 4 {
            buf.reserve(READ_BUF);
        }
        match rd.read_buf(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        loop {
            match P::parse(&mut buf) {
                Ok(Some(reply)) => {
                    let Some(tx) = queue.lock().expect("queue poisoned").waiting.pop_front() else {
                        eprintln!("closing connection: reply without a request");
                        break 'outer;
                    };
                    let _ = tx.send(reply);
                }
                Ok(None) => break,
                Err(e) => {
                    eprintln!("closing connection: {e}");
                    break 'outer;
                }
            }
        }
    }
    closed.store(true, Ordering::Release);
    // Dropping the senders wakes every waiter with "connection closed".
    queue.lock().expect("queue poisoned").waiting.clear();
}
