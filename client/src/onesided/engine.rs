//! The TCP backend: batches of reads sent to the server's software
//! one-sided engine, many batches in flight on one connection, replies
//! matched by batch id.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use dmkv_common::onesided::{MAX_REPLY_FRAME, ReadStatus, ReadWr, decode_reply, encode_request, next_frame};
use dmkv_common::read::ReadSpec;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use super::{BackendError, Reads};
use crate::conn::{SEND_QUEUE, write_loop};

const READ_BUF: usize = 64 * 1024;

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<BytesMut>>>>;

/// A connection to a server's one-sided engine.
pub struct EngineConn {
    tx: mpsc::Sender<BytesMut>,
    pending: Pending,
    next: AtomicU64,
    closed: Arc<AtomicBool>,
    rkey: u64,
    timeout: Duration,
}

impl EngineConn {
    /// Connects to the engine at `addr`; reads will present `rkey`.
    pub async fn connect(addr: &str, rkey: u64, timeout: Duration) -> Result<EngineConn, BackendError> {
        let stream = match tokio::time::timeout(timeout, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(BackendError::Attach(format!("engine {addr}: {e}"))),
            Err(_) => return Err(BackendError::Attach(format!("engine {addr}: connect timed out"))),
        };
        let _ = stream.set_nodelay(true);
        let (mut rd, wr) = stream.into_split();
        let (tx, rx) = mpsc::channel::<BytesMut>(SEND_QUEUE);
        let pending: Pending = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        tokio::spawn(write_loop(wr, rx, Arc::clone(&closed)));
        let (p, c) = (Arc::clone(&pending), Arc::clone(&closed));
        tokio::spawn(async move {
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
                    match next_frame(&mut buf, MAX_REPLY_FRAME) {
                        Ok(Some(body)) if body.len() >= 8 => {
                            let id = u64::from_le_bytes(body[..8].try_into().expect("8 bytes"));
                            if let Some(tx) = p.lock().expect("pending poisoned").remove(&id) {
                                let _ = tx.send(body);
                            }
                        }
                        Ok(None) => break,
                        _ => break 'outer,
                    }
                }
            }
            c.store(true, Ordering::Release);
            p.lock().expect("pending poisoned").clear();
        });
        Ok(EngineConn { tx, pending, next: AtomicU64::new(1), closed, rkey, timeout })
    }

    /// Posts `specs` as one batch (one frame) and waits for its completions.
    pub async fn read(&self, specs: &[ReadSpec], out: &mut Reads) -> Result<(), BackendError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(BackendError::Closed);
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let wrs: Vec<ReadWr> = specs.iter().map(|s| ReadWr { rkey: self.rkey, offset: s.offset, len: s.len }).collect();
        let mut frame = BytesMut::new();
        encode_request(id, &wrs, &mut frame);
        let (otx, orx) = oneshot::channel();
        self.pending.lock().expect("pending poisoned").insert(id, otx);
        if self.tx.send(frame).await.is_err() || self.closed.load(Ordering::Acquire) {
            self.pending.lock().expect("pending poisoned").remove(&id);
            return Err(BackendError::Closed);
        }
        let body = match tokio::time::timeout(self.timeout, orx).await {
            Ok(Ok(b)) => b,
            Ok(Err(_)) => return Err(BackendError::Closed),
            Err(_) => {
                self.pending.lock().expect("pending poisoned").remove(&id);
                return Err(BackendError::Timeout);
            }
        };
        let reply = decode_reply(&body).map_err(|e| BackendError::Protocol(e.to_string()))?;
        if reply.results.len() != specs.len() {
            return Err(BackendError::Protocol("reply has the wrong number of completions".into()));
        }
        out.clear();
        for (status, range) in reply.results {
            match status {
                ReadStatus::Success => out.push_slot(range.len()).copy_from_slice(&body[range]),
                ReadStatus::BadRkey => return Err(BackendError::Stale),
                ReadStatus::OutOfBounds | ReadStatus::TooLong => out.push_failed(),
            }
        }
        Ok(())
    }
}
