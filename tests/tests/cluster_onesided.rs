//! One-sided GETs in a cluster of real dmkvd processes: readers read each
//! shard leader's region directly (shared memory and the TCP engine) and
//! stay linearizable when the leader changes, because they believe a
//! region only under the lease its header publishes.
//!
//! The stalled-leader test freezes a shard leader with SIGSTOP: its memory
//! stays mapped by same-host readers while the others elect a new leader
//! and take writes. A reader that believed the frozen region would return
//! values overwritten long before; the recorded history (PUTs, one-sided
//! and RPC GETs) is checked for linearizability with stateright's tester,
//! once with the lease check (must pass) and once without (must fail).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dmkv_client::{Client, ClientConfig, ReadPath, Transport};
use dmkv_tests::cluster::TestCluster;
use stateright::semantics::register::{Register, RegisterOp, RegisterRet};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

fn reader_config(t: Transport) -> ClientConfig {
    ClientConfig { read_path: ReadPath::OneSided, transport: Some(t), ..Default::default() }
}

/// Puts until acknowledged (a write whose reply was lost is sent again:
/// the same value, so applying it twice is harmless).
async fn put_surely(c: &Client, key: &str, value: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match c.put(key, value).await {
            Ok(_) => return,
            Err(e) => assert!(Instant::now() < deadline, "PUT {key} failed for 20 s: {e}"),
        }
    }
}

#[test]
fn one_sided_gets_read_shard_leaders_and_follow_a_failover() {
    let mut c = TestCluster::start(3, 6, 3, false, &[]);
    let rt = rt();
    rt.block_on(async {
        let map = c.leaders_known(0).await;
        let victim = map.shards()[0].leader.expect("a leader") as usize - 1;
        let via = (victim + 1) % 3;
        let writer = Client::connect(c.rpc(via)).await.expect("connect");
        let keys: Vec<String> = (0..200).map(|i| format!("os-{i}")).collect();
        for k in &keys {
            put_surely(&writer, k, &format!("one {k}")).await;
        }
        let readers = [
            ("shm", Client::connect_with(c.rpc(via), reader_config(Transport::Shm)).await.expect("connect")),
            ("tcp", Client::connect_with(c.rpc(via), reader_config(Transport::Tcp)).await.expect("connect")),
        ];
        for (name, r) in &readers {
            for _ in 0..2 {
                for k in &keys {
                    assert_eq!(r.get(k).await.expect("get").as_deref(), Some(format!("one {k}").as_bytes()), "{name}");
                }
            }
            let got = r.multi_get(&keys).await.expect("multi-get");
            assert!(got.iter().zip(&keys).all(|(v, k)| v.as_deref() == Some(format!("one {k}").as_bytes())));
            let rs = r.read_stats();
            println!("{name} before the failover: {rs:?}");
            assert!(rs.gets >= 2 * keys.len() as u64, "{name}: GETs went over RPC: {rs:?}");
        }
        // The leader of shard 0 dies; writes move to new leaders.
        c.kill(victim);
        for k in &keys {
            put_surely(&writer, k, &format!("two {k}")).await;
        }
        for (name, r) in &readers {
            let before = r.read_stats();
            for k in &keys {
                assert_eq!(r.get(k).await.expect("get").as_deref(), Some(format!("two {k}").as_bytes()), "{name}");
            }
            let rs = r.read_stats();
            println!("{name} after the failover: {rs:?}");
            assert!(rs.gets - before.gets >= keys.len() as u64 / 2, "{name}: new leaders' regions unused: {rs:?}");
        }
    });
}

#[derive(Debug, Clone)]
enum Event {
    Invoke(usize, String, RegisterOp<u64>),
    Return(usize, String, RegisterRet<u64>),
}

/// What one run of the stalled-leader scenario saw.
struct Run {
    /// Every key's history was linearizable.
    linearizable: bool,
    /// A history that was not (for the failure message).
    counterexample: String,
    one_sided_gets: u64,
    unleased: u64,
    writes: u64,
    reads: u64,
}

/// Freezes the leader of a shard for longer than an election while a
/// writer overwrites that shard's keys (through the new leader) and
/// readers read them one-sided (shared memory, routed to the frozen
/// leader) and over RPC; checks each key's history.
fn stalled_leader_run(check_leases: bool) -> Run {
    const KEYS: usize = 6;
    let c = TestCluster::start(3, 3, 3, false, &[]);
    let rt = rt();
    let map = rt.block_on(c.leaders_known(0));
    let shard = 1;
    let stalled = map.shards()[shard as usize].leader.expect("a leader") as usize - 1;
    let via = (stalled + 1) % 3;
    let keys: Vec<String> =
        (0..).map(|i| format!("st-{i}")).filter(|k| map.shard_of(k.as_bytes()).id == shard).take(KEYS).collect();
    let log: Arc<Mutex<Vec<Event>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let next_thread = Arc::new(AtomicU64::new(0));
    let cfg = |path, t| ClientConfig {
        read_path: path,
        transport: t,
        request_timeout: Duration::from_millis(1500),
        check_leases,
        ..Default::default()
    };
    let (writer, readers) = rt.block_on(async {
        let w = Client::connect_with(c.rpc(via), cfg(ReadPath::Rpc, None)).await.expect("connect");
        for k in &keys {
            put_surely(&w, k, "0").await;
        }
        let mut rs = Vec::new();
        for _ in 0..2 {
            rs.push(Client::connect_with(c.rpc(via), cfg(ReadPath::OneSided, Some(Transport::Shm))).await.unwrap());
        }
        rs.push(Client::connect_with(c.rpc(via), cfg(ReadPath::Rpc, None)).await.unwrap());
        // Attached to the leader's region, every key read once.
        for r in &rs {
            for k in &keys {
                r.get(k).await.expect("get");
            }
        }
        (w, rs)
    });
    let record = |e: Event| log.lock().unwrap().push(e);
    // Each client's operations run one at a time; one that failed (no
    // answer: it may or may not have taken effect) stays open in the
    // history, and the client goes on under a new thread id.
    let spawn_client = |client: Client, writes: bool| {
        let (log, stop, next_thread, keys) =
            (Arc::clone(&log), Arc::clone(&stop), Arc::clone(&next_thread), keys.clone());
        rt.spawn(async move {
            let record = |e: Event| log.lock().unwrap().push(e);
            let mut t = next_thread.fetch_add(1, Ordering::Relaxed) as usize;
            let mut i = 0u64;
            let (mut done_w, mut done_r) = (0u64, 0u64);
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let key = keys[i as usize % keys.len()].clone();
                if writes {
                    let v = i;
                    record(Event::Invoke(t, key.clone(), RegisterOp::Write(v)));
                    match client.put(&key, v.to_string()).await {
                        Ok(_) => {
                            record(Event::Return(t, key, RegisterRet::WriteOk));
                            done_w += 1;
                        }
                        Err(_) => t = next_thread.fetch_add(1, Ordering::Relaxed) as usize,
                    }
                } else {
                    // Paced: the full linearizability search grows with
                    // the history.
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    record(Event::Invoke(t, key.clone(), RegisterOp::Read));
                    match client.get(&key).await {
                        Ok(v) => {
                            let v = v.map_or(u64::MAX, |b| std::str::from_utf8(&b).unwrap().parse().unwrap());
                            record(Event::Return(t, key, RegisterRet::ReadOk(v)));
                            done_r += 1;
                        }
                        Err(_) => t = next_thread.fetch_add(1, Ordering::Relaxed) as usize,
                    }
                }
            }
            (done_w, done_r)
        })
    };
    let _ = record;
    let mut tasks = vec![spawn_client(writer, true)];
    for r in &readers {
        tasks.push(spawn_client(r.clone(), false));
    }
    std::thread::sleep(Duration::from_millis(300));
    c.pause(stalled);
    // Well past an election (150-300 ms) and the leader's lease.
    std::thread::sleep(Duration::from_millis(1500));
    c.resume(stalled);
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let (mut writes, mut reads) = (0, 0);
    for t in tasks {
        let (w, r) = rt.block_on(t).expect("client task");
        writes += w;
        reads += r;
    }
    let log = log.lock().unwrap().clone();
    let stats: Vec<_> = readers.iter().map(|r| r.read_stats()).collect();
    // The tester searches recursively: long histories need a deep stack.
    let (linearizable, counterexample) = std::thread::Builder::new()
        .stack_size(1 << 30)
        .spawn(move || check(&keys, &log))
        .expect("checker thread")
        .join()
        .expect("checker");
    Run {
        linearizable,
        counterexample,
        one_sided_gets: stats.iter().map(|s| s.gets).sum(),
        unleased: stats.iter().map(|s| s.unleased).sum(),
        writes,
        reads,
    }
}

/// A read that returned a value overwritten before it began: write W of
/// v returned, then a write W' started and returned, then the read started
/// and returned v. No linearization exists (W' must follow W and precede
/// the read). A quick, certain proof of a violation, where the full search
/// can take very long to exhaust.
fn stale_read(log: &[Event]) -> Option<String> {
    // Per key: each write's value → (invoked at, returned at) positions.
    let mut writes: BTreeMap<(String, u64), (usize, Option<usize>)> = BTreeMap::new();
    let mut open: BTreeMap<usize, (String, RegisterOp<u64>, usize)> = BTreeMap::new();
    let mut reads = Vec::new();
    for (at, e) in log.iter().enumerate() {
        match e {
            Event::Invoke(t, k, op) => {
                if let RegisterOp::Write(v) = op {
                    writes.insert((k.clone(), *v), (at, None));
                }
                open.insert(*t, (k.clone(), op.clone(), at));
            }
            Event::Return(t, k, ret) => {
                let (_, op, inv) = open.remove(t).expect("a return follows its invoke");
                match (op, ret) {
                    (RegisterOp::Write(v), _) => writes.get_mut(&(k.clone(), v)).expect("invoked").1 = Some(at),
                    (RegisterOp::Read, RegisterRet::ReadOk(v)) => reads.push((k.clone(), *v, inv, at)),
                    _ => {}
                }
            }
        }
    }
    for (k, v, inv, _) in reads {
        // The value's write returned at `w_ret` (the initial 0 "returned"
        // before the history).
        let w_ret = if v == 0 { Some(0) } else { writes.get(&(k.clone(), v)).and_then(|w| w.1) };
        let Some(w_ret) = w_ret else { continue };
        let newer = writes
            .iter()
            .find(|((k2, v2), (i2, r2))| *k2 == k && *v2 != v && *i2 > w_ret && r2.is_some_and(|r| r < inv));
        if let Some(((_, v2), _)) = newer {
            return Some(format!("key {k}: a read invoked at event {inv} returned {v}, overwritten by {v2} before"));
        }
    }
    None
}

/// Whether every key's history is linearizable; if not, why not.
fn check(keys: &[String], log: &[Event]) -> (bool, String) {
    if let Some(why) = stale_read(log) {
        return (false, why);
    }
    let mut testers: BTreeMap<String, LinearizabilityTester<usize, Register<u64>>> =
        keys.iter().map(|k| (k.clone(), LinearizabilityTester::new(Register(0u64)))).collect();
    for e in log {
        match e.clone() {
            Event::Invoke(t, k, op) => testers.get_mut(&k).unwrap().on_invoke(t, op).map(|_| ()),
            Event::Return(t, k, ret) => testers.get_mut(&k).unwrap().on_return(t, ret).map(|_| ()),
        }
        .expect("well-formed history");
    }
    let bad = testers.iter().find(|(_, t)| !t.is_consistent()).map(|(k, _)| k.clone());
    let counterexample = bad
        .clone()
        .map(|k| {
            let h: Vec<String> = log
                .iter()
                .filter(|e| matches!(e, Event::Invoke(_, x, _) | Event::Return(_, x, _) if *x == k))
                .map(|e| format!("{e:?}"))
                .collect();
            format!("key {k}:\n{}", h.join("\n"))
        })
        .unwrap_or_default();
    (bad.is_none(), counterexample)
}

#[test]
fn reads_of_a_stalled_leaders_region_stay_linearizable() {
    let run = stalled_leader_run(true);
    println!(
        "lease check on: {} writes, {} reads ({} one-sided), {} batches refused for want of a lease",
        run.writes, run.reads, run.one_sided_gets, run.unleased
    );
    assert!(run.linearizable, "history is not linearizable:\n{}", run.counterexample);
    assert!(run.one_sided_gets > 0 && run.unleased > 0, "the readers did not meet the lapsed lease");
    assert!(run.writes > 0, "no write was acknowledged");
}

#[test]
fn without_the_lease_check_a_stalled_leaders_region_reads_stale() {
    let run = stalled_leader_run(false);
    println!(
        "lease check off: {} writes, {} reads ({} one-sided); linearizable: {}",
        run.writes, run.reads, run.one_sided_gets, run.linearizable
    );
    assert!(!run.linearizable, "the scenario no longer tells a checked reader from an unchecked one");
}
