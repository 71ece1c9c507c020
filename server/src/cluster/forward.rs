//! Requests a node passes on to another node's peer port: the memcached
//! port serves every key on every node, and a key whose shard another
//! node leads goes to that node this way (as a proxy such as mcrouter
//! would, but inside the node). Over the cluster's own connections:
//! dialed like raft's ([`super::dial`]: authenticated with this node's
//! secret, TLS when the node has peer TLS), one per peer, pipelined
//! (requests carry ids, replies come back by id, in any order).
//!
//! A link is dialed when first needed and dropped when it fails, stalls
//! (its peer answers nothing while callers wait) or idles ([`LINK_IDLE`]);
//! the requests on it then fail (a write among them may or may not have
//! been applied, unless it was never wholly written: the caller says
//! which). Everything is bounded: requests waiting on a link
//! ([`MAX_LINK_QUEUE`]), unanswered ones ([`MAX_IN_FLIGHT`]), bytes not yet
//! written ([`MAX_UNWRITTEN`]), and each request's wait
//! ([`FORWARD_TIMEOUT`]).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use dmkv_common::cluster::map::NodeId;
use dmkv_common::frame::{self, Decoder};
use dmkv_common::proto::{self, Request, request::Op, response::Result as R};
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::dial::{self, Dialer};

/// Requests waiting for a link's writer, per peer.
pub const MAX_LINK_QUEUE: usize = 1024;
/// Requests sent on one link and not yet answered.
pub const MAX_IN_FLIGHT: usize = 4096;
/// Most a forwarded request waits for its answer, dial included.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes of requests taken from the queue and not yet written.
pub const MAX_UNWRITTEN: usize = 4 << 20;
/// How often a link drops the requests whose callers gave up, and checks
/// that its peer still reads and answers.
const SWEEP_EVERY: Duration = Duration::from_secs(1);
/// A link with nothing to do for this long is closed (a peer's server
/// closes idle connections after minutes).
pub const LINK_IDLE: Duration = Duration::from_secs(60);

/// Why a forwarded request has no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardError {
    /// It was not sent: the peer is unknown, unreachable, or its queue is
    /// full. Nothing happened there.
    NotSent(String),
    /// Sent, but no answer came (the link failed or the wait ran out): a
    /// write may or may not have been applied.
    NoAnswer(String),
}

type Answer = oneshot::Sender<Result<R, ForwardError>>;

/// This node's links to its peers for forwarded requests.
pub struct Forwarder {
    dialer: Dialer,
    addrs: HashMap<NodeId, SocketAddr>,
    links: Mutex<HashMap<NodeId, mpsc::Sender<(Op, Answer)>>>,
    /// Requests sent (memcached's `stats`: `forwarded`).
    pub sent: std::sync::atomic::AtomicU64,
}

impl Forwarder {
    pub fn new(dialer: Dialer, peers: &[(NodeId, SocketAddr)]) -> Forwarder {
        Forwarder {
            dialer,
            addrs: peers.iter().copied().collect(),
            links: Mutex::new(HashMap::new()),
            sent: Default::default(),
        }
    }

    /// Node `to`'s peer address.
    pub fn addr(&self, to: NodeId) -> Option<SocketAddr> {
        self.addrs.get(&to).copied()
    }

    /// Sends `op` to node `to` and waits for its answer (an error reply is
    /// an answer: `R::Error`).
    pub async fn call(&self, to: NodeId, op: Op) -> Result<R, ForwardError> {
        let tx = self.link(to)?;
        let (answer, rx) = oneshot::channel();
        tx.try_send((op, answer)).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ForwardError::NotSent(format!("node {to}'s queue is full")),
            mpsc::error::TrySendError::Closed(_) => ForwardError::NotSent(format!("node {to}'s link closed")),
        })?;
        self.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match tokio::time::timeout(FORWARD_TIMEOUT, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ForwardError::NoAnswer(format!("node {to}'s link failed"))),
            Err(_) => Err(ForwardError::NoAnswer(format!("node {to} did not answer within {FORWARD_TIMEOUT:?}"))),
        }
    }

    /// The link to `to`, started if there is none (or it ended).
    fn link(&self, to: NodeId) -> Result<mpsc::Sender<(Op, Answer)>, ForwardError> {
        let addr = *self.addrs.get(&to).ok_or_else(|| ForwardError::NotSent(format!("no node {to}")))?;
        let mut links = crate::lock::lock(&self.links);
        if let Some(tx) = links.get(&to).filter(|tx| !tx.is_closed()) {
            return Ok(tx.clone());
        }
        let (tx, rx) = mpsc::channel(MAX_LINK_QUEUE);
        tokio::spawn(run_link(self.dialer.clone(), to, addr, rx));
        links.insert(to, tx.clone());
        Ok(tx)
    }
}

/// Dials, then writes requests and routes answers until the link fails,
/// stalls, idles, or nobody holds a sender; every request not answered
/// then fails. Reading and writing go on side by side (a link that only
/// read between writes could wait on a peer that waits on it).
async fn run_link(d: Dialer, to: NodeId, addr: SocketAddr, mut rx: mpsc::Receiver<(Op, Answer)>) {
    let stream = match tokio::time::timeout(dial::DIAL_TIMEOUT, dial::dial(&d, to, addr)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => return fail_queued(&mut rx, &format!("cannot reach node {to}: {e}")),
        Err(_) => return fail_queued(&mut rx, &format!("cannot reach node {to}: timed out")),
    };
    let (mut rd, mut wr) = tokio::io::split(stream);
    let mut link = Link::default();
    let dec = Decoder::new(d.max_frame);
    let mut inbuf = BytesMut::new();
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    let (mut last_write, mut last_use) = (Instant::now(), Instant::now());
    // Since when the peer has owed an answer without sending any: set
    // when a request is wholly written and none was owed, renewed by every
    // read. Requests whose callers gave up still count (their answers
    // are owed all the same), so a peer that went silent is found even
    // when every caller leaves early.
    let mut owed_since: Option<Instant> = None;
    // The id of the last request wholly written (ids rise, and frames go
    // out in order): those up to it are owed answers, later ones not yet.
    let mut written_through = 0u64;
    // Ids from 10: the dial's HELLO and AUTHENTICATE took lower ones.
    let mut next_id = 10u64;
    // Written since the last flush: TLS holds written bytes until flushed.
    let mut unflushed = false;
    let why = loop {
        tokio::select! {
            req = rx.recv(), if link.pending.len() < MAX_IN_FLIGHT && link.out.len() < MAX_UNWRITTEN => {
                let Some((op, answer)) = req else { break "no more requests".to_string() };
                next_id += 1;
                last_use = Instant::now();
                let before = link.out.len();
                if let Err(e) = frame::encode(&Request { id: next_id, op: Some(op) }, d.max_frame, &mut link.out) {
                    link.out.truncate(before);
                    let _ = answer.send(Err(ForwardError::NotSent(e.to_string())));
                    continue;
                }
                link.unwritten.push_back((next_id, link.out.len() - before));
                link.pending.insert(next_id, answer);
            }
            wrote = write_or_flush(&mut wr, &link.out), if !link.out.is_empty() || unflushed => {
                match wrote {
                    Ok(Some(0)) => break "closed by the peer".to_string(),
                    Ok(Some(n)) => {
                        if let Some(id) = link.wrote(n) {
                            written_through = id;
                            if owed_since.is_none() {
                                owed_since = Some(Instant::now());
                            }
                        }
                        last_write = Instant::now();
                        unflushed = true;
                    }
                    Ok(None) => unflushed = false,
                    Err(e) => break e.to_string(),
                }
            }
            read = rd.read_buf(&mut inbuf) => {
                match read {
                    Ok(0) => break "closed by the peer".to_string(),
                    Ok(_) => owed_since = Some(Instant::now()),
                    Err(e) => break e.to_string(),
                }
                loop {
                    match dec.next_message::<proto::Response>(&mut inbuf) {
                        Ok(Some(resp)) => {
                            // An id nobody waits for (answered after its
                            // caller gave up) is dropped.
                            if let Some(answer) = link.pending.remove(&resp.id) {
                                let r = resp.result.ok_or_else(|| ForwardError::NoAnswer("an empty reply".into()));
                                let _ = answer.send(r);
                            }
                        }
                        Ok(None) => {
                            // Nothing owed to anyone waiting (what is
                            // pending is not wholly written yet): the next
                            // request written starts the count.
                            if !link.pending.keys().any(|&id| id <= written_through) {
                                owed_since = None;
                            }
                            break;
                        }
                        Err(e) => {
                            inbuf.clear();
                            link.fail(&format!("a bad reply from node {to}: {e}"));
                            return fail_queued(&mut rx, "the link failed");
                        }
                    }
                }
            }
            _ = sweep.tick() => {
                // An answer owed for a caller's whole timeout with
                // nothing read: the peer is taken for dead (a host gone
                // without a reset would otherwise hold the link, and every
                // request to that node, forever). A link that reads
                // answers to others meanwhile is alive, however slow one
                // request is. Callers that gave up: their entries go.
                if owed_since.is_some_and(|t| t.elapsed() >= FORWARD_TIMEOUT) {
                    break format!("node {to} answered nothing for {FORWARD_TIMEOUT:?}");
                }
                link.pending.retain(|_, answer| !answer.is_closed());
                if !link.out.is_empty() && last_write.elapsed() >= FORWARD_TIMEOUT {
                    break format!("node {to} took nothing for {FORWARD_TIMEOUT:?}");
                }
                // Closed here, well before the peer's idle timeout would
                // close it under a request on its way.
                if link.pending.is_empty() && last_use.elapsed() >= LINK_IDLE {
                    break "idle".to_string();
                }
            }
        }
    };
    tracing::debug!(node = to, "forwarding link ends: {why}");
    link.fail(&why);
    fail_queued(&mut rx, &why);
}

/// Writes some of `out`, or flushes once it is all written: Some(bytes
/// written), or None once flushed. Either may be dropped unfinished (a
/// write then took nothing).
async fn write_or_flush<W: AsyncWrite + Unpin>(wr: &mut W, out: &[u8]) -> std::io::Result<Option<usize>> {
    if out.is_empty() { wr.flush().await.map(|()| None) } else { wr.write(out).await.map(Some) }
}

/// A link's requests: those sent and not answered, and the bytes of those
/// not wholly written yet.
#[derive(Default)]
struct Link {
    /// Requests written (or on their way), by id: who waits.
    pending: HashMap<u64, Answer>,
    out: BytesMut,
    /// Requests in `out`, in order: (id, frame length).
    unwritten: VecDeque<(u64, usize)>,
}

impl Link {
    /// `n` more bytes of `out` were written; the id of the last request
    /// that finished writing with them, if any did.
    fn wrote(&mut self, mut n: usize) -> Option<u64> {
        self.out.advance(n);
        let mut done = None;
        while let Some((id, len)) = self.unwritten.front_mut() {
            if n < *len {
                *len -= n;
                break;
            }
            n -= *len;
            done = Some(*id);
            self.unwritten.pop_front();
        }
        done
    }

    /// Fails every request: one not wholly written was not taken by the
    /// peer (it reads whole frames only); any other may have been.
    fn fail(&mut self, why: &str) {
        for (id, _) in self.unwritten.drain(..) {
            if let Some(answer) = self.pending.remove(&id) {
                let _ = answer.send(Err(ForwardError::NotSent(why.to_string())));
            }
        }
        for (_, answer) in self.pending.drain() {
            let _ = answer.send(Err(ForwardError::NoAnswer(why.to_string())));
        }
    }
}

/// Fails what is queued, and closes the queue: the next request starts a
/// new link.
fn fail_queued(rx: &mut mpsc::Receiver<(Op, Answer)>, why: &str) {
    rx.close();
    while let Ok((_, answer)) = rx.try_recv() {
        let _ = answer.send(Err(ForwardError::NotSent(why.to_string())));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use dmkv_common::proto::{Response, response::Result as R};

    use super::*;

    /// A peer that answers HELLO without asking for a proof, a GET of
    /// "slow" after 1.5 s, never a GET of "never", any other at once;
    /// counts the connections it accepted.
    async fn fake_peer() -> (SocketAddr, Arc<AtomicUsize>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                count.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let (mut rd, wr) = tokio::io::split(s);
                    let wr = Arc::new(tokio::sync::Mutex::new(wr));
                    let (dec, mut buf) = (Decoder::new(1 << 20), BytesMut::new());
                    while rd.read_buf(&mut buf).await.is_ok_and(|n| n > 0) {
                        while let Ok(Some(req)) = dec.next_message::<Request>(&mut buf) {
                            let (delay, result) = match req.op {
                                Some(Op::Hello(_)) => (0, R::Hello(Default::default())),
                                Some(Op::Get(g)) if &g.key[..] == b"never" => continue,
                                Some(Op::Get(g)) if &g.key[..] == b"slow" => (1500, R::Get(Default::default())),
                                _ => (0, R::Get(Default::default())),
                            };
                            let wr = Arc::clone(&wr);
                            tokio::spawn(async move {
                                tokio::time::sleep(Duration::from_millis(delay)).await;
                                let mut out = BytesMut::new();
                                let resp = Response { id: req.id, result: Some(result) };
                                frame::encode(&resp, 1 << 20, &mut out).unwrap();
                                let _ = wr.lock().await.write_all(&out).await;
                            });
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    fn get(key: &str) -> Op {
        Op::Get(proto::Get { key: bytes::Bytes::copy_from_slice(key.as_bytes()) })
    }

    /// A link quiet for longer than the forward timeout stays up when a
    /// caller gives up on a request while the peer is still answering
    /// others; a peer that answers nothing within the timeout is taken for
    /// dead (whether or not its callers waited), and the next request
    /// dials anew.
    #[tokio::test]
    async fn a_caller_giving_up_on_a_quiet_link_breaks_it_only_if_the_peer_is_silent() {
        let (addr, accepted) = fake_peer().await;
        let d = Dialer { me: 2, token: None, max_frame: 1 << 20, source: None, tls: None };
        let fw = Forwarder::new(d, &[(1, addr)]);
        assert!(fw.call(1, get("a")).await.is_ok());
        tokio::time::sleep(FORWARD_TIMEOUT + Duration::from_millis(300)).await;
        // A caller gives up at once (a client went away); another's
        // request takes 1.5 s to be answered.
        assert!(tokio::time::timeout(Duration::from_millis(20), fw.call(1, get("never"))).await.is_err());
        let slow = fw.call(1, get("slow")).await;
        assert!(slow.is_ok(), "a slow answer on a live link: {slow:?}");
        assert_eq!(accepted.load(Ordering::Relaxed), 1, "the link was not broken");

        // Nothing answered for the whole timeout: the link goes, and the
        // next request dials again.
        let silent = fw.call(1, get("never")).await;
        assert!(matches!(silent, Err(ForwardError::NoAnswer(_))), "{silent:?}");
        tokio::time::sleep(2 * SWEEP_EVERY + Duration::from_millis(200)).await;
        assert!(fw.call(1, get("b")).await.is_ok());
        assert_eq!(accepted.load(Ordering::Relaxed), 2, "a silent peer's link was kept");

        // The same when every caller leaves early: the answer is owed all
        // the same.
        assert!(tokio::time::timeout(Duration::from_millis(20), fw.call(1, get("never"))).await.is_err());
        tokio::time::sleep(FORWARD_TIMEOUT + 2 * SWEEP_EVERY + Duration::from_millis(200)).await;
        assert!(fw.call(1, get("c")).await.is_ok());
        assert_eq!(accepted.load(Ordering::Relaxed), 3, "a silent peer's link was kept after its callers left");
    }
}
