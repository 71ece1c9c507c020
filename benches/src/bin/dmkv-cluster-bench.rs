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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use dmkv_client::Client;
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

fn main() {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    match cli.cmd {
        Cmd::Failover { kills, shards } => rt.block_on(failover(kills, shards)),
        Cmd::PutLatency { sync, puts, concurrency, value_size, nodes } => {
            rt.block_on(put_latency(&sync, puts, concurrency, value_size, nodes))
        }
        Cmd::CatchUp { mib, value_size } => rt.block_on(catch_up(mib, value_size)),
    }
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

async fn failover(kills: usize, shards: u32) {
    let mut c = TestCluster::start(3, shards, 3, true, &[]);
    let (mut put_times, mut get_times) = (Vec::new(), Vec::new());
    for k in 0..kills {
        let shard = k as u32 % shards;
        let map = c.leaders_known(0).await;
        let victim = map.shards()[shard as usize].leader.expect("a leader") as usize - 1;
        let via = (victim + 1) % 3;
        let key = (0..).map(|i| format!("fo-{shard}-{i}")).find(|k| map.shard_of(k.as_bytes()).id == shard).unwrap();
        let writer = Client::connect(c.rpc(via)).await.expect("connect");
        let reader = Client::connect(c.rpc(via)).await.expect("connect");
        writer.put(&key, "0").await.expect("first put");
        reader.get(&key).await.expect("first get");
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
        c.restart(victim);
    }
    report("kill to first acknowledged PUT of the shard", put_times);
    report("kill to first GET (sent after the kill) answered", get_times);
}

async fn put_latency(sync: &str, puts: usize, concurrency: usize, value_size: usize, nodes: usize) {
    let c = TestCluster::start(nodes, 3, nodes, true, &["--sync", sync]);
    c.leaders_known(0).await;
    let client = Client::connect(c.rpc(0)).await.expect("connect");
    let value = Arc::new(vec![b'v'; value_size]);
    // Warm-up: sessions to every node, leases, caches.
    for i in 0..1000 {
        client.put(format!("warm{i}"), value.as_slice()).await.expect("put");
    }
    let hist: Arc<Mutex<Histogram<u64>>> = Arc::new(Mutex::new(Histogram::new(3).expect("histogram")));
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let (client, value, hist) = (client.clone(), Arc::clone(&value), Arc::clone(&hist));
            tokio::spawn(async move {
                let mut local = Histogram::<u64>::new(3).expect("histogram");
                for i in (t..puts).step_by(concurrency) {
                    let sent = Instant::now();
                    client.put(format!("lat{i}"), value.as_slice()).await.expect("put");
                    local.record(sent.elapsed().as_micros() as u64).expect("record");
                }
                hist.lock().await.add(local).expect("merge");
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
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
}

async fn catch_up(mib: u64, value_size: usize) {
    // One shard; room for the data under the leader's admission limit.
    let memory = format!("{}MiB", mib * 2 + 64);
    let mut c =
        TestCluster::start(3, 1, 3, true, &["--memory", &memory, "--sync", "none", "--raft-log-entries", "2000"]);
    let map = c.leaders_known(0).await;
    let leader = map.shards()[0].leader.expect("a leader") as usize - 1;
    let away = (leader + 1) % 3;
    let via = (leader + 2) % 3;
    c.kill(away);
    let client = Client::connect(c.rpc(via)).await.expect("connect");
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
                    assert!(failed < 1000, "PUTs keep failing: {e}");
                }
            }
            failed
        });
    }
    let mut failed = 0;
    while let Some(f) = tasks.join_next().await {
        failed += f.expect("filler");
    }
    println!(
        "filled {mib} MiB ({puts} PUTs of {value_size} B) in {:.1} s, {failed} PUTs failed and were sent again",
        filled.elapsed().as_secs_f64()
    );
    let applied = |s: &dmkv_common::proto::ClusterMapReply| s.local.first().map_or(0, |r| r.applied);
    let target = applied(&client.cluster_status().await.expect("status"));
    let started = Instant::now();
    c.restart(away);
    let deadline = started + Duration::from_secs(600);
    loop {
        if let Ok(node) = Client::connect(c.rpc(away)).await
            && let Ok(s) = node.cluster_status().await
            && applied(&s) >= target
        {
            break;
        }
        assert!(Instant::now() < deadline, "no catch-up within 10 minutes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = started.elapsed();
    let node = Client::connect(c.rpc(away)).await.expect("connect");
    let stats = node.stats().await.expect("stats");
    println!(
        "replica of {mib} MiB caught up in {:.2} s from its restart (snapshots installed: {}, items: {})",
        took.as_secs_f64(),
        stats.get("shard_snapshots_installed").copied().unwrap_or(0),
        stats.get("items").copied().unwrap_or(0)
    );
}
