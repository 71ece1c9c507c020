//! Cluster measurements on real dmkvd processes on this host:
//!
//! - `failover`: kills (SIGKILL) a shard leader again and again while a
//!   writer PUTs and a reader GETs keys of that shard; reports the time
//!   from each kill to the shard's first acknowledged PUT, and to the
//!   first GET sent after the kill that succeeded. The node is restarted
//!   from its log (`--data-dir`) before the next kill.
//! - `put-latency`: PUT latency at a fixed concurrency on a 3-node cluster,
//!   per `--sync` policy.
//! - `catch-up`: a replica that was down while its shard filled with
//!   `--mib` MiB restarts; the time until it has applied what the leader
//!   has (by snapshot: the log was compacted meanwhile), and foreground
//!   GET and PUT latency during it beside the same load idle before, and
//!   whether the shard's leader changed.
//! - `rss`: an in-memory 3-node cluster takes `--puts` PUTs of
//!   `--value-size` over a key set that fits; each node's resident and
//!   peak memory against `--memory`.
//! - `move`: a partition holding `--mib` MiB moves to another shard of an
//!   in-memory 3-node cluster while a foreground client GETs (one-sided)
//!   and PUTs across the cluster and a writer overwrites the partition's
//!   keys: the move's time, copy rate and write pause, the foreground
//!   latency beside the same load idle, and the longest wait of a write
//!   to the moving partition.
//! - `rebalance`: `--mib` MiB written to one shard of an in-memory 3-node,
//!   3-shard cluster, then `dmkv cluster rebalance` (at `--rate-mib`)
//!   while a foreground client GETs (one-sided) and PUTs: the shards'
//!   bytes and their imbalance (max over mean) before and after, the
//!   rebalance's time and moves, and the foreground latency during it
//!   beside the same load idle.
//! - `grow`: `--mib` MiB written to an in-memory 3-node cluster of
//!   `--shards` shards, then its spare fourth node added (`dmkv cluster
//!   add-node`: replica moves, one at a time) while a foreground client
//!   GETs (one-sided) and PUTs: the time from add-node to balanced, each
//!   move's time, the bytes per node and their imbalance before and
//!   after, and the foreground latency during it beside the same load
//!   idle.
//!
//! Needs dmkvd built (release: `cargo build --release --bin dmkvd`).

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use dmkv_client::{Client, ClientConfig, ReadPath, RpcTransport, Transport};
use dmkv_common::limits::MAX_VALUE_LEN;
use dmkv_tests::cluster::TestCluster;
use hdrhistogram::Histogram;
use tokio::sync::Mutex;

#[derive(Parser)]
#[command(about = "Failover time and PUT latency of a local dmkv cluster")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Kill shard leaders and time the recovery of writes and reads.
    Failover {
        /// Kills (each followed by a restart of the killed node).
        #[arg(long, default_value_t = 20)]
        kills: usize,
        #[arg(long, default_value_t = 3)]
        shards: u32,
        /// The reader's GETs one-sided over this transport (shm, engine,
        /// rdma), and its time the first GET after the kill answered
        /// one-sided (a leased read of the new leader's region); without
        /// it, the client's default path and any answer.
        #[arg(long, value_name = "TRANSPORT")]
        reader_transport: Option<Transport>,
    },
    /// PUT latency with a `--sync` policy.
    PutLatency {
        /// always, batch or none.
        #[arg(long, default_value = "always")]
        sync: String,
        #[arg(long, default_value_t = 20_000)]
        puts: usize,
        /// PUTs in flight (one task each).
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        #[arg(long, default_value_t = 1000)]
        value_size: usize,
        /// Nodes, and replicas per shard (1 node with 1 replica is the
        /// baseline a 3-replica cluster is compared with).
        #[arg(long, default_value_t = 3)]
        nodes: usize,
        /// How the client's PUTs travel: auto, tcp or verbs (verbs
        /// messages where both ends have an RDMA device).
        #[arg(long, default_value = "auto")]
        rpc_transport: String,
    },
    /// Time for a restarted replica to catch up with a full shard.
    CatchUp {
        /// Live data in the shard when the replica restarts (MiB).
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, default_value_t = 65536)]
        value_size: usize,
    },
    /// Move a full partition to another shard under load.
    Move {
        /// Live data in the partition moved (MiB).
        #[arg(long, default_value_t = 100)]
        mib: u64,
        #[arg(long, default_value_t = MAX_VALUE_LEN)]
        value_size: usize,
        /// Most MiB/s the move's copy sends (default: the node's; 0:
        /// unpaced).
        #[arg(long)]
        rate_mib: Option<u32>,
    },
    /// Even out a cluster whose data sits on one shard, under load.
    Rebalance {
        /// Live data written to shard 0 (MiB).
        #[arg(long, default_value_t = 64)]
        mib: u64,
        #[arg(long, default_value_t = 65536)]
        value_size: usize,
        /// Most MiB/s each move's copy sends (default: the node's; 0:
        /// unpaced).
        #[arg(long)]
        rate_mib: Option<u32>,
    },
    /// Add a spare fourth node to a 3-node cluster holding data, under load.
    Grow {
        /// Live data written before the node is added (MiB).
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, default_value_t = 65536)]
        value_size: usize,
        #[arg(long, default_value_t = 12)]
        shards: u32,
    },
    /// Resident memory of an in-memory cluster after many large PUTs.
    Rss {
        #[arg(long, default_value_t = 100_000)]
        puts: usize,
        #[arg(long, default_value_t = 65536)]
        value_size: usize,
        /// Each node's `--memory` (MiB).
        #[arg(long, default_value_t = 1024)]
        memory_mib: u64,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dmkv-cluster-bench: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    check(&cli.cmd)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    match cli.cmd {
        Cmd::Failover { kills, shards, reader_transport } => rt.block_on(failover(kills, shards, reader_transport)),
        Cmd::PutLatency { sync, puts, concurrency, value_size, nodes, rpc_transport } => {
            rt.block_on(put_latency(&sync, puts, concurrency, value_size, nodes, rpc(&rpc_transport)?))
        }
        Cmd::CatchUp { mib, value_size } => rt.block_on(catch_up(mib, value_size)),
        Cmd::Rss { puts, value_size, memory_mib } => rt.block_on(rss(puts, value_size, memory_mib)),
        Cmd::Move { mib, value_size, rate_mib } => rt.block_on(move_partition(mib, value_size, rate_mib)),
        Cmd::Rebalance { mib, value_size, rate_mib } => rt.block_on(rebalance(mib, value_size, rate_mib)),
        Cmd::Grow { mib, value_size, shards } => rt.block_on(grow(mib, value_size, shards)),
    }
}

/// Checks the flags clap cannot, before any dmkvd starts.
fn check(cmd: &Cmd) -> Result<(), String> {
    let at_least_one = |name: &str, n: u64| if n == 0 { Err(format!("{name} must be at least 1")) } else { Ok(()) };
    let value = |n: usize| match n {
        1..=MAX_VALUE_LEN => Ok(()),
        _ => Err(format!("--value-size {n}: expected 1 to {MAX_VALUE_LEN} bytes")),
    };
    match cmd {
        Cmd::Move { mib, value_size, .. } | Cmd::Rebalance { mib, value_size, .. } => {
            at_least_one("--mib", *mib)?;
            value(*value_size)
        }
        Cmd::Grow { mib, value_size, shards } => {
            at_least_one("--mib", *mib)?;
            at_least_one("--shards", u64::from(*shards))?;
            if mib.checked_mul(4 << 20).is_none() {
                return Err(format!("--mib {mib} is too large"));
            }
            value(*value_size)
        }
        Cmd::Failover { kills, shards, .. } => {
            at_least_one("--kills", *kills as u64)?;
            at_least_one("--shards", u64::from(*shards))
        }
        Cmd::PutLatency { sync, puts, concurrency, value_size, nodes, rpc_transport } => {
            rpc(rpc_transport)?;
            if !["always", "batch", "none"].contains(&sync.as_str()) {
                return Err(format!("--sync {sync:?}: expected always, batch or none"));
            }
            at_least_one("--puts", *puts as u64)?;
            at_least_one("--concurrency", *concurrency as u64)?;
            at_least_one("--nodes", *nodes as u64)?;
            value(*value_size)
        }
        Cmd::CatchUp { mib, value_size } => {
            at_least_one("--mib", *mib)?;
            if mib.checked_mul(2 << 20).is_none() {
                return Err(format!("--mib {mib} is too large"));
            }
            value(*value_size)
        }
        Cmd::Rss { puts, value_size, memory_mib } => {
            at_least_one("--puts", *puts as u64)?;
            at_least_one("--memory-mib", *memory_mib)?;
            value(*value_size)
        }
    }
}

/// Starts a cluster from async code: its start blocks, and waits on a
/// runtime of its own, which may not run inside this one's context.
fn start_cluster(nodes: usize, shards: u32, replicas: usize, args: &[&str]) -> Result<TestCluster, String> {
    tokio::task::block_in_place(|| TestCluster::try_start(nodes, shards, replicas, true, args))
        .map_err(|e| format!("the cluster did not start: {e}"))
}

fn connect_err(e: impl std::fmt::Display) -> String {
    format!("cannot connect: {e}")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn report(name: &str, mut v: Vec<Duration>) {
    v.sort();
    let at = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
    println!(
        "{name}: n={} min {:.0} ms, p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms",
        v.len(),
        ms(v[0]),
        ms(at(0.5)),
        ms(at(0.99)),
        ms(v[v.len() - 1])
    );
}

async fn failover(kills: usize, shards: u32, reader_transport: Option<Transport>) -> Result<(), String> {
    let mut c = start_cluster(3, shards, 3, &[])?;
    let (mut put_times, mut get_times) = (Vec::new(), Vec::new());
    for k in 0..kills {
        let shard = k as u32 % shards;
        let map = c.try_leaders_known(0).await?;
        let leader = map.shards().get(shard as usize).and_then(|s| s.leader);
        let victim = leader.ok_or_else(|| format!("shard {shard} has no leader"))? as usize - 1;
        let via = (victim + 1) % 3;
        let key = (0u64..)
            .map(|i| format!("fo-{shard}-{i}"))
            .find(|k| map.shard_of(k.as_bytes()).id == shard)
            .ok_or_else(|| format!("no key falls in shard {shard}"))?;
        let writer = Client::connect(c.rpc(via)).await.map_err(connect_err)?;
        let reader_cfg = match reader_transport {
            Some(t) => ClientConfig::default().read_path(ReadPath::OneSided).transport(Some(t)),
            None => ClientConfig::default(),
        };
        let reader = Client::connect_with(c.rpc(via), reader_cfg).await.map_err(connect_err)?;
        writer.put(&key, "0").await.map_err(|e| format!("first PUT: {e}"))?;
        reader.get(&key).await.map_err(|e| format!("first GET: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        // Completion times of PUTs and GETs, with when each was sent.
        let puts: Arc<Mutex<Vec<(Instant, Instant)>>> = Arc::default();
        let gets: Arc<Mutex<Vec<(Instant, Instant)>>> = Arc::default();
        let w = {
            let (stop, puts, key) = (Arc::clone(&stop), Arc::clone(&puts), key.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let sent = Instant::now();
                    if writer.put(&key, i.to_string()).await.is_ok() {
                        puts.lock().await.push((sent, Instant::now()));
                    }
                }
            })
        };
        let r = {
            let (stop, gets, key, one_sided_only) =
                (Arc::clone(&stop), Arc::clone(&gets), key.clone(), reader_transport);
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    let before = reader.read_stats().gets;
                    // With a reader transport, only a GET answered
                    // one-sided counts (this task is the client's only one).
                    if reader.get(&key).await.is_ok() && (one_sided_only.is_none() || reader.read_stats().gets > before)
                    {
                        gets.lock().await.push((sent, Instant::now()));
                    }
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(300)).await;
        c.kill(victim);
        let killed = Instant::now();
        let first_after = |v: &Vec<(Instant, Instant)>| {
            v.iter().filter(|(sent, _)| *sent >= killed).map(|(_, done)| *done - killed).min()
        };
        let deadline = killed + Duration::from_secs(10);
        while (first_after(&*puts.lock().await).is_none() || first_after(&*gets.lock().await).is_none())
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.store(true, Ordering::Relaxed);
        let _ = w.await;
        let _ = r.await;
        let (p, g) = (first_after(&*puts.lock().await), first_after(&*gets.lock().await));
        println!(
            "kill {k}: shard {shard}, node {}: first PUT after {:?}, first GET after {:?}",
            victim + 1,
            p.map(ms),
            g.map(ms)
        );
        put_times.push(p.unwrap_or(Duration::from_secs(10)));
        get_times.push(g.unwrap_or(Duration::from_secs(10)));
        tokio::task::block_in_place(|| c.try_restart(victim))?;
    }
    report("kill to first acknowledged PUT of the shard", put_times);
    match reader_transport {
        Some(t) => report(&format!("kill to first GET (sent after the kill) answered one-sided over {t}"), get_times),
        None => report("kill to first GET (sent after the kill) answered", get_times),
    }
    Ok(())
}

fn rpc(name: &str) -> Result<RpcTransport, String> {
    match name {
        "auto" => Ok(RpcTransport::Auto),
        "tcp" => Ok(RpcTransport::Tcp),
        "verbs" => Ok(RpcTransport::Verbs),
        other => Err(format!("--rpc-transport {other:?}: expected auto, tcp or verbs")),
    }
}

/// utime + stime of every live node, in clock ticks.
fn nodes_cpu_ticks(c: &TestCluster, nodes: usize) -> u64 {
    let ticks = |pid: u32| -> Option<u64> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
    };
    (0..nodes).filter_map(|i| c.pid(i)).filter_map(ticks).sum()
}

async fn put_latency(
    sync: &str,
    puts: usize,
    concurrency: usize,
    value_size: usize,
    nodes: usize,
    rpc_transport: RpcTransport,
) -> Result<(), String> {
    let c = start_cluster(nodes, 3, nodes, &["--sync", sync])?;
    c.try_leaders_known(0).await?;
    let cfg = ClientConfig::default().rpc_transport(rpc_transport);
    let client = Client::connect_with(c.rpc(0), cfg).await.map_err(connect_err)?;
    let value = Arc::new(vec![b'v'; value_size]);
    // Warm-up: sessions to every node, leases, caches.
    for i in 0..1000 {
        client.put(format!("warm{i}"), value.as_slice()).await.map_err(|e| format!("PUT: {e}"))?;
    }
    let histogram = || Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).map_err(|e| format!("histogram: {e}"));
    let hist: Arc<Mutex<Histogram<u64>>> = Arc::new(Mutex::new(histogram()?));
    let cpu_before = nodes_cpu_ticks(&c, nodes);
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let (client, value, hist) = (client.clone(), Arc::clone(&value), Arc::clone(&hist));
            tokio::spawn(async move {
                let mut local = histogram()?;
                for i in (t..puts).step_by(concurrency) {
                    let sent = Instant::now();
                    client.put(format!("lat{i}"), value.as_slice()).await.map_err(|e| format!("PUT: {e}"))?;
                    local.saturating_record(sent.elapsed().as_micros() as u64);
                }
                hist.lock().await.add(local).map_err(|e| format!("histogram: {e}"))
            })
        })
        .collect();
    for t in tasks {
        t.await.map_err(|e| format!("PUT task: {e}"))??;
    }
    let took = started.elapsed();
    // Clock ticks are 10 ms: over 20,000 PUTs that is 0.5 µs per PUT.
    let cpu_us = (nodes_cpu_ticks(&c, nodes) - cpu_before) as f64 * 10_000.0 / puts as f64;
    let h = hist.lock().await;
    println!(
        "{nodes} node(s) × {nodes} replica(s), --sync {sync}, rpc {rpc_transport:?}: {puts} PUTs of {value_size} B, {concurrency} in flight: {:.0} PUTs/s, \
         p50 {} µs, p99 {} µs, max {} µs, servers' CPU {cpu_us:.1} µs per PUT",
        puts as f64 / took.as_secs_f64(),
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.max()
    );
    Ok(())
}

async fn catch_up(mib: u64, value_size: usize) -> Result<(), String> {
    // One shard; room for the data under the leader's admission limit.
    let memory = format!("{}MiB", mib * 2 + 64);
    let mut c = start_cluster(3, 1, 3, &["--memory", &memory, "--sync", "none", "--raft-log-entries", "2000"])?;
    let map = c.try_leaders_known(0).await?;
    let leader = map.shards().first().and_then(|s| s.leader).ok_or("the shard has no leader")? as usize - 1;
    let away = (leader + 1) % 3;
    let via = (leader + 2) % 3;
    c.kill(away);
    let client = Client::connect(c.rpc(via)).await.map_err(connect_err)?;
    let puts = (mib << 20) as usize / value_size;
    let filled = Instant::now();
    let value = vec![b'v'; value_size];
    let failed = put_all(&client, puts, &value, |i| format!("cu-{i}")).await?;
    println!(
        "filled {mib} MiB ({puts} PUTs of {value_size} B) in {:.1} s, {failed} PUTs failed and were sent again",
        filled.elapsed().as_secs_f64()
    );
    let applied = |s: &dmkv_common::proto::ClusterMapReply| s.local.first().map_or(0, |r| r.applied);
    let term = |s: &dmkv_common::proto::ClusterMapReply| s.shards.first().map(|e| (e.term, e.leader));
    let before = client.cluster_status().await.map_err(|e| format!("cluster status: {e}"))?;
    let target = applied(&before);
    // The same foreground load idle, then during the catch-up.
    let idle = Probe::start(client.clone());
    tokio::time::sleep(PROBE_IDLE).await;
    let idle = idle.stop().await;
    let during = Probe::start(client.clone());
    let watch = Watch::start(client.clone());
    let started = Instant::now();
    tokio::task::block_in_place(|| c.try_restart(away))?;
    let deadline = started + Duration::from_secs(600);
    loop {
        if let Ok(node) = Client::connect(c.rpc(away)).await
            && let Ok(s) = node.cluster_status().await
            && applied(&s) >= target
        {
            break;
        }
        if Instant::now() >= deadline {
            return Err("no catch-up within 10 minutes".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = started.elapsed();
    let during = during.stop().await;
    watch.stop().await;
    let after = client.cluster_status().await.map_err(|e| format!("cluster status: {e}"))?;
    idle.print("idle");
    during.print("during catch-up");
    let (t0, t1) = (term(&before), term(&after));
    println!(
        "shard leader and term before {t0:?}, after {t1:?}: {}",
        if t0 == t1 { "no leader change" } else { "THE LEADER CHANGED" }
    );
    if t0 != t1 {
        // Why: each node's account of the change, and what it warned of.
        for i in 0..c.len() {
            let log = c.log(i);
            let lines: Vec<&str> = log
                .lines()
                .filter(|l| {
                    ["leader changed", "WARN", "ERROR", "election", "became", "stepped down", "snapshot"]
                        .iter()
                        .any(|w| l.contains(w))
                })
                .collect();
            for l in lines.iter().rev().take(25).rev() {
                println!("  node {}: {l}", i + 1);
            }
        }
    }
    let node = Client::connect(c.rpc(away)).await.map_err(connect_err)?;
    let stats = node.stats().await.map_err(|e| format!("STATS: {e}"))?;
    println!(
        "replica of {mib} MiB caught up in {:.2} s from its restart (snapshots installed: {}, items: {})",
        took.as_secs_f64(),
        stats.get("shard_snapshots_installed").copied().unwrap_or(0),
        stats.get("items").copied().unwrap_or(0)
    );
    Ok(())
}

/// PUTs `value` under `key(i)` for i in 0..puts, 16 in flight, each sent
/// again until it is acknowledged (at most 1000 failures in all per
/// writer); how many were sent again.
async fn put_all(
    client: &Client,
    puts: usize,
    value: &[u8],
    key: impl Fn(usize) -> String + Clone + Send + 'static,
) -> Result<u64, String> {
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..16 {
        let (client, value, key) = (client.clone(), value.to_vec(), key.clone());
        tasks.spawn(async move {
            let mut failed = 0u64;
            for i in (t..puts).step_by(16) {
                while let Err(e) = client.put(key(i), &value).await {
                    failed += 1;
                    if failed >= 1000 {
                        return Err(format!("PUTs keep failing: {e}"));
                    }
                }
            }
            Ok(failed)
        });
    }
    let mut failed = 0;
    while let Some(f) = tasks.join_next().await {
        failed += f.map_err(|e| format!("writer task: {e}"))??;
    }
    Ok(failed)
}

/// How long the foreground load runs idle before a catch-up.
const PROBE_IDLE: Duration = Duration::from_secs(10);
/// The foreground load's pace: one GET and one PUT of 100 B each time.
const PROBE_PACE: Duration = Duration::from_millis(2);

/// A foreground client: GETs and PUTs of small values at a fixed pace,
/// their latencies recorded.
struct Probe {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<ProbeResult>,
}

struct ProbeResult {
    gets: Histogram<u64>,
    puts: Histogram<u64>,
    errors: u64,
}

impl Probe {
    fn start(client: Client) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let new = || Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("static bounds");
            let mut r = ProbeResult { gets: new(), puts: new(), errors: 0 };
            let value = vec![b'f'; 100];
            let mut tick = tokio::time::interval(PROBE_PACE);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut i = 0u64;
            while !flag.load(Ordering::Relaxed) {
                tick.tick().await;
                let key = format!("fg-{}", i % 1000);
                let t = Instant::now();
                match client.put(key.clone(), &value).await {
                    Ok(_) => r.puts.saturating_record(t.elapsed().as_micros() as u64),
                    Err(_) => r.errors += 1,
                }
                let t = Instant::now();
                match client.get(key).await {
                    Ok(_) => r.gets.saturating_record(t.elapsed().as_micros() as u64),
                    Err(_) => r.errors += 1,
                }
                i += 1;
            }
            r
        });
        Probe { stop, task }
    }

    async fn stop(self) -> ProbeResult {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the probe task does not panic")
    }
}

impl ProbeResult {
    fn print(&self, when: &str) {
        let line = |h: &Histogram<u64>| {
            format!(
                "n={} p50 {} µs, p99 {} µs, max {} µs",
                h.len(),
                h.value_at_quantile(0.5),
                h.value_at_quantile(0.99),
                h.max()
            )
        };
        println!("foreground {when}: GET {}; PUT {}; {} errors", line(&self.gets), line(&self.puts), self.errors);
    }
}

/// `VmRSS` and `VmHWM` of a process, in KiB.
fn rss_kib(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

async fn rss(puts: usize, value_size: usize, memory_mib: u64) -> Result<(), String> {
    let memory = format!("{memory_mib}MiB");
    let c = tokio::task::block_in_place(|| TestCluster::try_start(3, 3, 3, false, &["--memory", &memory]))
        .map_err(|e| format!("the cluster did not start: {e}"))?;
    c.try_leaders_known(0).await?;
    let client = Client::connect(c.rpc(0)).await.map_err(connect_err)?;
    // Live data of about half of each node's memory: every node holds a
    // replica of every shard, so the key set is overwritten again and
    // again and the logs, not the stores, would grow.
    let keys = ((memory_mib << 20) / 2 / value_size as u64).max(1) as usize;
    let value = vec![b'r'; value_size];
    let started = Instant::now();
    let failed = put_all(&client, puts, &value, move |i| format!("rss-{}", i % keys)).await?;
    println!(
        "{puts} PUTs of {value_size} B over {keys} keys in {:.1} s ({failed} sent again), 3 in-memory nodes, --memory {memory}",
        started.elapsed().as_secs_f64()
    );
    for i in 0..c.len() {
        let pid = c.pid(i).ok_or_else(|| format!("node {} is not running", i + 1))?;
        let (now, peak) = rss_kib(pid).ok_or_else(|| format!("cannot read node {}'s memory", i + 1))?;
        println!(
            "node {}: RSS {} MiB, peak {} MiB ({:.2} and {:.2} of --memory)",
            i + 1,
            now >> 10,
            peak >> 10,
            now as f64 / (memory_mib << 10) as f64,
            peak as f64 / (memory_mib << 10) as f64
        );
    }
    Ok(())
}

/// How long the foreground load runs idle before a move.
const MOVE_IDLE: Duration = Duration::from_secs(5);
/// How long a rebalance may flip nothing, with no move under way, before
/// the bench calls it stopped (moves are a second apart; a stopped mover
/// is resumed within seconds).
const REBALANCE_STALL: Duration = Duration::from_secs(30);
/// Keys of the moving partition its writer cycles over.
const WRITER_KEYS: usize = 64;

async fn move_partition(mib: u64, value_size: usize, rate_mib: Option<u32>) -> Result<(), String> {
    use dmkv_common::cluster::map::partition_of;
    // Each node holds a replica of both shards: room for the partition on
    // either, and the foreground keys.
    let memory = format!("{}MiB", 4 * mib + 256);
    let c = tokio::task::block_in_place(|| TestCluster::try_start(3, 2, 3, false, &["--memory", &memory]))
        .map_err(|e| format!("the cluster did not start: {e}"))?;
    let map = c.try_leaders_known(0).await?;
    let client = Client::connect(c.rpc(0)).await.map_err(connect_err)?;
    let p = (0..).map(|i| partition_of(format!("mv-{i}").as_bytes())).find(|&p| map.shard_of_partition(p) == Some(0));
    let p = p.ok_or("no partition on shard 0")?;
    let n = ((mib << 20) / value_size as u64).max(1) as usize;
    // The first n keys hold the partition's data; the writer's small keys
    // follow (overwriting the big ones would leave nothing to move).
    let mut keys: Vec<String> =
        (0..).map(|i| format!("mv-{i}")).filter(|k| partition_of(k.as_bytes()) == p).take(n + WRITER_KEYS).collect();
    let small: Arc<Vec<String>> = Arc::new(keys.split_off(n));
    let keys = Arc::new(keys);
    let value = vec![b'm'; value_size];
    let started = Instant::now();
    let k = Arc::clone(&keys);
    put_all(&client, n, &value, move |i| k[i].clone()).await?;
    println!("partition {p}: {n} keys of {value_size} B written in {:.1} s", started.elapsed().as_secs_f64());
    let reader = ClientConfig::default().read_path(ReadPath::OneSided).transport(Some(Transport::Shm));
    let fg = Client::connect_with(c.rpc(0), reader.clone()).await.map_err(connect_err)?;
    let idle = Probe::start(fg.clone());
    tokio::time::sleep(MOVE_IDLE).await;
    let idle = idle.stop().await;
    let during = Probe::start(fg);
    // A writer of the moving partition's keys: the longest a write waited
    // is the pause as a client sees it.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (client, stop, keys) = (client.clone(), Arc::clone(&stop), Arc::clone(&small));
        tokio::spawn(async move {
            let (mut longest, mut errors, mut i) = (Duration::ZERO, 0u64, 0usize);
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                if client.put(keys[i % keys.len()].clone(), b"w").await.is_err() {
                    errors += 1;
                }
                longest = longest.max(t.elapsed());
                i += 1;
                tokio::time::sleep(PROBE_PACE).await;
            }
            (longest, errors, i)
        })
    };
    let t = Instant::now();
    let r = move_at_meta_leader(&c, p, 1, rate_mib).await?;
    let took = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    let (longest, errors, writes) = writer.await.map_err(|e| format!("writer task: {e}"))?;
    let during = during.stop().await;
    idle.print("idle");
    during.print("during the move");
    println!(
        "moved partition {p} ({} keys, {:.1} MiB) from shard {} in {:.3} s: {:.1} MiB/s, {} catch-up rounds, writes \
         paused {:.2} ms; its writer: {writes} PUTs, longest {:.2} ms, {errors} errors",
        r.keys,
        r.bytes as f64 / f64::from(1 << 20),
        r.from,
        took.as_secs_f64(),
        r.bytes as f64 / f64::from(1 << 20) / took.as_secs_f64(),
        r.rounds,
        r.pause_us as f64 / 1000.0,
        longest.as_secs_f64() * 1000.0
    );
    // Every key where the map now puts it, read one-sided.
    let check = Client::connect_with(c.rpc(1), reader).await.map_err(connect_err)?;
    let mut missing = 0;
    for k in keys.iter() {
        if check.get(k).await.map_err(|e| format!("GET {k}: {e}"))?.is_none() {
            missing += 1;
        }
    }
    for k in small.iter().take(writes) {
        if check.get(k).await.map_err(|e| format!("GET {k}: {e}"))?.as_deref() != Some(&b"w"[..]) {
            missing += 1;
        }
    }
    if missing > 0 {
        return Err(format!("{missing} keys missing after the move"));
    }
    println!("all {n} keys read back after the move ({:?})", check.read_stats());
    Ok(())
}

/// Max over mean of the shards' bytes.
fn max_over_mean(v: &[u64]) -> f64 {
    dmkv_common::cluster::rebalance::imbalance(&v.iter().map(|&b| b as f64).collect::<Vec<_>>())
}

async fn rebalance(mib: u64, value_size: usize, rate_mib: Option<u32>) -> Result<(), String> {
    use dmkv_common::cluster::map::partition_of;
    const SHARDS: u32 = 3;
    let memory = format!("{}MiB", 2 * mib + 256);
    let c = tokio::task::block_in_place(|| TestCluster::try_start(3, SHARDS, 3, false, &["--memory", &memory]))
        .map_err(|e| format!("the cluster did not start: {e}"))?;
    let map = c.try_leaders_known(0).await?;
    let client = Client::connect(c.rpc(0)).await.map_err(connect_err)?;
    let n = ((mib << 20) / value_size as u64).max(1) as usize;
    let keys: Arc<Vec<String>> = Arc::new(
        (0..)
            .map(|i| format!("rb-{i}"))
            .filter(|k| map.shard_of_partition(partition_of(k.as_bytes())) == Some(0))
            .take(n)
            .collect(),
    );
    let value = vec![b'r'; value_size];
    let started = Instant::now();
    let k = Arc::clone(&keys);
    put_all(&client, n, &value, move |i| k[i].clone()).await?;
    println!("{n} keys of {value_size} B written to shard 0 in {:.1} s", started.elapsed().as_secs_f64());
    let before = c.shard_bytes(SHARDS).await;
    let reader = ClientConfig::default().read_path(ReadPath::OneSided).transport(Some(Transport::Shm));
    let fg = Client::connect_with(c.rpc(0), reader.clone()).await.map_err(connect_err)?;
    let idle = Probe::start(fg.clone());
    tokio::time::sleep(MOVE_IDLE).await;
    let idle = idle.stop().await;
    let during = Probe::start(fg);
    let version = client.cluster_map().await.map_err(|e| format!("map: {e}"))?.version;
    let t = Instant::now();
    let plan =
        at_meta_leader(&c, Duration::from_secs(10), async |admin| admin.rebalance(false, rate_mib).await).await?;
    // Each move flips the map two versions on (its plan, its flip).
    let done_at = version + 2 * plan.planned.len() as u64;
    let mut last = (version, Instant::now());
    loop {
        let map = client.cluster_map().await.map_err(|e| format!("map: {e}"))?;
        if map.version >= done_at && map.moving.is_none() {
            break;
        }
        // A rebalance that stopped early (a move failed: its outcome is in
        // the map's history) flips nothing more: say so, not wait an hour.
        if map.version != last.0 {
            last = (map.version, Instant::now());
        } else if map.moving.is_none() && last.1.elapsed() > REBALANCE_STALL {
            return Err(format!(
                "the rebalance stopped at map version {} of {done_at}; last moves: {:?}",
                map.version,
                map.history.iter().rev().take(3).map(|m| (m.partition, m.outcome.as_str())).collect::<Vec<_>>()
            ));
        }
        if t.elapsed() > Duration::from_secs(3600) {
            return Err(format!("the rebalance did not end within an hour (map version {})", map.version));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let took = t.elapsed();
    let during = during.stop().await;
    let after = c.shard_bytes(SHARDS).await;
    idle.print("idle");
    during.print("during the rebalance");
    let moved: u64 = plan.planned.iter().map(|m| m.bytes).sum();
    println!(
        "rebalanced in {:.1} s: {} moves ({:.1} MiB); planned fill imbalance {:.2} -> {:.2}; shard bytes {before:?} \
         (max/mean {:.2}) -> {after:?} (max/mean {:.2})",
        took.as_secs_f64(),
        plan.planned.len(),
        moved as f64 / f64::from(1 << 20),
        plan.fill_before,
        plan.fill_after,
        max_over_mean(&before),
        max_over_mean(&after)
    );
    let check = Client::connect_with(c.rpc(1), reader).await.map_err(connect_err)?;
    for k in keys.iter() {
        if check.get(k).await.map_err(|e| format!("GET {k}: {e}"))?.is_none() {
            return Err(format!("{k} missing after the rebalance"));
        }
    }
    println!("all {n} keys read back after the rebalance");
    Ok(())
}

/// Each node's bytes: the live bytes of the replicas it holds.
async fn node_bytes(c: &TestCluster) -> Vec<u64> {
    let mut out = Vec::new();
    for i in 0..c.len() {
        let bytes = match Client::connect(c.rpc(i)).await {
            Ok(client) => match client.cluster_status().await {
                Ok(s) => {
                    s.local.iter().filter(|l| l.shard != dmkv_common::cluster::map::META_SHARD).map(|l| l.bytes).sum()
                }
                Err(_) => 0,
            },
            Err(_) => 0,
        };
        out.push(bytes);
    }
    out
}

async fn grow(mib: u64, value_size: usize, shards: u32) -> Result<(), String> {
    // Every node holds a replica of every shard before the fourth comes:
    // its memory takes the whole data set, twice over for the index,
    // free space and the snapshots it sends.
    let memory = format!("{}MiB", 2 * mib + 256);
    let c = tokio::task::block_in_place(|| {
        TestCluster::try_start_with_spares(3, 1, shards, 3, false, &["--memory", &memory])
    })
    .map_err(|e| format!("the cluster did not start: {e}"))?;
    c.try_leaders_known(0).await?;
    let client = Client::connect(c.rpc(0)).await.map_err(connect_err)?;
    let n = ((mib << 20) / value_size as u64).max(1) as usize;
    let value = vec![b'g'; value_size];
    let started = Instant::now();
    put_all(&client, n, &value, |i| format!("gr-{i}")).await?;
    println!("{n} keys of {value_size} B written to {shards} shards in {:.1} s", started.elapsed().as_secs_f64());
    let before = node_bytes(&c).await;
    let reader = ClientConfig::default().read_path(ReadPath::OneSided).transport(Some(Transport::Shm));
    let fg = Client::connect_with(c.rpc(0), reader.clone()).await.map_err(connect_err)?;
    let idle = Probe::start(fg.clone());
    tokio::time::sleep(MOVE_IDLE).await;
    let idle = idle.stop().await;
    let during = Probe::start(fg);
    let map = client.cluster_status().await.map_err(|e| format!("status: {e}"))?;
    let placed: Vec<(u32, Vec<u64>)> = map.shards.iter().map(|s| (s.id, s.replicas.clone())).collect();
    let mut nodes: Vec<u64> = map.nodes.iter().map(|n| n.id).collect();
    nodes.sort_unstable();
    let moves = dmkv_common::cluster::replica_plan::plan_add(&placed, &nodes, 4);
    let t = Instant::now();
    let mut took = Vec::new();
    for m in &moves {
        let one = Instant::now();
        at_meta_leader(&c, Duration::from_secs(900), async |admin| admin.move_replica(m.shard, m.from, m.to).await)
            .await?;
        took.push(one.elapsed().as_secs_f64());
    }
    let total = t.elapsed();
    let during = during.stop().await;
    let after = node_bytes(&c).await;
    idle.print("idle");
    during.print("during add-node");
    let longest = took.iter().copied().fold(0.0, f64::max);
    println!(
        "add-node to balanced in {:.1} s: {} replica moves (longest {longest:.1} s, mean {:.1} s); bytes per node \
         {before:?} (max/mean over the 3 nodes {:.2}) -> {after:?} (max/mean over 4 {:.2})",
        total.as_secs_f64(),
        moves.len(),
        took.iter().sum::<f64>() / took.len().max(1) as f64,
        max_over_mean(&before[..3]),
        max_over_mean(&after)
    );
    let check = Client::connect_with(c.rpc(3), reader).await.map_err(connect_err)?;
    for i in 0..n {
        let k = format!("gr-{i}");
        if check.get(&k).await.map_err(|e| format!("GET {k}: {e}"))?.is_none() {
            return Err(format!("{k} missing after add-node"));
        }
    }
    println!("all {n} keys read back through the new node");
    Ok(())
}

/// Asks each node in turn to move `p` to shard `to` until the one leading
/// the metadata group does it.
async fn move_at_meta_leader(
    c: &TestCluster,
    p: u32,
    to: u32,
    rate_mib: Option<u32>,
) -> Result<dmkv_common::proto::MovePartitionReply, String> {
    at_meta_leader(c, Duration::from_secs(600), async |admin| admin.move_partition(p, to, rate_mib).await).await
}

/// Asks each node in turn (`timeout` per request) until the one leading
/// the metadata group answers something other than NOT_LEADER.
async fn at_meta_leader<T>(
    c: &TestCluster,
    timeout: Duration,
    ask: impl AsyncFn(Client) -> Result<T, dmkv_client::ClientError>,
) -> Result<T, String> {
    let patient = ClientConfig::default().request_timeout(timeout);
    for _ in 0..50 {
        for i in 0..c.len() {
            let admin = Client::connect_with(c.rpc(i), patient.clone()).await.map_err(connect_err)?;
            match ask(admin).await {
                Ok(r) => return Ok(r),
                Err(dmkv_client::ClientError::NotLeader { .. }) => continue,
                Err(e) => return Err(format!("node {}: {e}", i + 1)),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err("no node leads the metadata group".into())
}

/// Watches the shard's term and leader, and the host's dirty page cache,
/// during a catch-up: when a leader change came, and what the disk was
/// doing then.
struct Watch {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<String>>,
}

impl Watch {
    fn start(client: Client) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let started = Instant::now();
            let mut seen = None;
            let mut notes = Vec::new();
            let mut max_dirty = 0u64;
            while !flag.load(Ordering::Relaxed) {
                let dirty = dirty_kib().unwrap_or(0);
                max_dirty = max_dirty.max(dirty);
                if let Ok(s) = client.cluster_status().await {
                    let now = s.shards.first().map(|e| (e.term, e.leader));
                    if now != seen {
                        notes.push(format!(
                            "t={:.2}s term/leader {now:?} (dirty page cache {} MiB)",
                            started.elapsed().as_secs_f64(),
                            dirty >> 10
                        ));
                        seen = now;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            notes.push(format!("most dirty page cache meanwhile: {} MiB", max_dirty >> 10));
            notes
        });
        Watch { stop, task }
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for n in self.task.await.unwrap_or_default() {
            println!("  {n}");
        }
    }
}

fn dirty_kib() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    m.lines().find_map(|l| l.strip_prefix("Dirty:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}
