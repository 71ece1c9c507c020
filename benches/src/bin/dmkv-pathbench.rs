//! Read-path selection scenarios over a real network path: a probe client's
//! GET latency and how its GETs split between one-sided reads (the server's
//! TCP engine) and RPC, for each read path in one run, while other clients
//! congest the engine's link, saturate the RPC workers with PUTs, or
//! rewrite the probe's key (see `dmkv_benches::scenario`).
//!
//! Needs root: dmkvd runs in a network namespace of its own (started from
//! this executable's directory), joined to this one by a veth pair, with the
//! engine's replies rate-limited by HTB in the engine-congested scenario.
//!
//! ```sh
//! cargo build --release -p dmkv-benches -p dmkv-server
//! sudo target/release/dmkv-pathbench --scenario all --duration 3 --rounds 2 --json paths.json
//! ```
//!
//! For each scenario, round and path (auto, one-sided, rpc, interleaved), a
//! fresh probe client warms up (one GET per key) and is measured through
//! the scenario's phases; the load runs during the middle ones. Exit code
//! 0: ran; 1: probe GETs failed or read wrong values; 2: could not run.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Parser;
use dmkv_benches::scenario::{Params, Scenario, Setup, Split, Window, path_name};
use dmkv_client::ReadPath;
use serde::Serialize;

#[derive(Parser, Debug, Serialize)]
#[command(name = "dmkv-pathbench", about = "Read-path selection scenarios over a shaped veth link (needs root)")]
struct Args {
    /// engine-congested, rpc-saturated, hot-key, or all.
    #[arg(long, default_value = "all")]
    scenario: String,
    /// Seconds of each measured phase.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// Rounds of (auto, one-sided, rpc).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Paths measured, comma-separated, in this order each round.
    #[arg(long, default_value = "auto,one-sided,rpc")]
    paths: String,
    /// The probe's GETs in flight.
    #[arg(long, default_value_t = Params::default().in_flight)]
    in_flight: usize,
    /// Value size of the probe's keys and of the writers' PUTs.
    #[arg(long, default_value_t = Params::default().value_size)]
    value_size: usize,
    /// Keys the probe reads (uniformly; hot-key reads one).
    #[arg(long, default_value_t = Params::default().probe_keys)]
    probe_keys: u64,
    /// HTB rate of the engine's replies in engine-congested (tc syntax).
    #[arg(long, default_value_t = Params::default().rate)]
    rate: String,
    /// Byte limit of the shaped queue (default: about 30 ms at --rate).
    #[arg(long)]
    queue_limit: Option<u32>,
    /// Bulk reader (engine-congested): size of its values.
    #[arg(long, default_value_t = Params::default().bulk_value_size)]
    bulk_value_size: usize,
    /// Bulk reader: keys it reads.
    #[arg(long, default_value_t = Params::default().bulk_keys)]
    bulk_keys: u64,
    /// Bulk reader: clients (one engine connection each).
    #[arg(long, default_value_t = Params::default().bulk_clients)]
    bulk_clients: usize,
    /// Bulk reader: multi-GETs in flight per client.
    #[arg(long, default_value_t = Params::default().bulk_in_flight)]
    bulk_in_flight: usize,
    /// Bulk reader: keys per multi-GET.
    #[arg(long, default_value_t = Params::default().bulk_batch)]
    bulk_batch: usize,
    /// PUT load (rpc-saturated): clients, one connection each.
    #[arg(long, default_value_t = Params::default().writers)]
    writers: usize,
    /// PUT load: PUTs in flight per client.
    #[arg(long, default_value_t = Params::default().writer_in_flight)]
    writer_in_flight: usize,
    /// PUT load: keys written (uniformly).
    #[arg(long, default_value_t = Params::default().writer_keys)]
    writer_keys: u64,
    /// PUTs of the hot key in flight (hot-key).
    #[arg(long, default_value_t = Params::default().hot_in_flight)]
    hot_in_flight: usize,
    /// Seed of every random choice.
    #[arg(long, default_value_t = Params::default().seed)]
    seed: u64,
    /// Write every window and the per-path summary as JSON.
    #[arg(long)]
    json: Option<String>,
}

/// One measured window (or, with `round: None`, a phase merged over rounds).
#[derive(Debug, Clone, Serialize)]
struct Row {
    scenario: &'static str,
    round: Option<usize>,
    path: &'static str,
    phase: &'static str,
    secs: f64,
    gets: u64,
    gets_per_sec: f64,
    mean_us: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    max_us: f64,
    errors: u64,
    wrong: u64,
    /// The probe's GETs by path, one entry per source ("server", "client",
    /// "selector").
    splits: Vec<Split>,
    /// Share of the probe's GETs that went RPC, by the path controller's
    /// counters (exact; the server's count is in `splits`).
    rpc_share: f64,
    /// Changes of the preferred path.
    switches: u64,
    client_retries: u64,
    client_fallbacks: u64,
    hint_hits: u64,
    engine_batches: u64,
    load_ops_per_sec: f64,
    load_mbytes_per_sec: f64,
    load_errors: u64,
    load_rpc_gets: u64,
    shaped_mbit_per_sec: Option<f64>,
    shaped_drops: Option<u64>,
}

impl Row {
    fn new(scenario: Scenario, round: Option<usize>, path: ReadPath, phase: &'static str, w: &Window) -> Row {
        let us = |ns: u64| ns as f64 / 1000.0;
        let splits = w.splits();
        Row {
            scenario: scenario.name(),
            round,
            path: path_name(path),
            phase,
            secs: w.secs,
            gets: w.gets,
            gets_per_sec: w.rate(),
            mean_us: if w.hist.is_empty() { 0.0 } else { w.hist.mean() / 1000.0 },
            p50_us: w.quantile_us(0.5),
            p99_us: w.quantile_us(0.99),
            p999_us: w.quantile_us(0.999),
            max_us: us(w.hist.max()),
            errors: w.errors,
            wrong: w.wrong,
            rpc_share: splits[2].rpc_share(),
            switches: w.switches,
            splits,
            client_retries: w.client_retries,
            client_fallbacks: w.client_fallbacks,
            hint_hits: w.hint_hits,
            engine_batches: w.engine_batches,
            load_ops_per_sec: w.load_ops as f64 / w.secs.max(1e-9),
            load_mbytes_per_sec: w.load_bytes as f64 / 1e6 / w.secs.max(1e-9),
            load_errors: w.load_errors,
            load_rpc_gets: w.load_rpc_gets,
            shaped_mbit_per_sec: w.slow_class_bytes.map(|b| b as f64 * 8.0 / 1e6 / w.secs.max(1e-9)),
            shaped_drops: w.slow_class_drops,
        }
    }
}

/// Windows of one (scenario, path, phase) merged over rounds.
struct Merged {
    w: Window,
}

impl Merged {
    fn add(&mut self, w: &Window) {
        let m = &mut self.w;
        m.hist.add(&w.hist).expect("same histogram bounds");
        m.secs += w.secs;
        m.gets += w.gets;
        m.errors += w.errors;
        m.wrong += w.wrong;
        m.server_rpc_gets += w.server_rpc_gets;
        m.load_rpc_gets += w.load_rpc_gets;
        m.engine_batches += w.engine_batches;
        m.engine_reads += w.engine_reads;
        m.client_one_sided += w.client_one_sided;
        m.selector_rpc += w.selector_rpc;
        m.selector_one_sided += w.selector_one_sided;
        m.switches += w.switches;
        m.client_fallbacks += w.client_fallbacks;
        m.client_retries += w.client_retries;
        m.hint_hits += w.hint_hits;
        m.load_ops += w.load_ops;
        m.load_bytes += w.load_bytes;
        m.load_errors += w.load_errors;
        m.slow_class_bytes = w.slow_class_bytes.map(|b| b + m.slow_class_bytes.unwrap_or(0));
        m.slow_class_drops = w.slow_class_drops.map(|b| b + m.slow_class_drops.unwrap_or(0));
    }
}

#[derive(Serialize)]
struct JsonReport<'a> {
    args: &'a Args,
    params: Vec<(&'static str, Params)>,
    windows: &'a [Row],
    summary: &'a [Row],
}

/// Set by SIGINT/SIGTERM: finish the current window, clean up, exit.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

fn main() -> ExitCode {
    let a = Args::parse();
    match run(&a) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dmkv-pathbench: {e}");
            ExitCode::from(2)
        }
    }
}

fn parse_lists(a: &Args) -> Result<(Vec<Scenario>, Vec<ReadPath>), String> {
    let scenarios = if a.scenario == "all" {
        Scenario::ALL.to_vec()
    } else {
        a.scenario
            .split(',')
            .map(|s| {
                <Scenario as clap::ValueEnum>::from_str(s.trim(), false).map_err(|_| {
                    format!("unknown scenario {s:?}: expected engine-congested, rpc-saturated, hot-key or all")
                })
            })
            .collect::<Result<_, _>>()?
    };
    let paths = a.paths.split(',').map(|p| p.trim().parse::<ReadPath>()).collect::<Result<Vec<_>, _>>()?;
    if paths.is_empty() || a.rounds == 0 || a.duration.is_nan() || a.duration <= 0.0 {
        return Err("need at least one path, one round and a positive duration".into());
    }
    Ok((scenarios, paths))
}

fn params(a: &Args) -> Params {
    Params {
        value_size: a.value_size,
        probe_keys: a.probe_keys.max(1),
        in_flight: a.in_flight.max(1),
        rate: a.rate.clone(),
        queue_limit: a.queue_limit,
        bulk_value_size: a.bulk_value_size,
        bulk_keys: a.bulk_keys,
        bulk_clients: a.bulk_clients,
        bulk_in_flight: a.bulk_in_flight,
        bulk_batch: a.bulk_batch,
        writers: a.writers,
        writer_in_flight: a.writer_in_flight,
        writer_keys: a.writer_keys,
        hot_in_flight: a.hot_in_flight,
        seed: a.seed,
        ..Params::default()
    }
}

fn run(a: &Args) -> Result<ExitCode, String> {
    let (scenarios, paths) = parse_lists(a)?;
    let dur =
        Duration::try_from_secs_f64(a.duration).map_err(|_| format!("--duration {}: out of range", a.duration))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    watch_signals();
    let mut rows = Vec::new();
    let mut merged: BTreeMap<(usize, usize, usize), Merged> = BTreeMap::new();
    let mut used_params = Vec::new();
    'scenarios: for (si, &scenario) in scenarios.iter().enumerate() {
        let p = params(a);
        used_params.push((scenario.name(), p.clone()));
        let setup = Setup::start(scenario, p)?;
        println!(
            "== {} (dmkvd pid {} in netns {}: rpc={} engine={})",
            scenario.name(),
            setup.server_pid(),
            setup.netns().name(),
            setup.rpc,
            setup.engine
        );
        rt.block_on(setup.preload())?;
        let admin = rt.block_on(setup.client(ReadPath::Rpc))?;
        let keys = setup.probe_keys();
        for round in 0..a.rounds {
            for (pi, &path) in paths.iter().enumerate() {
                let probe = rt.block_on(setup.client(path))?;
                rt.block_on(setup.warm(&probe, &keys))?;
                let mut load = None;
                for (phi, &(phase, loaded)) in scenario.phases().iter().enumerate() {
                    if INTERRUPTED.load(Ordering::Relaxed) {
                        break 'scenarios;
                    }
                    if loaded && load.is_none() {
                        load = Some(setup.start_load()?);
                    } else if !loaded && let Some(mut l) = load.take() {
                        l.stop()?;
                    }
                    let w = rt.block_on(setup.window(&probe, &admin, &keys, dur, load.as_ref()))?;
                    println!(
                        "{:<16} round {round} {:<9} {:<6} {}",
                        scenario.name(),
                        path_name(path),
                        phase,
                        w.summary()
                    );
                    if let Some(e) = &w.first_error {
                        println!("    first probe error: {e}");
                    }
                    rows.push(Row::new(scenario, Some(round), path, phase, &w));
                    merged.entry((si, phi, pi)).or_insert_with(|| Merged { w: Window::default() }).add(&w);
                }
                if let Some(mut l) = load.take() {
                    l.stop()?;
                }
            }
        }
    }
    let summary: Vec<Row> = merged
        .iter()
        .map(|(&(si, phi, pi), m)| Row::new(scenarios[si], None, paths[pi], scenarios[si].phases()[phi].0, &m.w))
        .collect();
    print_summary(&summary, a.rounds);
    if let Some(path) = &a.json {
        let report = JsonReport { args: a, params: used_params, windows: &rows, summary: &summary };
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("write {path}: {e}"))?;
    }
    if INTERRUPTED.load(Ordering::Relaxed) {
        return Err("interrupted".into());
    }
    let failed = rows.iter().any(|r| r.errors > 0 || r.wrong > 0);
    Ok(if failed { ExitCode::from(1) } else { ExitCode::SUCCESS })
}

fn print_summary(rows: &[Row], rounds: usize) {
    println!();
    println!("summary over {rounds} round(s): probe GETs; rpc% = share of the probe's GETs served by RPC");
    println!(
        "{:<16} {:<6} {:<9} {:>9} {:>9} {:>9} {:>11} {:>11} {:>9} {:>8} {:>10} {:>10} {:>7}",
        "scenario",
        "phase",
        "path",
        "GETs/s",
        "p50 us",
        "p99 us",
        "rpc% server",
        "rpc% client",
        "rpc% sel",
        "switches",
        "load op/s",
        "shaped Mb",
        "errors"
    );
    let share = |s: &[Split], src: &str| s.iter().find(|x| x.source == src).map_or(f64::NAN, |x| 100.0 * x.rpc_share());
    for r in rows {
        println!(
            "{:<16} {:<6} {:<9} {:>9.0} {:>9.0} {:>9.0} {:>11.1} {:>11.1} {:>9.1} {:>8} {:>10.0} {:>10} {:>7}",
            r.scenario,
            r.phase,
            r.path,
            r.gets_per_sec,
            r.p50_us,
            r.p99_us,
            share(&r.splits, "server"),
            share(&r.splits, "client"),
            share(&r.splits, "selector"),
            r.switches,
            r.load_ops_per_sec,
            r.shaped_mbit_per_sec.map_or("-".into(), |m| format!("{m:.1}")),
            r.errors + r.wrong,
        );
    }
}

/// SIGINT or SIGTERM sets [`INTERRUPTED`]; the run stops after the current
/// window, so the namespace and dmkvd are cleaned up.
fn watch_signals() {
    let _ = std::thread::Builder::new().name("signals".into()).spawn(move || {
        let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else { return };
        rt.block_on(async {
            let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
                return;
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            eprintln!("dmkv-pathbench: interrupted; stopping after this window");
            INTERRUPTED.store(true, Ordering::Relaxed);
        });
    });
}
