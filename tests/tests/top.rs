//! `dmkv top` against a live dmkvd under traffic: two plain blocks (stdout
//! is a pipe), with the expected columns and the PUTs counted.

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use dmkv_client::{Client, ClientConfig, ReadPath};
use dmkv_tests::{ServerProcess, bin_path};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_each_interval_with_a_put_rate() {
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    let cfg = ClientConfig::default().read_path(ReadPath::Rpc).pool_size(1);
    let client = Client::connect_with(&srv.rpc, cfg).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                client.put(format!("k{}", i % 100), "v").await.unwrap();
                client.get(format!("k{}", i % 200)).await.unwrap();
                i += 1;
            }
            i
        }
    });
    let rpc = srv.rpc.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(bin_path("dmkv"))
            .args(["--server", &rpc, "top", "--interval", "200ms", "--iterations", "2"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    stop.store(true, Ordering::Relaxed);
    assert!(traffic.await.unwrap() > 0);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    // Not a terminal: no escape codes, one block per interval.
    assert!(!text.contains('\x1b'), "{text:?}");
    let blocks: Vec<&str> = text.split("dmkv top: ").filter(|b| !b.is_empty()).collect();
    assert_eq!(blocks.len(), 2, "{text}");
    for block in blocks {
        let lines: Vec<&str> = block.lines().collect();
        let heads: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(heads, dmkv_client::top::COLUMNS, "{block}");
        let cells: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(cells.len(), heads.len(), "{block}");
        let cell = |name: &str| cells[heads.iter().position(|h| *h == name).unwrap()];
        assert_eq!(cell("NODE"), srv.rpc, "{block}");
        let puts: f64 = cell("PUT/s").trim_end_matches('k').parse().unwrap();
        assert!(puts > 0.0, "no PUTs counted:\n{block}");
        // Half the GETs are of keys never written.
        let hit: f64 = cell("HIT%").parse().unwrap();
        assert!((0.0..100.0).contains(&hit), "{block}");
        assert_eq!(cell("LAG"), "-", "not a cluster node:\n{block}");
        assert_ne!(cell("ITEMS"), "-", "{block}");
    }
}

/// Against a cluster node, one row per node of the cluster, each with a
/// replication lag (the largest of the shards it leads; 0 when it leads
/// none or its followers are caught up).
#[test]
fn top_of_a_cluster_shows_every_node_with_its_lag() {
    let c = dmkv_tests::cluster::TestCluster::start(3, 3, 3, false, &[]);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        c.leaders_known(0).await;
        let client = Client::connect(c.rpc(0)).await.unwrap();
        for i in 0..50 {
            client.put(format!("k{i}"), "v").await.unwrap();
        }
    });
    let out = Command::new(bin_path("dmkv"))
        .args(["--server", c.rpc(0), "top", "--interval", "200ms", "--iterations", "1"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("dmkv top: 3 node(s)"), "{text}");
    let heads: Vec<&str> = lines[1].split_whitespace().collect();
    let mut nodes = Vec::new();
    for line in lines[2..].iter().filter(|l| !l.is_empty()) {
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cells.len(), heads.len(), "{text}");
        nodes.push(cells[0].to_string());
        let lag = cells[heads.iter().position(|h| *h == "LAG").unwrap()];
        assert!(lag.parse::<u64>().is_ok(), "lag {lag:?} of a cluster node:\n{text}");
    }
    nodes.sort();
    assert_eq!(nodes.len(), 3, "{text}");
}
