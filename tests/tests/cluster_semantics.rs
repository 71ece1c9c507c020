//! memcached's semantics in a cluster of real dmkvd processes: flags,
//! TTLs, write modes, CAS, counters and touch go through raft and apply
//! alike on every replica (the leader's clock decides expiries, the log
//! index is the CAS version, conditions are judged at the entry's place in
//! the log), so after a leader is killed the new one serves the same
//! values, versions, flags and expiries, every replica's items checksum
//! the same, and a CAS race keeps one winner per version.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dmkv_client::{Client, ClientConfig, ErrorCode, PutMode, PutOptions, ReadPath, Versioned};
use dmkv_tests::cluster::TestCluster;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// Waits until every running node reports, for every shard, the same
/// applied index, item count and checksum of its items (STATS with
/// digests), and returns the per-shard (items, checksum).
async fn replicas_agree(c: &TestCluster, nodes: &[usize]) -> BTreeMap<String, (u64, u64)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut per_node = Vec::new();
        for &i in nodes {
            let client = Client::connect(c.rpc(i)).await.expect("connect");
            let s = client.stats_with_digests().await.expect("stats");
            let mut shards = BTreeMap::new();
            for (k, v) in &s {
                if let Some(shard) = k.strip_suffix("_digest") {
                    let items = s[&format!("{shard}_items")];
                    let applied = s[&format!("{shard}_applied")];
                    shards.insert(shard.to_string(), (items, *v, applied));
                }
            }
            per_node.push(shards);
        }
        let same = per_node.windows(2).all(|w| w[0] == w[1]) && per_node[0].values().all(|&(_, _, a)| a > 0);
        if same {
            return per_node[0].iter().map(|(k, &(n, d, _))| (k.clone(), (n, d))).collect();
        }
        assert!(Instant::now() < deadline, "replicas differ: {per_node:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn code(e: &dmkv_client::ClientError) -> Option<ErrorCode> {
    e.code()
}

#[test]
fn flags_ttls_cas_and_counters_replicate_and_survive_a_leader_kill() {
    let mut c = TestCluster::start(3, 2, 3, false, &[]);
    let rt = rt();
    let map = rt.block_on(c.leaders_known(0));
    let victim = map.shards()[0].leader.expect("a leader") as usize - 1;
    let via = (victim + 1) % 3;
    let survivors: Vec<usize> = (0..3).filter(|&i| i != victim).collect();
    let keys: Vec<String> = (0..24).map(|i| format!("sem-{i}")).collect();
    let before: BTreeMap<String, Versioned> = rt.block_on(async {
        let client = Client::connect(c.rpc(via)).await.expect("connect");
        for (i, k) in keys.iter().enumerate() {
            let opts = PutOptions { flags: i as u32 + 1, ttl: Some(Duration::from_secs(3600)), ..Default::default() };
            let v1 = client.put_with(k, format!("v{i}"), opts).await.expect("put with flags and TTL");
            // add of a present key, replace of a missing one: refused.
            let add = PutOptions { mode: PutMode::Add, ..Default::default() };
            let e = client.put_with(k, "no", add).await.expect_err("add of a present key");
            assert_eq!(code(&e), Some(ErrorCode::NotStored), "{e}");
            let replace = PutOptions { mode: PutMode::Replace, ..Default::default() };
            let e = client.put_with(format!("missing-{i}"), "no", replace).await.expect_err("replace of a missing key");
            assert_eq!(code(&e), Some(ErrorCode::NotStored), "{e}");
            // append keeps flags and expiry; CAS wins once per version.
            let append = PutOptions { mode: PutMode::Append, ..Default::default() };
            let v2 = client.put_with(k, "+", append).await.expect("append");
            assert!(v2 > v1, "versions grow: {v1} then {v2}");
            let appended = client.rpc_get(k.as_bytes()).await.expect("get").expect("present");
            assert_eq!((appended.flags, appended.version), (i as u32 + 1, v2), "append keeps the flags");
            let e = client.cas(k, "lost", v1).await.expect_err("CAS with an old version");
            assert_eq!(code(&e), Some(ErrorCode::Exists), "{e}");
            client.cas(k, format!("v{i}+cas"), v2).await.expect("CAS with the version read");
            // A counter, and a key that expires soon.
            client.put(format!("n-{i}"), "10").await.expect("put a counter");
            assert_eq!(client.incr(format!("n-{i}"), i as u64).await.expect("incr"), 10 + i as u64);
            assert_eq!(client.decr(format!("n-{i}"), 3).await.expect("decr"), 7 + i as u64);
            let short = PutOptions { ttl: Some(Duration::from_secs(2)), ..Default::default() };
            client.put_with(format!("short-{i}"), "soon gone", short).await.expect("put with a short TTL");
        }
        let e = client.incr("sem-0", 1).await.expect_err("incr of a non-number");
        assert_eq!(code(&e), Some(ErrorCode::NotNumeric), "{e}");
        assert!(client.touch("sem-1", Some(Duration::from_secs(7200))).await.expect("touch"));
        let mut before = BTreeMap::new();
        for k in &keys {
            let v = client.rpc_get(k.as_bytes()).await.expect("get").expect("present");
            before.insert(k.clone(), v);
        }
        let v = &before["sem-3"];
        assert_eq!((&v.value[..], v.flags), (&b"v3+cas"[..], 0), "a CAS is a set, with its own flags");
        assert!(before["sem-1"].expires_at > before["sem-2"].expires_at + 3000, "touch moved the expiry");
        let sums = replicas_agree(&c, &[0, 1, 2]).await;
        println!("before the kill, per shard (items, checksum): {sums:?}");
        before
    });
    c.kill(victim);
    rt.block_on(async {
        let client = Client::connect(c.rpc(via)).await.expect("connect");
        let reader = Client::connect_with(c.rpc(via), ClientConfig::default().read_path(ReadPath::OneSided))
            .await
            .expect("connect");
        // The new leader serves the same values, versions, flags and
        // expiries, over RPC and one-sided.
        for k in &keys {
            let got = client.rpc_get(k.as_bytes()).await.expect("get after the kill");
            assert_eq!(got.as_ref(), Some(&before[k]), "{k} after the failover");
            let got = reader.get_versioned(k).await.expect("one-sided get after the kill");
            assert_eq!(got.as_ref(), Some(&before[k]), "{k} read one-sided after the failover");
        }
        assert!(reader.read_stats().gets > 0, "no GET was one-sided: {:?}", reader.read_stats());
        for i in 0..keys.len() {
            assert_eq!(client.incr(format!("n-{i}"), 1).await.expect("incr after the kill"), 8 + i as u64);
        }
        // The version read before the kill wins one CAS, after it.
        let k = &keys[5];
        let v = before[k].version;
        assert!(client.cas(k, "after", v).await.expect("CAS after the failover") > v);
        assert_eq!(code(&client.cas(k, "again", v).await.expect_err("same version twice")), Some(ErrorCode::Exists));
        // Expired by the leaders' clocks, on every path.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(4) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for i in 0..keys.len() {
            let k = format!("short-{i}");
            assert_eq!(client.rpc_get(k.as_bytes()).await.expect("get"), None, "{k} outlived its TTL");
            assert_eq!(reader.get(&k).await.expect("get"), None, "{k} outlived its TTL, read one-sided");
            let add = PutOptions { mode: PutMode::Add, ..Default::default() };
            client.put_with(&k, "again", add).await.expect("add over an expired item");
        }
        let sums = replicas_agree(&c, &survivors).await;
        println!("after the kill, per shard (items, checksum): {sums:?}");
    });
}

#[test]
fn a_cas_race_across_a_leader_kill_keeps_one_winner_per_version() {
    const RACERS: usize = 4;
    let mut c = TestCluster::start(3, 1, 3, false, &[]);
    let rt = rt();
    let map = rt.block_on(c.leaders_known(0));
    let victim = map.shards()[0].leader.expect("a leader") as usize - 1;
    let via = (victim + 1) % 3;
    let client = rt.block_on(Client::connect(c.rpc(via))).expect("connect");
    rt.block_on(client.put("race", "0")).expect("put");
    // Each racer reads the counter and CASes it one up; a win is one step.
    let wins = Arc::new(AtomicU64::new(0));
    let unknown = Arc::new(AtomicU64::new(0));
    let seen_versions = Arc::new(std::sync::Mutex::new(BTreeMap::<u64, String>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let racers: Vec<_> = (0..RACERS)
        .map(|r| {
            let (client, wins, unknown, seen, stop) = (
                client.clone(),
                Arc::clone(&wins),
                Arc::clone(&unknown),
                Arc::clone(&seen_versions),
                Arc::clone(&stop),
            );
            rt.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(Some(cur)) = client.get_versioned("race").await else { continue };
                    let n: u64 = std::str::from_utf8(&cur.value).unwrap().parse().unwrap();
                    match client.cas("race", (n + 1).to_string(), cur.version).await {
                        Ok(_) => {
                            wins.fetch_add(1, Ordering::Relaxed);
                            let mut seen = seen.lock().unwrap();
                            if let Some(other) = seen.insert(cur.version, format!("racer {r}")) {
                                panic!("version {} won twice: {other} and racer {r}", cur.version);
                            }
                        }
                        Err(e) if e.code() == Some(ErrorCode::Exists) || e.code() == Some(ErrorCode::NotFound) => {}
                        Err(_) => {
                            unknown.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        })
        .collect();
    assert!(dmkv_tests::wait_until(Duration::from_secs(60), || wins.load(Ordering::Relaxed) >= 30), "no CAS won");
    c.kill(victim);
    let killed = wins.load(Ordering::Relaxed);
    assert!(
        dmkv_tests::wait_until(Duration::from_secs(60), || wins.load(Ordering::Relaxed) >= killed + 30),
        "no CAS won after the leader was killed"
    );
    stop.store(true, Ordering::Relaxed);
    for r in racers {
        rt.block_on(r).expect("a racer panicked");
    }
    let (wins, unknown) = (wins.load(Ordering::Relaxed), unknown.load(Ordering::Relaxed));
    let value: u64 =
        std::str::from_utf8(&rt.block_on(client.get("race")).expect("get").expect("present")).unwrap().parse().unwrap();
    println!("{wins} CAS wins ({killed} before the kill), {unknown} with no answer; the counter reads {value}");
    // Every acknowledged win is one step; a try with no answer may have
    // won too (its client does not know), but none counts twice.
    assert!(value >= wins && value <= wins + unknown, "{value} steps for {wins} wins and {unknown} unknown");
}

/// `--evict lru` in a cluster: the shard's leader chooses the least
/// recently used items and logs their removal, so a cluster that is sent
/// ten times its memory takes every write, keeps a hot set that is
/// read (one-sided reads reported as on one node) over cold keys written
/// once, every replica holds the same items, and a leader kill does not
/// bring an evicted key back.
#[test]
fn an_evicting_cluster_takes_every_write_keeps_hot_keys_and_stays_alike() {
    let mut c = TestCluster::start(3, 2, 3, false, &["--evict", "lru", "--memory", "8MiB"]);
    let rt = rt();
    rt.block_on(c.leaders_known(0));
    let value = vec![b'x'; 4000];
    let hot: Vec<String> = (0..100).map(|i| format!("hot-{i}")).collect();
    let cold = 21_000;
    let gone: Vec<String> = rt.block_on(async {
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        let reader = Client::connect_with(c.rpc(1), ClientConfig::default().read_path(ReadPath::OneSided))
            .await
            .expect("connect");
        for k in &hot {
            client.put(k, value.clone()).await.expect("hot put");
        }
        // 84 MB of values into 8 MiB of regions on each node (4 MiB per
        // shard replica): ten times the memory.
        for i in 0..cold {
            let k = format!("cold-{i}");
            client.put(&k, value.clone()).await.unwrap_or_else(|e| panic!("{k}: {e} (an evicting cluster refused)"));
            if i % 2 == 0 {
                let h = &hot[(i / 2) % hot.len()];
                let got = reader.get(h).await.expect("hot get");
                assert!(
                    got.is_some_and(|v| v.len() == value.len()),
                    "{h} lost while being read (after {i} cold writes; {:?})",
                    reader.read_stats()
                );
            }
        }
        let mut gone = Vec::new();
        for i in 0..cold {
            let k = format!("cold-{i}");
            if client.get(&k).await.expect("get").is_none() {
                gone.push(k);
            }
        }
        gone
    });
    assert!(gone.len() > cold / 2, "only {} of {cold} cold keys evicted", gone.len());
    let kept = rt.block_on(async {
        let client = Client::connect(c.rpc(2)).await.expect("connect");
        let mut kept = 0;
        for k in &hot {
            kept += usize::from(client.get(k).await.expect("get").is_some());
        }
        kept
    });
    println!("{} of {cold} cold keys evicted; {kept} of {} hot keys kept", gone.len(), hot.len());
    assert!(kept >= 90, "only {kept} of {} hot keys survived", hot.len());
    rt.block_on(replicas_agree(&c, &[0, 1, 2]));
    // A new leader holds the same items: nothing evicted comes back.
    let map = rt.block_on(c.leaders_known(0));
    let victim = map.shards()[0].leader.expect("a leader") as usize - 1;
    c.kill(victim);
    let via = (victim + 1) % 3;
    rt.block_on(c.leaders_known(via));
    rt.block_on(async {
        let client = Client::connect(c.rpc(via)).await.expect("connect");
        for k in gone.iter().step_by(50) {
            assert_eq!(client.get(k).await.expect("get after the kill"), None, "{k} came back after a failover");
        }
    });
}
