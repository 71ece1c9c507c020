//! What a pipelined connection has yet to write. Senders encode their
//! frames straight into one shared buffer, and the connection's writer
//! takes the whole buffer at once and writes it: no buffer per request, no
//! channel hop, and no second copy to gather queued requests into one
//! write (a channel of per-request buffers cost all three on every RPC).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::BytesMut;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;

/// Requests queued for the writer before senders wait for room.
pub(crate) const SEND_QUEUE: usize = 1024;

/// Capacity the writer keeps between writes; a larger buffer (after a big
/// PUT) is given back rather than held for the connection's life.
const KEEP_CAPACITY: usize = 256 * 1024;

/// The frames queued for one connection's writer.
#[derive(Default)]
pub(crate) struct Outbox {
    state: Mutex<State>,
    /// Wakes the writer: something was queued into an empty buffer, or the
    /// outbox closed.
    wake: Notify,
    /// Wakes senders waiting for room.
    room: Notify,
}

#[derive(Default)]
struct State {
    buf: BytesMut,
    /// Frames in `buf`; bounded by [`SEND_QUEUE`].
    frames: usize,
    /// No more frames are taken; the writer writes what is queued and stops.
    closed: bool,
}

/// What [`Outbox::try_push`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Push {
    Queued,
    /// [`SEND_QUEUE`] frames wait already: wait for room ([`Outbox::room`]).
    Full,
    Closed,
}

impl Outbox {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a buffer and two plain fields, consistent after
        // every statement: a panic elsewhere while it was held leaves
        // nothing half-done to protect.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Appends the frame `encode` writes, unless the outbox is full or
    /// closed; an `encode` error queues nothing (it must fail before
    /// writing, as `frame::encode` does).
    pub fn try_push<E>(&self, encode: impl FnOnce(&mut BytesMut) -> Result<(), E>) -> Result<Push, E> {
        let was_empty = {
            let mut s = self.lock();
            if s.closed {
                return Ok(Push::Closed);
            }
            if s.frames >= SEND_QUEUE {
                return Ok(Push::Full);
            }
            let was_empty = s.buf.is_empty();
            let before = s.buf.len();
            encode(&mut s.buf)?;
            debug_assert!(s.buf.len() > before, "a frame has a header");
            s.frames += 1;
            was_empty
        };
        // A busy writer finds the frame when its write ends; an idle one
        // waits to be told (a permit is kept if it is not waiting yet).
        if was_empty {
            self.wake.notify_one();
        }
        Ok(Push::Queued)
    }

    /// Resolves once the writer has taken what is queued (or the outbox
    /// closed). Enable it before trying again, or its wake can be missed.
    pub fn room(&self) -> tokio::sync::futures::Notified<'_> {
        self.room.notified()
    }

    /// Takes no more frames; the writer writes what is queued and stops.
    pub fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_one();
        self.room.notify_waiters();
    }
}

/// Writes what `outbox` holds, all of it in one write each time, until it
/// closes (after writing what was queued) or a write fails; then marks the
/// connection `closed` and closes the outbox. Shared by every pipelined
/// connection.
pub(crate) async fn write_loop(mut wr: impl AsyncWrite + Unpin, outbox: Arc<Outbox>, closed: Arc<AtomicBool>) {
    let mut batch = BytesMut::new();
    loop {
        let idle = {
            let mut s = outbox.lock();
            if s.buf.is_empty() {
                if s.closed {
                    break;
                }
                true
            } else {
                std::mem::swap(&mut s.buf, &mut batch);
                s.frames = 0;
                false
            }
        };
        if idle {
            outbox.wake.notified().await;
            continue;
        }
        outbox.room.notify_waiters();
        // Flushing matters for TLS, which holds bytes until flushed.
        if wr.write_all(&batch).await.is_err() || wr.flush().await.is_err() {
            break;
        }
        batch.clear();
        if batch.capacity() > KEEP_CAPACITY {
            batch = BytesMut::new();
        }
    }
    closed.store(true, Ordering::Release);
    outbox.close();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(b: &mut BytesMut) -> Result<(), ()> {
        b.extend_from_slice(b"f");
        Ok(())
    }

    #[test]
    fn a_full_outbox_takes_nothing_more_and_a_failed_encode_queues_nothing() {
        let o = Outbox::default();
        assert_eq!(o.try_push(|_| Err::<(), _>("too large")), Err("too large"));
        for _ in 0..SEND_QUEUE {
            assert_eq!(o.try_push(frame), Ok(Push::Queued));
        }
        assert_eq!(o.try_push(frame), Ok(Push::Full));
        assert_eq!(o.lock().buf.len(), SEND_QUEUE, "only the frames that were queued");
        o.close();
        assert_eq!(o.try_push(frame), Ok(Push::Closed));
    }

    #[tokio::test]
    async fn the_writer_writes_everything_queued_in_order_even_after_close() {
        let (mut rd, wr) = tokio::io::duplex(1 << 20);
        let o = Arc::new(Outbox::default());
        let closed = Arc::new(AtomicBool::new(false));
        let writer = tokio::spawn(write_loop(wr, Arc::clone(&o), Arc::clone(&closed)));
        let mut want = Vec::new();
        for i in 0..3000u32 {
            let bytes = i.to_le_bytes();
            loop {
                let room = o.room();
                tokio::pin!(room);
                room.as_mut().enable();
                match o.try_push(|b| {
                    b.extend_from_slice(&bytes);
                    Ok::<_, ()>(())
                }) {
                    Ok(Push::Queued) => break,
                    Ok(Push::Full) => room.await,
                    other => panic!("{other:?}"),
                }
            }
            want.extend_from_slice(&bytes);
            if i % 700 == 0 {
                tokio::task::yield_now().await;
            }
        }
        o.close();
        writer.await.unwrap();
        assert!(closed.load(Ordering::Acquire));
        let mut got = Vec::new();
        tokio::io::AsyncReadExt::read_to_end(&mut rd, &mut got).await.unwrap();
        assert_eq!(got, want);
    }
}
