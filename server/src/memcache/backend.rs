//! What the memcached port's commands run against: a single node's store
//! ([`Kv`]), or a cluster node. A cluster node serves every key: a key
//! whose shard it leads runs here as the native port would run it (the
//! same request, `service::node_op`), and any other goes to the shard's
//! leader over the cluster's own connections (`cluster::forward`), as a
//! proxy such as mcrouter would send it, but inside the node. A multi-key
//! get asks each leader once for all of its keys.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dmkv_common::cluster::map::NodeId;
use dmkv_common::error::Error as StoreError;
use dmkv_common::limits::MAX_MULTI_GET_KEYS;
use dmkv_common::proto::{self, ErrorCode, request::Op, response::Result as R};

use crate::cluster::forward::ForwardError;
use crate::cluster::node::ClusterNode;
use crate::kv::{Arith, Expiry, Item, ItemMeta, Kv, Mode, Write};
use crate::node::SingleNode;
use crate::service::Shared;

/// Most nodes one request goes through after this one (leaders named by
/// NOT_LEADER answers that moved on meanwhile).
pub const MAX_HOPS: usize = 3;
/// Most a request waits for its shard to have a leader (an election).
pub const MAX_LEADER_WAIT: Duration = Duration::from_secs(2);
/// How often a request without a leader looks again.
const LEADER_POLL: Duration = Duration::from_millis(20);
/// Most a multi-key get waits, all its leaders together; a key not
/// answered by then is answered unavailable.
pub const GET_MANY_DEADLINE: Duration = Duration::from_secs(8);
/// A multi-key get's keys asked on their own at once (where a leader's
/// multi-get failed).
const MAX_GETS_AT_ONCE: usize = 32;

/// Why a command was not carried out: the store's refusals, and a
/// cluster's two of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    EmptyKey,
    KeyTooLarge(usize),
    ValueTooLarge(usize),
    OutOfMemory,
    IndexFull,
    NotStored,
    Exists,
    NotFound,
    NotNumeric,
    /// The key's shard has no leader this node can reach: nothing was
    /// done.
    Unavailable,
    /// A write was sent to the leader but its answer was lost: it may or
    /// may not have been applied.
    Uncertain,
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Error {
        match e {
            StoreError::EmptyKey => Error::EmptyKey,
            StoreError::KeyTooLarge(n) => Error::KeyTooLarge(n),
            StoreError::ValueTooLarge(n) => Error::ValueTooLarge(n),
            StoreError::OutOfMemory => Error::OutOfMemory,
            StoreError::IndexFull => Error::IndexFull,
            StoreError::NotStored => Error::NotStored,
            StoreError::Exists => Error::Exists,
            StoreError::NotFound => Error::NotFound,
            StoreError::NotNumeric => Error::NotNumeric,
        }
    }
}

/// What the port runs against.
#[derive(Clone)]
pub enum Backend {
    Single(Arc<SingleNode>),
    Cluster(Arc<ClusterNode>),
}

/// The commands' view of the backend.
pub enum McKv<'a> {
    Single(Kv<'a>),
    Cluster { node: &'a ClusterNode, shared: &'a Arc<Shared> },
}

impl McKv<'_> {
    /// The server's clock (unix ms).
    pub fn now_ms(&self) -> u64 {
        crate::clock::now_ms()
    }

    /// The live item of `key`.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Item>, Error> {
        match self {
            McKv::Single(kv) => Ok(kv.get(key)?),
            McKv::Cluster { .. } => {
                let r = self.run(key, Op::Get(proto::Get { key: Bytes::copy_from_slice(key) }), false).await?;
                match r {
                    R::Get(g) => Ok(item_of(g)),
                    other => Err(unexpected(&other)),
                }
            }
        }
    }

    /// The live item of each key, in order. One request per leader on a
    /// cluster node.
    pub async fn get_many(&self, keys: &[&[u8]]) -> Vec<Result<Option<Item>, Error>> {
        let McKv::Cluster { node, shared } = self else {
            let mut out = Vec::with_capacity(keys.len());
            for k in keys {
                out.push(self.get(k).await);
            }
            return out;
        };
        // Keys by the node the map says leads their shard: one multi-get
        // each (in pieces of at most MAX_MULTI_GET_KEYS); a key whose
        // shard has no leader known goes alone, through `get`.
        let map = node.map();
        let mut by_leader: BTreeMap<NodeId, Vec<usize>> = BTreeMap::new();
        let mut alone = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            match map.shard_of(k).leader {
                Some(l) => by_leader.entry(l).or_default().push(i),
                None => alone.push(i),
            }
        }
        // One deadline for the whole request, the leaders asked at once,
        // and keys that must go alone a few at a time: a leader that does
        // not answer costs one wait, not one per key.
        let deadline = tokio::time::Instant::now() + GET_MANY_DEADLINE;
        let mut out: Vec<Option<Result<Option<Item>, Error>>> = vec![None; keys.len()];
        let parts: Vec<(NodeId, &[usize])> =
            by_leader.iter().flat_map(|(&l, idx)| idx.chunks(MAX_MULTI_GET_KEYS).map(move |p| (l, p))).collect();
        let asked = futures_util::future::join_all(parts.iter().map(|&(leader, part)| {
            let op =
                Op::MultiGet(proto::MultiGet { keys: part.iter().map(|&i| Bytes::copy_from_slice(keys[i])).collect() });
            tokio::time::timeout_at(deadline, call(node, shared, leader, op))
        }))
        .await;
        for ((_, part), got) in parts.iter().zip(asked) {
            match got {
                Ok(Ok(R::MultiGet(m))) if m.values.len() == part.len() => {
                    for (&i, g) in part.iter().zip(m.values) {
                        out[i] = Some(Ok(item_of(g)));
                    }
                }
                // The deadline passed: unavailable, as below.
                Err(_) => {}
                // Moved on, too large for one reply, or unreachable: each
                // key on its own (where its shard is led now).
                Ok(_) => alone.extend_from_slice(part),
            }
        }
        let singles: Vec<(usize, Result<Option<Item>, Error>)> =
            futures_util::StreamExt::collect(futures_util::StreamExt::buffer_unordered(
                futures_util::stream::iter(alone.into_iter().map(|i| async move {
                    let got = tokio::time::timeout_at(deadline, self.get(keys[i])).await;
                    (i, got.unwrap_or(Err(Error::Unavailable)))
                })),
                MAX_GETS_AT_ONCE,
            ))
            .await;
        for (i, got) in singles {
            out[i] = Some(got);
        }
        out.into_iter().map(|r| r.unwrap_or(Err(Error::Unavailable))).collect()
    }

    /// The live item of `key`, after giving it expiry `expires_at` (0:
    /// never): memcached's gat and touch.
    pub async fn touch(&self, key: &[u8], expires_at: u32) -> Result<Option<Item>, Error> {
        match self {
            McKv::Single(kv) => Ok(kv.touch(key, expires_at).await?),
            McKv::Cluster { .. } => {
                let t = proto::Touch { key: Bytes::copy_from_slice(key), expires_at, get: true, ..Default::default() };
                // An expiry of 0 is "never" here; in a Touch request it is
                // "use ttl_secs", which is 0 too: never. The same.
                match self.run(key, Op::Touch(t), true).await? {
                    R::Touch(g) => Ok(item_of(g)),
                    other => Err(unexpected(&other)),
                }
            }
        }
    }

    /// One write; returns the item's meta.
    pub async fn write(&self, key: &[u8], w: &Write<'_>) -> Result<ItemMeta, Error> {
        match self {
            McKv::Single(kv) => Ok(kv.write(key, w).await?),
            McKv::Cluster { .. } => {
                let expires_at = match w.expiry {
                    Expiry::At(at) => at,
                    // Append and prepend keep the item's expiry wherever it
                    // applies: the request's is not looked at.
                    Expiry::Keep => 0,
                };
                let p = proto::Put {
                    key: Bytes::copy_from_slice(key),
                    value: Bytes::copy_from_slice(w.value),
                    mode: put_mode(w.mode) as i32,
                    flags: w.flags,
                    expires_at,
                    cas: w.cas,
                    vivify: w.vivify,
                    ..Default::default()
                };
                match self.run(key, Op::Put(p), true).await? {
                    R::Put(r) => Ok(ItemMeta { version: r.version, flags: w.flags, expires_at }),
                    other => Err(unexpected(&other)),
                }
            }
        }
    }

    /// Removes `key`; `cas` 0 or the item's version. Ok(false): no such
    /// (live) item; Err(Exists): another version.
    pub async fn delete(&self, key: &[u8], cas: u64) -> Result<bool, Error> {
        match self {
            McKv::Single(kv) => Ok(kv.delete(key, cas).await?),
            McKv::Cluster { .. } => {
                let d = proto::Delete { key: Bytes::copy_from_slice(key), cas, write_id: None };
                match self.run(key, Op::Delete(d), true).await? {
                    R::Delete(r) => Ok(r.existed),
                    other => Err(unexpected(&other)),
                }
            }
        }
    }

    /// A counter operation; returns the new value and the item's meta.
    pub async fn arith(&self, key: &[u8], a: &Arith) -> Result<(u64, ItemMeta), Error> {
        match self {
            McKv::Single(kv) => Ok(kv.arith(key, a).await?),
            McKv::Cluster { .. } => {
                // One expiry in the request: a vivified item's, else the
                // new one asked for (0: the item keeps its own).
                let expires_at = match (a.vivify, a.expiry) {
                    (Some((_, at)), _) => at,
                    (None, Expiry::At(at)) => at,
                    (None, Expiry::Keep) => 0,
                };
                let p = proto::Arith {
                    key: Bytes::copy_from_slice(key),
                    delta: a.delta,
                    decrement: !a.incr,
                    cas: a.cas,
                    vivify: a.vivify.is_some(),
                    initial: a.vivify.map_or(0, |(n, _)| n),
                    expires_at,
                    ..Default::default()
                };
                match self.run(key, Op::Arith(p), true).await? {
                    R::Arith(r) => Ok((r.value, ItemMeta { version: r.version, ..Default::default() })),
                    other => Err(unexpected(&other)),
                }
            }
        }
    }

    /// Removes every item stored up to now, after `delay`. On a cluster
    /// node: every shard, each by its leader (this node's own, and every
    /// other node asked for its own); a shard without a leader then is
    /// not emptied.
    pub async fn flush_all(&self, delay: Duration) -> Result<(), Error> {
        match self {
            McKv::Single(kv) => {
                kv.flush_all(delay).await;
                Ok(())
            }
            McKv::Cluster { node, shared } => {
                let (node, shared) = (node.id, Arc::clone(shared));
                let flush = async move {
                    let Some(c) = shared.node.cluster() else { return Err(Error::Unavailable) };
                    let mut result = Ok(());
                    let mut nodes: Vec<NodeId> = c.map().shards().iter().flat_map(|s| s.replicas.clone()).collect();
                    nodes.sort_unstable();
                    nodes.dedup();
                    for n in nodes {
                        let r = if n == node {
                            crate::service::node_op(&shared, Op::FlushAll(proto::FlushAll {})).await
                        } else {
                            forwarded(c.forward.call(n, Op::FlushAll(proto::FlushAll {})).await, true)
                        };
                        if let Err(e) = r {
                            tracing::warn!(node = n, "flush_all: a node did not flush its shards: {}", e.message);
                            result = Err(Error::Unavailable);
                        }
                    }
                    result
                };
                if delay.is_zero() {
                    return flush.await;
                }
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = flush.await;
                });
                Ok(())
            }
        }
    }

    /// Runs `op` (on `key`) where its shard is led: here, or on the leader
    /// this node knows, following NOT_LEADER answers (at most [`MAX_HOPS`])
    /// and waiting out an election (at most [`MAX_LEADER_WAIT`]). `write`:
    /// a request whose answer was lost may have been applied (UNCERTAIN),
    /// where a read is asked again.
    async fn run(&self, key: &[u8], op: Op, write: bool) -> Result<R, Error> {
        let McKv::Cluster { node, shared } = self else { return Err(Error::Unavailable) };
        let deadline = tokio::time::Instant::now() + MAX_LEADER_WAIT;
        let mut target = first_hop(node, key, 0);
        let (mut hops, mut asks) = (0, 0);
        loop {
            let r = match target {
                Some(to) if to != node.id => forwarded(node.forward.call(to, op.clone()).await, write),
                _ => crate::service::node_op(shared, op.clone()).await,
            };
            let e = match r {
                Ok(r) => return Ok(r),
                Err(e) => e,
            };
            match ErrorCode::try_from(e.code).unwrap_or(ErrorCode::Internal) {
                ErrorCode::NotLeader if e.leader != 0 && hops < MAX_HOPS => {
                    hops += 1;
                    target = Some(e.leader);
                    continue;
                }
                // A partition that moved: this node's map catches up.
                ErrorCode::NotLeader | ErrorCode::WrongShard | ErrorCode::Busy | ErrorCode::ShuttingDown
                    if tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(LEADER_POLL).await;
                    asks += 1;
                    target = first_hop(node, key, asks);
                    hops = 0;
                }
                code => return Err(error_of(code, &e)),
            }
        }
    }
}

/// Where a request for `key` goes first (`None`: here): the leader this
/// node knows; else, if it holds no replica of the key's shard (a spare,
/// or a shard placed elsewhere), one of the shard's nodes, a different
/// one each `ask`, whose NOT_LEADER names the leader. Leaders are learnt
/// from a node's own replicas, so one without any would otherwise wait
/// for an election it never hears of.
fn first_hop(node: &ClusterNode, key: &[u8], ask: usize) -> Option<NodeId> {
    let map = node.map();
    let shard = map.shard_of(key);
    shard.leader.or_else(|| {
        if shard.replicas.contains(&node.id) || shard.replicas.is_empty() {
            return None;
        }
        Some(shard.replicas[ask % shard.replicas.len()])
    })
}

/// Sends `op` to node `to` (this one: runs it here).
async fn call(node: &ClusterNode, shared: &Arc<Shared>, to: NodeId, op: Op) -> Result<R, proto::Error> {
    if to == node.id {
        return crate::service::node_op(shared, op).await;
    }
    forwarded(node.forward.call(to, op).await, false)
}

/// A forwarded request's answer as a local one's: an error reply as the
/// error, a request that was not sent as NOT_LEADER (nothing happened; the
/// leader is looked up again), a lost answer as UNCERTAIN for a write and
/// NOT_LEADER (asked again) for a read.
fn forwarded(r: Result<R, ForwardError>, write: bool) -> Result<R, proto::Error> {
    let plain = |code: ErrorCode, message: String| proto::Error { code: code as i32, message, ..Default::default() };
    match r {
        Ok(R::Error(e)) => Err(e),
        Ok(r) => Ok(r),
        Err(ForwardError::NotSent(m)) => Err(plain(ErrorCode::NotLeader, m)),
        Err(ForwardError::NoAnswer(m)) if write => Err(plain(ErrorCode::Uncertain, m)),
        Err(ForwardError::NoAnswer(m)) => Err(plain(ErrorCode::NotLeader, m)),
    }
}

fn error_of(code: ErrorCode, e: &proto::Error) -> Error {
    match code {
        ErrorCode::KeyTooLarge => Error::KeyTooLarge(0),
        ErrorCode::ValueTooLarge => Error::ValueTooLarge(0),
        ErrorCode::OutOfMemory => Error::OutOfMemory,
        ErrorCode::IndexFull => Error::IndexFull,
        ErrorCode::NotStored => Error::NotStored,
        ErrorCode::Exists => Error::Exists,
        ErrorCode::NotFound => Error::NotFound,
        ErrorCode::NotNumeric => Error::NotNumeric,
        ErrorCode::Uncertain => Error::Uncertain,
        ErrorCode::BadRequest if e.message.contains("empty") => Error::EmptyKey,
        _ => {
            tracing::debug!("memcached command not carried out: {code:?}: {}", e.message);
            Error::Unavailable
        }
    }
}

fn unexpected(r: &R) -> Error {
    tracing::warn!("memcached command: an unexpected reply {r:?}");
    Error::Unavailable
}

fn item_of(g: proto::GetReply) -> Option<Item> {
    g.found.then(|| Item {
        value: g.value,
        meta: ItemMeta { version: g.version, flags: g.flags, expires_at: g.expires_at },
    })
}

fn put_mode(m: Mode) -> proto::PutMode {
    match m {
        Mode::Set => proto::PutMode::Set,
        Mode::Add => proto::PutMode::Add,
        Mode::Replace => proto::PutMode::Replace,
        Mode::Append => proto::PutMode::Append,
        Mode::Prepend => proto::PutMode::Prepend,
    }
}
