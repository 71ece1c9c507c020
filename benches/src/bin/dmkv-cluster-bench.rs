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
//!   has (by snapshot: the log was compacted meanwhile).
//!
//! Needs dmkvd built (release: `cargo build --release --bin dmkvd`).

use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use dmkv_client::Client;
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
    },
    /// Time for a restarted replica to catch up with a full shard.
    CatchUp {
        /// Live data in the shard when the replica restarts (MiB).
        #[arg(long, default_value_t = 1024)]
        mib: u64,
        #[arg(long, default_value_t = 65536)]
        value_size: usize,
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
        Cmd::Failover { kills, shards } => rt.block_on(failover(kills, shards)),
        Cmd::PutLatency { sync, puts, concurrency, value_size, nodes } => {
            rt.block_on(put_latency(&sync, puts, concurrency, value_size, nodes))
        }
        Cmd::CatchUp { mib, value_size } => rt.block_on(catch_up(mib, value_size)),
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
        Cmd::Failover { kills, shards } => {
            at_least_one("--kills", *kills as u64)?;
            at_least_one("--shards", u64::from(*shards))
        }
        Cmd::PutLatency { sync, puts, concurrency, value_size, nodes } => {
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

async fn failover(kills: usize, shards: u32) -> Result<(), String> {
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
        let reader = Client::connect(c.rpc(via)).await.map_err(connect_err)?;
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
            let (stop, gets, key) = (Arc::clone(&stop), Arc::clone(&gets), key.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    if reader.get(&key).await.is_ok() {
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
    report("kill to first GET (sent after the kill) answered", get_times);
    Ok(())
}

async fn put_latency(
    sync: &str,
    puts: usize,
    concurrency: usize,
    value_size: usize,
    nodes: usize,
) -> Result<(), String> {
    let c = start_cluster(nodes, 3, nodes, &["--sync", sync])?;
    c.try_leaders_known(0).await?;
    let client = Client::connect(c.rpc(0)).await.map_err(connect_err)?;
    let value = Arc::new(vec![b'v'; value_size]);
    // Warm-up: sessions to every node, leases, caches.
    for i in 0..1000 {
        client.put(format!("warm{i}"), value.as_slice()).await.map_err(|e| format!("PUT: {e}"))?;
    }
    let histogram = || Histogram::<u64>::new(3).map_err(|e| format!("histogram: {e}"));
    let hist: Arc<Mutex<Histogram<u64>>> = Arc::new(Mutex::new(histogram()?));
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
    let h = hist.lock().await;
    println!(
        "{nodes} node(s) × {nodes} replica(s), --sync {sync}: {puts} PUTs of {value_size} B, {concurrency} in flight: {:.0} PUTs/s, p50 {} µs, p99 {} µs, \
         max {} µs",
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
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..16 {
        let (client, value) = (client.clone(), value.clone());
        tasks.spawn(async move {
            let mut failed = 0u64;
            for i in (t..puts).step_by(16) {
                while let Err(e) = client.put(format!("cu-{i}"), &value).await {
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
        failed += f.map_err(|e| format!("filler task: {e}"))??;
    }
    println!(
        "filled {mib} MiB ({puts} PUTs of {value_size} B) in {:.1} s, {failed} PUTs failed and were sent again",
        filled.elapsed().as_secs_f64()
    );
    let applied = |s: &dmkv_common::proto::ClusterMapReply| s.local.first().map_or(0, |r| r.applied);
    let target = applied(&client.cluster_status().await.map_err(|e| format!("cluster status: {e}"))?);
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
