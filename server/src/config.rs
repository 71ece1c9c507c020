//! dmkvd configuration: defaults that run one node on loopback, an optional
//! TOML file, and command-line flags that override the file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use std::collections::BTreeMap;

use dmkv_common::auth::{Keys, Token, node_name, parse_node_name};
use dmkv_common::limits::{DEFAULT_MAX_FRAME_LEN, MIN_MAX_FRAME_LEN};
use serde::Deserialize;

use crate::listen::MAX_CONNECTION_CAP;
use crate::workers::MAX_WORKERS;

pub mod validate;
pub use validate::{MAX_SOCKET_PATH, human, physical_memory};

/// Default RPC listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
/// Default region size.
pub const DEFAULT_MEMORY: u64 = 256 << 20;
/// Default time a retired item stays intact for one-sided readers.
pub const DEFAULT_GRACE: Duration = Duration::from_millis(100);
/// Default first index size: one bucket (15 slots) per this many bytes of
/// region (128 bytes each), so the index starts at 1/32 of memory; it grows
/// a segment at a time as keys need it.
pub const DEFAULT_BYTES_PER_BUCKET: u64 = 4096;
/// Most client connections served at once; more wait in the accept queue.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Connections the memcached port serves at once by default (as the RPC
/// port); more wait in the kernel's accept queue.
pub const MAX_MEMCACHED_CONNECTIONS: usize = DEFAULT_MAX_CONNECTIONS;
/// Environment variable holding a `data` secret (besides `--auth-file`).
pub const DATA_TOKEN_ENV: &str = "DMKVD_DATA_TOKEN";
/// Environment variable holding an `admin` secret.
pub const ADMIN_TOKEN_ENV: &str = "DMKVD_ADMIN_TOKEN";
/// Environment variable holding a cluster node's own secret, the one it
/// proves to its peers (before any `node:N` line of the auth file for it).
pub const NODE_TOKEN_ENV: &str = "DMKVD_NODE_TOKEN";
/// Shortest rkey rotation period: a rotation costs every one-sided client
/// a re-attach.
pub const MIN_RKEY_ROTATE: Duration = Duration::from_secs(1);
/// Most engine connections served at once: clients keep a few each.
pub const DEFAULT_MAX_ENGINE_CONNECTIONS: usize = 1024;
/// Most shared-memory handoff connections at once: one per mapping client
/// process on this host.
/// Smallest `--raft-log-entries`: below it a busy shard would snapshot
/// all the time.
pub const MIN_RAFT_LOG_ENTRIES: u64 = 100;
pub const DEFAULT_MAX_SHM_CONNECTIONS: usize = 256;
/// A connection whose peer sends nothing for this long is closed (clients
/// reconnect when they need to).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
/// Once part of a frame has arrived, the rest must follow within this: a
/// whole maximum frame crosses any working link well within it.
pub const DEFAULT_FRAME_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest idle or frame timeout accepted (a week).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long shutdown waits for connections to finish their requests.
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(5);

/// Command-line flags of `dmkvd`. Every flag overrides the config file.
#[derive(Debug, Clone, Parser, Default)]
#[command(name = "dmkvd", version, about = "dmkv server: a remote-memory key-value store")]
pub struct Flags {
    /// TOML config file.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// RPC listen address (port 0 picks a free port).
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<SocketAddr>,
    /// Region size, e.g. 256MiB, 4GiB, or bytes.
    #[arg(long, value_name = "SIZE")]
    pub memory: Option<String>,
    /// Index buckets (a power of two); default scales with memory.
    #[arg(long)]
    pub buckets: Option<u64>,
    /// Grace period before retired space is reused, in milliseconds.
    #[arg(long, value_name = "MS")]
    pub grace_ms: Option<u64>,
    /// When the compactor moves items to defragment memory: auto (keeps a
    /// free reserve, and makes room when a PUT needs it), off (only when a
    /// PUT needs room), continuous (always; for tests).
    #[arg(long, value_name = "MODE")]
    pub compactor: Option<crate::compact::Mode>,
    /// What happens when memory is full: none (writes fail with
    /// out-of-memory: a store never drops what it acknowledged), or lru
    /// (least recently used items are evicted, as a cache; one-sided
    /// readers report their reads). See docs/eviction.md.
    #[arg(long, value_name = "POLICY")]
    pub evict: Option<Evict>,
    /// Largest accepted frame, e.g. 2MiB.
    #[arg(long, value_name = "SIZE")]
    pub max_frame: Option<String>,
    /// Threads for client connections, and as many async workers for the
    /// rest: 1 to 1024 (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Address of the software one-sided engine (default: the RPC host, any port).
    #[arg(long, value_name = "ADDR")]
    pub engine_listen: Option<SocketAddr>,
    /// Do not offer the software one-sided engine.
    #[arg(long)]
    pub no_engine: bool,
    /// Unix socket for shared-memory handoff (default: in the temp dir, per process).
    #[arg(long, value_name = "PATH")]
    pub shm_socket: Option<PathBuf>,
    /// Do not offer shared memory to same-host clients.
    #[arg(long)]
    pub no_shm: bool,
    /// RDMA device to register the region with (builds with feature `rdma`;
    /// default: the first device with an active port, if any).
    #[arg(long, value_name = "NAME")]
    pub rdma_device: Option<String>,
    /// Do not offer RDMA even where a device exists.
    #[arg(long)]
    pub no_rdma: bool,
    /// Log filter, e.g. info or dmkv_server=debug. This (or `log` in the
    /// config file) wins over RUST_LOG, which applies only when neither is
    /// given; the default is info.
    #[arg(long, value_name = "FILTER")]
    pub log: Option<String>,
    /// Log line format: text, or json (one object per line).
    #[arg(long, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Serve Prometheus metrics at /metrics, and /healthz and /readyz, on
    /// this address (default: off). Unauthenticated: see docs/operations.md.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// Serve memcached's text and meta protocols on this address, e.g.
    /// 127.0.0.1:11211 (default: off; docs/memcached.md).
    #[arg(long, value_name = "ADDR")]
    pub memcached_listen: Option<SocketAddr>,
    /// Secrets clients must prove, per role, and each cluster node's own:
    /// TOML (`data = "..."`, `admin = ["...", "..."]`, and under `[node]`
    /// `1 = "..."`) or lines of `ROLE TOKEN` and `node:N TOKEN`.
    /// DMKVD_DATA_TOKEN and DMKVD_ADMIN_TOKEN add one each,
    /// DMKVD_NODE_TOKEN this node's own.
    #[arg(long, value_name = "FILE")]
    pub auth_file: Option<PathBuf>,
    /// Serve a non-loopback address without authentication (anyone who can
    /// reach it can read, write and re-register).
    #[arg(long)]
    pub insecure: bool,
    /// Register the region anew (new rkey and epoch) this often.
    #[arg(long, value_name = "SECS")]
    pub rkey_rotate_secs: Option<u64>,
    /// TLS certificate chain (PEM) for RPC and the engine; needs --tls-key.
    #[arg(long, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA (PEM).
    #[arg(long, value_name = "FILE")]
    pub tls_client_ca: Option<PathBuf>,
    /// Most RPC connections served at once; more wait to be accepted.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// Most one-sided engine connections served at once.
    #[arg(long, value_name = "N")]
    pub max_engine_connections: Option<usize>,
    /// Most shared-memory handoff connections at once.
    #[arg(long, value_name = "N")]
    pub max_shm_connections: Option<usize>,
    /// Close RPC and engine connections that send nothing for this long.
    #[arg(long, value_name = "SECS")]
    pub idle_timeout_secs: Option<u64>,
    /// Close a connection that has begun a frame but not finished it within this.
    #[arg(long, value_name = "MS")]
    pub frame_timeout_ms: Option<u64>,
    /// Join the cluster described by this file (nodes, shards, replicas);
    /// needs --node-id. Without it dmkvd serves a single node.
    #[arg(long, value_name = "FILE")]
    pub cluster: Option<PathBuf>,
    /// This node's id in the cluster file.
    #[arg(long, value_name = "N")]
    pub node_id: Option<u64>,
    /// Where a cluster node keeps its raft log (default: memory only).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// When a cluster node forces its raft log to disk: always (every
    /// batch, before acknowledging), batch (every 10 ms) or none.
    #[arg(long, value_name = "POLICY")]
    pub sync: Option<crate::cluster::sync_policy::SyncPolicy>,
    /// Entries a shard's raft log holds before it is cut down to a tenth
    /// (the shard's items saved as a snapshot first, with --data-dir).
    #[arg(long, value_name = "N")]
    pub raft_log_entries: Option<u64>,
    /// TLS between cluster nodes: this node's certificate chain (PEM),
    /// naming it `node-N`; needs --peer-tls-key and --peer-tls-ca.
    #[arg(long, value_name = "FILE")]
    pub peer_tls_cert: Option<PathBuf>,
    /// This node's peer TLS private key (PEM).
    #[arg(long, value_name = "FILE")]
    pub peer_tls_key: Option<PathBuf>,
    /// The CA (PEM) that signs every node's peer certificate.
    #[arg(long, value_name = "FILE")]
    pub peer_tls_ca: Option<PathBuf>,
}

/// What a full store does (`--evict`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Evict {
    /// Refuse writes with out-of-memory.
    #[default]
    None,
    /// Evict the least recently used (sampled) items.
    Lru,
}

/// How dmkvd writes its log lines (to stderr).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, fields at the top level.
    Json,
}

/// The TOML file; every field is optional.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<SocketAddr>,
    pub memory: Option<Size>,
    pub buckets: Option<u64>,
    pub grace_ms: Option<u64>,
    pub compactor: Option<crate::compact::Mode>,
    pub evict: Option<Evict>,
    pub max_frame: Option<Size>,
    pub threads: Option<usize>,
    pub log: Option<String>,
    pub log_format: Option<LogFormat>,
    pub metrics_listen: Option<SocketAddr>,
    pub memcached_listen: Option<SocketAddr>,
    pub engine_listen: Option<SocketAddr>,
    pub engine: Option<bool>,
    pub shm_socket: Option<PathBuf>,
    pub shm: Option<bool>,
    pub rdma_device: Option<String>,
    pub rdma: Option<bool>,
    pub auth_file: Option<PathBuf>,
    pub insecure: Option<bool>,
    pub cluster: Option<PathBuf>,
    pub node_id: Option<u64>,
    pub data_dir: Option<PathBuf>,
    pub sync: Option<crate::cluster::sync_policy::SyncPolicy>,
    pub raft_log_entries: Option<u64>,
    pub peer_tls_cert: Option<PathBuf>,
    pub peer_tls_key: Option<PathBuf>,
    pub peer_tls_ca: Option<PathBuf>,
    pub rkey_rotate_secs: Option<u64>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
    pub max_connections: Option<usize>,
    pub max_engine_connections: Option<usize>,
    pub max_shm_connections: Option<usize>,
    pub idle_timeout_secs: Option<u64>,
    pub frame_timeout_ms: Option<u64>,
}

/// A byte size written as a number or a string such as "256MiB".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Size(n)),
            Raw::S(s) => parse_size(&s).map(Size).map_err(serde::de::Error::custom),
        }
    }
}

/// Parses "123", "64KiB", "256MiB", "4GiB" (K/M/G and KB/MB/GB are binary too).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("invalid size {s:?}"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => return Err(format!("invalid size unit in {s:?}")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("size {s:?} overflows"))
}

/// The resolved configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub memory: u64,
    pub buckets: u64,
    pub grace: Duration,
    pub compactor: crate::compact::Mode,
    pub evict: Evict,
    pub max_frame: usize,
    pub threads: usize,
    /// The log filter given by `--log` or the file; `None`: RUST_LOG if
    /// set, else info (see [`log_filter`]).
    pub log: Option<String>,
    /// How log lines are written.
    pub log_format: LogFormat,
    /// Where `/metrics`, `/healthz` and `/readyz` are served; `None`: off.
    pub metrics_listen: Option<SocketAddr>,
    /// Where memcached's protocols are served; `None`: off.
    pub memcached_listen: Option<SocketAddr>,
    /// Connections served at once by the RPC listener, the engine, the
    /// shared-memory handoff, and the memcached port.
    pub max_connections: usize,
    pub max_engine_connections: usize,
    pub max_shm_connections: usize,
    pub max_memcached_connections: usize,
    /// How long an RPC or engine connection may send nothing.
    pub idle_timeout: Duration,
    /// How long the rest of a begun frame may take to arrive.
    pub frame_timeout: Duration,
    /// Engine address; `None` when the engine is off.
    pub engine_listen: Option<SocketAddr>,
    /// Handoff socket path; `None` when shared memory is off.
    pub shm_socket: Option<PathBuf>,
    /// Whether to offer RDMA (when built with it and a device exists).
    pub rdma: bool,
    /// A specific RDMA device; an error at start if it cannot be opened.
    pub rdma_device: Option<String>,
    /// Secrets per role; empty: no authentication (loopback only, unless
    /// `insecure`).
    pub auth: Arc<Keys>,
    /// Serve non-loopback addresses without authentication.
    pub insecure: bool,
    /// Re-register the region this often (`None`: only on request).
    pub rkey_rotate: Option<Duration>,
    /// TLS for RPC and the engine.
    pub tls: Option<TlsFiles>,
    /// Cluster membership; `None`: a single node.
    pub cluster: Option<crate::cluster::node::ClusterSetup>,
}

/// Where the server's TLS material is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Clients must present a certificate signed by this CA.
    pub client_ca: Option<PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config::resolve(FileConfig::default(), Flags::default()).expect("defaults are valid")
    }
}

impl Config {
    /// Reads the file named by `flags.config` (if any) and applies the flags.
    pub fn load(flags: Flags) -> Result<Config, String> {
        let file = match &flags.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let physical = physical_memory();
        Config::resolve_on(file, flags, physical)
    }

    /// Merges file and flags (flags win) over the defaults and validates,
    /// without checking the region against this machine's memory.
    pub fn resolve(file: FileConfig, flags: Flags) -> Result<Config, String> {
        Config::resolve_on(file, flags, None)
    }

    /// [`Config::resolve`] on a machine with `physical` bytes of memory
    /// (`None`: unknown, not checked).
    pub fn resolve_on(file: FileConfig, flags: Flags, physical: Option<u64>) -> Result<Config, String> {
        // Copies to name settings by where they came from, in errors.
        let (given, in_file, config_path) = (flags.clone(), file.clone(), flags.config.clone());
        macro_rules! name {
            ($key:ident) => {
                validate::setting_name(
                    stringify!($key),
                    given.$key.is_none() && in_file.$key.is_some(),
                    config_path.as_deref(),
                )
            };
        }
        let memory = match flags.memory {
            Some(s) => parse_size(&s).map_err(|e| format!("--memory: {e}"))?,
            None => file.memory.map_or(DEFAULT_MEMORY, |s| s.0),
        };
        let buckets =
            flags.buckets.or(file.buckets).unwrap_or_else(|| (memory / DEFAULT_BYTES_PER_BUCKET).next_power_of_two());
        let buckets_name = (given.buckets.is_some() || in_file.buckets.is_some()).then(|| name!(buckets));
        validate::region(memory, &name!(memory), buckets, buckets_name.as_deref(), physical)?;
        let max_frame = match flags.max_frame {
            Some(s) => parse_size(&s).map_err(|e| format!("--max-frame: {e}"))?,
            None => file.max_frame.map_or(DEFAULT_MAX_FRAME_LEN as u64, |s| s.0),
        };
        if max_frame < MIN_MAX_FRAME_LEN as u64 || max_frame > u32::MAX as u64 {
            return Err(format!(
                "{}: must be between {MIN_MAX_FRAME_LEN} and {} bytes, got {max_frame}",
                name!(max_frame),
                u32::MAX
            ));
        }
        let threads = match flags.threads.or(file.threads) {
            // A runtime with no worker cannot run anything.
            Some(0) => return Err(format!("{}: must be at least 1, got 0", name!(threads))),
            Some(n) if n > MAX_WORKERS => {
                return Err(format!("{}: at most {MAX_WORKERS}, got {n}", name!(threads)));
            }
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_WORKERS),
        };
        let log = flags.log.or(file.log);
        if let Some(filter) = &log {
            log_filter(Some(filter), None).map_err(|e| format!("{} {filter:?}: {e}", name!(log)))?;
        }
        let listen = flags.listen.or(file.listen).unwrap_or_else(|| DEFAULT_LISTEN.parse().expect("valid default"));
        let engine_on = !flags.no_engine && file.engine.unwrap_or(true);
        let engine_listen =
            engine_on.then(|| flags.engine_listen.or(file.engine_listen).unwrap_or(SocketAddr::new(listen.ip(), 0)));
        let shm_on = !flags.no_shm && file.shm.unwrap_or(true);
        let shm_socket = shm_on.then(|| {
            flags
                .shm_socket
                .or(file.shm_socket)
                .unwrap_or_else(|| std::env::temp_dir().join(format!("dmkvd-{}.sock", std::process::id())))
        });
        if let Some(path) = &shm_socket {
            let name = name!(shm_socket);
            validate::parent_exists(&name, path)?;
            let len = path.as_os_str().len();
            if len > MAX_SOCKET_PATH {
                return Err(format!(
                    "{name} {}: {len} bytes long; a Unix socket path has at most {MAX_SOCKET_PATH}",
                    path.display()
                ));
            }
        }
        // Where the secrets came from, for errors about them.
        let mut auth_source = format!("{DATA_TOKEN_ENV}, {ADMIN_TOKEN_ENV}, {NODE_TOKEN_ENV}");
        let mut keys = match flags.auth_file.or(file.auth_file) {
            Some(path) => {
                let name = name!(auth_file);
                let text = validate::read_text(&name, &path)?;
                auth_source = format!("{name} {}", path.display());
                parse_auth(&text).map_err(|e| format!("{auth_source}: {e}"))?
            }
            None => AuthLists::default(),
        };
        for (var, list) in [(DATA_TOKEN_ENV, &mut keys.data), (ADMIN_TOKEN_ENV, &mut keys.admin)] {
            if let Ok(v) = std::env::var(var) {
                list.push(Token::new(&v).map_err(|e| format!("{var}: {e}"))?);
            }
        }
        if let Ok(v) = std::env::var(NODE_TOKEN_ENV) {
            let token = Token::new(&v).map_err(|e| format!("{NODE_TOKEN_ENV}: {e}"))?;
            let (Some(_), Some(me)) =
                (flags.cluster.as_ref().or(file.cluster.as_ref()), flags.node_id.or(file.node_id))
            else {
                return Err(format!(
                    "{NODE_TOKEN_ENV}: a node's own secret is for cluster nodes (--cluster FILE --node-id N)"
                ));
            };
            // First: the secret a node proves is its first.
            let own = keys.nodes.entry(me).or_default();
            own.retain(|t| *t != token);
            own.insert(0, token);
        }
        let auth = Keys::new(keys.data, keys.admin)
            .and_then(|k| k.with_nodes(keys.nodes))
            .map_err(|e| format!("{auth_source}: {e}"))?;
        if auth.enabled() && !auth.has_roles() {
            return Err(format!(
                "{auth_source}: node secrets but no data or admin secret: no client could authenticate \
                 (see docs/security.md)"
            ));
        }
        let auth = Arc::new(auth);
        let insecure = flags.insecure || file.insecure.unwrap_or(false);
        let memcached_listen = flags.memcached_listen.or(file.memcached_listen);
        if !auth.enabled() && !insecure {
            let exposed =
                std::iter::once(listen).chain(engine_listen).chain(memcached_listen).find(|a| !a.ip().is_loopback());
            if let Some(a) = exposed {
                return Err(format!(
                    "refusing to serve {a} without authentication: give secrets with --auth-file \
                     (see docs/security.md), listen on loopback, or pass --insecure"
                ));
            }
        }
        let rkey_rotate = flags.rkey_rotate_secs.or(file.rkey_rotate_secs).map(Duration::from_secs);
        if rkey_rotate.is_some_and(|d| d < MIN_RKEY_ROTATE) {
            return Err(format!("rkey_rotate_secs must be at least {}", MIN_RKEY_ROTATE.as_secs()));
        }
        let tls = match (flags.tls_cert.or(file.tls_cert), flags.tls_key.or(file.tls_key)) {
            (Some(cert), Some(key)) => {
                let client_ca = flags.tls_client_ca.or(file.tls_client_ca);
                validate::readable_file(&name!(tls_cert), &cert)?;
                validate::readable_file(&name!(tls_key), &key)?;
                if let Some(ca) = &client_ca {
                    validate::readable_file(&name!(tls_client_ca), ca)?;
                }
                Some(TlsFiles { cert, key, client_ca })
            }
            (None, None) if flags.tls_client_ca.is_some() || file.tls_client_ca.is_some() => {
                return Err("tls_client_ca needs tls_cert and tls_key".into());
            }
            (None, None) => None,
            _ => return Err("tls_cert and tls_key go together".into()),
        };
        let cap = |name: &str, v: Option<usize>, default: usize| match v.unwrap_or(default) {
            n @ 1..=MAX_CONNECTION_CAP => Ok(n),
            n => Err(format!("{name} must be between 1 and {MAX_CONNECTION_CAP}, got {n}")),
        };
        let max_connections =
            cap("max_connections", flags.max_connections.or(file.max_connections), DEFAULT_MAX_CONNECTIONS)?;
        let max_engine_connections = cap(
            "max_engine_connections",
            flags.max_engine_connections.or(file.max_engine_connections),
            DEFAULT_MAX_ENGINE_CONNECTIONS,
        )?;
        let max_shm_connections = cap(
            "max_shm_connections",
            flags.max_shm_connections.or(file.max_shm_connections),
            DEFAULT_MAX_SHM_CONNECTIONS,
        )?;
        let idle_timeout = Duration::from_secs(
            flags.idle_timeout_secs.or(file.idle_timeout_secs).unwrap_or(DEFAULT_IDLE_TIMEOUT.as_secs()),
        );
        let frame_timeout = Duration::from_millis(
            flags.frame_timeout_ms.or(file.frame_timeout_ms).unwrap_or(DEFAULT_FRAME_TIMEOUT.as_millis() as u64),
        );
        // Zero would close every connection at once; a timeout far past any
        // clock's range would overflow the deadline arithmetic.
        for (name, t) in [("idle_timeout_secs", idle_timeout), ("frame_timeout_ms", frame_timeout)] {
            if t.is_zero() || t > MAX_TIMEOUT {
                return Err(format!("{name} must be above zero and at most {} seconds", MAX_TIMEOUT.as_secs()));
            }
        }
        let cluster = match (flags.cluster.or(file.cluster), flags.node_id.or(file.node_id)) {
            (Some(path), Some(node_id)) => {
                let name = name!(cluster);
                let text = validate::read_text(&name, &path)?;
                let config = crate::cluster::config::ClusterConfig::parse(&text)
                    .map_err(|e| format!("{name} {}: {e}", path.display()))?;
                let me = config.node(node_id)?;
                if flags.listen.or(file.listen).is_some_and(|l| l != me.rpc) {
                    return Err(format!(
                        "--listen differs from node {node_id}'s rpc address {} in the cluster file",
                        me.rpc
                    ));
                }
                if !auth.enabled() && !insecure {
                    let exposed = config.nodes.iter().flat_map(|n| [n.rpc, n.peer]).find(|a| !a.ip().is_loopback());
                    if let Some(a) = exposed {
                        return Err(format!(
                            "refusing to run a cluster on {a} without authentication: peers would take raft \
                             traffic from anyone; give secrets with --auth-file (with a `node:N` secret for every \
                             node) or pass --insecure"
                        ));
                    }
                }
                if auth.enabled() {
                    node_secrets(&auth, &config, node_id).map_err(|e| format!("{auth_source}: {e}"))?;
                }
                let data_dir = flags.data_dir.or(file.data_dir);
                if let Some(dir) = &data_dir {
                    validate::creatable_dir(&name!(data_dir), dir)?;
                }
                let sync = flags.sync.or(file.sync);
                if sync.is_some() && data_dir.is_none() {
                    return Err("--sync needs --data-dir: without it the raft log is in memory".into());
                }
                let log_limits = match flags.raft_log_entries.or(file.raft_log_entries) {
                    None => crate::cluster::shard::LogLimits::default(),
                    Some(n) if n < MIN_RAFT_LOG_ENTRIES => {
                        return Err(format!("--raft-log-entries must be at least {MIN_RAFT_LOG_ENTRIES}"));
                    }
                    Some(n) => {
                        crate::cluster::shard::LogLimits { max_entries: n, keep_entries: n / 10, ..Default::default() }
                    }
                };
                let peer_tls = match (
                    flags.peer_tls_cert.or(file.peer_tls_cert),
                    flags.peer_tls_key.or(file.peer_tls_key),
                    flags.peer_tls_ca.or(file.peer_tls_ca),
                ) {
                    (Some(cert), Some(key), Some(ca)) => {
                        validate::readable_file(&name!(peer_tls_cert), &cert)?;
                        validate::readable_file(&name!(peer_tls_key), &key)?;
                        validate::readable_file(&name!(peer_tls_ca), &ca)?;
                        Some(crate::cluster::peer_tls::PeerTlsFiles { cert, key, ca })
                    }
                    (None, None, None) => None,
                    _ => return Err("peer_tls_cert, peer_tls_key and peer_tls_ca go together".into()),
                };
                Some(crate::cluster::node::ClusterSetup {
                    config,
                    node_id,
                    data_dir,
                    sync: sync.unwrap_or_default(),
                    log_limits,
                    peer_tls,
                })
            }
            (None, None) if flags.raft_log_entries.is_some() || file.raft_log_entries.is_some() => {
                return Err("--raft-log-entries is for cluster nodes (--cluster FILE --node-id N)".into());
            }
            (None, None) if flags.data_dir.is_some() || file.data_dir.is_some() => {
                return Err("--data-dir is for cluster nodes (--cluster FILE --node-id N)".into());
            }
            (None, None) if flags.sync.is_some() || file.sync.is_some() => {
                return Err("--sync is for cluster nodes with --data-dir".into());
            }
            (None, None)
                if [&flags.peer_tls_cert, &flags.peer_tls_key, &flags.peer_tls_ca, &file.peer_tls_cert]
                    .iter()
                    .any(|f| f.is_some()) =>
            {
                return Err("--peer-tls-cert, --peer-tls-key and --peer-tls-ca are for cluster nodes".into());
            }
            (None, None) => None,
            (Some(_), None) => return Err("--cluster needs --node-id".into()),
            (None, Some(_)) => return Err("--node-id needs --cluster".into()),
        };
        let evict = flags.evict.or(file.evict).unwrap_or_default();
        let listen = match &cluster {
            Some(c) => c.config.node(c.node_id)?.rpc,
            None => listen,
        };
        // A cluster node's engine listens beside its RPC address unless
        // told otherwise.
        let engine_listen = match &cluster {
            Some(_) if flags.engine_listen.is_none() && file.engine_listen.is_none() => {
                engine_listen.map(|_| SocketAddr::new(listen.ip(), 0))
            }
            _ => engine_listen,
        };
        let rdma_device = flags.rdma_device.or(file.rdma_device);
        if let Some(dev) = rdma_device.as_ref().filter(|_| !cfg!(feature = "rdma")) {
            return Err(format!(
                "{} {dev}: this dmkvd was built without RDMA support (cargo feature `rdma`)",
                name!(rdma_device)
            ));
        }
        Ok(Config {
            rdma: !flags.no_rdma && file.rdma.unwrap_or(true),
            rdma_device,
            listen,
            engine_listen,
            shm_socket,
            memory,
            buckets,
            grace: Duration::from_millis(flags.grace_ms.or(file.grace_ms).unwrap_or(DEFAULT_GRACE.as_millis() as u64)),
            compactor: flags.compactor.or(file.compactor).unwrap_or_default(),
            evict,
            max_frame: max_frame as usize,
            threads,
            log,
            log_format: flags.log_format.or(file.log_format).unwrap_or_default(),
            metrics_listen: flags.metrics_listen.or(file.metrics_listen),
            memcached_listen,
            max_memcached_connections: MAX_MEMCACHED_CONNECTIONS,
            auth,
            insecure,
            rkey_rotate,
            tls,
            cluster,
            max_connections,
            max_engine_connections,
            max_shm_connections,
            idle_timeout,
            frame_timeout,
        })
    }
}

/// Checks that a cluster with secrets has one for every node it lists and
/// none for nodes it does not: a node proves its own to its peers, and
/// peers take raft traffic only from a node whose secret they know (one
/// without would be refused by every peer, and its failed proofs would
/// get its address rate-limited). A secret for a node outside the file
/// would let its holder in as a node the cluster does not have.
fn node_secrets(auth: &Keys, config: &crate::cluster::config::ClusterConfig, me: u64) -> Result<(), String> {
    if auth.node_token(me).is_none() {
        return Err(format!(
            "no secret for node {me}, which it proves to its peers: add a line `{} SECRET` (TOML: `{me} = \"SECRET\"` \
             under [node]) or set {NODE_TOKEN_ENV}",
            node_name(me)
        ));
    }
    let missing: Vec<String> =
        config.nodes.iter().filter(|n| auth.node_token(n.id).is_none()).map(|n| n.id.to_string()).collect();
    if !missing.is_empty() {
        return Err(format!(
            "no secret for node {} of the cluster file: every node's auth file lists every node's secret, or \
             peers refuse its raft traffic",
            missing.join(", ")
        ));
    }
    if let Some(n) = auth.nodes().find(|&n| config.node(n).is_err()) {
        return Err(format!("a secret for node {n}, which the cluster file does not list"));
    }
    Ok(())
}

/// Secrets per role, and per cluster node, as read from an auth file.
#[derive(Debug, Default)]
struct AuthLists {
    data: Vec<Token>,
    admin: Vec<Token>,
    /// Node N's secrets, in the file's order (the first is the one N proves).
    nodes: BTreeMap<u64, Vec<Token>>,
}

/// Parses an auth file: TOML with `data` and `admin` (a string or a list
/// of strings each) and a table `[node]` of node id to a string or a list,
/// or plain lines of `ROLE TOKEN` and `node:N TOKEN` (`#` starts a comment).
fn parse_auth(text: &str) -> Result<AuthLists, String> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct AuthToml {
        data: Option<OneOrMany>,
        admin: Option<OneOrMany>,
        node: Option<BTreeMap<String, OneOrMany>>,
    }
    let tokens = |v: Option<OneOrMany>| -> Result<Vec<Token>, String> {
        match v {
            None => Ok(Vec::new()),
            Some(OneOrMany::One(s)) => Ok(vec![Token::new(&s)?]),
            Some(OneOrMany::Many(v)) => v.iter().map(|s| Token::new(s)).collect(),
        }
    };
    let lists = match toml::from_str::<AuthToml>(text) {
        Ok(t) => {
            let mut nodes = BTreeMap::new();
            for (id, v) in t.node.unwrap_or_default() {
                let n = match parse_node_name(&format!("node:{id}")) {
                    Some(Ok(n)) => n,
                    Some(Err(e)) => return Err(format!("[node] {e}")),
                    None => return Err(format!("[node] {id:?}: not a node id")),
                };
                let list: &mut Vec<Token> = nodes.entry(n).or_default();
                list.extend(tokens(Some(v)).map_err(|e| format!("[node] {id}: {e}"))?);
            }
            AuthLists { data: tokens(t.data)?, admin: tokens(t.admin)?, nodes }
        }
        Err(toml_err) => {
            let mut lists = AuthLists::default();
            for (n, line) in text.lines().enumerate() {
                let line = line.split('#').next().unwrap_or("").trim();
                if line.is_empty() {
                    continue;
                }
                let mut parts = line.split_whitespace();
                let (Some(role), Some(token), None) = (parts.next(), parts.next(), parts.next()) else {
                    return Err(format!(
                        "line {}: expected `ROLE TOKEN` (roles: data, admin) or `node:N TOKEN`, and the file is \
                         not TOML either: {toml_err}",
                        n + 1
                    ));
                };
                let token = Token::new(token).map_err(|e| format!("line {}: {e}", n + 1))?;
                match (role, parse_node_name(role)) {
                    (_, Some(node)) => {
                        let node = node.map_err(|e| format!("line {}: {e}", n + 1))?;
                        lists.nodes.entry(node).or_default().push(token);
                    }
                    ("data", None) => lists.data.push(token),
                    ("admin", None) => lists.admin.push(token),
                    (other, None) => {
                        return Err(format!(
                            "line {}: unknown role {other:?} (roles: data, admin; node secrets: node:N)",
                            n + 1
                        ));
                    }
                }
            }
            lists
        }
    };
    if lists.data.is_empty() && lists.admin.is_empty() && lists.nodes.values().all(Vec::is_empty) {
        return Err("no tokens in it".into());
    }
    Ok(lists)
}

fn read_file(path: &Path) -> Result<FileConfig, String> {
    let text = validate::read_text("--config", path)?;
    toml::from_str(&text).map_err(|e| format!("--config {}: {}", path.display(), validate::toml_error(&e, &text)))
}

/// The log filter dmkvd runs with: `explicit` (`--log` or `log` in the
/// file) if given, else `env` (RUST_LOG) if set, else info. Flags win over
/// the environment as they win over the file.
pub fn log_filter(explicit: Option<&str>, env: Option<&str>) -> Result<tracing_subscriber::EnvFilter, String> {
    use tracing_subscriber::EnvFilter;
    match (explicit, env.filter(|v| !v.trim().is_empty())) {
        (Some(f), _) => EnvFilter::try_new(f).map_err(|e| format!("invalid log filter: {e}")),
        (None, Some(v)) => EnvFilter::try_new(v).map_err(|e| format!("RUST_LOG {v:?}: invalid log filter: {e}")),
        (None, None) => Ok(EnvFilter::new("info")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size("4g"), Ok(4 << 30));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999999999999G").is_err());
    }

    #[test]
    fn flags_override_file() {
        let file: FileConfig = toml::from_str("listen = \"127.0.0.1:9000\"\nmemory = \"64MiB\"\ngrace_ms = 5").unwrap();
        let flags = Flags { memory: Some("32MiB".into()), ..Flags::default() };
        let c = Config::resolve(file, flags).unwrap();
        assert_eq!(c.listen.port(), 9000);
        assert_eq!(c.memory, 32 << 20);
        assert_eq!(c.grace, Duration::from_millis(5));
    }

    /// The example in deploy/ stays a valid config, with every commented
    /// setting too.
    #[test]
    fn deploy_example_parses() {
        let text = include_str!("../../deploy/dmkvd.toml");
        let file: FileConfig = toml::from_str(text).unwrap();
        let c = Config::resolve(file, Flags::default()).unwrap();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        let uncommented: String = text
            .lines()
            .map(|l| l.strip_prefix("# ").filter(|r| r.contains(" = ")).unwrap_or(l))
            .collect::<Vec<_>>()
            .join("\n");
        let all: FileConfig = toml::from_str(&uncommented).unwrap();
        assert!(all.buckets.is_some() && all.engine_listen.is_some() && all.shm_socket.is_some());
        assert!(all.memcached_listen.is_some());
        assert!(all.max_connections.is_some() && all.max_engine_connections.is_some());
        assert!(all.max_shm_connections.is_some() && all.idle_timeout_secs.is_some() && all.frame_timeout_ms.is_some());
    }

    #[test]
    fn auth_files_in_both_formats() {
        let t = parse_auth(
            "data = \"data-0123456789abcdef\"\nadmin = [\"adm1-0123456789abcdef\", \"adm2-0123456789abcdef\"]",
        )
        .unwrap();
        assert_eq!((t.data.len(), t.admin.len()), (1, 2));
        let t = parse_auth("# secrets\ndata data-0123456789abcdef\n\nadmin adm1-0123456789abcdef # ops\n").unwrap();
        assert_eq!((t.data.len(), t.admin.len()), (1, 1));
        assert!(parse_auth("data short").is_err());
        assert!(parse_auth("root x-0123456789abcdef").is_err());
        assert!(parse_auth("# nothing\n").is_err());
        assert!(parse_auth("data = \"data-0123456789abcdef\"\nroot = \"x\"").is_err());
    }

    #[test]
    fn auth_files_hold_node_secrets() {
        let t = parse_auth(
            "data = \"data-0123456789abcdef\"\n[node]\n1 = \"node1-0123456789abcdef\"\n\
             2 = [\"node2-0123456789abcdef\", \"node2-next-0123456789\"]\n",
        )
        .unwrap();
        assert_eq!((t.data.len(), t.admin.len()), (1, 0));
        assert_eq!(t.nodes.iter().map(|(&n, l)| (n, l.len())).collect::<Vec<_>>(), vec![(1, 1), (2, 2)]);
        assert_eq!(t.nodes[&2][0], Token::new("node2-0123456789abcdef").unwrap(), "in the file's order");
        let t = parse_auth(
            "admin adm1-0123456789abcdef\nnode:3 node3-0123456789abcdef # this host\nnode:4 node4-0123456789abcdef\n\
             node:3 node3-next-0123456789\n",
        )
        .unwrap();
        assert_eq!(t.nodes.iter().map(|(&n, l)| (n, l.len())).collect::<Vec<_>>(), vec![(3, 2), (4, 1)]);
        // Node secrets alone are tokens (whether they let clients in is
        // decided with the rest of the config).
        assert_eq!(parse_auth("node:1 node1-0123456789abcdef").unwrap().nodes.len(), 1);
        for (bad, says) in [
            ("node:0 node0-0123456789abcdef", "line 1: \"node:0\": a node id is a number from 1"),
            ("node:x node0-0123456789abcdef", "a node id is a number"),
            ("node:4294967296 n-0123456789abcdef", "a node id is a number"),
            ("node:1 short", "line 1: a token must be at least"),
            ("node: n-0123456789abcdef", "a node id is a number"),
            ("nodes:1 n-0123456789abcdef", "unknown role \"nodes:1\""),
            ("[node]\n0 = \"node0-0123456789abcdef\"", "[node] \"node:0\": a node id"),
            ("[node]\nx = \"node0-0123456789abcdef\"", "[node] \"node:x\": a node id"),
            ("[node]\n1 = \"short\"", "[node] 1: a token must be at least"),
        ] {
            let err = parse_auth(bad).unwrap_err();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }

    /// A cluster file of nodes 1 to 3 on loopback, and an auth file.
    fn cluster_with_auth(dir: &Path, auth: &str) -> Flags {
        let file = dir.join("cluster.toml");
        let mut text = String::from("shards = 3\nreplicas = 3\n");
        for n in 1..=3 {
            text +=
                &format!("[[node]]\nid = {n}\nrpc = \"127.0.0.1:{}\"\npeer = \"127.0.0.1:{}\"\n", 7069 + n, 7169 + n);
        }
        std::fs::write(&file, text).unwrap();
        let auth_file = dir.join("auth");
        std::fs::write(&auth_file, auth).unwrap();
        Flags { cluster: Some(file), node_id: Some(1), auth_file: Some(auth_file), ..Flags::default() }
    }

    #[test]
    fn peer_tls_files_go_together_and_only_on_cluster_nodes() {
        let dir = tempfile::tempdir().unwrap();
        let auth = "data data-0123456789abcdef\nnode:1 n1-secret-0123456789\nnode:2 n2-secret-0123456789\n\
                    node:3 n3-secret-0123456789\n";
        let pem = dir.path().join("x.pem");
        std::fs::write(&pem, "not read until the node starts").unwrap();
        let cluster = cluster_with_auth(dir.path(), auth);
        let with = |cert: bool, key: bool, ca: bool, base: Flags| Flags {
            peer_tls_cert: cert.then(|| pem.clone()),
            peer_tls_key: key.then(|| pem.clone()),
            peer_tls_ca: ca.then(|| pem.clone()),
            ..base
        };
        let c = Config::resolve(FileConfig::default(), with(true, true, true, cluster.clone())).unwrap();
        assert_eq!(c.cluster.unwrap().peer_tls.map(|f| f.ca), Some(pem.clone()));
        let err = Config::resolve(FileConfig::default(), with(true, false, true, cluster.clone())).unwrap_err();
        assert!(err.contains("go together"), "{err}");
        let err = Config::resolve(FileConfig::default(), with(true, true, true, Flags::default())).unwrap_err();
        assert!(err.contains("for cluster nodes"), "{err}");
        let missing = Flags { peer_tls_ca: Some(dir.path().join("nope.pem")), ..with(true, true, false, cluster) };
        let err = Config::resolve(FileConfig::default(), missing).unwrap_err();
        assert!(err.contains("peer_tls_ca") || err.contains("peer-tls-ca"), "{err}");
    }

    #[test]
    fn cluster_nodes_with_secrets_need_every_nodes_own() {
        let dir = tempfile::tempdir().unwrap();
        let roles = "data data-0123456789abcdef\nadmin adm1-0123456789abcdef\n";
        let nodes =
            |ids: &[u64]| -> String { ids.iter().map(|n| format!("node:{n} node{n}-secret-0123456789\n")).collect() };
        let resolve = |auth: String| Config::resolve(FileConfig::default(), cluster_with_auth(dir.path(), &auth));
        let c = resolve(format!("{roles}{}", nodes(&[1, 2, 3]))).unwrap();
        assert_eq!(c.auth.node_token(1), Some(&Token::new("node1-secret-0123456789").unwrap()));
        // The admin secret no longer stands in for a node's own.
        let err = resolve(roles.to_string()).unwrap_err();
        assert!(err.starts_with("--auth-file ") && err.contains("no secret for node 1"), "{err}");
        assert!(err.contains("`node:1 SECRET`") && err.contains(NODE_TOKEN_ENV), "{err}");
        assert!(!err.contains('\n'), "one line: {err}");
        let err = resolve(format!("{roles}{}", nodes(&[1, 3]))).unwrap_err();
        assert!(err.contains("no secret for node 2 of the cluster file"), "{err}");
        let err = resolve(format!("{roles}{}", nodes(&[1, 2, 3, 9]))).unwrap_err();
        assert!(err.contains("a secret for node 9, which the cluster file does not list"), "{err}");
        let err = resolve(nodes(&[1, 2, 3])).unwrap_err();
        assert!(err.contains("no client could authenticate"), "{err}");
        let err = resolve(format!("{roles}{}node:3 node1-secret-0123456789\n", nodes(&[1, 2]))).unwrap_err();
        assert!(err.contains("nodes 1 and 3 have the same token"), "{err}");
        let err = resolve(format!("{roles}{}node:3 data-0123456789abcdef\n", nodes(&[1, 2]))).unwrap_err();
        assert!(err.contains("node 3's token is also a data or admin token"), "{err}");
        // A single node takes (and ignores) node lines in a shared file.
        let single = Flags { auth_file: Some(dir.path().join("auth")), ..Flags::default() };
        std::fs::write(dir.path().join("auth"), format!("{roles}{}", nodes(&[1, 2]))).unwrap();
        assert!(Config::resolve(FileConfig::default(), single).unwrap().auth.enabled());
    }

    #[test]
    fn non_loopback_needs_auth_or_insecure() {
        let open = Flags { listen: Some("0.0.0.0:7070".parse().unwrap()), ..Flags::default() };
        let err = Config::resolve(FileConfig::default(), open).unwrap_err();
        assert!(err.contains("without authentication"), "{err}");
        let engine = Flags { engine_listen: Some("0.0.0.0:0".parse().unwrap()), ..Flags::default() };
        assert!(Config::resolve(FileConfig::default(), engine).is_err());
        let memcached = Flags { memcached_listen: Some("0.0.0.0:11211".parse().unwrap()), ..Flags::default() };
        assert!(Config::resolve(FileConfig::default(), memcached).unwrap_err().contains("0.0.0.0:11211"));
        let insecure = Flags { listen: Some("0.0.0.0:7070".parse().unwrap()), insecure: true, ..Flags::default() };
        assert!(Config::resolve(FileConfig::default(), insecure).is_ok());
        let dir = std::env::temp_dir().join(format!("dmkv-auth-test-{}", std::process::id()));
        std::fs::write(&dir, "data data-0123456789abcdef\n").unwrap();
        let authed =
            Flags { listen: Some("0.0.0.0:7070".parse().unwrap()), auth_file: Some(dir.clone()), ..Flags::default() };
        let c = Config::resolve(FileConfig::default(), authed).unwrap();
        assert!(c.auth.enabled());
        let _ = std::fs::remove_file(dir);
    }

    #[test]
    fn sync_policies_need_a_cluster_data_dir() {
        use crate::cluster::sync_policy::SyncPolicy;
        let dir = std::env::temp_dir().join(format!("dmkv-sync-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("cluster.toml");
        std::fs::write(
            &file,
            "shards = 1\nreplicas = 1\n[[node]]\nid = 1\nrpc = \"127.0.0.1:7070\"\npeer = \"127.0.0.1:7170\"\n",
        )
        .unwrap();
        let node = |sync: Option<SyncPolicy>, data: bool| Flags {
            cluster: Some(file.clone()),
            node_id: Some(1),
            data_dir: data.then(|| dir.join("data")),
            sync,
            ..Flags::default()
        };
        let c = Config::resolve(FileConfig::default(), node(None, true)).unwrap();
        assert_eq!(c.cluster.unwrap().sync, SyncPolicy::Always, "the default");
        let mut mc = node(None, true);
        mc.memcached_listen = Some("127.0.0.1:11211".parse().unwrap());
        let c = Config::resolve(FileConfig::default(), mc).unwrap();
        assert!(c.memcached_listen.is_some(), "the memcached port on a cluster node");
        let c = Config::resolve(FileConfig::default(), node(Some(SyncPolicy::Batch), true)).unwrap();
        assert_eq!(c.cluster.unwrap().sync, SyncPolicy::Batch);
        let err = Config::resolve(FileConfig::default(), node(Some(SyncPolicy::None), false)).unwrap_err();
        assert!(err.contains("--sync needs --data-dir"), "{err}");
        let single = Flags { sync: Some(SyncPolicy::Always), ..Flags::default() };
        assert!(Config::resolve(FileConfig::default(), single).unwrap_err().contains("cluster nodes"));
        assert!("sometimes".parse::<SyncPolicy>().unwrap_err().contains("always, batch or none"));
        let f: FileConfig = toml::from_str("sync = \"none\"").unwrap();
        assert_eq!(f.sync, Some(SyncPolicy::None));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn defaults_and_rejections() {
        let c = Config::default();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.memory, DEFAULT_MEMORY);
        assert!(toml::from_str::<FileConfig>("bogus = 1").is_err());
        let bad = Flags { buckets: Some(1000), ..Flags::default() };
        assert!(Config::resolve(FileConfig::default(), bad).is_err());
        let odd = Flags { memory: Some("33554433".into()), ..Flags::default() };
        assert!(Config::resolve(FileConfig::default(), odd).is_err());
    }

    /// Each thread is a connection runtime too: a count it cannot start is
    /// refused here, naming the flag, not after the listeners are bound.
    #[test]
    fn too_many_threads_are_refused_by_name() {
        let n = MAX_WORKERS + 1;
        let err = Config::resolve(FileConfig::default(), Flags { threads: Some(n), ..Flags::default() }).unwrap_err();
        assert_eq!(err, format!("--threads: at most {MAX_WORKERS}, got {n}"));
        let ok = Config::resolve(FileConfig::default(), Flags { threads: Some(MAX_WORKERS), ..Flags::default() });
        assert_eq!(ok.map(|c| c.threads), Ok(MAX_WORKERS));
    }

    #[test]
    fn errors_name_the_flag_or_the_file_key() {
        let file: FileConfig = toml::from_str("memory = \"1MiB\"\nthreads = 0").unwrap();
        let flags = Flags { config: Some("dmkvd.toml".into()), ..Flags::default() };
        let err = Config::resolve(file.clone(), flags).unwrap_err();
        assert_eq!(err, "dmkvd.toml: memory: 1 MiB is below the smallest region dmkvd accepts, 4 MiB");
        let flags = Flags { config: Some("dmkvd.toml".into()), memory: Some("4MiB".into()), ..Flags::default() };
        let err = Config::resolve(file, flags).unwrap_err();
        assert_eq!(err, "dmkvd.toml: threads: must be at least 1, got 0");
        let err = Config::resolve(FileConfig::default(), Flags { threads: Some(0), ..Flags::default() }).unwrap_err();
        assert_eq!(err, "--threads: must be at least 1, got 0");
        let err = Config::resolve(FileConfig::default(), Flags { memory: Some("lots".into()), ..Flags::default() })
            .unwrap_err();
        assert!(err.starts_with("--memory: invalid size"), "{err}");
        let big = Flags { memory: Some("64GiB".into()), ..Flags::default() };
        let err = Config::resolve_on(FileConfig::default(), big, Some(8 << 30)).unwrap_err();
        assert!(err.contains("more than this machine's physical memory, 8 GiB"), "{err}");
    }

    #[test]
    fn log_flag_wins_over_rust_log() {
        assert_eq!(log_filter(Some("error"), Some("debug")).unwrap().to_string(), "error");
        assert_eq!(log_filter(None, Some("debug")).unwrap().to_string(), "debug");
        assert_eq!(log_filter(None, Some("")).unwrap().to_string(), "info");
        assert_eq!(log_filter(None, None).unwrap().to_string(), "info");
        assert!(log_filter(None, Some("x=notalevel")).unwrap_err().starts_with("RUST_LOG"));
        let bad = Flags { log: Some("dmkv_server=loud".into()), ..Flags::default() };
        let err = Config::resolve(FileConfig::default(), bad).unwrap_err();
        assert!(err.starts_with("--log \"dmkv_server=loud\": invalid log filter"), "{err}");
    }

    #[test]
    fn config_file_errors_are_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.toml");
        std::fs::write(&path, "listen = \"127.0.0.1:0\"\nmemory = \"lots\"\n").unwrap();
        let err = read_file(&path).unwrap_err();
        assert!(!err.contains('\n') && err.contains("d.toml: line 2: invalid size"), "{err}");
        let err = read_file(&dir.path().join("missing.toml")).unwrap_err();
        assert!(
            err.starts_with("--config ") && err.ends_with("missing.toml: cannot read it: No such file or directory")
        );
    }

    #[test]
    fn connection_bounds_resolve_and_zero_is_rejected() {
        let c = Config::default();
        assert_eq!(
            (c.max_connections, c.max_engine_connections, c.max_shm_connections),
            (DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_ENGINE_CONNECTIONS, DEFAULT_MAX_SHM_CONNECTIONS)
        );
        assert_eq!((c.idle_timeout, c.frame_timeout), (DEFAULT_IDLE_TIMEOUT, DEFAULT_FRAME_TIMEOUT));
        let file: FileConfig = toml::from_str("max_shm_connections = 3\nframe_timeout_ms = 250").unwrap();
        let flags = Flags { max_engine_connections: Some(7), idle_timeout_secs: Some(1), ..Flags::default() };
        let c = Config::resolve(file, flags).unwrap();
        assert_eq!((c.max_engine_connections, c.max_shm_connections), (7, 3));
        assert_eq!((c.idle_timeout, c.frame_timeout), (Duration::from_secs(1), Duration::from_millis(250)));
        for flags in [
            Flags { max_connections: Some(0), ..Flags::default() },
            Flags { max_engine_connections: Some(0), ..Flags::default() },
            Flags { max_shm_connections: Some(0), ..Flags::default() },
            Flags { max_connections: Some(MAX_CONNECTION_CAP + 1), ..Flags::default() },
            Flags { idle_timeout_secs: Some(0), ..Flags::default() },
            Flags { frame_timeout_ms: Some(0), ..Flags::default() },
            Flags { idle_timeout_secs: Some(u64::MAX), ..Flags::default() },
        ] {
            let err = Config::resolve(FileConfig::default(), flags).unwrap_err();
            assert!(err.contains("must be"), "{err}");
        }
    }
}
