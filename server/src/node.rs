//! What a node serves, single or cluster: every client op is one method
//! here, so the RPC service decodes a request, calls the node and encodes
//! the reply, with one dispatch for both modes.
//!
//! [`Node`] is an enum, not a struct of options: the two modes share no
//! data (a single node's store, compactor and registration; a cluster
//! node's shard replicas, each with its own), so a field that is `None` in
//! one mode would be a state that must not happen. As an enum, a cluster
//! node cannot hold a store by mistake, and each op's difference between
//! the modes is one `match` in one place. Ops a mode does not serve are
//! refused here with the message that mode has always given.

mod stats;

use std::sync::Arc;

use bytes::Bytes;
use dmkv_common::cluster::map::ShardId;
use dmkv_common::error::Error as StoreError;
use dmkv_common::layout::LAYOUT_VERSION;
use dmkv_common::limits::MAX_MULTI_GET_KEYS;
use dmkv_common::proto;

use crate::clock;
use crate::cluster::node::{ClusterError, ClusterNode};
use crate::cluster::shard::JoinStep;
use crate::compact::{self, Compactor};
use crate::config::validate::{human, plain};
use crate::kv::{self, Item, ItemMeta, Kv, arith_of, expiry_of, write_of};
use crate::region::Region;
use crate::registration::{Registration, Served, ServedSet};
use crate::store::{Location, Store};

/// What this node serves (a handle: cloning it shares the node).
#[derive(Clone)]
pub enum Node {
    /// One store over the node's own region.
    Single(Arc<SingleNode>),
    /// Shard replicas: their stores and regions are the cluster node's.
    Cluster(Arc<ClusterNode>),
}

/// A node outside a cluster: its region, the store over it, the compactor
/// that makes room in it, and the region's registration.
pub struct SingleNode {
    store: Arc<Store>,
    /// Defragments the store's memory, and frees room for a PUT that needs it.
    compactor: Compactor,
    registration: Arc<Registration>,
    region_id: u32,
    #[cfg(feature = "rdma")]
    rdma: Option<crate::rdma::RdmaRegion>,
}

/// What a single node needs from the server's configuration.
pub struct SingleParams {
    pub memory: u64,
    pub buckets: u64,
    pub grace: std::time::Duration,
    /// `--evict lru`.
    pub evict: bool,
    pub compactor: compact::Mode,
}

/// Why an op failed; the service turns each into its error reply.
#[derive(Debug)]
pub enum NodeError {
    Store(StoreError),
    Cluster(ClusterError),
    /// Not served by this node, or malformed: BAD_REQUEST.
    BadRequest(String),
    /// The reply would exceed this many bytes (the frame limit).
    TooLarge(usize),
    /// The node could not do it: INTERNAL.
    Internal(String),
}

impl std::fmt::Display for NodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeError::Store(e) => e.fmt(f),
            NodeError::Cluster(e) => write!(f, "{e:?}"),
            NodeError::BadRequest(m) | NodeError::Internal(m) => f.write_str(m),
            NodeError::TooLarge(n) => write!(f, "reply exceeds the maximum frame of {n} bytes"),
        }
    }
}

impl From<StoreError> for NodeError {
    fn from(e: StoreError) -> NodeError {
        NodeError::Store(e)
    }
}

impl From<ClusterError> for NodeError {
    fn from(e: ClusterError) -> NodeError {
        NodeError::Cluster(e)
    }
}

/// A live item and where its slot is (the reply's hint for one-sided
/// readers).
pub struct Found {
    pub item: Item,
    pub at: Location,
}

const NOT_IN_CLUSTER: &str = "this node is not part of a cluster";

impl SingleNode {
    /// Creates the region, formats the store over it, and starts eviction
    /// (with `--evict lru`) and the compactor.
    pub fn format(p: &SingleParams) -> std::io::Result<SingleNode> {
        let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, e);
        let region = Arc::new(Region::create("dmkv-region", p.memory as usize).map_err(|e| {
            let size = human(p.memory);
            std::io::Error::new(e.kind(), format!("--memory: cannot create a {size} region: {}", plain(&e)))
        })?);
        let seed: u64 = rand::random();
        // Epochs start at a random value so a restarted server never reuses one.
        let epoch: u64 = rand::random::<u32>() as u64 + 1;
        let store = Arc::new(
            Store::format(region, p.buckets, seed, epoch, p.grace)
                .map_err(|e| invalid(format!("--memory, --buckets: cannot lay out the region: {e}")))?,
        );
        if p.evict {
            crate::store::evict::start(&store)
                .map_err(|e| std::io::Error::new(e.kind(), format!("cannot start eviction: {e}")))?;
        }
        let compactor = Compactor::spawn(Arc::clone(&store), p.compactor)
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot start the compactor: {e}")))?;
        let registration = Arc::new(Registration::new(*store.header()));
        Ok(SingleNode {
            store,
            compactor,
            registration,
            region_id: 0,
            #[cfg(feature = "rdma")]
            rdma: None,
        })
    }

    /// Registers the region for RDMA reads too (`Ok` without when it
    /// cannot be and the device was found, not named: see [`crate::rdma::RdmaUse`]).
    #[cfg(feature = "rdma")]
    pub fn register_rdma(&mut self, rdma: &crate::rdma::RdmaUse) -> Result<(), String> {
        self.rdma = rdma.register(Arc::clone(self.store.region()), "the region")?;
        if self.rdma.is_some() {
            tracing::info!(device = rdma.device.device_name(), "region registered for RDMA reads");
        }
        Ok(())
    }

    #[cfg(feature = "rdma")]
    pub fn rdma(&self) -> Option<&crate::rdma::RdmaRegion> {
        self.rdma.as_ref()
    }

    /// The rkey RDMA readers of the region name now (0: not registered).
    fn rdma_rkey(&self) -> u32 {
        #[cfg(feature = "rdma")]
        if let Some(Ok(r)) = self.rdma.as_ref().map(|r| r.remote()) {
            return r.rkey;
        }
        0
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    pub fn registration(&self) -> &Arc<Registration> {
        &self.registration
    }

    /// The store's semantics (expiry, conditional writes, waiting for
    /// room) over this node's store and compactor.
    pub fn kv(&self) -> Kv<'_> {
        Kv::new(&self.store, &self.compactor)
    }

    fn get(&self, key: &[u8]) -> Result<Option<Found>, NodeError> {
        Ok(self.store.get_item(key, clock::now_ms())?.map(|(item, at)| Found { item, at }))
    }

    fn multi_get(&self, keys: &[Bytes], max_bytes: usize) -> Result<Vec<Option<Found>>, NodeError> {
        let mut values = Vec::with_capacity(keys.len());
        let mut value_bytes = 0usize;
        for k in keys {
            let found = self.get(k)?;
            if let Some(f) = &found {
                // Values past the frame limit cannot be sent: refuse as
                // soon as they are, rather than first gathering up to
                // MAX_MULTI_GET_KEYS maximum values (a gigabyte) that
                // one small request can ask for.
                value_bytes += f.item.value.len();
                if value_bytes > max_bytes {
                    return Err(NodeError::TooLarge(max_bytes));
                }
            }
            values.push(found);
        }
        Ok(values)
    }

    /// Registers the region anew (new rkey, next epoch) on every transport;
    /// returns the new epoch.
    fn reregister(&self) -> Result<u64, NodeError> {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            r.reregister().map_err(|e| NodeError::Internal(format!("RDMA re-registration failed: {e}")))?;
        }
        let epoch = self.registration.reregister(self.store.region());
        tracing::info!(epoch, "region registered anew");
        Ok(epoch)
    }
}

/// A cluster shard's item as a GET finds it.
fn found((item, at): (Item, Location)) -> Found {
    Found { item, at }
}

impl Node {
    /// The cluster node, if this is one.
    pub fn cluster(&self) -> Option<&Arc<ClusterNode>> {
        match self {
            Node::Cluster(c) => Some(c),
            Node::Single(_) => None,
        }
    }

    /// The single node, if this is one: what only it serves (the memcached
    /// port) takes it from here.
    pub fn single(&self) -> Option<&Arc<SingleNode>> {
        match self {
            Node::Single(s) => Some(s),
            Node::Cluster(_) => None,
        }
    }

    /// Stores a PUT; returns the item's new version.
    pub async fn put(&self, p: &proto::Put) -> Result<u64, NodeError> {
        match self {
            Node::Single(s) => {
                let w = write_of(p, clock::now_ms());
                Ok(kv::write(&s.kv(), &p.key, &w).await?.version)
            }
            Node::Cluster(c) => Ok(c.write(p.clone()).await?),
        }
    }

    /// The live item of `key` on a single node, which answers without a
    /// wait; `None` on a cluster node, whose GETs wait for their shard.
    pub fn get_now(&self, key: &[u8]) -> Option<Result<Option<Found>, NodeError>> {
        match self {
            Node::Single(s) => Some(s.get(key)),
            Node::Cluster(_) => None,
        }
    }

    /// The live item of `key`.
    pub async fn get(&self, key: &[u8]) -> Result<Option<Found>, NodeError> {
        match self {
            Node::Single(s) => s.get(key),
            Node::Cluster(c) => Ok(c.get(key).await?.map(found)),
        }
    }

    /// Removes a key; whether it had a live item.
    pub async fn delete(&self, d: &proto::Delete) -> Result<bool, NodeError> {
        match self {
            Node::Single(s) => Ok(kv::delete(&s.kv(), &d.key, d.cas)?),
            Node::Cluster(c) => Ok(c.delete_cas(d.clone()).await?),
        }
    }

    /// A counter operation: the new value and the item's meta.
    pub async fn arith(&self, a: &proto::Arith) -> Result<(u64, ItemMeta), NodeError> {
        match self {
            Node::Single(s) => Ok(kv::arith(&s.kv(), &a.key, &arith_of(a, clock::now_ms())).await?),
            Node::Cluster(c) => {
                let (value, version) = c.arith(a.clone()).await?;
                Ok((value, ItemMeta { version, ..Default::default() }))
            }
        }
    }

    /// Gives a key's live item the expiry asked for; returns the item.
    pub async fn touch(&self, t: &proto::Touch) -> Result<Option<Item>, NodeError> {
        match self {
            Node::Single(s) => {
                let at = expiry_of(t.ttl_secs, t.expires_at, clock::now_ms());
                Ok(kv::touch(&s.kv(), &t.key, at).await?)
            }
            Node::Cluster(c) => Ok(c.touch(t.clone()).await?),
        }
    }

    /// Each key's live item, in the keys' order; refused when there are
    /// more than [`MAX_MULTI_GET_KEYS`] keys or the values exceed
    /// `max_bytes`.
    pub async fn multi_get(&self, keys: &[Bytes], max_bytes: usize) -> Result<Vec<Option<Found>>, NodeError> {
        if keys.len() > MAX_MULTI_GET_KEYS {
            return Err(NodeError::BadRequest(format!(
                "multi-get of {} keys exceeds the limit of {MAX_MULTI_GET_KEYS}",
                keys.len()
            )));
        }
        let values = match self {
            Node::Single(s) => s.multi_get(keys, max_bytes)?,
            Node::Cluster(c) => {
                let got = c.multi_get(keys).await?;
                let bytes: usize = got.iter().flatten().map(|(item, _)| item.value.len()).sum();
                if bytes > max_bytes {
                    return Err(NodeError::TooLarge(max_bytes));
                }
                got.into_iter().map(|v| v.map(found)).collect()
            }
        };
        // The reply's entries answer the keys by position.
        debug_assert_eq!(values.len(), keys.len(), "a multi-get reply has one entry per key");
        Ok(values)
    }

    /// Empties every shard this cluster node leads (a flush_all passed on
    /// by another node); how many items went.
    pub async fn flush_led(&self) -> Result<u64, NodeError> {
        match self {
            Node::Single(_) => Err(NodeError::BadRequest("this node is not part of a cluster".into())),
            Node::Cluster(c) => Ok(c.flush_led().await?),
        }
    }

    /// Notes a client's one-sided reads (for eviction's recency).
    /// In a cluster the region read is a shard leader's (`region_id`: the
    /// shard + 1), and its leader chooses what goes (`evict_round`). The
    /// offsets are in the region that was read: a report that reaches a
    /// replica no longer leading is dropped (another replica's items lie
    /// elsewhere), which costs recency only.
    pub fn note_accesses(&self, r: proto::AccessReport) {
        match self {
            Node::Single(s) => s.store.note_remote_accesses(&r.units),
            Node::Cluster(c) => {
                if let Some(shard) = r.region_id.checked_sub(1) {
                    c.note_accesses(shard, &r.units);
                }
            }
        }
    }

    pub fn map_reply(&self) -> Result<proto::ClusterMapReply, NodeError> {
        Ok(self.cluster_only()?.map_reply())
    }

    /// The map, asked of the metadata group first if this node's is not
    /// newer than `version` (see `ClusterNode::refresh_past`).
    pub async fn map_reply_past(&self, version: u64) -> Result<proto::ClusterMapReply, NodeError> {
        let c = self.cluster_only()?;
        c.refresh_past(version).await;
        Ok(c.map_reply())
    }

    /// The map as the metadata group holds it (this node must lead it).
    pub async fn meta_map(&self) -> Result<proto::ClusterMapReply, NodeError> {
        let (map, _) = self.cluster_only()?.meta_map().await?;
        Ok(map.to_proto())
    }

    pub async fn join_shard(&self, shard: ShardId, replica_id: u64) -> Result<JoinStep, NodeError> {
        Ok(self.cluster_only()?.join_shard(shard, replica_id).await?)
    }

    pub async fn leave_shard(&self, shard: ShardId, replica_id: u64) -> Result<JoinStep, NodeError> {
        Ok(self.cluster_only()?.leave_shard(shard, replica_id).await?)
    }

    pub async fn replace_replica(&self, shard: ShardId) -> Result<u64, NodeError> {
        Ok(self.cluster_only()?.replace_replica(shard).await?)
    }

    pub async fn move_work(&self, w: proto::MoveWork) -> Result<proto::MoveWorkReply, NodeError> {
        Ok(self.cluster_only()?.move_work(w).await?)
    }

    /// Runs apart from the connection that asked: a client that stops
    /// waiting (or a connection lost) must not stop a move mid-way.
    pub async fn move_partition(&self, m: proto::MovePartition) -> Result<proto::MovePartitionReply, NodeError> {
        use crate::cluster::mover::DEFAULT_MOVE_RATE_MIB;
        let c = self.cluster().cloned().ok_or_else(|| NodeError::BadRequest(NOT_IN_CLUSTER.into()))?;
        let rate = match (m.unpaced, m.rate_mib) {
            (true, _) => 0,
            (false, 0) => u64::from(DEFAULT_MOVE_RATE_MIB) << 20,
            (false, mib) => u64::from(mib) << 20,
        };
        let run = async move {
            match m.control {
                0 => c.move_partition(m.partition, m.to, rate).await,
                1 => c.control_move(m.partition, false).await,
                2 => c.control_move(m.partition, true).await,
                3 => c.rebalance(false, rate).await,
                4 => c.rebalance(true, rate).await,
                n => Err(crate::cluster::node::ClusterError::Failed(format!("move control {n} is of no known kind"))),
            }
        };
        match tokio::spawn(run).await {
            Ok(r) => Ok(r?),
            Err(e) => Err(NodeError::Internal(format!("the mover failed: {e}"))),
        }
    }

    /// Runs apart from the connection that asked, as a partition move.
    pub async fn move_replica(&self, m: proto::MoveReplica) -> Result<proto::MoveReplicaReply, NodeError> {
        let c = self.cluster().cloned().ok_or_else(|| NodeError::BadRequest(NOT_IN_CLUSTER.into()))?;
        match tokio::spawn(async move { c.move_replica(m.shard, m.from, m.to).await }).await {
            Ok(r) => Ok(r?),
            Err(e) => Err(NodeError::Internal(format!("the replica move failed: {e}"))),
        }
    }

    pub async fn transfer_leader(&self, shard: ShardId, to: u64) -> Result<proto::TransferLeaderReply, NodeError> {
        Ok(self.cluster_only()?.transfer_leader(shard, to).await?)
    }

    pub async fn receive_snapshot(&self, c: proto::SnapshotChunk) -> Result<proto::SnapshotChunkReply, NodeError> {
        Ok(self.cluster_only()?.receive_snapshot(c).await?)
    }

    fn cluster_only(&self) -> Result<&ClusterNode, NodeError> {
        self.cluster().map(|c| &**c).ok_or_else(|| NodeError::BadRequest(NOT_IN_CLUSTER.into()))
    }

    /// Registers the node's region anew (new rkey, next epoch); returns
    /// the new epoch. A cluster node's replicas are registered anew by
    /// their leaders' fences, never from outside their shard.
    pub fn reregister(&self) -> Result<u64, NodeError> {
        match self {
            Node::Single(s) => s.reregister(),
            Node::Cluster(_) => Err(NodeError::BadRequest(
                "re-registration is not served in cluster mode: each shard's leader registers its replica's \
                 region anew when it takes over"
                    .into(),
            )),
        }
    }

    /// The regions one-sided readers may read: the node's own, or every
    /// local replica's (readers tell the leader's by its lease, a
    /// follower's has none, so leadership changes need no new ones).
    pub fn descriptors(&self) -> Vec<proto::RegionDescriptor> {
        match self {
            Node::Single(s) => {
                vec![proto::RegionDescriptor {
                    rdma_rkey: s.rdma_rkey(),
                    ..descriptor(&s.registration, &s.store, s.region_id)
                }]
            }
            Node::Cluster(c) => c
                .regions()
                .into_iter()
                .map(|r| proto::RegionDescriptor {
                    shard: r.shard,
                    leased: true,
                    rdma_rkey: r.rdma_rkey,
                    ..descriptor(&r.reg, &r.store, r.shard + 1)
                })
                .collect(),
        }
    }

    /// The RDMA device this node's regions are registered with, if any:
    /// client queue pairs are accepted on it.
    #[cfg(feature = "rdma")]
    pub fn rdma_device(&self) -> Option<&Arc<crate::rdma::RdmaDevice>> {
        match self {
            Node::Single(s) => s.rdma.as_ref().map(|r| r.device()),
            Node::Cluster(c) => c.rdma_device(),
        }
    }

    /// What the engine and the shm handoff serve (a cluster node's
    /// regions change as its replicas open and close).
    pub fn served(&self) -> ServedSet {
        match self {
            Node::Single(s) => {
                ServedSet::new(vec![Served { region: Arc::clone(s.store.region()), reg: Arc::clone(&s.registration) }])
            }
            Node::Cluster(c) => c.served(),
        }
    }

    /// Region registrations so far: read from the registrations
    /// themselves, since a cluster leader's fence re-registers its shard's
    /// region without going through the node.
    pub fn registrations(&self) -> u64 {
        match self {
            Node::Single(s) => s.registration.registrations(),
            Node::Cluster(c) => c.regions().iter().map(|r| r.reg.registrations()).sum(),
        }
    }

    /// The stores holding this node's data.
    pub fn stores(&self) -> Vec<Arc<Store>> {
        match self {
            Node::Single(s) => vec![Arc::clone(&s.store)],
            Node::Cluster(c) => c.stores(),
        }
    }

    /// Each store's live items and checksum (see [`Store::digest`]), and
    /// in a cluster the index each replica's are as of: `shard<S>_items`,
    /// `shard<S>_digest`, `shard<S>_applied` (a single node's as shard 0,
    /// applied 0). Walks every store: for tests and diagnostics.
    pub fn digests(&self) -> Vec<(String, u64)> {
        let rows = match self {
            Node::Single(s) => {
                let (items, digest) = s.store.digest();
                vec![(0, items, digest, 0)]
            }
            Node::Cluster(c) => c.digests(),
        };
        rows.into_iter()
            .flat_map(|(shard, items, digest, applied)| {
                [
                    (format!("shard{shard}_items"), items),
                    (format!("shard{shard}_digest"), digest),
                    (format!("shard{shard}_applied"), applied),
                ]
            })
            .collect()
    }

    /// STATS entries of what the node serves: its stores (a cluster's
    /// summed), its compactors, its region's epoch (a single node's; a
    /// cluster's replicas each have one, in REGION_INFO).
    pub fn stats(&self) -> Vec<(String, u64)> {
        match self {
            Node::Single(s) => {
                let mut out: Vec<(String, u64)> =
                    stats::store_stats(&s.store).into_iter().map(|(k, v)| (k.to_string(), v)).collect();
                out.extend(stats::compactor_stats([&s.compactor]));
                out.push(("region_epoch".into(), s.registration.epoch()));
                out
            }
            Node::Cluster(c) => {
                let mut out = stats::summed(c.stores().iter().map(|s| &**s));
                out.push(("shard_replicas".into(), c.stores().len() as u64));
                out.extend(c.replica_counters().into_iter().map(|(k, v)| (k.to_string(), v)));
                out.extend(stats::compactor_stats(c.compactors().iter().map(|c| &**c)));
                out
            }
        }
    }
}

fn descriptor(reg: &Registration, store: &Store, region_id: u32) -> proto::RegionDescriptor {
    let h = reg.header();
    proto::RegionDescriptor {
        region_id,
        epoch: h.epoch,
        length: h.region_len,
        rkey: reg.rkey(),
        directory_depth: h.dir_depth,
        hash_seed: h.hash_seed,
        index_offset: h.index_offset,
        data_offset: h.data_offset,
        data_length: h.data_len,
        layout_version: LAYOUT_VERSION,
        grace_nanos: h.grace_nanos,
        base_addr: store.region().base_ptr() as u64,
        shard: 0,
        leased: false,
        evicts: store.evicts(),
        rdma_rkey: 0,
    }
}
