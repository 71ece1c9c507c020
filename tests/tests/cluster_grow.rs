//! A cluster that grows and shrinks while clients use it: a spare node is
//! given its share of replicas (`dmkv cluster add-node`), leads a shard
//! and serves its one-sided readers, then is emptied again
//! (`remove-node`). Throughout, a YCSB-B-like load (reads far more than
//! writes) runs through the SDK (a writer, and a reader GETting one-sided
//! over shared memory) and through a memcached port (95 % gets, 5 %
//! sets): every GET is checked against the writes acknowledged before it
//! began, none may fail, and every acknowledged write is read back at the
//! end (docs/elasticity.md, "Adding and removing nodes").

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dmkv_client::{Client, ClientConfig, ReadPath, Transport};
use dmkv_tests::cluster::TestCluster;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

const KEYS: usize = 300;

/// The counter a value was written with (`{n} {key}`).
fn n_of(v: &[u8]) -> u64 {
    let s = std::str::from_utf8(v).expect("utf-8");
    s.split(' ').next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("not a value of this test: {s}"))
}

/// Writes `g-{k}` = `{n} g-{k}` with a growing `n` until `stop`, recording
/// the last acknowledged `n` of each key; a write that failed is counted
/// (the SDK retries within its deadline: none should).
fn writer(seed: String, acked: Arc<Mutex<BTreeMap<usize, u64>>>, stop: Arc<AtomicBool>, failed: Arc<AtomicU64>) {
    rt().block_on(async {
        let client = Client::connect(seed).await.expect("connect");
        let mut n = 1_000u64;
        while !stop.load(Ordering::Relaxed) {
            n += 1;
            let k = (n as usize * 7) % KEYS;
            match client.put(format!("g-{k}"), format!("{n} g-{k}")).await {
                Ok(_) => {
                    acked.lock().unwrap().insert(k, n);
                }
                Err(e) => {
                    eprintln!("put g-{k}: {e}");
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
}

/// GETs every key in turn one-sided (over shared memory) until `stop`,
/// each checked against the writes acknowledged before it began; returns
/// the GETs made. A failed or stale GET fails the test.
fn one_sided_reader(seed: String, acked: Arc<Mutex<BTreeMap<usize, u64>>>, stop: Arc<AtomicBool>) -> u64 {
    rt().block_on(async {
        let cfg = ClientConfig::default().read_path(ReadPath::OneSided).transport(Some(Transport::Shm));
        let client = Client::connect_with(seed, cfg).await.expect("connect");
        let mut gets = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let k = (gets as usize * 13) % KEYS;
            let want = acked.lock().unwrap().get(&k).copied().unwrap_or(0);
            let got = client.get(format!("g-{k}")).await.unwrap_or_else(|e| panic!("one-sided get g-{k}: {e}"));
            let got = n_of(&got.unwrap_or_else(|| panic!("g-{k} missing")));
            assert!(got >= want, "one-sided get g-{k} read {got} after {want} was acknowledged");
            gets += 1;
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
        gets
    })
}

/// Most a memcached client waits for one answer.
const MC_TIMEOUT: Duration = Duration::from_secs(10);
/// Times a memcached command answered SERVER_ERROR (its shard had no
/// leader for a moment: a hand-over) is sent again, 50 ms apart.
const MC_TRIES: usize = 100;

/// 95 % gets and 5 % sets of `mc-{k}` on a memcached port until `stop`,
/// every get checked against the sets acknowledged before it; a command
/// answered SERVER_ERROR is sent again (as a client retries a retryable
/// error), anything else fails the test. Returns (commands, sent again).
fn memcached_load(port: u16, stop: Arc<AtomicBool>, acked: Arc<Mutex<BTreeMap<usize, u64>>>) -> (u64, u64) {
    let s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the memcached port");
    s.set_read_timeout(Some(MC_TIMEOUT)).unwrap();
    let mut s = BufReader::new(s);
    let line = |s: &mut BufReader<TcpStream>| {
        let mut l = String::new();
        s.read_line(&mut l).expect("a memcached answer");
        l
    };
    let (mut n, mut again) = (0u64, 0u64);
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let k = (n as usize * 7) % KEYS;
        for attempt in 0.. {
            assert!(attempt < MC_TRIES, "mc-{k}: SERVER_ERROR {MC_TRIES} times");
            if n.is_multiple_of(20) {
                let v = format!("{n} mc-{k}");
                s.get_mut().write_all(format!("set mc-{k} 0 0 {}\r\n{v}\r\n", v.len()).as_bytes()).unwrap();
                let got = line(&mut s);
                if got.starts_with("SERVER_ERROR") {
                    again += 1;
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                assert_eq!(got, "STORED\r\n", "set mc-{k}");
                acked.lock().unwrap().insert(k, n);
            } else {
                let want = acked.lock().unwrap().get(&k).copied().unwrap_or(0);
                s.get_mut().write_all(format!("get mc-{k}\r\n").as_bytes()).unwrap();
                let first = line(&mut s);
                if first.starts_with("SERVER_ERROR") {
                    again += 1;
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
                if first.starts_with("VALUE ") {
                    let got = n_of(line(&mut s).trim_end().as_bytes());
                    assert_eq!(line(&mut s), "END\r\n");
                    assert!(got >= want, "memcached get mc-{k} read {got} after {want} was acknowledged");
                } else {
                    assert_eq!(first, "END\r\n", "get mc-{k}");
                    assert_eq!(want, 0, "memcached get mc-{k} found nothing after {want} was acknowledged");
                }
            }
            break;
        }
    }
    (n, again)
}

/// Reads every key through `client` and checks each is at least as new as
/// its last acknowledged write before the read began.
async fn check_all(client: &Client, acked: &Mutex<BTreeMap<usize, u64>>, what: &str) {
    let before = acked.lock().unwrap().clone();
    for k in 0..KEYS {
        let got = client.get(format!("g-{k}")).await.unwrap_or_else(|e| panic!("{what}: get g-{k}: {e}"));
        let got = got.unwrap_or_else(|| panic!("{what}: g-{k} is missing"));
        let want = before.get(&k).copied().unwrap_or(0);
        assert!(n_of(&got) >= want, "{what}: g-{k} read {} after {want} was acknowledged", n_of(&got));
    }
}

/// Node 4's replicas as it reports them: (shard, voters).
async fn local_of(c: &TestCluster, i: usize) -> Vec<(u32, usize)> {
    let s = Client::connect(c.rpc(i)).await.expect("connect").cluster_status().await.expect("status");
    s.local
        .iter()
        .filter(|l| l.shard != dmkv_common::cluster::map::META_SHARD)
        .map(|l| (l.shard, l.voters.len()))
        .collect()
}

#[test]
fn a_spare_takes_its_share_of_replicas_serves_them_and_gives_them_back() {
    let c = TestCluster::start_with_spares(3, 1, 3, 3, false, &["--memcached-listen", "127.0.0.1:0"]);
    let rt = rt();
    let acked: Arc<Mutex<BTreeMap<usize, u64>>> = Arc::default();
    let mc_acked: Arc<Mutex<BTreeMap<usize, u64>>> = Arc::default();
    rt.block_on(async {
        c.leaders_known(0).await;
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        for k in 0..KEYS {
            client.put(format!("g-{k}"), format!("{k} g-{k}")).await.expect("put");
            acked.lock().unwrap().insert(k, k as u64);
        }
    });
    let (stop, failed) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let w = {
        let (seed, acked, stop, failed) =
            (c.rpc(1).to_string(), Arc::clone(&acked), Arc::clone(&stop), Arc::clone(&failed));
        std::thread::spawn(move || writer(seed, acked, stop, failed))
    };
    let reader = {
        let (seed, acked, stop) = (c.rpc(2).to_string(), Arc::clone(&acked), Arc::clone(&stop));
        std::thread::spawn(move || one_sided_reader(seed, acked, stop))
    };
    let mc = {
        let port = c.endpoint(1, "memcached").expect("a memcached port").rsplit(':').next().unwrap().parse().unwrap();
        let (stop, acked) = (Arc::clone(&stop), Arc::clone(&mc_acked));
        std::thread::spawn(move || memcached_load(port, stop, acked))
    };

    let (ok, out) = c.cli(0, &["cluster", "add-node", "4"]);
    assert!(ok, "add-node: {out}");
    println!("{out}");
    // Leaders spread over the new node too.
    let (ok, out) = c.cli(0, &["cluster", "rebalance"]);
    assert!(ok, "rebalance: {out}");
    println!("{out}");
    let placed = rt.block_on(async {
        // Nodes learn the map within a poll: asked until node 1's is the
        // one add-node wrote last.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let local = local_of(&c, 3).await;
            let map = Client::connect(c.rpc(0)).await.expect("connect").cluster_map().await.expect("map");
            let spread = map.shards().iter().all(|sh| {
                let mut nodes = sh.replicas.clone();
                nodes.sort_unstable();
                nodes.dedup();
                nodes.len() == 3 && sh.replicas.len() == 3
            });
            if local.len() == 2 && local.iter().all(|&(_, voters)| voters == 3) && spread {
                break local[0].0;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "9 replicas over 4 nodes: the new one holds 2, every shard 3 on distinct nodes: node 4 has \
                 {local:?}, the map {:?}",
                map.shards().iter().map(|s| &s.replicas).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    // The new node leads one of its shards and serves its one-sided readers.
    let (ok, out) = c.cli(0, &["cluster", "transfer-leader", "--shard", &placed.to_string(), "--to", "4"]);
    assert!(ok, "transfer-leader: {out}");
    rt.block_on(async {
        let reader = ClientConfig::default().read_path(ReadPath::OneSided).transport(Some(Transport::Shm));
        let reader = Client::connect_with(c.rpc(3), reader).await.expect("connect");
        let map = reader.cluster_map().await.expect("map");
        let before = reader.read_stats();
        let mut on_new = 0;
        for _ in 0..2 {
            check_all(&reader, &acked, "after add-node").await;
            on_new = (0..KEYS).filter(|k| map.shard_of(format!("g-{k}").as_bytes()).id == placed).count();
        }
        let rs = reader.read_stats();
        println!("one-sided reader after add-node: {rs:?}");
        // Two rounds of `on_new` keys whose shard node 4 leads: read from its
        // region, not over RPC (a few may be, while its first lease starts).
        assert!(on_new > 0);
        assert!(rs.rpc_gets - before.rpc_gets < on_new as u64 / 2, "node 4's region was not read one-sided: {rs:?}");
    });

    let (ok, out) = c.cli(0, &["cluster", "remove-node", "4"]);
    assert!(ok, "remove-node: {out}");
    println!("{out}");
    rt.block_on(async {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !local_of(&c, 3).await.is_empty() {
            assert!(std::time::Instant::now() < deadline, "node 4 still holds {:?}", local_of(&c, 3).await);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    stop.store(true, Ordering::Relaxed);
    w.join().expect("the writer");
    let gets = reader.join().expect("the one-sided reader");
    let (mc_commands, mc_again) = mc.join().expect("the memcached client");
    println!("{gets} one-sided GETs; {mc_commands} memcached commands ({mc_again} sent again after SERVER_ERROR)");
    assert!(gets > 0 && mc_commands > 0);
    rt.block_on(async {
        let client = Client::connect(c.rpc(2)).await.expect("connect");
        check_all(&client, &acked, "after remove-node").await;
        let mc_acked = mc_acked.lock().unwrap().clone();
        for (k, n) in &mc_acked {
            let got = client.get(format!("mc-{k}")).await.expect("get").expect("an acknowledged set");
            assert!(n_of(&got) >= *n, "mc-{k} read {} after {n} was acknowledged", n_of(&got));
        }
    });
    assert_eq!(failed.load(Ordering::Relaxed), 0, "writes failed while the replicas moved");
}

/// Node index `i`'s data shards' replicas, once they settled: each with
/// `voters` voters, none a learner (asked for up to 20 s).
async fn settled_local(c: &TestCluster, i: usize, want: usize) -> Vec<u32> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let got = local_of(c, i).await;
        if got.len() == want && got.iter().all(|&(_, v)| v == 3) {
            return got.iter().map(|&(s, _)| s).collect();
        }
        assert!(std::time::Instant::now() < deadline, "node {} holds {got:?}, not {want} settled replicas", i + 1);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn nodes_that_gained_and_lost_replicas_restart_from_their_logs() {
    let mut c = TestCluster::start_with_spares(3, 1, 3, 3, true, &[]);
    let rt = rt();
    rt.block_on(async {
        c.leaders_known(0).await;
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        for k in 0..KEYS {
            client.put(format!("g-{k}"), format!("{k} g-{k}")).await.expect("put");
        }
    });
    let (ok, out) = c.cli(0, &["cluster", "add-node", "4"]);
    assert!(ok, "add-node: {out}");
    let gained = rt.block_on(settled_local(&c, 3, 2));
    // Node 1 gave one of its replicas to node 4 (the plan takes from the
    // fullest, lowest id first).
    let kept = rt.block_on(settled_local(&c, 0, 2));
    // Both restart from their logs: node 4 reopens the replicas it gained
    // (the cluster file places none on it), node 1 does not keep the one
    // it gave away (the file still places it there).
    for i in [3, 0] {
        c.kill(i);
        c.restart(i);
    }
    rt.block_on(async {
        assert_eq!(settled_local(&c, 3, 2).await, gained, "node 4 after its restart");
        assert_eq!(settled_local(&c, 0, 2).await, kept, "node 1 after its restart");
        for i in 0..4 {
            let client = Client::connect(c.rpc(i)).await.expect("connect");
            client.put(format!("after-{i}"), "x").await.expect("put after the restarts");
        }
        let client = Client::connect(c.rpc(3)).await.expect("connect");
        for k in 0..KEYS {
            let got = client.get(format!("g-{k}")).await.expect("get").expect("every key is there");
            assert_eq!(n_of(&got), k as u64);
        }
    });
    // Node 4 goes down and is removed (the leaders take its replicas out);
    // back up, it is added again: its logs of those shards name members
    // the shards no longer count, so its replicas join anew instead of
    // coming back as voters no one talks to.
    c.kill(3);
    let (ok, out) = c.cli(0, &["cluster", "remove-node", "4"]);
    assert!(ok, "remove-node of a node that is down: {out}");
    c.restart(3);
    let (ok, out) = c.cli(0, &["cluster", "add-node", "4"]);
    assert!(ok, "add-node again: {out}");
    rt.block_on(async {
        assert_eq!(settled_local(&c, 3, 2).await, gained, "node 4 added again");
        for s in &gained {
            assert!(joined(&c, 3, *s).await, "node 4's replica of shard {s} is not counted by its leader");
        }
    });
}

/// Whether node index `i`'s replica of `shard` is a voter as the shard's
/// leader counts them, its node's older ones gone (three voters on three
/// nodes) and no learner left.
async fn joined(c: &TestCluster, i: usize, shard: u32) -> bool {
    let Ok(client) = Client::connect(c.rpc(i)).await else { return false };
    let Ok(s) = client.cluster_status().await else { return false };
    let Some(mine) = s.local.iter().find(|l| l.shard == shard).map(|l| l.replica_id) else { return false };
    for j in 0..c.len() {
        let Ok(client) = Client::connect(c.rpc(j)).await else { continue };
        let Ok(s) = client.cluster_status().await else { continue };
        if let Some(l) = s.local.iter().find(|l| l.shard == shard && l.role == "leader") {
            let nodes: std::collections::BTreeSet<u64> = l.voters.iter().map(|v| v >> 32).collect();
            return l.voters.contains(&mine) && l.learners.is_empty() && l.voters.len() == 3 && nodes.len() == 3;
        }
    }
    false
}

#[test]
fn an_in_memory_node_restarted_rejoins_a_shard_led_from_a_node_placed_later() {
    let mut c = TestCluster::start_with_spares(3, 1, 3, 3, false, &[]);
    let rt = rt();
    rt.block_on(c.leaders_known(0));
    let (ok, out) = c.cli(0, &["cluster", "add-node", "4"]);
    assert!(ok, "add-node: {out}");
    let on_new = rt.block_on(settled_local(&c, 3, 2));
    // A shard node 4 holds and node 2 too: node 4 leads it, and node 2
    // (in memory) restarts, its replica a new member to be. The cluster
    // file names neither node 4 nor the leader: it finds the leader from
    // the map.
    let kept_by_2 = rt.block_on(settled_local(&c, 1, 2));
    let shard = *on_new.iter().find(|s| kept_by_2.contains(s)).expect("a shard on nodes 2 and 4");
    let (ok, out) = c.cli(0, &["cluster", "transfer-leader", "--shard", &shard.to_string(), "--to", "4"]);
    assert!(ok, "transfer-leader: {out}");
    c.kill(1);
    c.restart(1);
    rt.block_on(async {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !joined(&c, 1, shard).await {
            assert!(std::time::Instant::now() < deadline, "node 2's new replica of shard {shard} never joined");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    // Node 4 goes down for good and is removed all the same: the leaders
    // take its replicas out, since it cannot ask.
    c.kill(3);
    let (ok, out) = c.cli(0, &["cluster", "remove-node", "4"]);
    assert!(ok, "remove-node of a node that is down: {out}");
    rt.block_on(async {
        for i in 0..3 {
            settled_local(&c, i, 3).await;
        }
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        for k in 0..KEYS {
            client.put(format!("g-{k}"), format!("{k} g-{k}")).await.expect("put after node 4 went");
        }
    });
}
