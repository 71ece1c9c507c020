//! A rolling restart, as an operator does one: each node in turn stopped
//! with SIGTERM and started again. A stopping node hands the leadership of
//! the shards it leads to another voter before it exits (no election
//! timeout, no stretch of RPC-only GETs), giving its lease up first, while
//! a writer and a one-sided reader keep going: no read returns a value
//! older than one acknowledged before the read began, and every
//! acknowledged write is readable at the end.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dmkv_client::{Client, ClientConfig, ReadPath};
use dmkv_tests::cluster::TestCluster;

const KEYS: usize = 8;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

fn value_of(v: &[u8]) -> u64 {
    std::str::from_utf8(v).ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("not a number: {v:?}"))
}

#[derive(Default)]
struct Seen {
    acked: Vec<AtomicU64>,
    reads: AtomicU64,
    stale: AtomicU64,
    write_errors: AtomicU64,
}

#[test]
fn a_rolling_restart_hands_leadership_over_and_serves_no_stale_read() {
    let mut c = TestCluster::start(3, 2, 3, true, &["--log", "warn,dmkv_server=info"]);
    let rt = rt();
    rt.block_on(c.leaders_known(0));
    let seen = Arc::new(Seen { acked: (0..KEYS).map(|_| AtomicU64::new(0)).collect(), ..Default::default() });
    let next = Arc::new(AtomicU64::new(1));
    let mut handed = 0;
    for i in 0..3 {
        let seed = (i + 1) % 3;
        let id = i as u64 + 1;
        let map = rt.block_on(c.leaders_known(seed));
        let led: Vec<u32> = map.shards().iter().filter(|s| s.leader == Some(id)).map(|s| s.id).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (seen, next, stop, addr) =
                (Arc::clone(&seen), Arc::clone(&next), Arc::clone(&stop), c.rpc(seed).to_string());
            rt.spawn(async move {
                let client = Client::connect(&addr).await.expect("connect");
                while !stop.load(Ordering::Relaxed) {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let k = n as usize % KEYS;
                    match client.put(format!("roll-{k}"), n.to_string()).await {
                        Ok(_) => drop(seen.acked[k].fetch_max(n, Ordering::Relaxed)),
                        Err(_) => drop(seen.write_errors.fetch_add(1, Ordering::Relaxed)),
                    }
                }
            })
        };
        let reader = {
            let (seen, stop, addr) = (Arc::clone(&seen), Arc::clone(&stop), c.rpc(seed).to_string());
            rt.spawn(async move {
                let cfg = ClientConfig::default().read_path(ReadPath::OneSided);
                let client = Client::connect_with(&addr, cfg).await.expect("connect");
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    k = (k + 1) % KEYS;
                    let before = seen.acked[k].load(Ordering::Relaxed);
                    if let Ok(got) = client.get(format!("roll-{k}")).await {
                        seen.reads.fetch_add(1, Ordering::Relaxed);
                        let n = got.as_deref().map_or(0, value_of);
                        if n < before {
                            eprintln!("stale read of roll-{k}: {n}, after {before} was acknowledged");
                            seen.stale.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                client.read_stats().gets
            })
        };
        std::thread::sleep(Duration::from_millis(500));
        let errors_before = seen.write_errors.load(Ordering::Relaxed);
        let stopping = Instant::now();
        let status = c.stop(i).expect("the node ran");
        let stopped = stopping.elapsed();
        assert!(status.success(), "node {id} exited with {status}");
        let log = c.log(i);
        if !led.is_empty() {
            assert!(
                log.contains("leadership handed over"),
                "node {id} led shards {led:?} and did not hand them over:\n{log}"
            );
            handed += led.len();
        }
        let moved = rt.block_on(c.leaders_known(seed));
        assert!(moved.shards().iter().all(|s| s.leader != Some(id)), "node {id} still named leader: {moved:?}");
        println!(
            "node {id}: led {led:?}; SIGTERM to exit {stopped:.0?}, leaders known {:.0?} after SIGTERM; {} failed PUTs meanwhile",
            stopping.elapsed(),
            seen.write_errors.load(Ordering::Relaxed) - errors_before
        );
        c.restart(i);
        rt.block_on(c.leaders_known(i));
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        rt.block_on(writer).expect("writer");
        let one_sided = rt.block_on(reader).expect("reader");
        assert!(one_sided > 0, "no GET was one-sided");
    }
    assert!(handed > 0, "no node led a shard when it stopped");
    let (reads, stale) = (seen.reads.load(Ordering::Relaxed), seen.stale.load(Ordering::Relaxed));
    println!(
        "{reads} reads, {stale} stale; {} writes, {} failed",
        next.load(Ordering::Relaxed) - 1,
        seen.write_errors.load(Ordering::Relaxed)
    );
    assert_eq!(stale, 0, "reads older than an acknowledged write");
    rt.block_on(async {
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        for (k, acked) in seen.acked.iter().enumerate() {
            let got = client.get(format!("roll-{k}")).await.expect("get").map_or(0, |v| value_of(&v));
            assert!(
                got >= acked.load(Ordering::Relaxed),
                "roll-{k}: {got} after {} was acknowledged",
                acked.load(Ordering::Relaxed)
            );
        }
    });
}
