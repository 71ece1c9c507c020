//! Shared-memory handoff: same-host clients get a read-only descriptor of
//! the region's memfd over a Unix socket (SCM_RIGHTS) and map it.
//!
//! Why a descriptor over a socket rather than a path under /dev/shm: the
//! descriptor is reopened read-only (through /proc/self/fd), so a client
//! can never map the region writable; nothing is left in the filesystem
//! when the server dies; and the socket connection doubles as the liveness
//! signal the client ties its mapping to. The server closes it on shutdown
//! and on re-registration; the client then unmaps and asks again. The
//! memfd is sealed (`region::REGION_SEALS`), so reopening the descriptor
//! read-write gains nothing either.
//!
//! Access is limited by the socket's file permissions (owner only), by a
//! challenge-response when the server has secrets (`dmkv_common::auth`,
//! for a role that may read), and by the rkey and epoch the client must
//! present. Failed proofs and wrong rkeys for the current epoch count
//! against the peer's uid (a Unix socket has no address); too many and it
//! is refused unchecked for a while. The messages are in
//! `dmkv_common::shm_handoff`.

use std::fs::File;
use std::io::{self, IoSlice};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dmkv_common::auth::{NONCE_LEN, Purpose, Role};
use dmkv_common::shm_handoff as handoff;
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tracing::{debug, warn};

use crate::access::{Denied, Gate};
use crate::listen;
use crate::registration::{Registration, Served, ServedSet, find_by_rkey};

/// How long a client gets to send its request: the whole request, so a
/// client trickling it holds its connection no longer than this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// A bound handoff socket; the path is removed when this is dropped.
pub struct ShmListener {
    listener: UnixListener,
    path: PathBuf,
}

impl ShmListener {
    /// Binds `path` (replacing a stale socket file) with owner-only access.
    pub fn bind(path: &Path) -> io::Result<ShmListener> {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        Ok(ShmListener { listener, path: path.to_path_buf() })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl listen::Listener for ShmListener {
    type Conn = UnixStream;

    fn accept(&self) -> impl std::future::Future<Output = io::Result<UnixStream>> + Send {
        listen::Listener::accept(&self.listener)
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One region a handoff can give.
struct Entry {
    /// A read-only reopen of the memfd (sealed too).
    ro: File,
    len: u64,
    reg: Arc<Registration>,
}

/// What every handoff connection shares.
struct Ctx {
    served: ServedSet,
    gate: Arc<Gate>,
}

/// Serves handoffs until shutdown, to at most `max_connections` clients at
/// once (each holds its connection for as long as it maps the region).
/// `gate` holds the server's secrets (with none, clients need no proof and
/// send zeros) and counts failures, per uid here. The regions given are
/// `served`'s as they are at each handoff.
pub async fn serve(
    listener: ShmListener,
    served: ServedSet,
    gate: Arc<Gate>,
    max_connections: usize,
    stats: Arc<crate::counters::ListenerStats>,
    shutdown: watch::Receiver<bool>,
) -> io::Result<()> {
    let ctx = Arc::new(Ctx { served, gate });
    let rx = shutdown.clone();
    let mut conns = listen::serve(listener, stats, max_connections, shutdown, move |stream| {
        handoff(stream, Arc::clone(&ctx), rx.clone())
    })
    .await;
    conns.shutdown().await;
    Ok(())
}

/// The failure limiter's key for a peer: its uid, written as an address no
/// network peer has (the unique-local fd00:646d:6b76::UID, so logs show
/// the uid in the last two groups), since Unix sockets have no address.
/// Without credentials, one shared key.
fn peer_key(stream: &UnixStream) -> IpAddr {
    match rustix::net::sockopt::socket_peercred(stream) {
        Ok(cred) => {
            let uid = cred.uid.as_raw();
            IpAddr::V6(Ipv6Addr::new(0xfd00, 0x646d, 0x6b76, 0, 0, 0, (uid >> 16) as u16, uid as u16))
        }
        Err(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
    }
}

/// A region to hand over: a read-only reopen of its memfd, so that what
/// clients get can only be mapped for reading (and the seals keep a
/// read-write reopen from writing).
fn entry(s: &Served) -> io::Result<Entry> {
    let ro = File::open(format!("/proc/self/fd/{}", s.region.fd().as_raw_fd()))?;
    Ok(Entry { ro, len: s.region.len() as u64, reg: Arc::clone(&s.reg) })
}

/// Checks a request: the status to answer, and the region it asked for.
fn check(ctx: &Ctx, req: &[u8; handoff::REQUEST_LEN], nonce: &[u8; NONCE_LEN], peer: IpAddr) -> (u8, Option<Entry>) {
    let (proof, rkey, epoch) = handoff::decode_request(req);
    if ctx.gate.enabled() {
        match ctx.gate.check(Purpose::Shm, Some(peer), nonce, &proof, Role::Data) {
            Ok(_) => {}
            Err(Denied::RateLimited) => return (handoff::STATUS_RATE_LIMITED, None),
            Err(Denied::BadProof) => return (handoff::STATUS_UNAUTHENTICATED, None),
        }
    } else if !ctx.gate.allowed(peer) {
        return (handoff::STATUS_RATE_LIMITED, None);
    }
    let regions = ctx.served.current();
    let found = find_by_rkey(&regions, rkey);
    if let Some(s) = found
        && epoch == s.reg.epoch()
    {
        return match entry(s) {
            Ok(e) => (handoff::STATUS_OK, Some(e)),
            Err(e) => {
                warn!("shm handoff: cannot reopen the region read-only: {e}");
                (handoff::STATUS_REFUSED, None)
            }
        };
    }
    // Only a wrong rkey for a current epoch counts as a guess: a client
    // that missed a re-registration presents the old pair, and any answer
    // to a wrong epoch is a refusal whatever the rkey, so it tells nothing.
    if found.is_none() && regions.iter().any(|s| s.reg.epoch() == epoch) {
        ctx.gate.failed(Purpose::Shm, peer, "shm handoff refused: wrong rkey");
    }
    (handoff::STATUS_REFUSED, None)
}

async fn handoff(mut stream: UnixStream, ctx: Arc<Ctx>, mut shutdown: watch::Receiver<bool>) {
    let peer = peer_key(&stream);
    let nonce = ctx.gate.nonce();
    let greeting = handoff::encode_greeting(ctx.gate.enabled(), &nonce);
    let mut req = [0u8; handoff::REQUEST_LEN];
    let exchange = async {
        stream.write_all(&greeting).await?;
        stream.read_exact(&mut req).await
    };
    match tokio::time::timeout(REQUEST_TIMEOUT, exchange).await {
        Ok(Ok(_)) => {}
        _ => return,
    }
    let (status, entry) = check(&ctx, &req, &nonce, peer);
    let reply = handoff::encode_reply(status, entry.as_ref().map_or(0, |e| e.len));
    if let Err(e) = send_with_fd(&stream, &reply, entry.as_ref().map(|e| &e.ro)).await {
        debug!("shm handoff failed: {e}");
        return;
    }
    let Some(entry) = entry else { return };
    let mut epoch_rx = entry.reg.subscribe();
    // A re-registration between the check and here must close this too.
    if *epoch_rx.borrow_and_update() != epoch_of(&req) {
        return;
    }
    // Hold the connection open: it is the client's proof that this server
    // and this registration are alive. Any byte or EOF from the client ends it.
    let mut b = [0u8; 1];
    tokio::select! {
        _ = stream.read(&mut b) => {}
        _ = shutdown.changed() => {}
        _ = epoch_rx.changed() => {}
    }
}

fn epoch_of(req: &[u8; handoff::REQUEST_LEN]) -> u64 {
    handoff::decode_request(req).2
}

async fn send_with_fd(stream: &UnixStream, data: &[u8], fd: Option<&File>) -> io::Result<()> {
    loop {
        stream.writable().await?;
        let sent = stream.try_io(Interest::WRITABLE, || {
            let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            let fds;
            if let Some(f) = fd {
                fds = [f.as_fd()];
                control.push(SendAncillaryMessage::ScmRights(&fds));
            }
            sendmsg(stream, &[IoSlice::new(data)], &mut control, SendFlags::NOSIGNAL).map_err(io::Error::from)
        });
        match sent {
            Ok(n) if n == data.len() => return Ok(()),
            Ok(_) => return Err(io::Error::other("short write of a handoff reply")),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}
