//! Command line of `dmkv-ycsb`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use dmkv_client::{ReadPath, Transport};

use crate::backend::{BackendKind, DmkvOptions};
use crate::driver::{DEFAULT_OPERATIONS, Settings, Warmup};
use crate::generator::EtaGrowth;
use crate::workload::{Distribution, UpdateWrites, Workload, YCSB_FIELDS};

/// Flags of `dmkv-ycsb`.
#[derive(Debug, Parser)]
#[command(
    name = "dmkv-ycsb",
    version,
    about = "YCSB core workloads against dmkv, memcached or Redis",
    after_help = "Workload E (scans) is refused: a hash store has no ordered key space."
)]
pub struct Args {
    /// YCSB core workload.
    #[arg(long, value_enum, default_value = "a")]
    pub workload: Workload,
    /// Records loaded (and read, updated) by the workload.
    #[arg(long, default_value_t = 100_000)]
    pub records: u64,
    /// Measured operations of the run phase [default: 100000 unless --duration].
    #[arg(long, conflicts_with = "duration")]
    pub operations: Option<u64>,
    /// Measured seconds of the run phase, instead of --operations.
    #[arg(long, value_name = "S")]
    pub duration: Option<f64>,
    /// Bytes per record (YCSB: 10 fields × 100 B).
    #[arg(long, default_value_t = 1000)]
    pub value_size: usize,
    /// Fields per record, of value-size / fields bytes each (YCSB's fieldcount).
    #[arg(long, default_value_t = YCSB_FIELDS)]
    pub fields: usize,
    /// What an update (and the write of a read-modify-write) writes: the
    /// whole record (YCSB writeallfields=true) or one field (YCSB's default;
    /// it replaces the stored value, as YCSB's memcached binding does).
    #[arg(long, value_enum, default_value = "record")]
    pub update_writes: UpdateWrites,
    /// Key distribution [default: latest for D, zipfian otherwise].
    #[arg(long, value_enum)]
    pub distribution: Option<Distribution>,
    /// Workload D's latest distribution as inserts grow the key space:
    /// `ycsb` keeps YCSB's eta, `corrected` recomputes it from the new
    /// count (a different distribution, not YCSB-comparable).
    #[arg(long, value_enum, default_value = "ycsb")]
    pub latest_eta: EtaGrowth,
    /// Inserts to size the zipfian key space for (records + 2 × N + 1, as
    /// YCSB) [default: operations × insert proportion; needed for zipfian
    /// with inserts and --duration].
    #[arg(long, value_name = "N")]
    pub expected_inserts: Option<u64>,
    /// Client threads, each with one connection.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Operations outstanding per thread (pipelining depth).
    #[arg(long, default_value_t = 1)]
    pub in_flight: usize,
    /// Open loop at this many operations per second in all; latency counts
    /// from each operation's intended start.
    #[arg(long, value_name = "OPS")]
    pub target_rate: Option<f64>,
    /// Not measured at the start: seconds ("5s", "500ms") or operations ("1000").
    #[arg(long, default_value = "0")]
    pub warmup: Warmup,
    /// Seed of every random choice (keys, operations, values).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Store to measure.
    #[arg(long, value_enum, default_value = "dmkv")]
    pub backend: BackendKind,
    /// Server address [default: the store's usual port on 127.0.0.1].
    #[arg(long, value_name = "ADDR")]
    pub server: Option<String>,
    /// dmkv: which way GETs go (auto, one-sided, rpc).
    #[arg(long, default_value = "auto")]
    pub path: ReadPath,
    /// dmkv: one-sided transport (shm, engine, rdma; tcp is engine's old name) [default: the best available].
    #[arg(long)]
    pub transport: Option<Transport>,
    /// dmkv: speak TLS to the server, trusting this CA (PEM). A secret, if
    /// the server wants one, comes from DMKV_TOKEN.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the report as CSV to this file.
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    /// Do not load records (they were loaded by an earlier run with the same seed).
    #[arg(long)]
    pub skip_load: bool,
    /// Name of the store in reports [default: the backend's name], e.g. to
    /// tell dmkv's read paths apart.
    #[arg(long)]
    pub label: Option<String>,
}

impl Args {
    /// The run these flags describe.
    pub fn settings(&self) -> Result<Settings, String> {
        let duration = match self.duration {
            Some(d) if d > 0.0 => match Duration::try_from_secs_f64(d) {
                Ok(d) => Some(d),
                Err(_) => return Err(format!("--duration {d}: out of range")),
            },
            Some(_) => return Err("--duration must be a positive number of seconds".into()),
            None => None,
        };
        let operations = match (self.operations, duration) {
            (None, None) => Some(DEFAULT_OPERATIONS),
            (o, _) => o,
        };
        Ok(Settings {
            label: self.label.clone().unwrap_or_else(|| self.backend.name().to_string()),
            backend: self.backend,
            server: self.server.clone().unwrap_or_else(|| self.backend.default_server().to_string()),
            dmkv: DmkvOptions { read_path: self.path, transport: self.transport, tls_ca: self.tls_ca.clone() },
            workload: self.workload,
            distribution: self.distribution.unwrap_or(self.workload.default_distribution()),
            latest_eta: self.latest_eta,
            expected_inserts: self.expected_inserts,
            records: self.records,
            operations,
            duration,
            value_size: self.value_size,
            fields: self.fields,
            update_writes: self.update_writes,
            threads: self.threads,
            in_flight: self.in_flight,
            target_rate: self.target_rate,
            warmup: self.warmup,
            seed: self.seed,
            skip_load: self.skip_load,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_map_to_settings() {
        let a = Args::parse_from([
            "dmkv-ycsb",
            "--workload",
            "d",
            "--backend",
            "redis",
            "--threads",
            "2",
            "--in-flight",
            "16",
            "--warmup",
            "2s",
            "--duration",
            "3",
            "--path",
            "rpc",
            "--transport",
            "tcp",
        ]);
        let s = a.settings().unwrap();
        assert_eq!(s.distribution, Distribution::Latest);
        assert_eq!(s.server, "127.0.0.1:6379");
        assert_eq!(s.operations, None);
        assert_eq!(s.duration, Some(Duration::from_secs(3)));
        assert_eq!(s.warmup, Warmup::Time(Duration::from_secs(2)));
        assert_eq!(s.dmkv.read_path, ReadPath::Rpc);
        assert_eq!(s.dmkv.transport, Some(Transport::Engine));
        let d = Args::parse_from(["dmkv-ycsb"]).settings().unwrap();
        assert_eq!(d.operations, Some(DEFAULT_OPERATIONS));
        assert_eq!(d.value_size, 1000);
        assert_eq!(d.distribution, Distribution::Zipfian);
        assert_eq!(d.latest_eta, EtaGrowth::Ycsb);
        let c = Args::parse_from(["dmkv-ycsb", "--latest-eta", "corrected"]).settings().unwrap();
        assert_eq!(c.latest_eta, EtaGrowth::Corrected);
        // YCSB's key space: records, 2 × operations × insert share, one more.
        let d = |extra: &[&str]| {
            let base = ["dmkv-ycsb", "--workload", "d", "--distribution", "zipfian", "--records", "1000"];
            Args::parse_from(base.iter().chain(extra)).settings().unwrap()
        };
        let s = d(&["--operations", "10000"]);
        assert_eq!(s.key_space(s.validate().unwrap()), Ok(1000 + 1000 + 1));
        let s = d(&["--operations", "10000", "--expected-inserts", "7"]);
        assert_eq!(s.key_space(s.validate().unwrap()), Ok(1000 + 14 + 1));
        let s = d(&["--duration", "1", "--expected-inserts", "7"]);
        assert_eq!(s.key_space(s.validate().unwrap()), Ok(1000 + 14 + 1));
        assert!(d(&["--duration", "1"]).validate().unwrap_err().contains("--expected-inserts"));
        assert!(d(&["--expected-inserts", &u64::MAX.to_string()]).validate().is_err());
        // The field model: an update writes the record or one field of it.
        assert_eq!(d(&[]).update_bytes(), 1000);
        let f = Args::parse_from(["dmkv-ycsb", "--update-writes", "field"]).settings().unwrap();
        assert_eq!((f.fields, f.update_bytes()), (10, 100));
        assert!(f.validate().is_ok());
        let bad =
            Args::parse_from(["dmkv-ycsb", "--update-writes", "field", "--value-size", "1001"]).settings().unwrap();
        assert!(bad.validate().unwrap_err().contains("multiple of --fields"));
        let zero = Args::parse_from(["dmkv-ycsb", "--fields", "0"]).settings().unwrap();
        assert!(zero.validate().unwrap_err().contains("--fields"));
        let a = Args::parse_from(["dmkv-ycsb", "--records", "1000"]).settings().unwrap();
        assert_eq!(a.key_space(a.validate().unwrap()), Ok(1001));
        assert!(Args::try_parse_from(["dmkv-ycsb", "--operations", "5", "--duration", "1"]).is_err());
        assert!(Args::try_parse_from(["dmkv-ycsb", "--workload", "g"]).is_err());
        let e = Args::parse_from(["dmkv-ycsb", "--workload", "e"]).settings().unwrap();
        assert!(e.validate().unwrap_err().contains("not supported"));
        let z = Args::parse_from(["dmkv-ycsb", "--threads", "0"]).settings().unwrap();
        assert!(z.validate().is_err());
    }
}
