//! Raft traffic to peer nodes: one connection per peer, dialed by this
//! node, authenticated with this node's own secret, carrying batches of raft
//! messages as `Raft` requests of the framed protocol. Shard threads hand
//! messages over without blocking: each peer has a queue bounded in
//! messages and in bytes, and a message that finds it full (or the peer
//! unreachable) is dropped: raft retransmits. A peer that takes nothing
//! for [`PEER_WRITE_TIMEOUT`] is dropped too, and its queue with it.
//! With peer TLS (`peer_tls`) the connection is TLS, and the peer's
//! certificate must name the node dialed.
//! Snapshots do not go this way: raft's MsgSnapshot goes to `transfer`,
//! which streams the snapshot on a connection of its own.
//!
//! Dials leave from the IP of this node's own peer address in the cluster
//! file (unless that is unspecified, `0.0.0.0` or `::`), so peers, and
//! firewalls between nodes, see node traffic come from the address the
//! file names for the node, not whichever address the route picks.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use dmkv_common::frame;
use dmkv_common::proto::{Request, request::Op};
use raft::prelude::Message;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

pub use super::dial::{DIAL_TIMEOUT, Dialer, ask};
use super::dial::{PeerStream, dial};
use super::wire::{self, MAX_BATCH_MESSAGES};

/// Raft messages queued for one peer at most...
pub const MAX_PEER_QUEUE: usize = 16384;
/// ...and bytes of them (entries' data and a message's framing), at most
/// this share (1/n) of the node's memory, and at most
/// [`MAX_PEER_QUEUE_BYTES`].
pub const PEER_QUEUE_MEMORY_SHARE: u64 = 16;
pub const MAX_PEER_QUEUE_BYTES: u64 = 64 << 20;
/// What a message costs in a queue beside its entries' data.
const MESSAGE_OVERHEAD: u64 = 64;
/// A write to a peer that does not complete within this drops the
/// connection (the peer takes nothing: stalled, or gone without a reset).
pub const PEER_WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// First wait before redialing a peer; doubles up to [`MAX_REDIAL`].
pub const MIN_REDIAL: Duration = Duration::from_millis(50);
/// Longest wait between dials of an unreachable peer.
pub const MAX_REDIAL: Duration = Duration::from_secs(1);

/// The node's queues towards its peers.
pub struct Peers {
    queues: HashMap<u64, Queue>,
    /// Where snapshots go.
    pub snapshots: super::transfer::Transfers,
}

/// One peer's queue, and its bytes.
struct Queue {
    tx: mpsc::Sender<(u32, Message)>,
    bytes: Arc<AtomicU64>,
    max_bytes: u64,
}

/// Whether a queue holding `queued` bytes of at most `max` takes a
/// message of `cost`. An empty queue takes any one message, however large
/// (one entry of the largest value may be above a small node's bound):
/// else it would be dropped, and resent, forever.
fn admits(queued: u64, cost: u64, max: u64) -> bool {
    queued == 0 || queued.saturating_add(cost) <= max
}

/// What a queued message costs.
fn cost(m: &Message) -> u64 {
    MESSAGE_OVERHEAD + m.entries.iter().map(|e| e.data.len() as u64 + MESSAGE_OVERHEAD).sum::<u64>()
}

impl Peers {
    /// Starts a sender task per peer on the current runtime; they stop
    /// when `stop` turns true. `memory`: the node's memory, which bounds
    /// the queues' bytes.
    pub fn start(dialer: Dialer, peers: Vec<(u64, SocketAddr)>, stop: watch::Receiver<bool>, memory: u64) -> Peers {
        let max_bytes = (memory / PEER_QUEUE_MEMORY_SHARE).clamp(1 << 20, MAX_PEER_QUEUE_BYTES);
        let snapshots = super::transfer::Transfers::new(dialer.clone(), &peers);
        let mut queues = HashMap::new();
        for (id, addr) in peers {
            let (tx, rx) = mpsc::channel(MAX_PEER_QUEUE);
            let bytes = Arc::new(AtomicU64::new(0));
            queues.insert(id, Queue { tx, bytes: Arc::clone(&bytes), max_bytes });
            tokio::spawn(send_loop(dialer.clone(), id, addr, rx, bytes, stop.clone()));
        }
        Peers { queues, snapshots }
    }

    /// Queues `m` (of `shard`) for its addressee; drops it if the queue is
    /// full or the peer is unknown. A snapshot goes to [`Peers::snapshots`].
    pub fn send(&self, shard: u32, m: Message) {
        if m.get_msg_type() == raft::prelude::MessageType::MsgSnapshot {
            self.snapshots.send(shard, m);
            return;
        }
        let Some(q) = self.queues.get(&dmkv_common::cluster::map::node_of(m.to)) else { return };
        let c = cost(&m);
        if !admits(q.bytes.fetch_add(c, Ordering::Relaxed), c, q.max_bytes) {
            q.bytes.fetch_sub(c, Ordering::Relaxed);
            return;
        }
        if q.tx.try_send((shard, m)).is_err() {
            q.bytes.fetch_sub(c, Ordering::Relaxed);
        }
    }
}

/// Takes a message off a queue, giving its bytes back.
fn taken(bytes: &AtomicU64, m: (u32, Message)) -> (u32, Message) {
    bytes.fetch_sub(cost(&m.1), Ordering::Relaxed);
    m
}

async fn send_loop(
    d: Dialer,
    peer: u64,
    addr: SocketAddr,
    mut rx: mpsc::Receiver<(u32, Message)>,
    bytes: Arc<AtomicU64>,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = MIN_REDIAL;
    let mut warned = false;
    loop {
        let dialed = tokio::select! {
            r = tokio::time::timeout(DIAL_TIMEOUT, dial(&d, peer, addr)) => r.unwrap_or_else(|_| Err("timed out".into())),
            _ = stop.changed() => return,
        };
        match dialed {
            Ok(stream) => {
                info!(peer, %addr, "connected to peer");
                backoff = MIN_REDIAL;
                warned = false;
                tokio::select! {
                    r = pump(&d, stream, &mut rx, &bytes) => match r {
                        Ok(()) => return,
                        Err(e) => warn!(peer, %addr, "peer connection lost: {e}"),
                    },
                    _ = stop.changed() => return,
                }
            }
            Err(e) if !warned => {
                // Peers start in any order: say it once, not per redial.
                warn!(peer, %addr, "cannot reach peer (will keep trying): {e}");
                warned = true;
            }
            Err(e) => debug!(peer, %addr, "cannot reach peer: {e}"),
        }
        // Messages queued while the peer was away are stale: raft resends
        // what still matters.
        while let Ok(m) = rx.try_recv() {
            taken(&bytes, m);
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(MAX_REDIAL);
    }
}

/// Sends batches until the queue closes (`Ok`) or the connection fails.
async fn pump(
    d: &Dialer,
    stream: PeerStream,
    rx: &mut mpsc::Receiver<(u32, Message)>,
    bytes: &AtomicU64,
) -> Result<(), String> {
    let (mut rd, mut wr) = tokio::io::split(stream);
    // Replies only count accepted messages: read and discard them, so the
    // peer's writes never block.
    let mut drain = tokio::spawn(async move { tokio::io::copy(&mut rd, &mut tokio::io::sink()).await });
    // A batch's messages must fit one frame, with room for framing.
    let budget = d.max_frame.saturating_sub(64 << 10).max(1);
    let mut id = 10u64;
    let mut out = BytesMut::new();
    let mut next: Option<(u32, Message)> = None;
    loop {
        let first = match next.take() {
            Some(m) => m,
            None => tokio::select! {
                m = rx.recv() => match m {
                    Some(m) => taken(bytes, m),
                    None => return Ok(()),
                },
                _ = &mut drain => return Err("connection closed by the peer".into()),
            },
        };
        // Alone if over the budget: raft bounds a message's entries
        // (`replica::MAX_MESSAGE_BYTES`), and one entry fits a frame.
        let mut size = protobuf::Message::compute_size(&first.1) as usize;
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH_MESSAGES && size < budget {
            let Ok(m) = rx.try_recv() else { break };
            let m = taken(bytes, m);
            let n = protobuf::Message::compute_size(&m.1) as usize;
            if size + n > budget {
                next = Some(m);
                break;
            }
            size += n;
            batch.push(m);
        }
        id += 1;
        let req = Request { id, op: Some(Op::Raft(wire::encode(d.me, &batch))) };
        out.clear();
        if let Err(e) = frame::encode(&req, d.max_frame, &mut out) {
            // Never expected (see above): say so loudly; raft sends again.
            warn!("raft batch of {size} bytes does not fit a frame: {e}");
            continue;
        }
        match tokio::time::timeout(PEER_WRITE_TIMEOUT, wr.write_all(&out)).await {
            Ok(r) => r.map_err(|e| e.to_string())?,
            Err(_) => return Err(format!("the peer took nothing for {PEER_WRITE_TIMEOUT:?}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_is_bounded_in_bytes_but_always_takes_one_message() {
        assert!(admits(0, 5 << 20, 1 << 20), "an empty queue takes a message above its bound");
        assert!(!admits(1, 1 << 20, 1 << 20), "a queue with something in it keeps its bound");
        assert!(admits(100, 200, 300));
        assert!(!admits(u64::MAX - 1, 10, u64::MAX - 1), "no overflow");
    }
}
