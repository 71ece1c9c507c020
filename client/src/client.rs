//! The SDK's face: a [`Client`] over one node's [`Session`], or over a
//! [`Router`] that keeps a session per node of a cluster. Every call checks
//! its input here and goes to one of the two; nothing below knows this
//! type.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use dmkv_common::error::{check_key, check_value};
use dmkv_common::proto::{self, request::Op};

use crate::conn::InFlight;
use crate::error::ClientError;
use crate::onesided::{self, ItemMeta, ReadCounters, ReadStats};
use crate::router::Router;
use crate::session::Session;

pub use crate::config::{ClientConfig, MAX_SEEDS, TOKEN_ENV};
pub use crate::error::unwrap;
pub use crate::read_path::{ReadPath, Transport};
pub use crate::session::PathStats;
pub use crate::value::Versioned;

/// An async dmkv client. Cheap to clone; clones share the connections.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    /// The session with the node connected to: the whole client on a
    /// single node; in a cluster, where admin calls and STATS go.
    node: Session,
    /// Set when the node is a cluster node: requests then go through the
    /// router to each key's shard leader.
    router: Option<Router>,
}

/// A [`Client`] that may have been dropped (see [`Client::downgrade`]).
#[cfg(feature = "prometheus")]
#[derive(Debug, Clone)]
pub(crate) struct WeakClient(std::sync::Weak<Inner>);

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("addr", &self.node.addr()).field("cluster", &self.router.is_some()).finish()
    }
}

#[cfg(feature = "prometheus")]
impl WeakClient {
    /// The client, while some clone of it is alive.
    pub(crate) fn upgrade(&self) -> Option<Client> {
        self.0.upgrade().map(|inner| Client { inner })
    }
}

impl Client {
    /// Connects to a server with default settings.
    pub async fn connect(addr: impl Into<String>) -> Result<Client, ClientError> {
        Client::connect_with(addr, ClientConfig::default()).await
    }

    /// Connects with the given settings. Opens one connection now (so a
    /// wrong address fails here) and checks the protocol version. If the
    /// server is a cluster node, loads the cluster map: requests then go to
    /// each key's shard leader, wherever it is.
    pub async fn connect_with(addr: impl Into<String>, cfg: ClientConfig) -> Result<Client, ClientError> {
        let counters = Arc::new(ReadCounters::default());
        let node = Session::open(addr.into(), cfg, Arc::clone(&counters)).await?;
        let router = if node.is_cluster_node() {
            let cfg = node.config();
            // Shard regions are attached on first read, and a failure then
            // sends reads over RPC: a forced transport the seed node does
            // not offer is refused here, before anything goes anywhere.
            if let (Some(transport), true) = (cfg.transport, cfg.read_path != ReadPath::Rpc) {
                let info = node.region_info_full().await?;
                onesided::offered(&info, transport)
                    .map_err(|reason| ClientError::TransportUnavailable { transport, reason })?;
            }
            let map = node.cluster_map().await?;
            Some(Router::new(map, cfg, counters))
        } else {
            None
        };
        Ok(Client { inner: Arc::new(Inner { node, router }) })
    }

    /// Connects to the first of `seeds` that answers, in order, as
    /// [`Client::connect_with`] does to one: give a cluster's nodes, and
    /// the client connects while any of them is up (it then learns the
    /// map, and with it every node). If none connects: the last answer a
    /// seed gave that was not a network failure (a refused token...), else
    /// one seed's error as it is, else [`ClientError::NoSeedAnswered`] with
    /// each seed's failure; at most [`MAX_SEEDS`] seeds.
    pub async fn connect_seeds<A: AsRef<str>>(seeds: &[A], cfg: ClientConfig) -> Result<Client, ClientError> {
        if seeds.is_empty() || seeds.len() > MAX_SEEDS {
            return Err(ClientError::Config(format!("{} seed addresses: give 1 to {MAX_SEEDS}", seeds.len())));
        }
        let mut failed = Vec::new();
        for seed in seeds {
            match Client::connect_with(seed.as_ref(), cfg.clone()).await {
                Ok(c) => return Ok(c),
                Err(e) => failed.push(e),
            }
        }
        Err(seeds_failed(failed))
    }

    /// The session with the node this client connected to.
    pub fn session(&self) -> &Session {
        &self.inner.node
    }

    /// The cluster router, when the server is a cluster node.
    pub fn router(&self) -> Option<&Router> {
        self.inner.router.as_ref()
    }

    /// A handle that does not keep the client (and its connections) alive,
    /// for metrics collectors that outlive it.
    #[cfg(feature = "prometheus")]
    pub(crate) fn downgrade(&self) -> WeakClient {
        WeakClient(Arc::downgrade(&self.inner))
    }

    /// The server address.
    pub fn addr(&self) -> &str {
        self.inner.node.addr()
    }

    /// Settings in use.
    pub fn config(&self) -> &ClientConfig {
        self.inner.node.config()
    }

    /// Reads `key`; `None` if it is not stored.
    pub async fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Bytes>, ClientError> {
        Ok(self.get_versioned(key).await?.map(|v| v.value))
    }

    /// Reads `key` with its version, down the path [`ReadPath`] says: in
    /// `Auto`, the one the path controller prices cheaper for this key now.
    pub async fn get_versioned(&self, key: impl AsRef<[u8]>) -> Result<Option<Versioned>, ClientError> {
        let key = key.as_ref();
        check_key(key)?;
        match self.router() {
            Some(r) => r.get(key).await,
            None => self.inner.node.get(key).await,
        }
    }

    /// Reads `key` on the calling thread from a region mapped in this
    /// process (shared memory), without a runtime or any allocation once
    /// `out` has grown: the value replaces `out`'s contents. `None` when
    /// the GET needs the runtime: no local path is attached (yet), the
    /// read path is RPC, the client routes a cluster, the server evicts
    /// (reads are reported from the runtime), or the server must answer
    /// this key (see [`crate::blocking::Client::get_into`]).
    pub fn get_local(&self, key: &[u8], out: &mut Vec<u8>) -> Option<Result<Option<ItemMeta>, ClientError>> {
        if self.router().is_some() {
            return None;
        }
        self.inner.node.get_local(key, out)
    }

    /// Reads `key` over RPC, whatever the read path.
    pub async fn rpc_get(&self, key: &[u8]) -> Result<Option<Versioned>, ClientError> {
        check_key(key)?;
        match self.router() {
            Some(r) => r.rpc_get(key).await,
            None => self.inner.node.rpc_get(key).await,
        }
    }

    /// Stores `value` under `key`; returns the version of this write.
    pub async fn put(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<u64, ClientError> {
        let (key, value) = (key.as_ref(), value.as_ref());
        check_key(key)?;
        check_value(value)?;
        match self.router() {
            Some(r) => r.put(key, value).await,
            None => self.inner.node.put(key, value).await,
        }
    }

    /// Removes `key`; returns whether it existed.
    pub async fn delete(&self, key: impl AsRef<[u8]>) -> Result<bool, ClientError> {
        let key = key.as_ref();
        check_key(key)?;
        match self.router() {
            Some(r) => r.delete(key).await,
            None => self.inner.node.delete(key).await,
        }
    }

    /// Reads many keys; the result is in the order of `keys`. Large batches
    /// are split into requests of at most
    /// [`dmkv_common::limits::MAX_MULTI_GET_KEYS`] keys, all in flight at
    /// once.
    pub async fn multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, ClientError> {
        for k in keys {
            check_key(k.as_ref())?;
        }
        match self.router() {
            Some(r) => r.multi_get(keys).await,
            None => self.inner.node.multi_get(keys).await,
        }
    }

    /// Multi-get over RPC, whatever the read path.
    pub async fn rpc_multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, ClientError> {
        match self.router() {
            Some(r) => r.rpc_multi_get(keys).await,
            None => self.inner.node.rpc_multi_get(keys).await,
        }
    }

    /// Sends a raw request on the next pooled connection of the node this
    /// client connected to, without waiting for its reply (no routing).
    /// Applications pipeline with the typed [`Client::send_get`],
    /// [`Client::send_put`] and [`Client::send_delete`]; this is for tests
    /// and benchmarks that speak the protocol itself.
    #[doc(hidden)]
    pub async fn send(&self, op: Op) -> Result<InFlight, ClientError> {
        self.inner.node.send(op).await
    }

    /// A request to the node this client connected to (no routing).
    pub(crate) async fn call(&self, op: Op) -> Result<proto::response::Result, ClientError> {
        self.inner.node.pool().call(op).await
    }

    /// The one-sided backend GETs use now, if any (a single node's).
    pub fn one_sided_transport(&self) -> Option<Transport> {
        self.inner.node.one_sided_transport()
    }

    /// Counters of this client's reads: one-sided ones, their retries and
    /// fallbacks, and the keys read over RPC (every node's in a cluster).
    pub fn read_stats(&self) -> ReadStats {
        self.inner.node.read_stats()
    }

    /// How this client's GETs to the node it connected to have been
    /// routed: per path the requests, retries, window and delay
    /// estimates, and the switches and repaths. In a cluster each node's
    /// session has a selector of its own: see [`Router::path_stats`].
    pub fn path_stats(&self) -> PathStats {
        self.inner.node.path_stats()
    }

    /// How this client's RPCs to the node it connected to were split
    /// between TCP and verbs messages, and each way's smoothed round trip
    /// (`ClientConfig::rpc_transport`). In a cluster, that node's only.
    pub fn rpc_price(&self) -> dmkv_common::path::rpc_price::RpcPrice {
        self.inner.node.pool().rpc_price()
    }

    /// Closes every pooled RPC connection; later requests open fresh ones.
    /// For tests.
    #[doc(hidden)]
    pub async fn replace_rpc_connections(&self) {
        self.inner.node.replace_rpc_connections().await;
    }

    /// The cluster map as this node knows it, with its replicas' state
    /// (`BAD_REQUEST` from a server outside a cluster).
    pub async fn cluster_status(&self) -> Result<proto::ClusterMapReply, ClientError> {
        self.inner.node.cluster_status().await
    }

    /// [`Client::cluster_status`] with the placement as the metadata group
    /// holds it now: the node asks the group first unless its map is newer
    /// than `version` (pass the version of a map already read).
    pub async fn cluster_status_past(&self, version: u64) -> Result<proto::ClusterMapReply, ClientError> {
        self.inner.node.cluster_status_past(version).await
    }

    /// Admin: replaces this node's replica of `shard` by a new one with no
    /// state, which joins the shard and catches up from its leader (the
    /// old one is removed from the members). Returns the new raft id.
    pub async fn replace_replica(&self, shard: u32) -> Result<u64, ClientError> {
        self.inner.node.replace_replica(shard).await
    }

    /// See [`crate::session::Session::move_partition`].
    pub async fn move_partition(
        &self,
        partition: u32,
        to: u32,
        rate_mib: Option<u32>,
    ) -> Result<proto::MovePartitionReply, ClientError> {
        self.inner.node.move_partition(partition, to, rate_mib).await
    }

    /// See [`crate::session::Session::move_replica`].
    pub async fn move_replica(&self, shard: u32, from: u64, to: u64) -> Result<proto::MoveReplicaReply, ClientError> {
        self.inner.node.move_replica(shard, from, to).await
    }

    /// See [`crate::session::Session::rebalance`].
    pub async fn rebalance(
        &self,
        dry_run: bool,
        rate_mib: Option<u32>,
    ) -> Result<proto::MovePartitionReply, ClientError> {
        self.inner.node.rebalance(dry_run, rate_mib).await
    }

    /// See [`crate::session::Session::control_move`].
    pub async fn control_move(&self, partition: u32, cancel: bool) -> Result<proto::MovePartitionReply, ClientError> {
        self.inner.node.control_move(partition, cancel).await
    }

    /// See [`crate::session::Session::transfer_leader`].
    pub async fn transfer_leader(&self, shard: u32, to: u64) -> Result<proto::TransferLeaderReply, ClientError> {
        self.inner.node.transfer_leader(shard, to).await
    }

    /// The cluster map as this node knows it, checked.
    pub async fn cluster_map(&self) -> Result<dmkv_common::cluster::map::ClusterMap, ClientError> {
        self.inner.node.cluster_map().await
    }

    /// The server's counters.
    pub async fn stats(&self) -> Result<HashMap<String, u64>, ClientError> {
        self.inner.node.stats().await
    }

    /// The counters of the node this client connected to, with each of
    /// its shard replicas' item count, checksum and applied index: see
    /// [`Session::stats_with`]. For tests and diagnostics.
    #[doc(hidden)]
    pub async fn stats_with_digests(&self) -> Result<HashMap<String, u64>, ClientError> {
        self.inner.node.stats_with(true).await
    }

    /// Descriptors of the server's remote-memory regions.
    pub async fn region_info(&self) -> Result<Vec<proto::RegionDescriptor>, ClientError> {
        self.inner.node.region_info().await
    }

    /// The server's regions and the one-sided endpoints it offers.
    pub async fn region_info_full(&self) -> Result<proto::RegionInfoReply, ClientError> {
        self.inner.node.region_info_full().await
    }

    /// Admin: makes the server register its region anew (new epoch and
    /// rkey). Every client's one-sided path then fails over and re-attaches.
    pub async fn reregister(&self) -> Result<proto::RegionInfoReply, ClientError> {
        self.inner.node.reregister().await
    }
}

/// What `connect_seeds` reports when no seed connected (`failed`: one
/// error per seed, in order). A seed that answered (a refused token, a
/// forced transport it does not offer) gave an answer that is no network
/// failure: the last such, so `code()` and `is_transport()` say what
/// happened.
fn seeds_failed(mut failed: Vec<ClientError>) -> ClientError {
    debug_assert!(!failed.is_empty(), "one failure per seed, and there is a seed");
    if let Some(i) = failed.iter().rposition(|e| !e.is_transport()) {
        return failed.swap_remove(i);
    }
    if failed.len() == 1 {
        return failed.remove(0);
    }
    ClientError::NoSeedAnswered { failures: failed }
}

#[cfg(test)]
mod seed_tests {
    use super::*;
    use crate::error::ConnectReason;
    use dmkv_common::proto::ErrorCode;

    fn down(addr: &str) -> ClientError {
        ClientError::Connect { addr: addr.into(), reason: ConnectReason::TimedOut(std::time::Duration::from_secs(1)) }
    }

    #[test]
    fn a_seed_that_answered_is_reported_over_those_that_did_not() {
        let refused = ClientError::Server { code: ErrorCode::Unauthenticated, message: "bad token".into() };
        let e = seeds_failed(vec![down("a"), refused, down("c")]);
        assert_eq!(e.code(), Some(ErrorCode::Unauthenticated), "{e}");
        assert!(!e.is_transport());
        assert!(matches!(seeds_failed(vec![down("a")]), ClientError::Connect { .. }));
        let all = seeds_failed(vec![down("a"), down("b")]);
        assert!(matches!(&all, ClientError::NoSeedAnswered { failures } if failures.len() == 2), "{all}");
    }
}
