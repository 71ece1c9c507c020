//! The clients of a fault run: writers PUTting unique values (and some
//! DELETEs) and readers on every read path (one-sided over shared memory,
//! one-sided over the TCP engine, RPC, multi-get, auto), each on an OS
//! thread of its own with a runtime of its own, all recording into one
//! [`Recorder`]. Threads, not tasks of one runtime: with more readers than
//! cores the kernel preempts them anywhere, between a one-sided read's
//! data and its lease check too, which is the race some faults are after.
//!
//! Each key has one writer (keys are dealt to writers), so a key's last
//! acknowledged value is known; values are unique per writer and key
//! (`(writer + 1) << 40 | n`), which the stale-read check relies on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dmkv_client::{Client, ReadPath, Transport};
use stateright::semantics::register::{RegisterOp, RegisterRet};

use crate::history::{ABSENT, Recorder, client_config};

/// How long a client gets to connect and read every key once (attach to
/// the leaders' regions) before the run starts.
pub const ATTACH_DEADLINE: Duration = Duration::from_secs(20);
/// Every how many operations a writer DELETEs instead of PUTting.
const DELETE_EVERY: u64 = 8;
/// Keys a multi-get asks at once (consecutive keys: several shards).
const MULTI_GET_KEYS: usize = 4;

/// What a client does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// PUTs (and DELETEs) over RPC to the keys dealt to writer `id` of
    /// `of`.
    Writer { id: u64, of: u64 },
    /// Single GETs.
    Get(ReadPath, Option<Transport>),
    /// Multi-gets of [`MULTI_GET_KEYS`] keys.
    MultiGet(ReadPath, Option<Transport>),
}

/// One client of a run.
#[derive(Debug, Clone)]
pub struct ClientSpec {
    pub role: Role,
    /// The node index it connects through (it routes from there).
    pub via: usize,
    /// Sleep before each read: the full linearizability search grows
    /// with the history. Zero for readers that should press hard.
    pub pace: Duration,
    /// Bytes of padding after a writer's number (a space, then noise): the
    /// log grows faster, so that a full disk is met sooner.
    pub pad: usize,
}

impl ClientSpec {
    /// A label for reports: role, path and node, e.g. `get shm via 2`.
    pub fn label(&self) -> String {
        let path = |p: ReadPath, t: Option<Transport>| match (p, t) {
            (ReadPath::Rpc, _) => "rpc".to_string(),
            (p, Some(t)) => format!("{} {}", p.name(), t.name()),
            (p, None) => p.name().to_string(),
        };
        match self.role {
            Role::Writer { id, .. } => format!("writer {id} via {}", self.via + 1),
            Role::Get(p, t) => format!("get {} via {}", path(p, t), self.via + 1),
            Role::MultiGet(p, t) => format!("multi-get {} via {}", path(p, t), self.via + 1),
        }
    }
}

/// What one client did.
#[derive(Debug, Clone, Default)]
pub struct Totals {
    pub label: String,
    /// Operations that returned, and that failed (left open).
    pub ok: u64,
    pub failed: u64,
    /// The longest operation, and when it began (recorder time).
    pub slowest: Duration,
    pub slowest_at: Duration,
    /// The first error, for reports.
    pub first_error: Option<String>,
    /// One-sided GETs answered, batches refused for want of a lease.
    pub one_sided: u64,
    pub unleased: u64,
}

impl Totals {
    pub(crate) fn op(&mut self, began: Duration, took: Duration, result: Result<(), String>) {
        match result {
            Ok(()) => self.ok += 1,
            Err(e) => {
                self.failed += 1;
                self.first_error.get_or_insert(e);
            }
        }
        if took > self.slowest {
            (self.slowest, self.slowest_at) = (took, began);
        }
    }
}

/// Running clients; [`Workload::stop`] ends them.
pub struct Workload {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Totals>>,
}

impl Workload {
    /// Starts `specs` against the nodes at `rpc` (by index) on `keys`, each
    /// recording into `recorder`; returns once every one has connected and
    /// read each key once, or the first client's error.
    pub fn start(
        rpc: &[String],
        keys: &[String],
        specs: &[ClientSpec],
        recorder: &Recorder,
    ) -> Result<Workload, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let mut threads = Vec::new();
        for (n, spec) in specs.iter().enumerate() {
            let (spec, addr, keys) = (spec.clone(), rpc[spec.via].clone(), keys.to_vec());
            let (recorder, stop, ready) = (recorder.clone(), Arc::clone(&stop), ready_tx.clone());
            let h = std::thread::Builder::new()
                .name(format!("client-{n}"))
                .spawn(move || run_client(spec, addr, keys, recorder, stop, ready))
                .map_err(|e| format!("cannot start a client thread: {e}"))?;
            threads.push(h);
        }
        let workload = Workload { stop, threads };
        let deadline = Instant::now() + ATTACH_DEADLINE;
        for _ in specs {
            match ready_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(format!("clients not attached within {ATTACH_DEADLINE:?}")),
            }
        }
        Ok(workload)
    }

    /// Stops the clients (each after its operation in flight, which its
    /// request timeout bounds) and says what each did.
    pub fn stop(mut self) -> Vec<Totals> {
        self.stop.store(true, Ordering::Relaxed);
        std::mem::take(&mut self.threads).into_iter().map(|h| h.join().unwrap_or_default()).collect()
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn run_client(
    spec: ClientSpec,
    addr: String,
    keys: Vec<String>,
    recorder: Recorder,
    stop: Arc<AtomicBool>,
    ready: mpsc::Sender<Result<(), String>>,
) -> Totals {
    let label = spec.label();
    let mut totals = Totals { label: label.clone(), ..Default::default() };
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(format!("{label}: no runtime: {e}")));
            return totals;
        }
    };
    rt.block_on(async {
        let client = match attach(&spec, &addr, &keys).await {
            Ok(c) => c,
            Err(e) => {
                let _ = ready.send(Err(format!("{label}: {e}")));
                return;
            }
        };
        let _ = ready.send(Ok(()));
        drop(ready);
        let mut t = recorder.thread(&label);
        let mut n = 0u64;
        let mine: Vec<&String> = match spec.role {
            Role::Writer { id, of } => {
                keys.iter().enumerate().filter(|(i, _)| *i as u64 % of == id).map(|p| p.1).collect()
            }
            _ => keys.iter().collect(),
        };
        while !stop.load(Ordering::Relaxed) {
            n += 1;
            let began = recorder.elapsed();
            let start = Instant::now();
            let result = match spec.role {
                Role::Writer { id, .. } => {
                    let key = mine[n as usize % mine.len()].as_str();
                    let v = (id + 1) << 40 | n;
                    write(&client, &recorder, t, key, v, spec.pad, n.is_multiple_of(DELETE_EVERY)).await
                }
                Role::Get(..) => {
                    tokio::time::sleep(spec.pace).await;
                    read(&client, &recorder, t, &[mine[n as usize % mine.len()].as_str()]).await
                }
                Role::MultiGet(..) => {
                    tokio::time::sleep(spec.pace).await;
                    let first = n as usize * MULTI_GET_KEYS;
                    let ks: Vec<&str> =
                        (0..MULTI_GET_KEYS.min(mine.len())).map(|i| mine[(first + i) % mine.len()].as_str()).collect();
                    read(&client, &recorder, t, &ks).await
                }
            };
            if result.is_err() {
                // The failed operation stays open in the history.
                t = recorder.thread(&label);
            }
            totals.op(began, start.elapsed(), result);
        }
        let s = client.read_stats();
        (totals.one_sided, totals.unleased) = (s.gets, s.unleased);
    });
    totals
}

/// Connects as `spec` says and reads every key once, retrying within
/// [`ATTACH_DEADLINE`] (a cluster just started may still elect).
async fn attach(spec: &ClientSpec, addr: &str, keys: &[String]) -> Result<Client, String> {
    let (path, transport) = match spec.role {
        Role::Writer { .. } => (ReadPath::Rpc, None),
        Role::Get(p, t) | Role::MultiGet(p, t) => (p, t),
    };
    let deadline = Instant::now() + ATTACH_DEADLINE;
    let client = loop {
        match Client::connect_with(addr, client_config(path, transport, true)).await {
            Ok(c) => break c,
            Err(e) if Instant::now() >= deadline => return Err(format!("cannot connect to {addr}: {e}")),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    for k in keys {
        loop {
            match client.get(k).await {
                Ok(_) => break,
                Err(e) if Instant::now() >= deadline => return Err(format!("cannot GET {k}: {e}")),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }
    Ok(client)
}

/// One PUT of `value` (padded), or a DELETE, recorded.
async fn write(
    client: &Client,
    rec: &Recorder,
    t: usize,
    key: &str,
    value: u64,
    pad: usize,
    delete: bool,
) -> Result<(), String> {
    let v = if delete { ABSENT } else { value };
    rec.invoke(t, &[key], RegisterOp::Write(v));
    let r = if delete {
        client.delete(key).await.map(|_| ())
    } else {
        let padded = if pad == 0 { v.to_string() } else { format!("{v} {}", noise(v, pad)) };
        client.put(key, padded).await.map(|_| ())
    };
    match r {
        Ok(()) => {
            rec.ret(t, &[(key, RegisterRet::WriteOk)]);
            Ok(())
        }
        Err(e) => Err(e.to_string()),
    }
}

async fn read(client: &Client, rec: &Recorder, t: usize, keys: &[&str]) -> Result<(), String> {
    rec.invoke(t, keys, RegisterOp::Read);
    let got = if let [k] = keys { client.get(k).await.map(|v| vec![v]) } else { client.multi_get(keys).await };
    let values = got.map_err(|e| e.to_string())?;
    let mut rets = Vec::new();
    for (k, v) in keys.iter().zip(values) {
        rets.push((*k, RegisterRet::ReadOk(parse_value(v.as_deref())?)));
    }
    rec.ret(t, &rets);
    Ok(())
}

/// `n` characters that do not compress (raft-engine compresses its log
/// batches: padding of one repeated byte would not grow the log at all).
fn noise(seed: u64, n: usize) -> String {
    const CHARS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            // xorshift64: cheap, and plenty random for a compressor.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            CHARS[(x >> 58) as usize] as char
        })
        .collect()
}

/// A value as the history records it: its number (padding after a space
/// aside); absent is [`ABSENT`].
pub fn parse_value(v: Option<&[u8]>) -> Result<u64, String> {
    match v {
        None => Ok(ABSENT),
        Some(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.split(' ').next().and_then(|n| n.parse().ok()))
            .ok_or_else(|| format!("a value that is not a number: {:?}", String::from_utf8_lossy(b))),
    }
}
