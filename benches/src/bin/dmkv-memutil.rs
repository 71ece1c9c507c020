//! Memory utilization under changing value sizes, in the style of RAMCloud's
//! log-structured memory paper (FAST'14): fill a fresh dmkvd to a target
//! share of its data area with one size, then keep it at that level while
//! writing another size (or a mix), and count the PUTs refused for space.
//! The highest level with no refusal is the utilization a workload reaches.
//!
//! It starts its own dmkvd for every run (`--dmkvd PATH`), so the same
//! binary measures any build of the server:
//!
//! ```sh
//! dmkv-memutil --dmkvd target/release/dmkvd --memory 16MiB --levels 70,80,85,90,95
//! ```
//!
//! Keys are plain counters, live data is tracked here (item units, as the
//! server lays items out) and a key is deleted before its space is counted
//! free again. The index is sized large (`--buckets`) so that index slots,
//! not memory, never run out first.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::Instant;

use clap::Parser;
use dmkv_benches::generator::Rng;
use dmkv_client::blocking::Client;
use dmkv_client::{ClientConfig, ReadPath};
use dmkv_common::layout::item_units;
use dmkv_common::limits::UNIT;
use dmkv_common::proto::ErrorCode;

#[derive(Parser)]
#[command(name = "dmkv-memutil", about = "memory utilization under changing value sizes")]
struct Args {
    /// The dmkvd binary to measure.
    #[arg(long)]
    dmkvd: String,
    #[arg(long, default_value = "16MiB")]
    memory: String,
    #[arg(long, default_value_t = 65536)]
    buckets: u64,
    /// Grace period of the server: short, so that this client's write rate
    /// does not keep much space waiting (the grace is not under test).
    #[arg(long, default_value_t = 1)]
    grace_ms: u64,
    /// Live-data levels to try, in percent of the data area.
    #[arg(long, value_delimiter = ',', default_value = "70,80,85,90,95")]
    levels: Vec<u64>,
    /// Bytes written in the second phase, as a multiple of the data area.
    #[arg(long, default_value_t = 1.0)]
    turnover: f64,
    /// Only the workloads whose names contain this.
    #[arg(long, default_value = "")]
    only: String,
    /// Extra dmkvd arguments (e.g. --compactor=off).
    #[arg(long, allow_hyphen_values = true)]
    server_arg: Vec<String>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[derive(Clone, Copy)]
enum Sizes {
    Fixed(usize),
    Uniform(usize, usize),
    Mix,
}

impl Sizes {
    fn draw(self, rng: &mut Rng) -> usize {
        match self {
            Sizes::Fixed(n) => n,
            Sizes::Uniform(a, b) => a + rng.below((b - a + 1) as u64) as usize,
            Sizes::Mix => [100, 1000, 10_000][rng.below(3) as usize],
        }
    }
}

const WORKLOADS: &[(&str, Sizes, Sizes)] = &[
    ("fixed-100", Sizes::Fixed(100), Sizes::Fixed(100)),
    ("100-to-1k", Sizes::Fixed(100), Sizes::Fixed(1000)),
    ("1k-to-10k", Sizes::Fixed(1000), Sizes::Fixed(10_000)),
    ("100-to-10k", Sizes::Fixed(100), Sizes::Fixed(10_000)),
    ("10k-to-100", Sizes::Fixed(10_000), Sizes::Fixed(100)),
    ("uniform-100..1k-to-1k..10k", Sizes::Uniform(100, 1000), Sizes::Uniform(1000, 10_000)),
    ("mix-100/1k/10k", Sizes::Mix, Sizes::Mix),
];

struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts dmkvd; if it does not come up, the error carries its own
/// one-line reason (so this tool's error stays one line too).
fn start(args: &Args) -> Result<Server, String> {
    let mut cmd = Command::new(&args.dmkvd);
    cmd.args(["--listen", "127.0.0.1:0", "--log", "error", "--memory", &args.memory])
        .args(["--buckets", &args.buckets.to_string(), "--grace-ms", &args.grace_ms.to_string()])
        .args(&args.server_arg)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("--dmkvd {}: cannot run it: {e}", args.dmkvd))?;
    let (Some(stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err("dmkvd's output is not piped".into());
    };
    let mut line = String::new();
    let _ = BufReader::new(stdout).read_line(&mut line);
    let Some(addr) = line.split_whitespace().find_map(|w| w.strip_prefix("rpc=")).map(str::to_string) else {
        let _ = child.kill();
        let status = child.wait().map_or("unknown status".into(), |s| s.to_string());
        let mut why = String::new();
        let _ = stderr.read_to_string(&mut why);
        let why = why.lines().last().unwrap_or("no error printed").to_string();
        return Err(format!("dmkvd ({}) did not start ({status}): {why}", args.dmkvd));
    };
    // The server's own errors while it runs still reach the terminal.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut stderr, &mut std::io::stderr());
    });
    Ok(Server { child, addr })
}

#[derive(Default)]
struct Outcome {
    refused: u64,
    index_full: u64,
    puts: u64,
    peak_live: u64,
    secs: f64,
    stats: std::collections::HashMap<String, u64>,
}

fn run(args: &Args, level: u64, first: Sizes, then: Sizes) -> Result<Outcome, String> {
    let srv = start(args)?;
    let c = Client::connect_with(&srv.addr, ClientConfig::default().read_path(ReadPath::Rpc))
        .map_err(|e| format!("cannot connect to dmkvd at {}: {e}", srv.addr))?;
    let stats = c.stats().map_err(|e| format!("STATS: {e}"))?;
    let data_units = stats.get("data_bytes").copied().ok_or("STATS has no data_bytes")? / UNIT as u64;
    let target = data_units * level / 100;
    let mut rng = Rng::new(args.seed);
    // (key number, units) of live keys.
    let mut live_keys: Vec<(u64, u64)> = Vec::new();
    let mut live = 0u64;
    let mut next_key = 0u64;
    let mut out = Outcome::default();
    let t = Instant::now();
    let mut put =
        |sizes: Sizes, out: &mut Outcome, live: &mut u64, live_keys: &mut Vec<(u64, u64)>| -> Result<u64, String> {
            let len = sizes.draw(&mut rng);
            let key = format!("k{next_key}");
            next_key += 1;
            let units = item_units(key.len(), len) as u64;
            while *live + units > target && !live_keys.is_empty() {
                let i = rng.below(live_keys.len() as u64) as usize;
                let (k, u) = live_keys.swap_remove(i);
                c.delete(format!("k{k}")).map_err(|e| format!("DELETE: {e}"))?;
                *live -= u;
            }
            out.puts += 1;
            match c.put(&key, vec![b'v'; len]) {
                Ok(_) => {
                    live_keys.push((next_key - 1, units));
                    *live += units;
                    out.peak_live = out.peak_live.max(*live);
                }
                Err(e) => match e.code() {
                    Some(ErrorCode::OutOfMemory) => out.refused += 1,
                    Some(ErrorCode::IndexFull) => out.index_full += 1,
                    _ => return Err(format!("PUT: {e}")),
                },
            }
            Ok(units)
        };
    // Fill to the level with the first size; stop early at refusals.
    while live < target * 99 / 100 && out.refused < 100 {
        put(first, &mut out, &mut live, &mut live_keys)?;
    }
    // Then write `turnover` × the data area with the second size.
    let mut written = 0u64;
    while (written as f64) < args.turnover * data_units as f64 {
        written += put(then, &mut out, &mut live, &mut live_keys)?;
    }
    out.secs = t.elapsed().as_secs_f64();
    out.stats = c.stats().map_err(|e| format!("STATS: {e}"))?;
    Ok(out)
}

fn main() -> ExitCode {
    match run_all(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dmkv-memutil: {e}");
            ExitCode::from(2)
        }
    }
}

fn run_all(args: &Args) -> Result<(), String> {
    if let Some(l) = args.levels.iter().find(|&&l| l > 100) {
        return Err(format!("--levels: {l} is above 100 percent"));
    }
    if !args.turnover.is_finite() || args.turnover < 0.0 {
        return Err(format!("--turnover {}: expected a finite number, at least 0", args.turnover));
    }
    println!(
        "| workload | level | PUTs | refused (OUT_OF_MEMORY) | INDEX_FULL | peak live | compactor moved | compactor CPU | time |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &(name, first, then) in WORKLOADS.iter().filter(|w| w.0.contains(&args.only)) {
        for &level in &args.levels {
            let o = run(args, level, first, then)?;
            let data = o.stats.get("data_bytes").copied().unwrap_or(1) / UNIT as u64;
            let moved = o.stats.get("compactor_moved_bytes").copied();
            let cpu = o.stats.get("compactor_cpu_micros").copied();
            println!(
                "| {name} | {level} % | {} | {} | {} | {:.1} % | {} | {} | {:.1} s |",
                o.puts,
                o.refused,
                o.index_full,
                o.peak_live as f64 * 100.0 / data as f64,
                moved.map_or("-".into(), |b| format!("{:.1} MiB", b as f64 / (1 << 20) as f64)),
                cpu.map_or("-".into(), |us| format!("{:.2} s", us as f64 / 1e6)),
                o.secs
            );
        }
    }
    Ok(())
}
