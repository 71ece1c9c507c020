//! GET throughput of one client core against a running dmkvd, over a chosen
//! path: one-sided (shm, tcp engine, rdma) or RPC; single GETs or batched
//! multi-GETs; uniform or zipfian keys. Also reports the server's CPU time
//! during the run (from /proc), which is about zero for shm and rdma.
//!
//! ```sh
//! dmkv-getbench --server 127.0.0.1:7070 --load --keys 1000000 --value-size 1000
//! dmkv-getbench --server 127.0.0.1:7070 --keys 1000000 --transport shm --distribution zipfian --server-pid PID
//! ```

use std::io::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use dmkv_benches::generator::{Rng, ScrambledZipfian};
use dmkv_client::{Client, ClientConfig, ReadPath, Transport};
use dmkv_common::limits::MAX_VALUE_LEN;

/// Puts in flight while loading.
const LOAD_DEPTH: usize = 64;
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Parser)]
#[command(name = "dmkv-getbench", about = "GETs per second of one client core")]
struct Args {
    #[arg(long, default_value = "127.0.0.1:7070")]
    server: String,
    /// Number of keys (loaded with --load, read otherwise).
    #[arg(long, default_value_t = 100_000)]
    keys: u64,
    #[arg(long, default_value_t = 1000)]
    value_size: usize,
    /// Load the keys first.
    #[arg(long)]
    load: bool,
    /// Number of the first key loaded (to add keys beside those read).
    #[arg(long, default_value_t = 0)]
    first_key: u64,
    /// shm, tcp, rdma (builds with the client's `rdma` feature), or rpc.
    #[arg(long, default_value = "shm")]
    transport: String,
    /// uniform or zipfian (0.99, scrambled as in YCSB).
    #[arg(long, default_value = "uniform")]
    distribution: String,
    /// Keys per multi-GET; 1 means single GETs.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Run time in seconds.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// dmkvd's process id, to report its CPU time during the run.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Read path of one-sided transports: one-sided (forced) or auto (the
    /// path controller's choice, as applications run by default).
    #[arg(long, default_value = "one-sided")]
    path: String,
    /// Single GETs through the synchronous API (`get_local`, the value
    /// copied into one reused buffer: no allocation per GET), instead of
    /// the async `get`.
    #[arg(long)]
    sync: bool,
    /// Concurrent callers sharing one client, each doing one GET at a time
    /// (2 runtime workers; reports GETs/s and p99 over all of them). 0: the
    /// single-core loop below.
    #[arg(long, default_value_t = 0)]
    callers: usize,
}

fn key(i: u64) -> Bytes {
    Bytes::from(format!("user{i:012}"))
}

/// utime + stime of a process in milliseconds (clock ticks of 10 ms).
fn cpu_ms(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks * 10)
}

/// Runtime workers of the `--callers` mode.
const CALLER_WORKERS: usize = 2;

/// Exit code when the run could not be made or failed (bad flags, an
/// unreachable server, a transport this build or host lacks).
const EXIT_ERROR: u8 = 2;

fn main() -> ExitCode {
    let a = Args::parse();
    let result = check(&a).and_then(|run_for| {
        let rt = if a.callers > 0 {
            tokio::runtime::Builder::new_multi_thread().worker_threads(CALLER_WORKERS).enable_all().build()
        } else {
            tokio::runtime::Builder::new_current_thread().enable_all().build()
        };
        rt.map_err(|e| format!("cannot start the runtime: {e}"))?.block_on(run(a, run_for))
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dmkv-getbench: {e}");
            ExitCode::from(EXIT_ERROR)
        }
    }
}

/// Checks the flags clap cannot; returns the run time.
fn check(a: &Args) -> Result<Duration, String> {
    if a.keys == 0 {
        return Err("--keys must be at least 1".into());
    }
    if a.first_key.checked_add(a.keys).is_none() {
        return Err("--first-key plus --keys overflows".into());
    }
    if a.value_size > MAX_VALUE_LEN {
        return Err(format!("--value-size {} is above the largest value, {MAX_VALUE_LEN} bytes", a.value_size));
    }
    if a.distribution != "uniform" && a.distribution != "zipfian" {
        return Err(format!("--distribution {:?}: expected uniform or zipfian", a.distribution));
    }
    if a.path != "one-sided" && a.path != "auto" {
        return Err(format!("--path {:?}: expected one-sided or auto", a.path));
    }
    if a.sync && (a.batch > 1 || a.callers > 0) {
        return Err("--sync measures single GETs of one caller: not with --batch or --callers".into());
    }
    if a.transport != "rpc" {
        a.transport.parse::<Transport>().map_err(|e| format!("--transport: {e}, or rpc"))?;
    }
    match Duration::try_from_secs_f64(a.secs) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(format!("--secs {}: expected a positive number of seconds", a.secs)),
    }
}

/// `callers` tasks GET random keys from one shared client until `run_for`
/// passes; prints GETs/s and latency percentiles over all of them.
async fn run_callers(c: &Client, a: &Args, run_for: Duration) -> Result<(), String> {
    let deadline = Instant::now() + run_for;
    let start = Instant::now();
    let mut tasks = Vec::new();
    for t in 0..a.callers {
        let c = c.clone();
        let (keys, value_size) = (a.keys, a.value_size);
        let mut rng = Rng::new(a.seed.wrapping_add(t as u64 + 1));
        tasks.push(tokio::spawn(async move {
            let mut hist = dmkv_benches::report::new_histogram();
            let mut bad = 0u64;
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let v = c.get(key(rng.below(keys))).await.map_err(|e| format!("GET: {e}"))?;
                hist.saturating_record(t0.elapsed().as_nanos() as u64);
                bad += u64::from(v.is_none_or(|v| v.len() != value_size));
            }
            Ok::<_, String>((hist, bad))
        }));
    }
    let mut all = dmkv_benches::report::new_histogram();
    let mut bad = 0;
    for t in tasks {
        let (h, b) = t.await.map_err(|e| format!("caller: {e}"))??;
        all.add(h).map_err(|e| format!("histogram: {e}"))?;
        bad += b;
    }
    let secs = start.elapsed().as_secs_f64();
    let us = |q: f64| all.value_at_quantile(q) as f64 / 1e3;
    println!(
        "transport={} callers={} keys={} value={}B: {:.0} GETs/s, p50 {:.1} us, p99 {:.1} us, max {:.1} us, \
         wrong/missing={bad} read_stats={:?}",
        a.transport,
        a.callers,
        a.keys,
        a.value_size,
        all.len() as f64 / secs,
        us(0.5),
        us(0.99),
        all.max() as f64 / 1e3,
        c.read_stats(),
    );
    Ok(())
}

async fn run(a: Args, run_for: Duration) -> Result<(), String> {
    let (path, transport) = match a.transport.as_str() {
        "rpc" => (ReadPath::Rpc, None),
        t if a.path == "auto" => (ReadPath::Auto, Some(t.parse::<Transport>()?)),
        t => (ReadPath::OneSided, Some(t.parse::<Transport>()?)),
    };
    let cfg = ClientConfig::default().read_path(path).transport(transport).pool_size(1);
    let c = Client::connect_with(a.server.clone(), cfg)
        .await
        .map_err(|e| format!("cannot connect to {} (--transport {}): {e}", a.server, a.transport))?;
    if a.load {
        let start = Instant::now();
        let value = Bytes::from(vec![b'v'; a.value_size]);
        // LOAD_DEPTH PUTs in flight through the client's routing, so a
        // cluster's keys reach their shards' leaders.
        let mut window = tokio::task::JoinSet::new();
        for i in 0..a.keys {
            if window.len() == LOAD_DEPTH {
                window.join_next().await.ok_or("load window empty")?.map_err(|e| format!("PUT task: {e}"))??;
            }
            let (c, k, value) = (c.clone(), key(a.first_key + i), value.clone());
            window.spawn(async move {
                match tokio::time::timeout(LOAD_TIMEOUT, c.put(k, value)).await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err(e)) => Err(format!("PUT: {e}")),
                    Err(_) => Err(format!("PUT: no answer within {LOAD_TIMEOUT:?}")),
                }
            });
        }
        while let Some(r) = window.join_next().await {
            r.map_err(|e| format!("PUT task: {e}"))??;
        }
        println!("loaded {} keys of {} B in {:.1}s", a.keys, a.value_size, start.elapsed().as_secs_f64());
    }
    if a.callers > 0 {
        return run_callers(&c, &a, run_for).await;
    }
    let zipf = ScrambledZipfian::new(0, a.keys - 1);
    let uniform = a.distribution == "uniform";
    let mut rng = Rng::new(a.seed);
    let mut pick = move || if uniform { rng.below(a.keys) } else { zipf.next(&mut rng) };
    // Warm up: attach, touch the cache.
    for _ in 0..1000 {
        c.get(key(pick())).await.map_err(|e| format!("GET: {e}"))?;
    }
    let before = c.read_stats();
    let pid = a.server_pid.map(|p| p.to_string());
    let server_cpu0 = pid.as_deref().and_then(cpu_ms);
    let client_cpu0 = cpu_ms("self");
    let deadline = Instant::now() + run_for;
    let start = Instant::now();
    let (mut gets, mut bad) = (0u64, 0u64);
    let mut keys = Vec::with_capacity(a.batch);
    let (mut key_buf, mut value) = (Vec::new(), Vec::new());
    while Instant::now() < deadline {
        if a.sync {
            // The deadline is checked every 64 GETs: a clock read per GET
            // would be a tenth of the cost measured.
            for _ in 0..64 {
                key_buf.clear();
                write!(key_buf, "user{:012}", pick()).map_err(|e| e.to_string())?;
                let got = match c.get_local(&key_buf, &mut value) {
                    Some(r) => r.map_err(|e| format!("GET: {e}"))?.is_some(),
                    None => match c.get(&key_buf).await.map_err(|e| format!("GET: {e}"))? {
                        Some(v) => {
                            value.clear();
                            value.extend_from_slice(&v);
                            true
                        }
                        None => false,
                    },
                };
                bad += u64::from(!got || value.len() != a.value_size);
                gets += 1;
            }
        } else if a.batch <= 1 {
            match c.get(key(pick())).await.map_err(|e| format!("GET: {e}"))? {
                Some(v) if v.len() == a.value_size => {}
                _ => bad += 1,
            }
            gets += 1;
        } else {
            keys.clear();
            keys.extend((0..a.batch).map(|_| key(pick())));
            for v in c.multi_get(&keys).await.map_err(|e| format!("multi-GET: {e}"))? {
                if v.is_none_or(|v| v.len() != a.value_size) {
                    bad += 1;
                }
                gets += 1;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let server_cpu = pid.as_deref().and_then(cpu_ms).zip(server_cpu0).map(|(b, a)| b.saturating_sub(a));
    let client_cpu = cpu_ms("self").zip(client_cpu0).map(|(b, a)| b.saturating_sub(a));
    let rs = c.read_stats();
    println!(
        "transport={} path={} sync={} distribution={} batch={} keys={} value={}B: {:.0} GETs/s ({:.2} us/GET), {} GETs in {:.1}s, \
         wrong/missing={} client_cpu_ms={} server_cpu_ms={} one_sided_gets={} hint_hits={} retries={} stale_directory={} directory_reads={} fallbacks={}",
        a.transport,
        a.path,
        a.sync,
        a.distribution,
        a.batch,
        a.keys,
        a.value_size,
        gets as f64 / secs,
        secs * 1e6 / gets.max(1) as f64,
        gets,
        secs,
        bad,
        client_cpu.map_or("?".into(), |v| v.to_string()),
        server_cpu.map_or("?".into(), |v| v.to_string()),
        rs.gets - before.gets,
        rs.hint_hits - before.hint_hits,
        (rs.torn + rs.other_key + rs.slow) - (before.torn + before.other_key + before.slow),
        rs.stale_directory - before.stale_directory,
        rs.directory_reads - before.directory_reads,
        rs.fallbacks - before.fallbacks,
    );
    Ok(())
}
