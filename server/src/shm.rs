//! Shared-memory handoff: same-host clients get a read-only descriptor of
//! the region's memfd over a Unix socket (SCM_RIGHTS) and map it.
//!
//! Why a descriptor over a socket rather than a path under /dev/shm: the
//! descriptor is reopened read-only (through /proc/self/fd), so a client
//! can never map the region writable; nothing is left in the filesystem
//! when the server dies; and the socket connection doubles as the liveness
//! signal the client ties its mapping to. The server closes it on shutdown
//! and on re-registration; the client then unmaps and asks again. Access
//! is limited by the socket's file permissions (owner only) and by the
//! rkey and epoch the client must present. The messages are in
//! `dmkv_common::shm_handoff`.

use std::fs::File;
use std::io::{self, IoSlice};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dmkv_common::shm_handoff as handoff;
use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tracing::debug;

use crate::listen;
use crate::region::Region;
use crate::registration::Registration;

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

/// Serves handoffs until shutdown, to at most `max_connections` clients at
/// once (each holds its connection for as long as it maps the region).
pub async fn serve(
    listener: ShmListener,
    region: Arc<Region>,
    reg: Arc<Registration>,
    max_connections: usize,
    shutdown: watch::Receiver<bool>,
) -> io::Result<()> {
    // A read-only reopen of the memfd: what clients get can only be mapped
    // for reading.
    let ro = Arc::new(File::open(format!("/proc/self/fd/{}", region.fd().as_raw_fd()))?);
    let len = region.len() as u64;
    let rx = shutdown.clone();
    let mut conns = listen::serve(listener, "shm", max_connections, shutdown, move |stream| {
        handoff(stream, Arc::clone(&ro), len, Arc::clone(&reg), rx.clone())
    })
    .await;
    conns.shutdown().await;
    Ok(())
}

async fn handoff(
    mut stream: UnixStream,
    ro: Arc<File>,
    len: u64,
    reg: Arc<Registration>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut epoch_rx = reg.subscribe();
    let mut req = [0u8; handoff::REQUEST_LEN];
    match tokio::time::timeout(REQUEST_TIMEOUT, stream.read_exact(&mut req)).await {
        Ok(Ok(_)) => {}
        _ => return,
    }
    let (rkey, epoch) = handoff::decode_request(&req);
    let ok = rkey == reg.rkey() && epoch == reg.epoch();
    let reply = handoff::encode_reply(if ok { handoff::STATUS_OK } else { handoff::STATUS_REFUSED }, len);
    if let Err(e) = send_with_fd(&stream, &reply, ok.then_some(&*ro)).await {
        debug!("shm handoff failed: {e}");
        return;
    }
    if !ok {
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
