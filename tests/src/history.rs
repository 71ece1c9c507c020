//! Recorded histories of PUTs and GETs against one shard of a test
//! cluster while a fault hits its leader, and their check for
//! linearizability.
//!
//! A writer PUTs unique values (its operation counter) over RPC; readers
//! GET one-sided (shared memory, the TCP engine) or over RPC. Every
//! invocation and return is logged under one lock at the moment it
//! happens, so the log respects real time. Each client runs one operation
//! at a time; one that failed (no answer: it may or may not have taken
//! effect) stays open in the history and the client goes on under a new
//! thread id. Each key's history is then checked: first for a read of a
//! value overwritten before the read began ([`stale_read`]), then with
//! stateright's linearizability tester.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dmkv_client::{Client, ClientConfig, ReadPath, Transport};
use dmkv_common::cluster::map::ShardId;
use stateright::semantics::register::{Register, RegisterOp, RegisterRet};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester};

use crate::cluster::TestCluster;

/// One entry of a history: thread, key, operation or its result.
#[derive(Debug, Clone)]
pub enum Event {
    Invoke(usize, String, RegisterOp<u64>),
    Return(usize, String, RegisterRet<u64>),
}

/// How long the recording runs before the fault and after it ends.
pub const BEFORE_FAULT: Duration = Duration::from_millis(300);
pub const AFTER_FAULT: Duration = Duration::from_millis(500);

/// Puts until acknowledged (a write whose reply was lost is sent again:
/// the same value, so applying it twice is harmless); bounded to 20 s.
pub async fn put_surely(c: &Client, key: &str, value: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match c.put(key, value).await {
            Ok(_) => return,
            Err(e) => assert!(Instant::now() < deadline, "PUT {key} failed for 20 s: {e}"),
        }
    }
}

/// The settings of every client of a recorded run: requests given up
/// after 1.5 s (a try per node after a quarter of that), connections after
/// 500 ms, so that an operation caught by a fault stays open a bounded time.
pub fn client_config(read_path: ReadPath, transport: Option<Transport>, check_leases: bool) -> ClientConfig {
    ClientConfig {
        read_path,
        transport,
        request_timeout: Duration::from_millis(1500),
        connect_timeout: Duration::from_millis(500),
        check_leases,
        ..Default::default()
    }
}

/// The clients of a recorded run.
pub struct Clients {
    /// Keys of the shard, each PUT once ("0") before the run.
    pub keys: Vec<String>,
    pub writer: Client,
    /// Readers, each attached (one GET of every key) before the run.
    pub readers: Vec<Reader>,
}

/// A reader and the runtime it runs on: the runtime's threads make its
/// sockets (which packet rules may tell apart by their threads' group,
/// see [`crate::partition`]).
pub struct Reader {
    pub client: Client,
    pub runtime: tokio::runtime::Handle,
}

impl Clients {
    /// Connects a writer (RPC) and readers of `paths` through node index
    /// `via`, all with `check_leases`, on the current runtime; PUTs `keys`
    /// keys of `shard` and has every reader GET each once, so one-sided
    /// readers are attached to the shard leader's region when the run
    /// starts.
    pub async fn connect(
        c: &TestCluster,
        via: usize,
        shard: ShardId,
        keys: usize,
        check_leases: bool,
        paths: &[(ReadPath, Option<Transport>)],
    ) -> Clients {
        let writer =
            Client::connect_with(c.rpc(via), client_config(ReadPath::Rpc, None, check_leases)).await.expect("connect");
        let map = writer.cluster_map().await.expect("map");
        let keys: Vec<String> =
            (0..).map(|i| format!("h-{i}")).filter(|k| map.shard_of(k.as_bytes()).id == shard).take(keys).collect();
        for k in &keys {
            put_surely(&writer, k, "0").await;
        }
        let readers = connect_readers(c.rpc(via).to_string(), keys.clone(), check_leases, paths.to_vec()).await;
        let runtime = tokio::runtime::Handle::current();
        let readers = readers.into_iter().map(|client| Reader { client, runtime: runtime.clone() }).collect();
        Clients { keys, writer, readers }
    }

    /// Adds readers of `paths` connected through node index `via`, made,
    /// attached and run on `rt`'s worker threads (not the caller's).
    pub fn add_readers(
        &mut self,
        rt: &tokio::runtime::Runtime,
        c: &TestCluster,
        via: usize,
        check_leases: bool,
        paths: &[(ReadPath, Option<Transport>)],
    ) {
        let made = rt.spawn(connect_readers(c.rpc(via).to_string(), self.keys.clone(), check_leases, paths.to_vec()));
        let readers = rt.block_on(made).expect("connecting readers");
        self.readers.extend(readers.into_iter().map(|client| Reader { client, runtime: rt.handle().clone() }));
    }
}

async fn connect_readers(
    via: String,
    keys: Vec<String>,
    check_leases: bool,
    paths: Vec<(ReadPath, Option<Transport>)>,
) -> Vec<Client> {
    let mut readers = Vec::new();
    for (path, t) in paths {
        readers.push(Client::connect_with(&via, client_config(path, t, check_leases)).await.expect("connect"));
    }
    for r in &readers {
        for k in &keys {
            r.get(k).await.expect("get");
        }
    }
    readers
}

/// What one recorded run saw.
#[derive(Debug)]
pub struct Run {
    /// Every key's history was linearizable.
    pub linearizable: bool,
    /// A history that was not (for the failure message).
    pub counterexample: String,
    /// GETs the readers answered one-sided, and batches they refused for
    /// want of a lease.
    pub one_sided_gets: u64,
    pub unleased: u64,
    /// Acknowledged PUTs, in all and from the fault's start on.
    pub writes: u64,
    pub writes_since_fault: u64,
    /// Answered GETs.
    pub reads: u64,
}

/// Runs the clients for [`BEFORE_FAULT`], then `fault` (which returns
/// once the fault is over), then [`AFTER_FAULT`] more; stops them and
/// checks the history on a thread with a deep stack (the tester searches
/// recursively).
pub fn record(rt: &tokio::runtime::Runtime, clients: Clients, fault: impl FnOnce()) -> Run {
    let Clients { keys, writer, readers } = clients;
    let log: Arc<Mutex<Vec<Event>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let next_thread = Arc::new(AtomicU64::new(0));
    let spawn_client = |on: &tokio::runtime::Handle, client: Client, writes: bool| {
        let (log, stop, next_thread, keys) =
            (Arc::clone(&log), Arc::clone(&stop), Arc::clone(&next_thread), keys.clone());
        on.spawn(async move {
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
    let mut tasks = vec![spawn_client(rt.handle(), writer, true)];
    for r in &readers {
        tasks.push(spawn_client(&r.runtime, r.client.clone(), false));
    }
    std::thread::sleep(BEFORE_FAULT);
    let fault_at = log.lock().unwrap().len();
    fault();
    std::thread::sleep(AFTER_FAULT);
    stop.store(true, Ordering::Relaxed);
    let (mut writes, mut reads) = (0, 0);
    for t in tasks {
        let (w, r) = rt.block_on(t).expect("client task");
        writes += w;
        reads += r;
    }
    let log = log.lock().unwrap().clone();
    let writes_since_fault =
        log[fault_at..].iter().filter(|e| matches!(e, Event::Return(_, _, RegisterRet::WriteOk))).count() as u64;
    let stats: Vec<_> = readers.iter().map(|r| r.client.read_stats()).collect();
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
        writes_since_fault,
        reads,
    }
}

/// A read that returned a value overwritten before it began: write W of
/// v returned, then a write W' started and returned, then the read started
/// and returned v. No linearization exists (W' must follow W and precede
/// the read). A quick, certain proof of a violation, where the full search
/// can take very long to exhaust.
pub fn stale_read(log: &[Event]) -> Option<String> {
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

/// Whether every key's history is linearizable (each key a register
/// starting at 0); if not, why not.
pub fn check(keys: &[String], log: &[Event]) -> (bool, String) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn w(t: usize, v: u64) -> [Event; 2] {
        [Event::Invoke(t, "k".into(), RegisterOp::Write(v)), Event::Return(t, "k".into(), RegisterRet::WriteOk)]
    }

    fn r(t: usize, v: u64) -> [Event; 2] {
        [Event::Invoke(t, "k".into(), RegisterOp::Read), Event::Return(t, "k".into(), RegisterRet::ReadOk(v))]
    }

    #[test]
    fn a_read_of_an_overwritten_value_is_caught() {
        let keys = ["k".to_string()];
        let fresh: Vec<Event> = [w(0, 1), w(0, 2), r(1, 2)].concat();
        assert!(stale_read(&fresh).is_none());
        assert!(check(&keys, &fresh).0);
        let stale: Vec<Event> = [w(0, 1), w(0, 2), r(1, 1)].concat();
        assert!(stale_read(&stale).is_some_and(|why| why.contains("returned 1, overwritten by 2")));
        assert!(!check(&keys, &stale).0);
        // Only the full search sees this one: 1 then 0 read after both
        // writes' invocations, the second write still open.
        let open: Vec<Event> =
            [vec![Event::Invoke(0, "k".into(), RegisterOp::Write(1))], r(1, 1).to_vec(), r(2, 0).to_vec()].concat();
        assert!(stale_read(&open).is_none());
        assert!(!check(&keys, &open).0);
    }
}
