//! Snapshots between nodes, on connections of their own.
//!
//! Raft hands a leader's snapshot to the transport as a MsgSnapshot whose
//! data is only a descriptor (`desk::Descriptor`). Its items go from the
//! view the leader offered (`desk::Outgoing`) straight to a new
//! connection to the follower's peer port: a thread walks the view and
//! encodes the stream a chunk at a time, the connection sends the chunks
//! with at most [`WINDOW`] unanswered, so the bytes in flight are bounded
//! and a slow receiver slows the walk. The last chunk carries the raft
//! message; the follower hands it to raft only once the whole stream is
//! on its side and checked. Raft's own connection to that peer carries
//! heartbeats and entries all the while.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bytes::BytesMut;
use dmkv_common::cluster::map::{NodeId, ShardId, node_of};
use dmkv_common::frame::{self, Decoder};
use dmkv_common::proto::{self, Request, request::Op, response::Result as R};
use protobuf::Message as _;
use raft::prelude::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Semaphore, mpsc};
use tracing::{info, warn};

use super::desk::{Descriptor, Desk, Outgoing};
use super::dial::{self, Dialer};
use super::snapshot;
use super::thread_priority::background;

/// Bytes of a snapshot in one chunk (one request frame).
pub const CHUNK_BYTES: usize = 1 << 20;
/// Chunks sent and not yet answered, at most: with [`CHUNK_BYTES`], the
/// bytes of one transfer in flight.
pub const WINDOW: usize = 4;
/// Snapshots a node sends at once; more wait (raft retries them anyway).
pub const MAX_SENDS: usize = 4;
/// A chunk not answered within this ends the transfer.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// The last part's answer comes once the receiver synced the stream and
/// read it whole again to check it: it gets [`REPLY_TIMEOUT`] and this
/// long a byte sent more, at this rate (a slow disk's).
pub const CHECK_BYTES_PER_SEC: u64 = 50 << 20;

/// What the transport knows of one shard replica here: its snapshots, and
/// how to tell raft that one did not reach a follower.
pub struct Link {
    pub desk: Arc<Desk>,
    pub failed: Box<dyn Fn(u64, u64) + Send + Sync>,
}

/// A node's snapshot sender.
pub struct Transfers {
    handle: tokio::runtime::Handle,
    dialer: Dialer,
    addrs: HashMap<NodeId, SocketAddr>,
    links: RwLock<HashMap<ShardId, Arc<Link>>>,
    sends: Arc<Semaphore>,
}

impl Transfers {
    /// A sender for a node reaching `peers` (node, peer address), spawning
    /// on the current runtime.
    pub fn new(dialer: Dialer, peers: &[(NodeId, SocketAddr)]) -> Transfers {
        Transfers {
            handle: tokio::runtime::Handle::current(),
            dialer,
            addrs: peers.iter().copied().collect(),
            links: RwLock::default(),
            sends: Arc::new(Semaphore::new(MAX_SENDS)),
        }
    }

    /// Makes shard `shard`'s replica here known to the sender.
    pub fn register(&self, shard: ShardId, link: Link) {
        self.links.write().unwrap_or_else(std::sync::PoisonError::into_inner).insert(shard, Arc::new(link));
    }

    /// Forgets shard `shard`'s replica (it closed): its snapshots are
    /// sent no more.
    pub fn unregister(&self, shard: ShardId) {
        self.links.write().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&shard);
    }

    /// Sends raft's MsgSnapshot `m` of `shard`: its stream first, then `m`
    /// (from the shard thread: never blocks). One that cannot go is
    /// reported failed at once, so raft tries again.
    pub fn send(&self, shard: ShardId, m: Message) {
        let link = self.links.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(&shard).cloned();
        let Some(link) = link else { return };
        let (to, index) = (m.to, m.get_snapshot().get_metadata().index);
        let offer = Descriptor::decode(m.get_snapshot().get_data()).and_then(|d| Some((d, link.desk.outgoing(d.id)?)));
        let (Some((desc, out)), Some(&addr)) = (offer, self.addrs.get(&node_of(to))) else {
            if let Some(d) = Descriptor::decode(m.get_snapshot().get_data()) {
                link.desk.withdraw(d.id);
            }
            (link.failed)(to, index);
            return;
        };
        let Ok(permit) = Arc::clone(&self.sends).try_acquire_owned() else {
            // Raft asks again, and a new view is offered then.
            link.desk.withdraw(desc.id);
            (link.failed)(to, index);
            return;
        };
        let dialer = self.dialer.clone();
        let stream = link.desk.stream_to(to);
        self.handle.spawn(async move {
            let started = std::time::Instant::now();
            // Taken until the follower answered the last part (it checked
            // the whole stream), not only until the walk ended.
            let held = Arc::clone(&out);
            match send_one(&dialer, node_of(to), addr, shard, desc, out, &m).await {
                Ok(bytes) => info!(
                    shard,
                    to = node_of(to),
                    index = desc.at.index,
                    bytes,
                    secs = started.elapsed().as_secs_f64(),
                    "snapshot sent"
                ),
                Err(e) => {
                    warn!(shard, to = node_of(to), index = desc.at.index, "snapshot not sent: {e}");
                    (link.failed)(to, index);
                }
            }
            link.desk.withdraw(desc.id);
            drop((held, stream, permit));
        });
    }
}

/// Encodes into chunks of [`CHUNK_BYTES`] handed to the connection.
struct ChunkWriter {
    tx: mpsc::Sender<Vec<u8>>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    fn ship(&mut self, n: usize) -> std::io::Result<()> {
        let rest = self.buf.split_off(n);
        let chunk = std::mem::replace(&mut self.buf, rest);
        self.tx
            .blocking_send(chunk)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the transfer ended"))
    }
}

impl std::io::Write for ChunkWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        while self.buf.len() >= CHUNK_BYTES {
            self.ship(CHUNK_BYTES)?;
        }
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if !self.buf.is_empty() {
            self.ship(self.buf.len())?;
        }
        Ok(())
    }
}

/// Streams `out` to node `node` at `addr`, then `m`; the bytes sent.
async fn send_one(
    d: &Dialer,
    node: NodeId,
    addr: SocketAddr,
    shard: ShardId,
    desc: Descriptor,
    out: Arc<Outgoing>,
    m: &Message,
) -> Result<u64, String> {
    let stream = tokio::time::timeout(dial::DIAL_TIMEOUT, dial::dial(d, node, addr))
        .await
        .unwrap_or_else(|_| Err("timed out connecting".into()))?;
    let (mut rd, mut wr) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(WINDOW);
    // The walk is background work: it yields the CPU to the shard threads.
    let walker = tokio::task::spawn_blocking(move || {
        background();
        let w = ChunkWriter { tx, buf: Vec::with_capacity(CHUNK_BYTES) };
        snapshot::encode_view(&out.view, &out.remembered, out.at, w).map(|(_, s)| s)
    });
    let dec = Decoder::new(d.max_frame);
    let mut inbuf = BytesMut::new();
    let mut frame_buf = BytesMut::new();
    let mut unanswered: VecDeque<u64> = VecDeque::new();
    let (mut offset, mut req_id) = (0u64, 0u64);
    let mut next = |data: Vec<u8>, last: bool, offset: u64| {
        req_id += 1;
        let raft_message = if last { m.write_to_bytes().map_err(|e| e.to_string())? } else { Vec::new() };
        let chunk = proto::SnapshotChunk {
            from_node: d.me,
            shard,
            id: desc.id,
            offset,
            data: data.into(),
            last,
            raft_message: raft_message.into(),
        };
        Ok::<_, String>((req_id, Request { id: req_id, op: Some(Op::SnapshotChunk(chunk)) }))
    };
    loop {
        let chunk = rx.recv().await;
        let last = chunk.is_none();
        let data = chunk.unwrap_or_default();
        let len = data.len() as u64;
        let (id, req) = next(data, last, offset)?;
        offset += len;
        frame_buf.clear();
        frame::encode(&req, d.max_frame, &mut frame_buf).map_err(|e| e.to_string())?;
        tokio::time::timeout(REPLY_TIMEOUT, wr.write_all(&frame_buf))
            .await
            .map_err(|_| "timed out sending".to_string())?
            .map_err(|e| e.to_string())?;
        unanswered.push_back(id);
        if last {
            // The stream is whole only if the walk was.
            walker.await.map_err(|e| e.to_string())??;
            let check = REPLY_TIMEOUT + Duration::from_secs(offset / CHECK_BYTES_PER_SEC);
            while !unanswered.is_empty() {
                reply(&mut rd, &dec, &mut inbuf, &mut unanswered, check).await?;
            }
            return Ok(offset);
        }
        while unanswered.len() >= WINDOW {
            reply(&mut rd, &dec, &mut inbuf, &mut unanswered, REPLY_TIMEOUT).await?;
        }
    }
}

/// Waits for the answer to the oldest unanswered chunk.
async fn reply(
    rd: &mut tokio::io::ReadHalf<super::dial::PeerStream>,
    dec: &Decoder,
    buf: &mut BytesMut,
    unanswered: &mut VecDeque<u64>,
    timeout: Duration,
) -> Result<(), String> {
    let wait = async {
        loop {
            if let Some(r) = dec.next_message::<proto::Response>(buf).map_err(|e| e.to_string())? {
                return Ok::<_, String>(r);
            }
            if rd.read_buf(buf).await.map_err(|e| e.to_string())? == 0 {
                return Err("connection closed by the receiver".into());
            }
        }
    };
    let r = tokio::time::timeout(timeout, wait).await.map_err(|_| "no answer from the receiver".to_string())??;
    if unanswered.pop_front() != Some(r.id) {
        return Err(format!("an answer to request {} out of order", r.id));
    }
    match r.result {
        Some(R::SnapshotChunk(_)) => Ok(()),
        Some(R::Error(e)) => Err(format!("{:?}: {}", e.code(), e.message)),
        other => Err(format!("unexpected answer {other:?}")),
    }
}
