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

/// DELETEs `key` until an answer comes, for at most 20 s (as
/// [`put_surely`]); whether it was there, if the first answer said so (a
/// try whose answer was lost may have deleted it: the next says absent).
pub async fn delete_surely(c: &Client, key: &str) -> Option<bool> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut tried = false;
    loop {
        match c.delete(key).await {
            Ok(found) => return (!tried || found).then_some(found),
            Err(e) => assert!(Instant::now() < deadline, "DELETE {key} failed for 20 s: {e}"),
        }
        tried = true;
    }
}

/// How long a recorded client waits for a request (every try of it
/// within; a try per node after a quarter of that) before giving up.
pub const REQUEST_TIMEOUT: Duration = Duration::from_millis(1500);
/// How long a recorded client waits for a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// The settings of every client of a recorded run (and of the fault
/// suite's: this is the one place they are made): requests given up
/// after [`REQUEST_TIMEOUT`], connections after [`CONNECT_TIMEOUT`], so
/// that an operation caught by a fault stays open a bounded time.
pub fn client_config(read_path: ReadPath, transport: Option<Transport>, check_leases: bool) -> ClientConfig {
    ClientConfig::default()
        .read_path(read_path)
        .transport(transport)
        .request_timeout(REQUEST_TIMEOUT)
        .connect_timeout(CONNECT_TIMEOUT)
        .testing_leases(check_leases)
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

    /// [`Clients::connect`] for the keys given (of any shards).
    pub async fn connect_keys(
        c: &TestCluster,
        via: usize,
        keys: Vec<String>,
        check_leases: bool,
        paths: &[(ReadPath, Option<Transport>)],
    ) -> Clients {
        let writer =
            Client::connect_with(c.rpc(via), client_config(ReadPath::Rpc, None, check_leases)).await.expect("connect");
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
    // Warmed up (maps, sessions, attaches) before the recording starts;
    // asked again past a request's deadline: in the emulated RDMA VM a
    // shard can be without a leader for longer.
    for r in &readers {
        for k in &keys {
            let deadline = Instant::now() + Duration::from_secs(20);
            while let Err(e) = r.get(k).await {
                assert!(Instant::now() < deadline, "GET {k} failed for 20 s: {e}");
            }
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
    /// One-sided GETs answered after the fault (its function) returned:
    /// after a kill, the new leader's region's.
    pub one_sided_after_fault: u64,
    /// Batches refused for want of a lease from the fault's start on.
    pub unleased_since_fault: u64,
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
    record_windowed(rt, clients, (BEFORE_FAULT, AFTER_FAULT), fault)
}

/// Most windows after the fault a recording is stretched by while it
/// lacks a write or a one-sided read since the fault ([`record_windowed`]).
pub const MAX_STRETCH: u32 = 3;

/// [`record`] with the times before and after the fault given: a slower
/// machine (the emulated VM) needs longer for the same number of
/// operations, and a failover to be over before the run ends.
pub fn record_windowed(
    rt: &tokio::runtime::Runtime,
    clients: Clients,
    (before, after): (Duration, Duration),
    fault: impl FnOnce(),
) -> Run {
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
    std::thread::sleep(before);
    let fault_at = log.lock().unwrap().len();
    let at_fault: Vec<_> = readers.iter().map(|r| r.client.read_stats()).collect();
    fault();
    let after_fault: u64 = readers.iter().map(|r| r.client.read_stats().gets).sum();
    std::thread::sleep(after);
    // On a slow machine (the emulated RDMA VM) the window is stretched, up
    // to MAX_STRETCH windows more, until the run has what its tests look
    // for: a write acknowledged since the fault and, for readers that read
    // one-sided before it, a one-sided read since.
    let one_sided_before = at_fault.iter().map(|s| s.gets).sum::<u64>() > 0;
    let stretch_until = std::time::Instant::now() + after * MAX_STRETCH;
    while std::time::Instant::now() < stretch_until {
        let read = !one_sided_before || readers.iter().map(|r| r.client.read_stats().gets).sum::<u64>() > after_fault;
        let wrote =
            log.lock().unwrap()[fault_at..].iter().any(|e| matches!(e, Event::Return(_, _, RegisterRet::WriteOk)));
        if read && wrote {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
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
        // The counters only grow (one set per client, shared by its sessions).
        one_sided_after_fault: stats.iter().map(|s| s.gets).sum::<u64>() - after_fault,
        unleased_since_fault: stats.iter().map(|s| s.unleased).sum::<u64>()
            - at_fault.iter().map(|s| s.unleased).sum::<u64>(),
        unleased: stats.iter().map(|s| s.unleased).sum(),
        writes,
        writes_since_fault,
        reads,
    }
}

/// Freezes the leader of a shard of a fresh 3-node cluster for longer than
/// an election (SIGSTOP, 1.5 s) while a writer overwrites that shard's
/// keys through the new leader, two readers read them one-sided over
/// `one_sided` (routed to the frozen leader's region, whose memory stays
/// readable: mapped on this host, or served by the NIC) and one over RPC;
/// returns the recorded run, its histories checked.
pub fn stalled_leader_run(check_leases: bool, one_sided: Transport) -> Run {
    let shape = Shape { shards: 3, shard: 1, windows: (BEFORE_FAULT, AFTER_FAULT) };
    stalled_leader_run_shaped(check_leases, one_sided, shape)
}

/// A recorded run's cluster and times: how many shards it has, which one
/// the keys are of, and the recording's windows ([`record_windowed`]).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub shards: u32,
    pub shard: ShardId,
    pub windows: (Duration, Duration),
}

/// [`stalled_leader_run`] in a cluster of the given shape.
pub fn stalled_leader_run_shaped(check_leases: bool, one_sided: Transport, shape: Shape) -> Run {
    let Shape { shards, shard, windows } = shape;
    let c = TestCluster::start(3, shards, 3, false, &[]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let map = rt.block_on(c.leaders_known(0));
    let stalled = map.shards()[shard as usize].leader.expect("a leader") as usize - 1;
    let via = (stalled + 1) % 3;
    let reader = (ReadPath::OneSided, Some(one_sided));
    let paths = [reader, reader, (ReadPath::Rpc, None)];
    let clients = rt.block_on(Clients::connect(&c, via, shard, 6, check_leases, &paths));
    record_windowed(&rt, clients, windows, || {
        c.pause(stalled);
        // Well past an election (150-300 ms) and the leader's lease.
        std::thread::sleep(Duration::from_millis(1500));
        c.resume(stalled);
    })
}

/// A read that returned a value overwritten before it began: write W of
/// v returned, then a write W' started and returned, then the read started
/// and returned v. No linearization exists (W' must follow W and precede
/// the read). Positions are indexes into the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaleRead {
    pub key: String,
    pub value: u64,
    /// The read's thread, invocation and return.
    pub reader: usize,
    pub read: (usize, usize),
    /// When the write of `value` returned (`None`: the key's initial 0,
    /// there before the history).
    pub written: Option<usize>,
    /// The write the read missed: value, thread, invocation, return.
    pub missed: u64,
    pub writer: usize,
    pub missed_at: (usize, usize),
}

/// A key's writes by value (when each returned), and from each write (by
/// invocation) on, the one that returned first.
type WriteIndex = (BTreeMap<u64, Option<usize>>, Vec<Option<usize>>);

/// The value a read of a missing key is recorded as (a DELETE writes it).
pub const ABSENT: u64 = u64::MAX;

/// Every read of a value overwritten before it began (see [`StaleRead`]),
/// in the order of the reads' invocations. Values are unique per key but
/// for [`ABSENT`], which many DELETEs write: reads of it are left to the
/// full search. Takes O(n log n): per key, the writes sorted by
/// invocation and, from each on, the one that returned first.
pub fn stale_reads(log: &[Event]) -> Vec<StaleRead> {
    struct Write {
        value: u64,
        thread: usize,
        inv: usize,
        ret: Option<usize>,
    }
    let mut writes: BTreeMap<&str, Vec<Write>> = BTreeMap::new();
    let mut open: BTreeMap<(usize, &str), (RegisterOp<u64>, usize)> = BTreeMap::new();
    let mut reads = Vec::new();
    for (at, e) in log.iter().enumerate() {
        match e {
            Event::Invoke(t, k, op) => {
                if let RegisterOp::Write(v) = op {
                    writes.entry(k).or_default().push(Write { value: *v, thread: *t, inv: at, ret: None });
                }
                open.insert((*t, k), (op.clone(), at));
            }
            Event::Return(t, k, ret) => {
                let Some((op, inv)) = open.remove(&(*t, k.as_str())) else { continue };
                match (op, ret) {
                    (RegisterOp::Write(_), _) => {
                        if let Some(w) =
                            writes.get_mut(k.as_str()).and_then(|ws| ws.iter_mut().rev().find(|w| w.inv == inv))
                        {
                            w.ret = Some(at);
                        }
                    }
                    (RegisterOp::Read, RegisterRet::ReadOk(v)) if *v != ABSENT => {
                        reads.push((k.as_str(), *v, *t, inv, at))
                    }
                    _ => {}
                }
            }
        }
    }
    // Per key: writes by invocation (the log's order already), each
    // value's return, and from each write on the earliest return.
    let index: BTreeMap<&str, WriteIndex> = writes
        .iter()
        .map(|(k, ws)| {
            let by_value = ws.iter().map(|w| (w.value, w.ret)).collect();
            let mut first: Vec<Option<usize>> = vec![None; ws.len() + 1];
            for i in (0..ws.len()).rev() {
                let later = first[i + 1];
                first[i] = match (ws[i].ret, later) {
                    (Some(r), Some(b)) => Some(if r <= ws[b].ret.unwrap_or(usize::MAX) { i } else { b }),
                    (Some(_), None) => Some(i),
                    (None, b) => b,
                };
            }
            (*k, (by_value, first))
        })
        .collect();
    let mut found = Vec::new();
    for (k, v, t, inv, ret) in reads {
        let Some((by_value, first)) = index.get(k) else { continue };
        let ws = &writes[k];
        // The initial 0 was written before the history; another value
        // never written, or whose write never returned, proves nothing here.
        let written = match v {
            0 => None,
            v => match by_value.get(&v) {
                Some(Some(r)) => Some(*r),
                _ => continue,
            },
        };
        let from = written.map_or(0, |r| ws.partition_point(|w| w.inv <= r));
        let Some(i) = first[from] else { continue };
        let w = &ws[i];
        if let Some(wr) = w.ret.filter(|&wr| wr < inv && w.value != v) {
            found.push(StaleRead {
                key: k.to_string(),
                value: v,
                reader: t,
                read: (inv, ret),
                written,
                missed: w.value,
                writer: w.thread,
                missed_at: (w.inv, wr),
            });
        }
    }
    found.sort_by_key(|s| s.read.0);
    found
}

/// The first [`StaleRead`], said in a line. A quick, certain proof of a
/// violation, where the full search can take very long to exhaust.
pub fn stale_read(log: &[Event]) -> Option<String> {
    stale_reads(log).first().map(|s| {
        format!(
            "key {}: a read invoked at event {} returned {}, overwritten by {} before",
            s.key, s.read.0, s.value, s.missed
        )
    })
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

/// A history recorded by clients in many threads and processes at once:
/// each invocation and return is logged under one lock at the moment it
/// happens (for a client in another process, the moment its parent
/// learns of it: before the invocation, after the return), so the log's
/// order respects real time. Cheap to clone; clones share the log.
#[derive(Debug, Clone)]
pub struct Recorder {
    inner: Arc<Mutex<History>>,
    start: Instant,
    /// Writes acknowledged so far, and the key of the last: what a fault
    /// timed to follow an acknowledgement waits on.
    acks: Arc<(AtomicU64, Mutex<String>)>,
}

/// What a [`Recorder`] logged.
#[derive(Debug, Clone, Default)]
pub struct History {
    pub events: Vec<Event>,
    /// When each event was logged, from the recorder's start.
    pub times: Vec<Duration>,
    /// Who each thread id is: its client's label.
    pub labels: Vec<String>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder { inner: Arc::default(), start: Instant::now(), acks: Arc::default() }
    }
}

impl Recorder {
    /// A new thread id, for a client labelled `label` (a client whose
    /// operation failed goes on under a new one: see the module's doc).
    pub fn thread(&self, label: &str) -> usize {
        let mut h = self.inner.lock().unwrap();
        h.labels.push(label.to_string());
        h.labels.len() - 1
    }

    /// Logs the invocation of `op` on each of `keys` by thread `t` (a
    /// multi-get invokes a read of each key at once).
    pub fn invoke(&self, t: usize, keys: &[&str], op: RegisterOp<u64>) {
        let mut h = self.inner.lock().unwrap();
        let now = self.start.elapsed();
        for k in keys {
            h.events.push(Event::Invoke(t, k.to_string(), op.clone()));
            h.times.push(now);
        }
    }

    /// Logs the returns of thread `t`'s operations on each key.
    pub fn ret(&self, t: usize, rets: &[(&str, RegisterRet<u64>)]) {
        let mut h = self.inner.lock().unwrap();
        let now = self.start.elapsed();
        for (k, r) in rets {
            h.events.push(Event::Return(t, k.to_string(), r.clone()));
            h.times.push(now);
            if *r == RegisterRet::WriteOk {
                *self.acks.1.lock().unwrap() = k.to_string();
                self.acks.0.fetch_add(1, Ordering::Release);
            }
        }
    }

    /// Waits (polling, up to `timeout`) until a write of a key that
    /// `wanted` accepts is acknowledged from now on; whether one was.
    pub fn await_ack(&self, wanted: impl Fn(&str) -> bool, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut seen = self.acks.0.load(Ordering::Acquire);
        while Instant::now() < deadline {
            let n = self.acks.0.load(Ordering::Acquire);
            if n != seen {
                seen = n;
                if wanted(&self.acks.1.lock().unwrap()) {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        false
    }

    /// Time since the recorder started: the clock of the log's times.
    pub fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }

    /// A copy of the log so far.
    pub fn history(&self) -> History {
        self.inner.lock().unwrap().clone()
    }
}

impl History {
    /// Operations that returned.
    pub fn returned(&self) -> usize {
        self.events.iter().filter(|e| matches!(e, Event::Return(..))).count()
    }

    /// `s` in a line: which key, value, client, write missed, and when
    /// (seconds from the recorder's start).
    pub fn describe(&self, s: &StaleRead) -> String {
        let at = |i: usize| self.times.get(i).map_or(f64::NAN, Duration::as_secs_f64);
        let who = |t: usize| self.labels.get(t).map_or("?", String::as_str);
        let value = |v: u64| if v == ABSENT { "absent (deleted)".to_string() } else { v.to_string() };
        let written = s.written.map_or("the initial value".to_string(), |w| format!("written by t={:.3}s", at(w)));
        format!(
            "stale read of key {}: {} read {} ({written}) in t={:.3}-{:.3}s, but write {} by {} had returned at t={:.3}s (invoked t={:.3}s), before the read began",
            s.key,
            who(s.reader),
            value(s.value),
            at(s.read.0),
            at(s.read.1),
            value(s.missed),
            who(s.writer),
            at(s.missed_at.1),
            at(s.missed_at.0),
        )
    }

    /// Reads that returned a value no write of the key wrote (nor the
    /// initial 0, nor absent): corruption, or a read of another key's item.
    pub fn phantom_reads(&self) -> Vec<String> {
        let written: std::collections::BTreeSet<(&str, u64)> = self
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Invoke(_, k, RegisterOp::Write(v)) => Some((k.as_str(), *v)),
                _ => None,
            })
            .collect();
        self.events
            .iter()
            .zip(&self.times)
            .filter_map(|(e, at)| match e {
                Event::Return(t, k, RegisterRet::ReadOk(v))
                    if *v != 0 && *v != ABSENT && !written.contains(&(k.as_str(), *v)) =>
                {
                    let who = self.labels.get(*t).map_or("?", String::as_str);
                    Some(format!(
                        "read of key {k} by {who} at t={:.3}s returned {v}, which no write wrote",
                        at.as_secs_f64()
                    ))
                }
                _ => None,
            })
            .collect()
    }
}

/// The outcome of the full linearizability search.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FullSearch {
    Linearizable,
    /// The first key found not linearizable, and its history.
    NotLinearizable(String),
    /// The search did not finish within its budget (it is exponential in
    /// the worst case), or could not run.
    Inconclusive(String),
}

/// Environment variable naming the program that runs the full search (the
/// `dmkv-history-check` binary; found beside the tests otherwise).
const CHECKER: &str = "dmkv-history-check";

/// Runs [`check`] on `log` in a child process (`dmkv-history-check`),
/// killed when `budget` runs out: the search can run for hours on a
/// history it cannot linearize, and a thread cannot be stopped.
pub fn full_search(keys: &[String], log: &[Event], budget: Duration) -> FullSearch {
    use std::io::Write;
    let bin = match crate::find_bin(CHECKER) {
        Ok(b) => b,
        Err(e) => return FullSearch::Inconclusive(e),
    };
    let mut child = match std::process::Command::new(&bin)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => return FullSearch::Inconclusive(format!("cannot run {}: {e}", bin.display())),
    };
    let text = encode(keys, log);
    let mut stdin = child.stdin.take().expect("piped stdin");
    // A thread: the child may stop reading (it crashed) before taking all.
    let feeder = std::thread::spawn(move || {
        let _ = stdin.write_all(text.as_bytes());
    });
    let mut stdout = child.stdout.take().expect("piped stdout");
    let reader = std::thread::spawn(move || {
        let mut out = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut out);
        out
    });
    let deadline = Instant::now() + budget;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
        }
    };
    let _ = feeder.join();
    let out = reader.join().unwrap_or_default();
    match status {
        None => FullSearch::Inconclusive(format!("the search did not finish within {budget:?}")),
        Some(s) if s.success() && out.starts_with("linearizable") => FullSearch::Linearizable,
        Some(s) if s.code() == Some(1) => FullSearch::NotLinearizable(out),
        Some(s) => FullSearch::Inconclusive(format!("{CHECKER} exited {s}: {}", out.trim())),
    }
}

/// A history as text, for [`full_search`]'s child: a line of keys, then
/// one event a line (`i THREAD KEY r|w VALUE`, `r THREAD KEY ok|r VALUE`).
/// Keys are the tests' own (no spaces).
pub fn encode(keys: &[String], log: &[Event]) -> String {
    let mut out = keys.join(" ") + "\n";
    for e in log {
        let line = match e {
            Event::Invoke(t, k, RegisterOp::Read) => format!("i {t} {k} r 0"),
            Event::Invoke(t, k, RegisterOp::Write(v)) => format!("i {t} {k} w {v}"),
            Event::Return(t, k, RegisterRet::WriteOk) => format!("r {t} {k} ok 0"),
            Event::Return(t, k, RegisterRet::ReadOk(v)) => format!("r {t} {k} r {v}"),
        };
        out += &line;
        out.push('\n');
    }
    out
}

/// The inverse of [`encode`].
pub fn decode(text: &str) -> Result<(Vec<String>, Vec<Event>), String> {
    let mut lines = text.lines();
    let keys = lines.next().ok_or("no line of keys")?.split_whitespace().map(String::from).collect();
    let mut log = Vec::new();
    for (n, line) in lines.enumerate() {
        let bad = || format!("line {}: {line:?}", n + 2);
        let w: Vec<&str> = line.split_whitespace().collect();
        let [kind, t, k, what, v] = w[..] else { return Err(bad()) };
        let (t, v): (usize, u64) = (t.parse().map_err(|_| bad())?, v.parse().map_err(|_| bad())?);
        log.push(match (kind, what) {
            ("i", "r") => Event::Invoke(t, k.into(), RegisterOp::Read),
            ("i", "w") => Event::Invoke(t, k.into(), RegisterOp::Write(v)),
            ("r", "ok") => Event::Return(t, k.into(), RegisterRet::WriteOk),
            ("r", "r") => Event::Return(t, k.into(), RegisterRet::ReadOk(v)),
            _ => return Err(bad()),
        });
    }
    Ok((keys, log))
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
