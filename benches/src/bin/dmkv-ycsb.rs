//! `dmkv-ycsb`: YCSB core workloads against dmkv, memcached or Redis.

use std::process::ExitCode;

use clap::Parser;
use dmkv_benches::cli::Args;
use dmkv_benches::{driver, report};

/// Exit code when the run could not be made (bad flags, unsupported
/// workload, unreachable server).
const EXIT_USAGE: u8 = 2;
/// Exit code when the run finished but some operations failed.
const EXIT_FAILURES: u8 = 1;

fn main() -> ExitCode {
    let args = Args::parse();
    let result = args.settings().and_then(|s| driver::run(&s));
    let r = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dmkv-ycsb: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    print!("{}", report::table(&r));
    let write = |path: &std::path::Path, text: String| {
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
    };
    let json = serde_json::to_string_pretty(&r).expect("report serialises");
    let written = args
        .json
        .as_deref()
        .map_or(Ok(()), |p| write(p, json))
        .and_then(|()| args.csv.as_deref().map_or(Ok(()), |p| write(p, report::csv(&r))));
    if let Err(e) = written {
        eprintln!("dmkv-ycsb: {e}");
        return ExitCode::from(EXIT_USAGE);
    }
    if r.failures() > 0 {
        eprintln!("dmkv-ycsb: {} operations failed", r.failures());
        return ExitCode::from(EXIT_FAILURES);
    }
    ExitCode::SUCCESS
}
