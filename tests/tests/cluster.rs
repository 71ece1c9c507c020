//! A cluster of real dmkvd processes on loopback: routing across shards,
//! failover after kill -9 with no acknowledged write lost, and recovery
//! from the raft log after every node restarts.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dmkv_client::Client;
use dmkv_tests::cluster::TestCluster;
use dmkv_tests::{bin_path, wait_until};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// Waits for leaders, then PUTs `prefix{i}` = `v{i}` for i in 0..n through
/// node index `via`.
async fn put_keys(c: &TestCluster, via: usize, prefix: &str, n: usize) {
    c.leaders_known(via).await;
    let client = Client::connect(c.rpc(via)).await.expect("connect");
    for i in 0..n {
        client.put(format!("{prefix}{i}"), format!("v{i}")).await.expect("put");
    }
}

#[test]
fn a_three_node_cluster_serves_every_shard() {
    let c = TestCluster::start(3, 6, 3, false, &[]);
    rt().block_on(async {
        c.leaders_known(0).await;
        let client = Client::connect(c.rpc(1)).await.expect("connect");
        let map = client.cluster_map().await.expect("map");
        let keys: Vec<String> = (0..300).map(|i| format!("key-{i}")).collect();
        let mut shards = std::collections::BTreeSet::new();
        for k in &keys {
            client.put(k, format!("value of {k}")).await.expect("put");
            shards.insert(map.shard_of(k.as_bytes()).id);
        }
        assert_eq!(shards.len(), 6, "the keys span every shard");
        // Typed pipelining goes to one node: a cluster refuses it and
        // nothing is sent (its writes need the router's retries).
        let refused = client.send_put("pipelined", "v").await.err();
        assert!(matches!(refused, Some(dmkv_client::ClientError::Config(_))), "{:?}", refused.map(|e| e.to_string()));
        assert_eq!(client.get("pipelined").await.expect("get"), None);
        for k in &keys {
            assert_eq!(client.get(k).await.expect("get").as_deref(), Some(format!("value of {k}").as_bytes()));
        }
        // A multi-get split per shard keeps the order of the keys.
        let got = client.multi_get(&keys).await.expect("multi-get");
        for (k, v) in keys.iter().zip(&got) {
            assert_eq!(v.as_deref(), Some(format!("value of {k}").as_bytes()));
        }
        // And over RPC: one read permission per shard on its leader,
        // granted by the leader's lease (no quorum round) when it holds one.
        let got = client.rpc_multi_get(&keys).await.expect("RPC multi-get");
        for (k, v) in keys.iter().zip(&got) {
            assert_eq!(v.as_deref(), Some(format!("value of {k}").as_bytes()));
        }
        let mut lease_reads = 0;
        for i in 0..3 {
            lease_reads +=
                Client::connect(c.rpc(i)).await.expect("connect").stats().await.expect("stats")["shard_lease_reads"];
        }
        assert!(lease_reads > 0, "no RPC read was answered under a lease");
        assert!(client.delete("key-7").await.expect("delete"));
        assert_eq!(client.get("key-7").await.expect("get"), None);
        assert!(!client.delete("key-7").await.expect("delete again"));
        // Every node answers, whichever it was asked through.
        for i in 0..3 {
            let other = Client::connect(c.rpc(i)).await.expect("connect");
            assert_eq!(other.get("key-99").await.expect("get").as_deref(), Some(&b"value of key-99"[..]));
        }
    });
    // `dmkv cluster status` shows every node up and a leader per shard.
    let out = std::process::Command::new(bin_path("dmkv"))
        .args(["--server", c.rpc(2), "cluster", "status"])
        .output()
        .expect("run dmkv cluster status");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "dmkv cluster status failed: {}", String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert_eq!(text.lines().filter(|l| l.ends_with(" up")).count(), 3, "{text}");
    let shard_lines: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("SHARD")).skip(1).collect();
    // The metadata group's row, then the data shards'.
    assert_eq!(shard_lines.len(), 7, "{text}");
    assert!(shard_lines[0].starts_with("meta "), "{text}");
    assert!(shard_lines.iter().all(|l| !l.contains(" none ")), "a shard without a leader: {text}");
}

/// The node leading the metadata group (index) and its term, asking every
/// node but `skip`.
fn meta_leader(rt: &tokio::runtime::Runtime, c: &TestCluster, skip: Option<usize>) -> Option<(usize, u64)> {
    rt.block_on(async {
        for i in (0..c.len()).filter(|&i| Some(i) != skip) {
            let Ok(client) = Client::connect(c.rpc(i)).await else { continue };
            let Ok(s) = client.cluster_status().await else { continue };
            let meta = s.local.iter().find(|r| r.shard == dmkv_common::cluster::map::META_SHARD);
            if let Some(r) = meta.filter(|r| r.role == "leader") {
                return Some((i, r.term));
            }
        }
        None
    })
}

/// The metadata group (the map's raft group, on the first three nodes)
/// elects a leader, elects another when that one is killed, takes the
/// killed node back as a member from its log, and every node keeps the
/// map's version meanwhile.
#[test]
fn the_metadata_group_keeps_a_leader_through_a_kill() {
    let mut c = TestCluster::start(3, 3, 3, true, &[]);
    let rt = rt();
    let mut first = None;
    assert!(wait_until(Duration::from_secs(10), || {
        first = meta_leader(&rt, &c, None);
        first.is_some()
    }));
    let (victim, term) = first.expect("a leader");
    c.kill(victim);
    let mut next = None;
    assert!(
        wait_until(Duration::from_secs(10), || {
            next = meta_leader(&rt, &c, Some(victim)).filter(|&(_, t)| t > term);
            next.is_some()
        }),
        "no new leader of the metadata group after node {} was killed",
        victim + 1
    );
    c.restart(victim);
    // Back as a member: a follower of the group that applies its entries.
    assert!(wait_until(Duration::from_secs(10), || {
        rt.block_on(async {
            let Ok(client) = Client::connect(c.rpc(victim)).await else { return false };
            let Ok(s) = client.cluster_status().await else { return false };
            s.local.iter().any(|r| r.shard == dmkv_common::cluster::map::META_SHARD && r.applied > 0 && r.term > term)
        })
    }));
    for i in 0..3 {
        let map = rt.block_on(async { Client::connect(c.rpc(i)).await.expect("connect").cluster_map().await });
        assert_eq!(map.expect("map").version, 1, "node {}'s map", i + 1);
    }
}

#[test]
fn killing_a_leader_loses_no_acknowledged_put() {
    const WRITERS: usize = 4;
    const PUTS: usize = 10_000;
    let mut c = TestCluster::start(3, 3, 3, false, &[]);
    let rt = rt();
    let map = rt.block_on(c.leaders_known(1));
    let victim_shard = 0;
    let victim = map.shards()[victim_shard as usize].leader.expect("a leader") as usize - 1;
    let seed = (victim + 1) % 3;
    let acked: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
    let failed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let client = rt.block_on(Client::connect(c.rpc(seed))).expect("connect");
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (client, acked, failed) = (client.clone(), Arc::clone(&acked), Arc::clone(&failed));
            rt.spawn(async move {
                for i in 0..PUTS / WRITERS {
                    let key = format!("w{w}-{i}");
                    match client.put(&key, format!("value {w}-{i}")).await {
                        Ok(_) => acked.lock().unwrap().push((key, Instant::now())),
                        Err(_) => {
                            failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    assert!(wait_until(Duration::from_secs(60), || acked.lock().unwrap().len() >= PUTS / 5), "PUTs stalled");
    c.kill(victim);
    let killed_at = Instant::now();
    for w in writers {
        rt.block_on(w).expect("writer");
    }
    let acked = acked.lock().unwrap().clone();
    let failed = failed.load(std::sync::atomic::Ordering::Relaxed);
    // Failover: the killed leader's shard took PUTs again.
    let first_after = acked
        .iter()
        .filter(|(k, t)| *t > killed_at && map.shard_of(k.as_bytes()).id == victim_shard)
        .map(|(_, t)| *t - killed_at)
        .min();
    println!(
        "{} PUTs acknowledged, {failed} failed; first acknowledged PUT of shard {victim_shard} after killing its leader \
         (node {}): {first_after:?}",
        acked.len(),
        victim + 1
    );
    assert!(first_after.is_some(), "the shard never took a PUT after its leader was killed");
    assert_eq!(acked.len() + failed, PUTS);
    // Writes carry ids: one whose reply was lost is sent again and
    // applies once, so none fails.
    assert_eq!(failed, 0, "{failed} PUTs failed: clients should ride over a failover");
    // Every acknowledged PUT is there, read through either survivor.
    rt.block_on(async {
        let reader = Client::connect(c.rpc(seed)).await.expect("connect");
        let keys: Vec<&str> = acked.iter().map(|(k, _)| k.as_str()).collect();
        let mut lost = BTreeMap::new();
        for chunk in keys.chunks(256) {
            let got = reader.multi_get(chunk).await.expect("multi-get");
            for (k, v) in chunk.iter().zip(got) {
                let want = format!("value {}", &k[1..]);
                if v.as_deref() != Some(want.as_bytes()) {
                    lost.insert(k.to_string(), v);
                }
            }
        }
        assert!(lost.is_empty(), "{} acknowledged PUTs lost, e.g. {:?}", lost.len(), lost.iter().next());
    });
}

#[test]
fn nodes_restarted_from_their_logs_keep_every_acknowledged_write() {
    let mut c = TestCluster::start(3, 3, 3, true, &[]);
    let rt = rt();
    rt.block_on(async {
        c.leaders_known(0).await;
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        for i in 0..500 {
            client.put(format!("d{i}"), format!("v{i}")).await.expect("put");
        }
        for i in (0..500).step_by(5) {
            assert!(client.delete(format!("d{i}")).await.expect("delete"));
        }
    });
    c.restart_all();
    rt.block_on(async {
        c.leaders_known(2).await;
        let client = Client::connect(c.rpc(2)).await.expect("connect");
        for i in 0..500 {
            let want = (i % 5 != 0).then(|| format!("v{i}"));
            let got = client.get(format!("d{i}")).await.expect("get");
            assert_eq!(got.as_deref(), want.as_deref().map(str::as_bytes), "d{i}");
        }
    });
}

#[test]
fn a_full_shard_refuses_writes_and_its_replicas_stay_equal() {
    let c = TestCluster::start(3, 2, 3, false, &[]);
    rt().block_on(async {
        c.leaders_known(0).await;
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        let value = vec![b'x'; 10 << 10];
        let (mut stored, mut refused) = (0u32, 0u32);
        for i in 0..4000 {
            match client.put(format!("fill{i}"), &value).await {
                Ok(_) => stored += 1,
                Err(e) if e.code() == Some(dmkv_client::ErrorCode::OutOfMemory) => refused += 1,
                Err(e) => panic!("PUT {i}: {e}"),
            }
        }
        println!("{stored} PUTs of 10 KiB stored, {refused} refused for memory");
        assert!(stored > 500 && refused > 0, "the shards never filled");
        // Every node holds a replica of both shards: once they applied the
        // same log, they hold the same items.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut items = Vec::new();
            for i in 0..3 {
                let s = Client::connect(c.rpc(i)).await.expect("connect").stats().await.expect("stats");
                items.push(s["items"]);
            }
            if items.iter().all(|&n| n == items[0]) {
                assert_eq!(items[0], u64::from(stored), "every stored PUT, and nothing refused ({items:?})");
                break;
            }
            assert!(Instant::now() < deadline, "replicas differ: {items:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Still serving: deletes make room for writes again.
        for i in 0..200 {
            client.delete(format!("fill{i}")).await.expect("delete");
        }
        client.put("after", &value).await.expect("a PUT after deletes");
    });
}

/// Every node's `items` (summed over its replicas) and one STATS counter.
async fn items_and(c: &TestCluster, counter: &str) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for i in 0..3 {
        let s = Client::connect(c.rpc(i)).await.expect("connect").stats().await.expect("stats");
        out.push((s["items"], s.get(counter).copied().unwrap_or(0)));
    }
    out
}

#[test]
fn a_node_far_behind_catches_up_by_snapshot_and_restarts_from_it() {
    // Logs cut down past 200 entries: the node away misses more than that.
    // Frames of about 1 MiB: a snapshot (1.6 MB of 4 KiB values per shard)
    // travels in parts.
    let mut c = TestCluster::start(3, 3, 3, true, &["--raft-log-entries", "200", "--max-frame", "1100000"]);
    let big = |i: usize| format!("b{i}-{}", "x".repeat(4000));
    let rt = rt();
    let mut want: BTreeMap<String, Option<String>> = BTreeMap::new();
    rt.block_on(async {
        c.leaders_known(0).await;
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        for i in 0..300 {
            client.put(format!("s{i}"), format!("a{i}")).await.expect("put");
            want.insert(format!("s{i}"), Some(format!("a{i}")));
        }
    });
    c.kill(2);
    rt.block_on(async {
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        for i in 0..2000 {
            let k = format!("s{}", i % 1200);
            if i % 7 == 3 {
                client.delete(&k).await.expect("delete");
                want.insert(k, None);
            } else {
                client.put(&k, big(i)).await.expect("put");
                want.insert(k, Some(big(i)));
            }
        }
    });
    c.restart(2);
    let live = want.values().filter(|v| v.is_some()).count() as u64;
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = items_and(&c, "shard_snapshots_installed").await;
            if s.iter().all(|&(n, _)| n == live) && s[2].1 > 0 {
                break;
            }
            assert!(Instant::now() < deadline, "node 3 did not catch up by snapshot: {s:?} (want {live} items)");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let built: u64 = items_and(&c, "shard_snapshots_built").await.iter().map(|s| s.1).sum();
        assert!(built > 0, "no leader built a snapshot");
    });
    // Every node restarts from its saved snapshot and what its log kept.
    c.restart_all();
    rt.block_on(async {
        c.leaders_known(2).await;
        let client = Client::connect(c.rpc(2)).await.expect("connect");
        for (k, v) in &want {
            let got = client.get(k).await.expect("get");
            assert_eq!(got.as_deref(), v.as_deref().map(str::as_bytes), "{k}");
        }
        let s = items_and(&c, "shard_snapshots_installed").await;
        assert!(s.iter().all(|&(n, _)| n == live), "replicas differ after the restart: {s:?}");
    });
}

/// Whether every shard's leader lists, as its members, node `node`'s replica
/// with an incarnation other than 1 and no other replica of that node, and
/// every node holds the same items; the metadata group's leader too if
/// `meta` (the node's whole log went, not only its data shards').
async fn rejoined(c: &TestCluster, node: u64, meta: bool) -> Result<(), String> {
    let mut leaders = 0;
    let mut items = Vec::new();
    for i in 0..3 {
        let client = Client::connect(c.rpc(i)).await.map_err(|e| e.to_string())?;
        let s = client.cluster_status().await.map_err(|e| e.to_string())?;
        for r in s.local.iter().filter(|r| r.role == "leader") {
            let is_meta = r.shard == dmkv_common::cluster::map::META_SHARD;
            if is_meta && !meta {
                continue;
            }
            leaders += u32::from(!is_meta);
            let mine: Vec<u64> = r.voters.iter().chain(&r.learners).copied().filter(|&v| v >> 32 == node).collect();
            if mine.len() != 1 || mine[0] & 0xffff_ffff == 1 || !r.voters.contains(&mine[0]) {
                return Err(format!("shard {}: node {node}'s members are {mine:?}", r.shard));
            }
        }
        items.push(client.stats().await.map_err(|e| e.to_string())?["items"]);
    }
    if leaders != 3 || items.iter().any(|&n| n != items[0]) {
        return Err(format!("{leaders} leaders, items {items:?}"));
    }
    Ok(())
}

async fn wait_rejoined(c: &TestCluster, node: u64, meta: bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match rejoined(c, node, meta).await {
            Ok(()) => return,
            Err(e) => assert!(Instant::now() < deadline, "node {node} did not rejoin: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A node that may have lost entries it acknowledged (`--sync none`, and
/// its machine restarted after it stopped without a clean stop: here a
/// kill -9 and another boot id) rejoins as a new member and catches up; a
/// process crash alone (the same boot) keeps it the member it was.
#[test]
fn a_node_that_may_have_lost_unsynced_entries_rejoins_as_a_new_replica() {
    let mut c = TestCluster::start(3, 3, 3, true, &["--sync", "none", "--raft-log-entries", "200"]);
    let rt = rt();
    rt.block_on(put_keys(&c, 0, "u", 600));
    let rebooted = ["env", "DMKV_TEST_BOOT_ID=after-a-power-cut"];
    c.kill(2);
    c.restart_with(2, &rebooted);
    rt.block_on(wait_rejoined(&c, 3, true));
    let ids = |c: &TestCluster| {
        rt.block_on(async {
            let client = Client::connect(c.rpc(2)).await.expect("connect");
            let s = client.cluster_status().await.expect("status");
            s.local.iter().map(|r| r.replica_id).collect::<Vec<_>>()
        })
    };
    let after = ids(&c);
    c.kill(2);
    c.restart_with(2, &rebooted);
    rt.block_on(c.leaders_known(2));
    assert_eq!(ids(&c), after, "a process crash on the same boot keeps the members");
    // With node 1 down every shard needs node 3's new replicas.
    c.kill(0);
    rt.block_on(async {
        c.leaders_known(1).await;
        let client = Client::connect(c.rpc(1)).await.expect("connect");
        for i in 0..600 {
            let got = client.get(format!("u{i}")).await.expect("get");
            assert_eq!(got.as_deref(), Some(format!("v{i}").as_bytes()), "u{i}");
        }
    });
}

#[test]
fn an_in_memory_node_restarted_rejoins_as_a_new_replica_and_catches_up() {
    // Short logs: the restarted node catches up by snapshot.
    let mut c = TestCluster::start(3, 3, 3, false, &["--raft-log-entries", "200"]);
    let rt = rt();
    rt.block_on(put_keys(&c, 0, "m", 900));
    // Node 3 forgets everything: it must come back as a new member, not
    // vote or acknowledge as the replica it was.
    c.kill(2);
    c.restart(2);
    rt.block_on(wait_rejoined(&c, 3, true));
    // Without node 1 every shard needs node 3's new replicas for a quorum.
    c.kill(0);
    rt.block_on(async {
        c.leaders_known(1).await;
        let client = Client::connect(c.rpc(1)).await.expect("connect");
        for i in 0..900 {
            let got = client.get(format!("m{i}")).await.expect("get");
            assert_eq!(got.as_deref(), Some(format!("v{i}").as_bytes()), "m{i}");
        }
        client.put("after", "1").await.expect("a PUT with node 1 down");
    });
}

#[test]
fn replace_replica_swaps_in_a_new_replica_that_catches_up_and_survives_a_restart() {
    let mut c = TestCluster::start(3, 3, 3, true, &[]);
    let rt = rt();
    rt.block_on(put_keys(&c, 0, "r", 300));
    for shard in 0..3 {
        let out = std::process::Command::new(bin_path("dmkv"))
            .args(["--server", c.rpc(0), "cluster", "replace-replica", "--shard", &shard.to_string(), "--node", "2"])
            .output()
            .expect("run dmkv cluster replace-replica");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "replace-replica failed: {}", String::from_utf8_lossy(&out.stderr));
        println!("{text}");
    }
    rt.block_on(wait_rejoined(&c, 2, false));
    // The new replicas' ids are on disk: after a restart node 2 is still
    // their member, and with node 1 down they carry the quorum.
    c.kill(1);
    c.restart(1);
    c.kill(0);
    rt.block_on(async {
        c.leaders_known(1).await;
        let client = Client::connect(c.rpc(1)).await.expect("connect");
        for i in 0..300 {
            let got = client.get(format!("r{i}")).await.expect("get");
            assert_eq!(got.as_deref(), Some(format!("v{i}").as_bytes()), "r{i}");
        }
    });
}

/// The leader of `shard` as node index `i` knows it.
fn leader_at(rt: &tokio::runtime::Runtime, c: &TestCluster, i: usize, shard: u32) -> Option<u64> {
    rt.block_on(async {
        let client = Client::connect(c.rpc(i)).await.ok()?;
        let map = client.cluster_map().await.ok()?;
        map.shards().iter().find(|s| s.id == shard)?.leader
    })
}

#[test]
fn transfer_leader_hands_a_shard_to_the_node_named_and_refuses_what_cannot_be() {
    let c = TestCluster::start(3, 2, 3, false, &[]);
    let rt = rt();
    rt.block_on(put_keys(&c, 0, "t", 100));
    let transfer = |args: &[&str]| {
        let out = std::process::Command::new(bin_path("dmkv"))
            .args(["--server", c.rpc(0), "cluster", "transfer-leader"])
            .args(args)
            .output()
            .expect("run dmkv cluster transfer-leader");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // Writes go on throughout: a transfer must not wait for a quiet shard,
    // and none of them may fail.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (addr, stop) = (c.rpc(2).to_string(), Arc::clone(&stop));
        rt.spawn(async move {
            let client = Client::connect(addr).await.expect("connect");
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                client.put(format!("w{}", n % 50), n.to_string()).await.map_err(|e| format!("PUT {n}: {e}"))?;
                n += 1;
            }
            Ok::<u64, String>(n)
        })
    };
    for shard in 0..2u32 {
        let before = leader_at(&rt, &c, 0, shard).expect("a leader known");
        // To each other node in turn, then to where it is already.
        let others: Vec<u64> = (1..=3).filter(|&n| n != before).collect();
        for to in others.iter().copied().chain([others[1]]) {
            let (ok, out, err) = transfer(&["--shard", &shard.to_string(), "--to", &to.to_string()]);
            assert!(ok, "transfer of shard {shard} to node {to} failed: {err}");
            println!("{}", out.trim());
            assert!(out.contains(&format!("node {to}")), "{out}");
            // The new leader says so itself.
            assert_eq!(leader_at(&rt, &c, to as usize - 1, shard), Some(to), "shard {shard} after {out}");
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let writes = rt.block_on(writer).expect("writer task").expect("every PUT during the transfers");
    println!("{writes} PUTs during the transfers, none failed");
    // Nothing that cannot be done is begun.
    let now: Vec<Option<u64>> = (0..2).map(|s| leader_at(&rt, &c, 0, s)).collect();
    for (args, why) in [
        (["--shard", "0", "--to", "9"], "node 9 is not in the cluster"),
        (["--shard", "7", "--to", "1"], "shard 7 does not exist"),
    ] {
        let (ok, _, err) = transfer(&args);
        assert!(!ok && err.contains(why), "{args:?}: {err}");
    }
    assert_eq!(now, (0..2).map(|s| leader_at(&rt, &c, 0, s)).collect::<Vec<_>>());
    // Every acknowledged write is there, and writes go on.
    rt.block_on(async {
        let client = Client::connect(c.rpc(1)).await.expect("connect");
        for i in 0..100 {
            let got = client.get(format!("t{i}")).await.expect("get");
            assert_eq!(got.as_deref(), Some(format!("v{i}").as_bytes()), "t{i}");
        }
        client.put("after-transfers", "1").await.expect("a PUT after the transfers");
    });
}

/// One memcached text command and its answer's lines up to `last`.
fn memcached(s: &mut std::io::BufReader<std::net::TcpStream>, cmd: &str, last: &str) -> Vec<String> {
    use std::io::{BufRead, Write};
    s.get_mut().write_all(cmd.as_bytes()).expect("send to the memcached port");
    let mut lines = Vec::new();
    loop {
        let mut l = String::new();
        s.read_line(&mut l).expect("a memcached answer");
        let end = l.is_empty() || l.starts_with(last) || l.contains("ERROR");
        lines.push(l);
        if end {
            return lines;
        }
    }
}

#[test]
fn a_spare_node_holds_no_replica_and_serves_every_key_through_the_others() {
    let c = TestCluster::start_with_spares(3, 1, 3, 3, false, &["--memcached-listen", "127.0.0.1:0"]);
    let spare = 3;
    rt().block_on(async {
        c.leaders_known(0).await;
        let status = Client::connect(c.rpc(spare)).await.expect("connect").cluster_status().await.expect("status");
        assert_eq!(status.node_id, 4);
        assert!(status.local.is_empty(), "the spare has replicas: {:?}", status.local);
        assert!(status.nodes.iter().any(|n| n.id == 4), "the spare is in the map: {:?}", status.nodes);
        assert!(status.shards.iter().all(|s| !s.replicas.contains(&4)), "placed on the spare: {:?}", status.shards);
        // A client seeded with the spare reaches every shard.
        let client = Client::connect(c.rpc(spare)).await.expect("connect");
        for i in 0..60 {
            client.put(format!("sp-{i}"), format!("v{i}")).await.expect("put");
        }
        let other = Client::connect(c.rpc(0)).await.expect("connect");
        for i in 0..60 {
            assert_eq!(other.get(format!("sp-{i}")).await.expect("get").as_deref(), Some(format!("v{i}").as_bytes()));
        }
    });
    // memcached's port on the spare passes every key on.
    let port: u16 =
        c.endpoint(spare, "memcached").expect("a memcached port").rsplit(':').next().unwrap().parse().unwrap();
    let s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect to the spare's memcached port");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut s = std::io::BufReader::new(s);
    for i in 0..30 {
        let v = format!("mc{i}");
        let set = memcached(&mut s, &format!("set spmc-{i} 0 0 {}\r\n{v}\r\n", v.len()), "STORED");
        assert_eq!(set, vec!["STORED\r\n".to_string()], "set spmc-{i}");
        let got = memcached(&mut s, &format!("get sp-{i}\r\n"), "END");
        assert_eq!(
            got,
            vec![format!("VALUE sp-{i} 0 {}\r\n", format!("v{i}").len()), format!("v{i}\r\n"), "END\r\n".into()]
        );
    }
}
