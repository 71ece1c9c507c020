//! `dmkv-hitratio`: the hit ratio of a cache-aside zipfian trace against
//! memcached or dmkv (see `dmkv_benches::hitratio`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use dmkv_benches::generator::ZIPFIAN_CONSTANT;
use dmkv_benches::hitratio::{self, Cache, DmkvCache, MemcachedCache, Settings};
use dmkv_client::ReadPath;
use serde::Serialize;

/// Exit code when the run could not be made (bad flags, unreachable server).
const EXIT_USAGE: u8 = 2;
/// Exit code when an operation failed during the run.
const EXIT_FAILED: u8 = 1;

/// Where the trace is replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Backend {
    /// memcached's text protocol (memcached, or dmkvd's memcached port).
    Memcached,
    /// dmkvd through the dmkv-client SDK.
    Dmkv,
}

/// Flags of `dmkv-hitratio`.
#[derive(Debug, Parser)]
#[command(
    name = "dmkv-hitratio",
    version,
    about = "Hit ratio of a cache-aside zipfian trace (GET; on a miss, SET) against memcached or dmkv",
    after_help = "Exit codes: 0 done, 1 an operation failed, 2 bad flags or unreachable server."
)]
struct Args {
    /// Store to replay against.
    #[arg(long, value_enum, default_value = "memcached")]
    backend: Backend,
    /// Server address [default: 127.0.0.1:11211 for memcached, 127.0.0.1:7070 for dmkv].
    #[arg(long, value_name = "ADDR")]
    server: Option<String>,
    /// dmkv: which way GETs go (auto, one-sided, rpc).
    #[arg(long)]
    path: Option<ReadPath>,
    /// Distinct keys of the trace.
    #[arg(long, default_value_t = 300_000)]
    keys: u64,
    /// Operations (GETs) of the trace.
    #[arg(long, default_value_t = 3_000_000)]
    ops: u64,
    /// Bytes per value.
    #[arg(long, default_value_t = 1000)]
    value_size: usize,
    /// Zipfian constant, between 0 and 1.
    #[arg(long, default_value_t = ZIPFIAN_CONSTANT)]
    zipf: f64,
    /// Operations at the start not counted [default: ops / 5].
    #[arg(long, value_name = "OPS")]
    warmup: Option<u64>,
    /// Seed of the trace.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Name of the store in the report [default: the backend's name].
    #[arg(long)]
    label: Option<String>,
    /// Write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// The JSON report: the run's identity and its outcome.
#[derive(Serialize)]
struct Report<'a> {
    label: &'a str,
    backend: Backend,
    server: &'a str,
    path: Option<&'static str>,
    #[serde(flatten)]
    outcome: &'a hitratio::Outcome,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let usage = |e: String| {
        eprintln!("dmkv-hitratio: {e}");
        ExitCode::from(EXIT_USAGE)
    };
    let settings = Settings {
        warmup: args.warmup.unwrap_or(args.ops / 5),
        zipf: args.zipf,
        ..Settings::new(args.keys, args.ops, args.value_size, args.seed)
    };
    if let Err(e) = settings.validate() {
        return usage(e);
    }
    let (server, label) = match args.backend {
        Backend::Memcached => ("127.0.0.1:11211", "memcached"),
        Backend::Dmkv => ("127.0.0.1:7070", "dmkv"),
    };
    let server = args.server.clone().unwrap_or_else(|| server.to_string());
    let label = args.label.clone().unwrap_or_else(|| label.to_string());
    let mut cache: Box<dyn Cache> = match (args.backend, args.path) {
        (Backend::Memcached, Some(_)) => return usage("--path is for --backend dmkv".into()),
        (Backend::Memcached, None) => match MemcachedCache::connect(&server) {
            Ok(c) => Box::new(c),
            Err(e) => return usage(e),
        },
        (Backend::Dmkv, path) => match DmkvCache::connect(&server, path.unwrap_or_default()) {
            Ok(c) => Box::new(c),
            Err(e) => return usage(format!("cannot connect to {server}: {e}")),
        },
    };
    let outcome = match hitratio::replay(cache.as_mut(), &settings) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("dmkv-hitratio: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    print!("{}", hitratio::text(&label, &outcome));
    if let Some(path) = &args.json {
        let report = Report {
            label: &label,
            backend: args.backend,
            server: &server,
            path: args.path.map(ReadPath::name),
            outcome: &outcome,
        };
        let json = serde_json::to_string_pretty(&report).expect("report serialises");
        if let Err(e) = std::fs::write(path, json + "\n") {
            return usage(format!("cannot write {}: {e}", path.display()));
        }
    }
    ExitCode::SUCCESS
}
