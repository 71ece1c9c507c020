//! `dmkv cluster rebalance` on a cluster of real dmkvd processes whose
//! data sits on one shard: `--dry-run` plans and changes nothing; the
//! rebalance moves partitions (one at a time, in the background) until
//! the shards' bytes are within 1.1 of their mean, spreads the leaders,
//! and every key is read back.

use std::time::{Duration, Instant};

use dmkv_client::Client;
use dmkv_common::cluster::map::partition_of;
use dmkv_tests::cluster::TestCluster;

const SHARDS: u32 = 3;
/// Keys written, all on shard 0, and their size: 6 MiB (few moves: a
/// rebalance waits a second between two).
const KEYS: usize = 24;
const VALUE: usize = 256 << 10;
/// Most the rebalance may take here (unpaced moves of a few MiB each).
const DEADLINE: Duration = Duration::from_secs(120);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// Max over mean of the shards' bytes.
fn imbalance(v: &[u64]) -> f64 {
    dmkv_common::cluster::rebalance::imbalance(&v.iter().map(|&b| b as f64).collect::<Vec<_>>())
}

#[test]
fn a_rebalance_evens_out_a_cluster_whose_data_sits_on_one_shard() {
    let c = TestCluster::start(3, SHARDS, 3, false, &["--memory", "96MiB"]);
    let rt = rt();
    let keys: Vec<String> = rt.block_on(async {
        let map = c.leaders_known(0).await;
        let keys: Vec<String> = (0..)
            .map(|i| format!("rb-{i}"))
            .filter(|k| map.shard_of_partition(partition_of(k.as_bytes())) == Some(0))
            .take(KEYS)
            .collect();
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        for (i, k) in keys.iter().enumerate() {
            client.put(k, vec![i as u8; VALUE]).await.expect("fill");
        }
        keys
    });
    let dmkv = |args: &[&str]| {
        let (ok, out) = c.cli(1, args);
        assert!(ok, "dmkv {args:?}: {out}");
        out
    };
    let before = rt.block_on(c.shard_bytes(SHARDS));
    let version = rt.block_on(async { Client::connect(c.rpc(0)).await.unwrap().cluster_map().await.unwrap().version });
    let plan = dmkv(&["cluster", "rebalance", "--dry-run"]);
    println!("{plan}");
    assert!(plan.contains("imbalance (max/mean): shard fill ") && plan.contains("no partition moved (a plan only)"));
    assert!(plan.contains("  move partition ") && plan.contains(": shard 0 -> "), "{plan}");
    let after_dry = rt.block_on(async { Client::connect(c.rpc(0)).await.unwrap().cluster_map().await.unwrap() });
    assert_eq!((after_dry.version, after_dry.history.len()), (version, 0), "a dry run changed the map");

    let started = Instant::now();
    let out = dmkv(&["cluster", "rebalance", "--rate-mib", "0"]);
    println!("{out}");
    assert!(out.contains("the moves run one at a time in the background"), "{out}");
    let bytes = loop {
        let bytes = rt.block_on(c.shard_bytes(SHARDS));
        let map = rt.block_on(async { Client::connect(c.rpc(2)).await.unwrap().cluster_map().await.unwrap() });
        if map.moving.is_none() && imbalance(&bytes) <= 1.1 {
            break bytes;
        }
        assert!(started.elapsed() < DEADLINE, "not balanced within {DEADLINE:?}: {bytes:?}, {:?}", map.moving);
        std::thread::sleep(Duration::from_millis(300));
    };
    println!(
        "shard bytes {before:?} (imbalance {:.2}) -> {bytes:?} (imbalance {:.2}) in {:?}",
        imbalance(&before),
        imbalance(&bytes),
        started.elapsed()
    );
    rt.block_on(async {
        let client = Client::connect(c.rpc(2)).await.expect("connect");
        for (i, k) in keys.iter().enumerate() {
            let got = client.get(k).await.expect("get");
            assert_eq!(got.as_deref(), Some(&vec![i as u8; VALUE][..]), "{k} lost or wrong");
        }
        let map = client.cluster_map().await.expect("map");
        assert!(map.history.iter().all(|h| h.outcome == "done"), "{:?}", map.history);
        // The leaders were spread: no node leads two shards more than another.
        let mut led = [0usize; 3];
        for s in map.shards() {
            if let Some(l) = s.leader {
                led[l as usize - 1] += 1;
            }
        }
        assert!(led.iter().max().unwrap() - led.iter().min().unwrap() <= 1, "leaders per node: {led:?}");
    });
}
