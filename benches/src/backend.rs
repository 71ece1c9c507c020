//! The stores a run can measure, behind one trait: a per-thread connection
//! on which many tasks keep requests in flight at once.

use std::future::Future;

use bytes::Bytes;
use clap::ValueEnum;
use dmkv_client::{Client, ClientConfig, ReadPath, Transport};
use serde::{Deserialize, Serialize};

use crate::memcached::{self, Memcached};
use crate::pipe::Pipe;
use crate::redis::{self, Resp};

/// A store to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// dmkvd through the dmkv-client SDK.
    Dmkv,
    /// memcached, text protocol.
    Memcached,
    /// Redis, RESP2.
    Redis,
}

impl BackendKind {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Dmkv => "dmkv",
            BackendKind::Memcached => "memcached",
            BackendKind::Redis => "redis",
        }
    }

    /// The store's customary address on this host.
    pub fn default_server(self) -> &'static str {
        match self {
            BackendKind::Dmkv => "127.0.0.1:7070",
            BackendKind::Memcached => "127.0.0.1:11211",
            BackendKind::Redis => "127.0.0.1:6379",
        }
    }
}

/// One connection to a store, shared by the in-flight tasks of a thread.
/// Implementations must allow concurrent calls (pipelining).
pub trait KvConn: Send + Sync + 'static {
    /// Reads `key`: its value, or `None` if it is not stored.
    fn get(&self, key: Bytes) -> impl Future<Output = Result<Option<Bytes>, String>> + Send;
    /// Stores `value` under `key` (insert or overwrite).
    fn set(&self, key: Bytes, value: Bytes) -> impl Future<Output = Result<(), String>> + Send;
}

/// dmkv through its SDK, with a pool of one connection so every store gets
/// the same number of connections per thread.
pub struct DmkvConn {
    client: Client,
}

/// Settings of the dmkv backend that the other stores have no use for.
/// (The secret, if the server wants one, comes from `DMKV_TOKEN`.)
#[derive(Debug, Clone, Default)]
pub struct DmkvOptions {
    /// Which way GETs go.
    pub read_path: ReadPath,
    /// Force a one-sided transport.
    pub transport: Option<Transport>,
    /// Speak TLS, trusting this CA.
    pub tls_ca: Option<std::path::PathBuf>,
}

impl DmkvConn {
    /// Connects one SDK client (one pooled connection) to `addr`.
    pub async fn connect(addr: &str, opts: &DmkvOptions) -> Result<DmkvConn, String> {
        let tls = opts.tls_ca.clone().map(|ca_file| dmkv_client::TlsOptions { ca_file, ..Default::default() });
        let cfg = ClientConfig::default()
            .pool_size(1)
            .read_path(opts.read_path)
            .transport(opts.transport)
            .tls(tls)
            .token(ClientConfig::token_from_env().map_err(|e| e.to_string())?);
        let client = Client::connect_with(addr, cfg).await.map_err(|e| e.to_string())?;
        Ok(DmkvConn { client })
    }
}

impl Drop for DmkvConn {
    /// With `DMKV_PATH_STATS=1`, each thread's client prints how it routed
    /// its GETs (see `Client::path_stats`).
    fn drop(&mut self) {
        if std::env::var_os("DMKV_PATH_STATS").is_some_and(|v| v == "1") {
            eprint!("{}", self.client.path_stats());
        }
    }
}

impl KvConn for DmkvConn {
    async fn get(&self, key: Bytes) -> Result<Option<Bytes>, String> {
        self.client.get(&key).await.map_err(|e| e.to_string())
    }

    async fn set(&self, key: Bytes, value: Bytes) -> Result<(), String> {
        self.client.put(&key, &value).await.map(|_| ()).map_err(|e| e.to_string())
    }
}

/// memcached over one pipelined connection.
pub struct MemcachedConn {
    pipe: Pipe<Memcached>,
}

impl MemcachedConn {
    /// Connects to `addr`.
    pub async fn connect(addr: &str) -> Result<MemcachedConn, String> {
        Ok(MemcachedConn { pipe: Pipe::connect(addr).await? })
    }
}

impl KvConn for MemcachedConn {
    async fn get(&self, key: Bytes) -> Result<Option<Bytes>, String> {
        match self.pipe.call(memcached::encode_get(&key)).await? {
            memcached::Reply::Values(mut v) if v.len() <= 1 => Ok(v.pop()),
            other => Err(format!("memcached get: unexpected reply {other:?}")),
        }
    }

    async fn set(&self, key: Bytes, value: Bytes) -> Result<(), String> {
        match self.pipe.call(memcached::encode_set(&key, &value)).await? {
            memcached::Reply::Stored => Ok(()),
            other => Err(format!("memcached set: {other:?}")),
        }
    }
}

/// Redis over one pipelined connection.
pub struct RedisConn {
    pipe: Pipe<Resp>,
}

impl RedisConn {
    /// Connects to `addr`.
    pub async fn connect(addr: &str) -> Result<RedisConn, String> {
        Ok(RedisConn { pipe: Pipe::connect(addr).await? })
    }
}

impl KvConn for RedisConn {
    async fn get(&self, key: Bytes) -> Result<Option<Bytes>, String> {
        match self.pipe.call(redis::encode(&[b"GET", &key])).await? {
            redis::Value::Bulk(v) => Ok(v),
            other => Err(format!("redis GET: {other:?}")),
        }
    }

    async fn set(&self, key: Bytes, value: Bytes) -> Result<(), String> {
        match self.pipe.call(redis::encode(&[b"SET", &key, &value])).await? {
            redis::Value::Simple(s) if s == "OK" => Ok(()),
            other => Err(format!("redis SET: {other:?}")),
        }
    }
}
