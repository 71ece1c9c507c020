//! `dmkv-ycsb-plot`: reads `dmkv-ycsb --json` reports and draws throughput
//! and p99 charts (SVG) and the comparison tables (Markdown).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use dmkv_benches::plot;
use dmkv_benches::report::{self, Report};

/// Flags of `dmkv-ycsb-plot`.
#[derive(Debug, Parser)]
#[command(name = "dmkv-ycsb-plot", version, about = "Charts and tables from dmkv-ycsb JSON reports")]
struct Args {
    /// Directory for ycsb-throughput.svg and ycsb-p99.svg.
    #[arg(long, default_value = "docs")]
    out_dir: PathBuf,
    /// Write the Markdown tables here instead of stdout.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,
    /// Reports written by `dmkv-ycsb --json`.
    #[arg(required = true)]
    reports: Vec<PathBuf>,
}

fn run(args: &Args) -> Result<(), String> {
    let mut reports = Vec::new();
    for p in &args.reports {
        let text = std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()))?;
        let r: Report = serde_json::from_str(&text).map_err(|e| format!("{} is not a report: {e}", p.display()))?;
        reports.push(r);
    }
    std::fs::create_dir_all(&args.out_dir).map_err(|e| format!("cannot create {}: {e}", args.out_dir.display()))?;
    plot::bar_chart(
        &args.out_dir.join("ycsb-throughput.svg"),
        "YCSB throughput (higher is better)",
        "operations per second",
        &plot::throughput(&reports),
    )?;
    plot::bar_chart(
        &args.out_dir.join("ycsb-p99.svg"),
        "YCSB p99 latency over all operations (lower is better)",
        "p99 latency, µs",
        &plot::p99(&reports),
    )?;
    let md = report::markdown(&reports);
    match &args.markdown {
        Some(p) => std::fs::write(p, md).map_err(|e| format!("cannot write {}: {e}", p.display())),
        None => {
            print!("{md}");
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dmkv-ycsb-plot: {e}");
            // As the other tools: 2 when the run could not be made.
            ExitCode::from(2)
        }
    }
}
