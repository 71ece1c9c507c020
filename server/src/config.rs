//! dmkvd configuration: defaults that run one node on loopback, an optional
//! TOML file, and command-line flags that override the file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use dmkv_common::limits::{DEFAULT_MAX_FRAME_LEN, MIN_MAX_FRAME_LEN, MIN_REGION_LEN};
use serde::Deserialize;

/// Default RPC listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
/// Default region size.
pub const DEFAULT_MEMORY: u64 = 256 << 20;
/// Default time a retired item stays intact for one-sided readers.
pub const DEFAULT_GRACE: Duration = Duration::from_millis(100);
/// Default index size: one bucket (8 slots) per this many bytes of region.
pub const DEFAULT_BYTES_PER_BUCKET: u64 = 1024;
/// Most client connections served at once; more wait in the accept queue.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// How long shutdown waits for connections to finish their requests.
pub const SHUTDOWN_DRAIN: Duration = Duration::from_secs(5);

/// Command-line flags of `dmkvd`. Every flag overrides the config file.
#[derive(Debug, Parser, Default)]
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
    /// Largest accepted frame, e.g. 2MiB.
    #[arg(long, value_name = "SIZE")]
    pub max_frame: Option<String>,
    /// Worker threads (default: one per core).
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
    /// Log filter, e.g. info or dmkv_server=debug (RUST_LOG also works).
    #[arg(long)]
    pub log: Option<String>,
}

/// The TOML file; every field is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub listen: Option<SocketAddr>,
    pub memory: Option<Size>,
    pub buckets: Option<u64>,
    pub grace_ms: Option<u64>,
    pub max_frame: Option<Size>,
    pub threads: Option<usize>,
    pub log: Option<String>,
    pub engine_listen: Option<SocketAddr>,
    pub engine: Option<bool>,
    pub shm_socket: Option<PathBuf>,
    pub shm: Option<bool>,
    pub rdma_device: Option<String>,
    pub rdma: Option<bool>,
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
    pub max_frame: usize,
    pub threads: usize,
    pub log: String,
    pub max_connections: usize,
    /// Engine address; `None` when the engine is off.
    pub engine_listen: Option<SocketAddr>,
    /// Handoff socket path; `None` when shared memory is off.
    pub shm_socket: Option<PathBuf>,
    /// Whether to offer RDMA (when built with it and a device exists).
    pub rdma: bool,
    /// A specific RDMA device; an error at start if it cannot be opened.
    pub rdma_device: Option<String>,
    /// Secrets clients must prove; empty: authentication is off.
    pub auth: std::sync::Arc<dmkv_common::auth::Keys>,
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
        Config::resolve(file, flags)
    }

    /// Merges file and flags (flags win) over the defaults and validates.
    pub fn resolve(file: FileConfig, flags: Flags) -> Result<Config, String> {
        let memory = match flags.memory {
            Some(s) => parse_size(&s)?,
            None => file.memory.map_or(DEFAULT_MEMORY, |s| s.0),
        };
        if memory < MIN_REGION_LEN as u64 * 4 {
            return Err(format!("memory {memory} is below the minimum of {} bytes", MIN_REGION_LEN * 4));
        }
        // The region is read and written in whole 8-byte words.
        if !memory.is_multiple_of(8) {
            return Err(format!("memory {memory} is not a multiple of 8 bytes"));
        }
        let buckets =
            flags.buckets.or(file.buckets).unwrap_or_else(|| (memory / DEFAULT_BYTES_PER_BUCKET).next_power_of_two());
        if buckets == 0 || !buckets.is_power_of_two() {
            return Err(format!("buckets must be a power of two, got {buckets}"));
        }
        let max_frame = match flags.max_frame {
            Some(s) => parse_size(&s)?,
            None => file.max_frame.map_or(DEFAULT_MAX_FRAME_LEN as u64, |s| s.0),
        };
        if max_frame < MIN_MAX_FRAME_LEN as u64 || max_frame > u32::MAX as u64 {
            return Err(format!("max_frame must be between {MIN_MAX_FRAME_LEN} and {} bytes", u32::MAX));
        }
        let threads = flags
            .threads
            .or(file.threads)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
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
        let rdma_device = flags.rdma_device.or(file.rdma_device);
        if rdma_device.is_some() && !cfg!(feature = "rdma") {
            return Err("this dmkvd was built without RDMA support (cargo feature `rdma`)".into());
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
            max_frame: max_frame as usize,
            threads: threads.max(1),
            log: flags.log.or(file.log).unwrap_or_else(|| "info".into()),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            auth: Default::default(),
        })
    }
}

fn read_file(path: &Path) -> Result<FileConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read config {}: {e}", path.display()))?;
    toml::from_str(&text).map_err(|e| format!("invalid config {}: {e}", path.display()))
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
}
