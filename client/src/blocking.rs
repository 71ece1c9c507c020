//! A blocking wrapper for callers without an async runtime. It owns a small
//! runtime whose one worker thread drives the connections.

use std::collections::HashMap;

use bytes::Bytes;

use crate::client::{Client as AsyncClient, ClientConfig, Versioned};
use crate::error::ClientError;
use crate::onesided::ItemMeta;

/// A blocking dmkv client.
pub struct Client {
    /// `Some` until dropped.
    rt: Option<tokio::runtime::Runtime>,
    inner: AsyncClient,
}

impl Drop for Client {
    fn drop(&mut self) {
        // Dropping a runtime waits for its blocking threads, which tokio
        // refuses (with a panic) inside another runtime: there, let them go.
        if let Some(rt) = self.rt.take()
            && tokio::runtime::Handle::try_current().is_ok()
        {
            rt.shutdown_background();
        }
    }
}

impl Client {
    /// Connects with default settings.
    pub fn connect(addr: impl Into<String>) -> Result<Client, ClientError> {
        Client::connect_with(addr, ClientConfig::default())
    }

    /// Connects with the given settings. Fails with
    /// [`ClientError::InsideRuntime`] when called where a tokio runtime is
    /// current, as every call of this client does: blocking there would
    /// stall the runtime's worker (and tokio panics on it); use the async
    /// [`AsyncClient`]. That includes `spawn_blocking` closures, which
    /// tokio does not tell apart from its workers here: call the async
    /// client through `Handle::block_on` there.
    pub fn connect_with(addr: impl Into<String>, cfg: ClientConfig) -> Result<Client, ClientError> {
        outside_runtime()?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| ClientError::Config(format!("cannot start the blocking client's runtime: {e}")))?;
        let addr = addr.into();
        let inner = rt.block_on(AsyncClient::connect_with(addr, cfg))?;
        Ok(Client { rt: Some(rt), inner })
    }

    /// Runs `f` to completion on this client's runtime; refused inside
    /// another runtime.
    fn run<T>(&self, f: impl std::future::Future<Output = Result<T, ClientError>>) -> Result<T, ClientError> {
        outside_runtime()?;
        match &self.rt {
            Some(rt) => rt.block_on(f),
            None => Err(ClientError::ConnectionClosed),
        }
    }

    /// See [`AsyncClient::get`].
    pub fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Bytes>, ClientError> {
        self.run(self.inner.get(key))
    }

    /// Reads `key` into `out` (its contents replaced by the value) and
    /// returns the item's version, flags and expiry; `None` if it is not
    /// stored. Over shared memory this runs on the calling thread with no
    /// runtime hop and no heap allocation once `out` has grown to the
    /// values read: the hot path for tight read loops. Otherwise (RPC, a
    /// cluster, an evicting server, or a key the server must answer) it is
    /// [`Client::get_versioned`] copied into `out`.
    pub fn get_into(&self, key: impl AsRef<[u8]>, out: &mut Vec<u8>) -> Result<Option<ItemMeta>, ClientError> {
        let key = key.as_ref();
        if let Some(r) = self.inner.get_local(key, out) {
            return r;
        }
        Ok(self.run(self.inner.get_versioned(key))?.map(|v| {
            out.clear();
            out.extend_from_slice(&v.value);
            ItemMeta { version: v.version, flags: v.flags, expires_at: v.expires_at }
        }))
    }

    /// See [`AsyncClient::get_versioned`].
    pub fn get_versioned(&self, key: impl AsRef<[u8]>) -> Result<Option<Versioned>, ClientError> {
        self.run(self.inner.get_versioned(key))
    }

    /// See [`AsyncClient::put`].
    pub fn put(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<u64, ClientError> {
        self.run(self.inner.put(key, value))
    }

    /// See [`AsyncClient::delete`].
    pub fn delete(&self, key: impl AsRef<[u8]>) -> Result<bool, ClientError> {
        self.run(self.inner.delete(key))
    }

    /// See [`AsyncClient::put_with`].
    pub fn put_with(
        &self,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
        opts: crate::PutOptions,
    ) -> Result<u64, ClientError> {
        self.run(self.inner.put_with(key, value, opts))
    }

    /// See [`AsyncClient::cas`].
    pub fn cas(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>, version: u64) -> Result<u64, ClientError> {
        self.run(self.inner.cas(key, value, version))
    }

    /// See [`AsyncClient::incr`].
    pub fn incr(&self, key: impl AsRef<[u8]>, delta: u64) -> Result<u64, ClientError> {
        self.run(self.inner.incr(key, delta))
    }

    /// See [`AsyncClient::decr`].
    pub fn decr(&self, key: impl AsRef<[u8]>, delta: u64) -> Result<u64, ClientError> {
        self.run(self.inner.decr(key, delta))
    }

    /// See [`AsyncClient::touch`].
    pub fn touch(&self, key: impl AsRef<[u8]>, ttl: Option<std::time::Duration>) -> Result<bool, ClientError> {
        self.run(self.inner.touch(key, ttl))
    }

    /// See [`AsyncClient::get_and_touch`].
    pub fn get_and_touch(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Option<std::time::Duration>,
    ) -> Result<Option<Versioned>, ClientError> {
        self.run(self.inner.get_and_touch(key, ttl))
    }

    /// See [`AsyncClient::delete_cas`].
    pub fn delete_cas(&self, key: impl AsRef<[u8]>, version: u64) -> Result<bool, ClientError> {
        self.run(self.inner.delete_cas(key, version))
    }

    /// See [`AsyncClient::multi_get`].
    pub fn multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<Option<Bytes>>, ClientError> {
        self.run(self.inner.multi_get(keys))
    }

    /// See [`AsyncClient::stats`].
    pub fn stats(&self) -> Result<HashMap<String, u64>, ClientError> {
        self.run(self.inner.stats())
    }

    /// The cluster map as the node knows it, with its replicas' state.
    pub fn cluster_status(&self) -> Result<dmkv_common::proto::ClusterMapReply, ClientError> {
        self.run(self.inner.cluster_status())
    }

    /// See [`AsyncClient::cluster_status_past`].
    pub fn cluster_status_past(&self, version: u64) -> Result<dmkv_common::proto::ClusterMapReply, ClientError> {
        self.run(self.inner.cluster_status_past(version))
    }

    /// See [`AsyncClient::replace_replica`].
    pub fn replace_replica(&self, shard: u32) -> Result<u64, ClientError> {
        self.run(self.inner.replace_replica(shard))
    }

    /// See [`crate::Client::move_replica`].
    pub fn move_replica(
        &self,
        shard: u32,
        from: u64,
        to: u64,
    ) -> Result<dmkv_common::proto::MoveReplicaReply, ClientError> {
        self.run(self.inner.move_replica(shard, from, to))
    }

    /// See [`AsyncClient::move_partition`].
    pub fn move_partition(
        &self,
        partition: u32,
        to: u32,
        rate_mib: Option<u32>,
    ) -> Result<dmkv_common::proto::MovePartitionReply, ClientError> {
        self.run(self.inner.move_partition(partition, to, rate_mib))
    }

    /// See [`AsyncClient::rebalance`].
    pub fn rebalance(
        &self,
        dry_run: bool,
        rate_mib: Option<u32>,
    ) -> Result<dmkv_common::proto::MovePartitionReply, ClientError> {
        self.run(self.inner.rebalance(dry_run, rate_mib))
    }

    /// See [`AsyncClient::control_move`].
    pub fn control_move(
        &self,
        partition: u32,
        cancel: bool,
    ) -> Result<dmkv_common::proto::MovePartitionReply, ClientError> {
        self.run(self.inner.control_move(partition, cancel))
    }

    /// See [`AsyncClient::transfer_leader`].
    pub fn transfer_leader(&self, shard: u32, to: u64) -> Result<dmkv_common::proto::TransferLeaderReply, ClientError> {
        self.run(self.inner.transfer_leader(shard, to))
    }

    /// See [`AsyncClient::read_stats`].
    pub fn read_stats(&self) -> crate::ReadStats {
        self.inner.read_stats()
    }

    /// See [`AsyncClient::path_stats`].
    pub fn path_stats(&self) -> crate::PathStats {
        self.inner.path_stats()
    }

    /// See [`AsyncClient::register_metrics`].
    #[cfg(feature = "prometheus")]
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        self.inner.register_metrics(registry);
    }

    /// See [`AsyncClient::one_sided_transport`].
    pub fn one_sided_transport(&self) -> Option<crate::Transport> {
        self.inner.one_sided_transport()
    }

    /// The async client inside, for mixing styles.
    pub fn as_async(&self) -> &AsyncClient {
        &self.inner
    }
}

/// Refuses a blocking call made from inside an async runtime.
fn outside_runtime() -> Result<(), ClientError> {
    match tokio::runtime::Handle::try_current() {
        Ok(_) => Err(ClientError::InsideRuntime),
        Err(_) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_blocking_call_inside_a_runtime_is_an_error_not_a_panic() {
        // Refused before any connection is tried: the address is never used.
        let r = Client::connect("127.0.0.1:1");
        assert!(matches!(r, Err(ClientError::InsideRuntime)), "{:?}", r.err());
    }

    #[test]
    fn outside_a_runtime_the_blocking_client_connects() {
        // Nothing listens on port 1: the refusal is the connect's, not the runtime check's.
        let r = Client::connect("127.0.0.1:1");
        assert!(matches!(r, Err(ClientError::Connect { .. })), "{:?}", r.err());
    }
}
