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
//!
//! The handoff: the server greets with a nonce, the client answers with a
//! proof of its token (when the server asks for one), the rkey and the
//! epoch, and the server replies with a status and, if OK, the descriptor
//! (`dmkv_common::shm_handoff`). Before mapping it, the client checks that
//! the memfd is sealed against writes and resizing ([`check_sealed`]):
//! a region that could shrink under the mapping would fault reads, and one
//! that others could still write is not the server's.

use std::fs::File;
use std::io::{self, IoSliceMut};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dmkv_common::auth::{self, Purpose, Token};
use dmkv_common::layout::{EPOCH_OFFSET, HEADER_LEN};
use dmkv_common::racy;
use dmkv_common::read::ReadSpec;
use dmkv_common::shm_handoff as handoff;
use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::SealFlags;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, recvmsg};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
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

/// The seals a server's region must carry before a client maps it: no
/// shrinking (reads past the new end would fault), no growing, no writer
/// but the server's own mapping, and no changing the seals.
pub const REQUIRED_SEALS: SealFlags =
    SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::FUTURE_WRITE).union(SealFlags::SEAL);

/// Refuses a handed-over region unless it carries [`REQUIRED_SEALS`] and
/// its size is the advertised length, at least a region header long.
pub fn check_sealed(file: &File, advertised_len: u64) -> Result<(), BackendError> {
    let refuse = |why: String| Err(BackendError::Attach(format!("refusing the server's region: {why}")));
    let seals = match rustix::fs::fcntl_get_seals(file) {
        Ok(s) => s,
        Err(e) => return refuse(format!("cannot read its seals ({e}); not a sealed memfd")),
    };
    if !seals.contains(REQUIRED_SEALS) {
        return refuse(format!("it is not sealed against writes and resizing (seals {seals:?})"));
    }
    let size = match rustix::fs::fstat(file) {
        Ok(st) => st.st_size as u64,
        Err(e) => return refuse(format!("cannot stat it: {e}")),
    };
    if size != advertised_len {
        return refuse(format!("its size {size} is not the advertised {advertised_len} bytes"));
    }
    if size < HEADER_LEN as u64 {
        return refuse(format!("its size {size} is less than a region header ({HEADER_LEN} bytes)"));
    }
    Ok(())
}

/// Runs the handoff with the server at `socket`: the connection (kept
/// open: it keeps the mapping valid), the descriptor and the region length
/// the server advertised. Public for tests that handle the descriptor
/// themselves.
#[doc(hidden)]
pub async fn receive_descriptor(
    socket: &str,
    rkey: u64,
    epoch: u64,
    token: Option<&Token>,
    timeout: Duration,
) -> Result<(UnixStream, File, u64), BackendError> {
    let work = async {
        let mut stream = UnixStream::connect(socket).await?;
        let mut greeting = [0u8; handoff::GREETING_LEN];
        stream.read_exact(&mut greeting).await?;
        let (auth_required, nonce) = handoff::decode_greeting(&greeting).map_err(io::Error::other)?;
        let proof = auth::answer(auth_required, token, Purpose::Shm, &nonce).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the server requires authentication and no token is configured",
            )
        })?;
        stream.write_all(&handoff::encode_request(&proof, rkey, epoch)).await?;
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
        return Err(BackendError::Attach(format!(
            "server refused the shared-memory handoff: {}",
            handoff::status_text(status)
        )));
    }
    let file = fd.ok_or_else(|| BackendError::Attach("handoff reply carried no descriptor".into()))?;
    Ok((stream, file, region_len))
}

impl ShmRegion {
    /// Asks the server at `socket` for its region, proving `token` if the
    /// server asks and presenting `rkey` and `epoch`, and maps it
    /// read-only once it has checked the region's seals and size.
    pub async fn attach(
        socket: &str,
        rkey: u64,
        epoch: u64,
        token: Option<&Token>,
        timeout: Duration,
    ) -> Result<ShmRegion, BackendError> {
        let (stream, file, region_len) = receive_descriptor(socket, rkey, epoch, token, timeout).await?;
        check_sealed(&file, region_len)?;
        let len = usize::try_from(region_len)
            .map_err(|_| BackendError::Attach(format!("region length {region_len} does not fit this host")))?;
        // Reads load whole words; a whole number of them keeps every in-bounds
        // read inside the mapping (the server's regions always are).
        if !len.is_multiple_of(8) {
            return Err(BackendError::Attach(format!("region length {len} is not a multiple of 8")));
        }
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

    /// Asks the CPU to start loading `len` bytes at region offset
    /// `offset` (nothing if out of bounds): see [`racy::prefetch`].
    pub fn prefetch(&self, offset: u64, len: usize) {
        if let Ok(at) = usize::try_from(offset)
            && at < self.len
        {
            racy::prefetch(self.map.as_ptr().wrapping_add(at), len.min(self.len - at));
        }
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
        // Every read's memory is requested first, so that their cache
        // misses overlap instead of following one another.
        for s in specs {
            if (s.offset as usize) < self.len {
                racy::prefetch(base.wrapping_add(s.offset as usize), s.len as usize);
            }
        }
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

    fn memfd(len: u64) -> File {
        let fd = rustix::fs::memfd_create("check-sealed", rustix::fs::MemfdFlags::ALLOW_SEALING).unwrap();
        let f = File::from(fd);
        f.set_len(len).unwrap();
        f
    }

    fn refused(r: Result<(), BackendError>) -> String {
        match r {
            Err(BackendError::Attach(m)) => m,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn only_a_sealed_region_of_the_advertised_size_is_accepted() {
        let len = 1 << 20;
        let plain = memfd(len);
        assert!(refused(check_sealed(&plain, len)).contains("not sealed"));
        // Sealed against resizing but still writable: refused too.
        rustix::fs::fcntl_add_seals(&plain, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        assert!(refused(check_sealed(&plain, len)).contains("not sealed"));

        let sealed = memfd(len);
        rustix::fs::fcntl_add_seals(&sealed, REQUIRED_SEALS).unwrap();
        check_sealed(&sealed, len).unwrap();
        assert!(refused(check_sealed(&sealed, len * 2)).contains("not the advertised"));
        assert!(refused(check_sealed(&sealed, len - 8)).contains("not the advertised"));

        let tiny = memfd(HEADER_LEN as u64 - 8);
        rustix::fs::fcntl_add_seals(&tiny, REQUIRED_SEALS).unwrap();
        assert!(refused(check_sealed(&tiny, HEADER_LEN as u64 - 8)).contains("less than a region header"));

        // Not a memfd at all (no seals to read).
        let not_memfd = File::open("/proc/self/exe").unwrap();
        assert!(refused(check_sealed(&not_memfd, 0)).contains("sealed"));
    }
}
