//! The shared-memory backend: the server's region, mapped read-only after a
//! descriptor handoff over its Unix socket. Reads are copies by this
//! process's CPU; the server runs nothing per GET.
//!
//! The mapping is valid only while the handoff connection is open: the
//! server closes it when it stops or registers the region anew, and a
//! crashed server's socket reports EOF. Reads check the connection
//! themselves, with a non-blocking peek at most every
//! [`LIVENESS_CHECK_INTERVAL`]: a task watching it would not run while a
//! caller GETs in a loop that never yields (shm reads never wait). Once it
//! has closed, every read fails with [`BackendError::Closed`] and the client
//! attaches again. This module and `rdma` (registering a completion
//! channel with the reactor) hold the client's `unsafe`.

use std::fs::File;
use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dmkv_common::layout::{EPOCH_OFFSET, HEADER_LEN};
use dmkv_common::racy;
use dmkv_common::read::ReadSpec;
use dmkv_common::shm_handoff as handoff;
use memmap2::{MmapOptions, MmapRaw};
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::UnixStream;

use super::{BackendError, Reads};

/// How stale the liveness of the handoff connection may be: a server that
/// went away is noticed by the first read this long after it did.
pub const LIVENESS_CHECK_INTERVAL: Duration = Duration::from_millis(1);

/// A mapped region and the connection that keeps it valid.
pub struct ShmRegion {
    map: MmapRaw,
    len: usize,
    epoch: u64,
    alive: AtomicBool,
    /// The handoff connection, non-blocking, only ever peeked at.
    control: std::os::unix::net::UnixStream,
    clock: Instant,
    /// When the connection was last seen open, in ns since `clock`.
    checked_at: AtomicU64,
}

// Every field is Send and Sync (`MmapRaw` included), so no unsafe impl is
// needed; this fails to compile if a field ever stops being so.
const _: () = {
    fn assert_send_sync<T: Send + Sync>() {}
    let _ = assert_send_sync::<ShmRegion>;
};

impl ShmRegion {
    /// Asks the server at `socket` for its region, presenting `rkey` and
    /// `epoch`, and maps it read-only.
    pub async fn attach(socket: &str, rkey: u64, epoch: u64, timeout: Duration) -> Result<ShmRegion, BackendError> {
        let work = async {
            let mut stream = UnixStream::connect(socket).await?;
            stream.write_all(&handoff::encode_request(rkey, epoch)).await?;
            let (reply, fd) = recv_with_fd(&stream).await?;
            Ok::<_, io::Error>((stream, reply, fd))
        };
        let (stream, reply, fd) = match tokio::time::timeout(timeout, work).await {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => return Err(BackendError::Attach(format!("shared-memory handoff via {socket}: {e}"))),
            Err(_) => return Err(BackendError::Attach(format!("shared-memory handoff via {socket} timed out"))),
        };
        let (status, region_len) = handoff::decode_reply(&reply);
        if status != handoff::STATUS_OK {
            return Err(BackendError::Attach(
                "server refused the shared-memory handoff (rkey or epoch not current)".into(),
            ));
        }
        let file = fd.ok_or_else(|| BackendError::Attach("handoff reply carried no descriptor".into()))?;
        let file_len = file.metadata().map_err(|e| BackendError::Attach(format!("handoff descriptor: {e}")))?.len();
        let len = mappable_len(region_len, file_len)?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw_read_only(&file)
            .map_err(|e| BackendError::Attach(format!("cannot map the region: {e}")))?;
        let control = stream.into_std().map_err(|e| BackendError::Attach(format!("handoff socket: {e}")))?;
        Ok(ShmRegion {
            map,
            len,
            epoch,
            alive: AtomicBool::new(true),
            control,
            clock: Instant::now(),
            checked_at: AtomicU64::new(0),
        })
    }

    /// Whether the handoff connection is still open, peeking at it if it was
    /// not checked within [`LIVENESS_CHECK_INTERVAL`].
    fn is_alive(&self) -> bool {
        if !self.alive.load(Ordering::Acquire) {
            return false;
        }
        let now = self.clock.elapsed().as_nanos() as u64;
        if now.saturating_sub(self.checked_at.load(Ordering::Relaxed)) < LIVENESS_CHECK_INTERVAL.as_nanos() as u64 {
            return true;
        }
        // The server never sends on this connection: any byte, EOF or error
        // means it is gone or has registered the region anew.
        let mut b = [0u8; 1];
        let peek = rustix::net::recv(&self.control, &mut b[..], RecvFlags::PEEK | RecvFlags::DONTWAIT);
        let open = matches!(peek, Err(rustix::io::Errno::AGAIN));
        if open {
            self.checked_at.store(now, Ordering::Relaxed);
        } else {
            self.alive.store(false, Ordering::Release);
        }
        open
    }

    /// Reads every spec, concatenated in order. A spec past the mapping's
    /// end (from a torn or reused slot) yields `None`, never a fault.
    pub fn read(&self, specs: &[ReadSpec], out: &mut Reads) -> Result<(), BackendError> {
        if !self.is_alive() {
            return Err(BackendError::Closed);
        }
        let base = self.map.as_ptr();
        // SAFETY: EPOCH_OFFSET + 8 <= header length <= self.len, 8-aligned
        // (the mapping is page-aligned); the mapping lives as long as self;
        // the server stores the header as whole words.
        let epoch = unsafe { racy::load_word(base.add(EPOCH_OFFSET as usize)) };
        if epoch != self.epoch {
            return Err(BackendError::Stale);
        }
        out.clear();
        for s in specs {
            let len = s.len as usize;
            match (s.offset as usize).checked_add(len) {
                Some(end) if end <= self.len => {
                    let dst = out.push_slot(len);
                    // SAFETY: offset..end lies inside the live mapping, and
                    // so do the words covering it (page-aligned base, length
                    // a multiple of 8, checked in `attach`); the server only
                    // ever stores whole aligned words atomically.
                    unsafe { racy::copy_from_shared(base.add(s.offset as usize), dst) };
                }
                _ => out.push_failed(),
            }
        }
        Ok(())
    }
}

/// The length to map for a region the server says is `region_len` bytes,
/// whose descriptor holds `file_len`. The reply is the server's word: a
/// length past the descriptor's end would map pages whose reads fault
/// (SIGBUS), and a region shorter than its header has no epoch word.
fn mappable_len(region_len: u64, file_len: u64) -> Result<usize, BackendError> {
    if region_len < HEADER_LEN as u64 || region_len > file_len {
        return Err(BackendError::Attach(format!(
            "region length {region_len} is not between the header's {HEADER_LEN} and the descriptor's {file_len} bytes"
        )));
    }
    // Reads load whole words; a whole number of them keeps every in-bounds
    // read inside the mapping (the server's regions always are).
    if !region_len.is_multiple_of(8) {
        return Err(BackendError::Attach(format!("region length {region_len} is not a multiple of 8")));
    }
    usize::try_from(region_len).map_err(|_| BackendError::Attach(format!("region length {region_len} too large")))
}

async fn recv_with_fd(stream: &UnixStream) -> io::Result<([u8; handoff::REPLY_LEN], Option<File>)> {
    loop {
        stream.readable().await?;
        let r = stream.try_io(Interest::READABLE, || {
            let mut reply = [0u8; handoff::REPLY_LEN];
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let msg = recvmsg(stream, &mut [IoSliceMut::new(&mut reply)], &mut control, RecvFlags::CMSG_CLOEXEC)
                .map_err(io::Error::from)?;
            let mut file = None;
            for m in control.drain() {
                if let RecvAncillaryMessage::ScmRights(fds) = m {
                    for fd in fds {
                        file.get_or_insert(File::from(fd));
                    }
                }
            }
            if msg.bytes != handoff::REPLY_LEN {
                return Err(io::Error::other(format!("handoff reply of {} bytes", msg.bytes)));
            }
            Ok((reply, file))
        });
        match r {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handoff reply claiming more bytes than its descriptor holds would
    /// have been mapped as is, and the first read past the file's end would
    /// have killed the client with SIGBUS.
    #[test]
    fn a_region_length_the_descriptor_does_not_hold_is_refused() {
        assert_eq!(mappable_len(1 << 20, 1 << 20).unwrap(), 1 << 20);
        assert_eq!(mappable_len(HEADER_LEN as u64, 1 << 20).unwrap(), HEADER_LEN);
        for (claimed, file) in [((1 << 20) + 8, 1 << 20), (0, 1 << 20), (8, 1 << 20), (!7, 1 << 20), (4100, 8192)] {
            assert!(matches!(mappable_len(claimed, file), Err(BackendError::Attach(_))), "{claimed} of {file}");
        }
    }
}
