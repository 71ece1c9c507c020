//! One run of the fault suite: a 3-node cluster of real dmkvd processes
//! (3 shards of 3 replicas, each node's data directory on a tmpfs of its
//! own, logs cut past 200 entries so that snapshots come and go all the
//! time), clients on every read path recording a history, a
//! [`Schedule`] carried out by the [`Nemesis`], then every fault healed
//! and the outcome judged:
//!
//! - the history, per key: stale reads (named with the write they
//!   missed), values no write wrote, then stateright's full
//!   linearizability search, segmented ([`crate::linearize`]; in a child
//!   process, within a budget);
//! - acknowledged writes lost: each key read once more on the healed
//!   cluster;
//! - every client's slowest operation against its deadline;
//! - nodes that exited by themselves;
//! - after the heal, every replica of every shard at the same applied
//!   index and every node holding the same items, and the large values
//!   written before the faults (what snapshots carry) all still there.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use dmkv_client::{Client, ReadPath, Transport};
use stateright::semantics::register::{RegisterOp, RegisterRet};

use crate::cluster::TestCluster;
use crate::history::{self, ABSENT, Event, FullSearch, REQUEST_TIMEOUT, Recorder, client_config};
use crate::nemesis::{Nemesis, Span};
use crate::schedule::{NODES, SHARDS, Schedule};
use crate::skewed::SkewedReader;
use crate::workload::{ClientSpec, Role, Totals, Workload, parse_value};

/// Each node's data disk: room for its log and snapshot files (a few MiB
/// of large values, snapshots written beside the old ones), small enough
/// to fill in a moment.
pub const DISK_BYTES: u64 = 96 << 20;
/// dmkvd flags of every fault cluster: logs cut down past 200 entries
/// (snapshots all the time), frames of about 1 MiB (a snapshot goes in
/// parts), memory for the large values.
pub const NODE_ARGS: [&str; 6] = ["--raft-log-entries", "200", "--max-frame", "1100000", "--memory", "96MiB"];
/// Keys of the history (each a register starting at 0), over all shards.
pub const KEYS: usize = 24;
/// Large values PUT before the faults, never rewritten: a snapshot
/// carries them, so a replica that restores one wrongly loses them.
const BULK_KEYS: usize = 48;
const BULK_BYTES: usize = 64 << 10;
/// Load before the first step, and after the last one ends.
const WARMUP: Duration = Duration::from_millis(500);
const COOLDOWN: Duration = Duration::from_millis(1000);
/// Load on the healed cluster before the clients stop: they find the
/// leaders again.
const RECOVERY: Duration = Duration::from_millis(1500);
/// How long the healed cluster gets to agree (every replica applied as
/// far as the others, every node the same items): past raft's 30 s
/// before it sends again a snapshot not taken up.
const SETTLE_DEADLINE: Duration = Duration::from_secs(45);
/// Agreement that takes longer than this is noted with what lagged.
const SLOW_SETTLE: Duration = Duration::from_secs(5);
/// How long the full linearizability search may run.
const SEARCH_BUDGET: Duration = Duration::from_secs(30);
/// An operation that outlasts its request timeout by more than this did
/// not move on within its deadline.
pub const LATE_SLACK: Duration = Duration::from_millis(1000);
/// The label of the reads of every key on the healed cluster.
const FINAL_READER: &str = "final reads rpc via 1";
/// Stale reads spelled out in a report (the count says how many more).
const STALE_SHOWN: usize = 5;

/// What one run found.
#[derive(Debug, Clone)]
pub struct Report {
    pub schedule: Schedule,
    /// What the nemesis did, a line each with its time.
    pub actions: Vec<String>,
    /// Operations recorded (returned), writes among them.
    pub ops: usize,
    pub writes: usize,
    pub clients: Vec<Totals>,
    /// What breaks a promise: each makes the run fail.
    pub anomalies: Vec<String>,
    /// What is worth knowing but breaks none (a node that exited on a full
    /// disk, a search that ran out of time).
    pub notes: Vec<String>,
    /// Snapshots installed, summed over the nodes (from their counters;
    /// a restarted node counts from its restart).
    pub snapshots_installed: u64,
    pub wall: Duration,
    /// How long each part of the run took (setup, faults, heal, settle,
    /// checks), for reports.
    pub timings: Vec<(&'static str, Duration)>,
    /// Per node, its log's warnings and errors (distinct messages, with
    /// how often and when first).
    pub node_logs: Vec<String>,
    /// The history itself, when each step was in force, and each key's
    /// shard: for a test's own checks.
    pub history: history::History,
    pub spans: BTreeMap<usize, Span>,
    pub shard_of: BTreeMap<String, u32>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.anomalies.is_empty()
    }

    /// Writes acknowledged between `from` and `to` (recorder time), per
    /// shard of their key.
    pub fn writes_between(&self, from: Duration, to: Duration) -> BTreeMap<u32, usize> {
        let mut n = BTreeMap::new();
        for (e, at) in self.history.events.iter().zip(&self.history.times) {
            if let Event::Return(_, k, RegisterRet::WriteOk) = e
                && (from..to).contains(at)
                && let Some(&shard) = self.shard_of.get(k)
            {
                *n.entry(shard).or_default() += 1;
            }
        }
        n
    }

    /// The one-line verdict: seed, ops, anomalies.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = self.timings.iter().map(|(n, d)| format!("{n} {:.1}", d.as_secs_f64())).collect();
        format!(
            "{} seed={}: {} ops recorded ({} writes), {} snapshots installed, {} anomalies, {:.1} s ({})",
            self.schedule.name,
            self.schedule.seed,
            self.ops,
            self.writes,
            self.snapshots_installed,
            self.anomalies.len(),
            self.wall.as_secs_f64(),
            parts.join(", ")
        )
    }

    /// Everything: the schedule, what was done, the clients, anomalies,
    /// notes, and how to replay it.
    pub fn text(&self, test: &str) -> String {
        let mut out = vec![self.summary()];
        out.extend(self.schedule.describe());
        out.push("what the nemesis did:".into());
        out.extend(self.actions.iter().map(|l| format!("  {l}")));
        out.push("clients:".into());
        for t in &self.clients {
            out.push(format!(
                "  {}: {} ok, {} failed, slowest {} ms at t={:.3}s, one-sided {} (unleased {}){}",
                t.label,
                t.ok,
                t.failed,
                t.slowest.as_millis(),
                t.slowest_at.as_secs_f64(),
                t.one_sided,
                t.unleased,
                t.first_error.as_ref().map_or(String::new(), |e| format!("; first error: {e}"))
            ));
        }
        if !self.node_logs.is_empty() {
            out.push("node logs (warnings and errors):".into());
            out.extend(self.node_logs.iter().map(|l| format!("  {l}")));
        }
        out.extend(self.notes.iter().map(|n| format!("note: {n}")));
        out.extend(self.anomalies.iter().map(|a| format!("ANOMALY: {a}")));
        out.push(format!(
            "replay: DMKV_FAULT_SEED={} cargo test -p dmkv-tests --test cluster_faults -- {test} --exact --nocapture",
            self.schedule.seed
        ));
        out.join("\n")
    }
}

/// The clients every run has: two writers, and eight readers over every
/// path through every node (more threads than this machine's cores).
fn default_clients(s: &Schedule) -> Vec<ClientSpec> {
    let (pace, pad) = (s.clients.pace, s.clients.pad);
    let one = |p, t, via| ClientSpec { role: Role::Get(p, t), via, pace, pad };
    let (os, shm, tcp) = (ReadPath::OneSided, Some(Transport::Shm), Some(Transport::Engine));
    let mut v = vec![
        ClientSpec { role: Role::Writer { id: 0, of: 2 }, via: 0, pace, pad },
        ClientSpec { role: Role::Writer { id: 1, of: 2 }, via: 1, pace, pad },
        one(os, shm, 1),
        one(os, shm, 2),
        one(os, tcp, 0),
        one(os, tcp, 2),
        one(ReadPath::Rpc, None, 1),
        one(ReadPath::Auto, None, 2),
        ClientSpec { role: Role::MultiGet(ReadPath::Auto, None), via: 0, pace, pad },
        ClientSpec { role: Role::MultiGet(os, tcp), via: 1, pace, pad },
    ];
    for n in 0..s.clients.extra_one_sided {
        v.push(one(os, if n % 2 == 0 { shm } else { tcp }, n % NODES));
    }
    v
}

/// Runs schedule `s` on a fresh cluster; an error when the cluster or
/// the clients could not be set up at all (the run proves nothing then).
pub fn run(s: &Schedule) -> Result<Report, String> {
    let began = Instant::now();
    let mut timings = Vec::new();
    let mut lap = Instant::now();
    let mut mark = |name: &'static str| {
        timings.push((name, lap.elapsed()));
        lap = Instant::now();
    };
    let mut c = TestCluster::try_start_on_tmpfs(NODES, SHARDS, 3, DISK_BYTES, &NODE_ARGS)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("fk-{i}")).collect();
    let bulk: Vec<(String, String)> = (0..BULK_KEYS).map(|i| (format!("fb-{i}"), bulk_value(i))).collect();
    let shard_of: BTreeMap<String, u32> = rt.block_on(async {
        let w = Client::connect_with(c.rpc(0), client_config(ReadPath::Rpc, None, true))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let map = w.cluster_map().await.map_err(|e| format!("cluster map: {e}"))?;
        for k in &keys {
            put_within(&w, k, "0").await?;
        }
        for (k, v) in &bulk {
            put_within(&w, k, v).await?;
        }
        Ok::<_, String>(keys.iter().map(|k| (k.clone(), map.shard_of(k.as_bytes()).id)).collect())
    })?;
    let recorder = Recorder::default();
    let rpc: Vec<String> = (0..NODES).map(|i| c.rpc(i).to_string()).collect();
    let workload = Workload::start(&rpc, &keys, &default_clients(s), &recorder)?;
    let mut skewed = Vec::new();
    for (n, skew) in s.clients.skewed.iter().enumerate() {
        let via = n % NODES;
        skewed.push(SkewedReader::spawn(*skew, &rpc[via], &keys, &recorder, &skew.label(via))?);
    }
    mark("setup");
    std::thread::sleep(WARMUP);
    let mut nemesis = Nemesis::new(&mut c, &recorder)?.with_shards(shard_of.clone());
    nemesis.run(s);
    std::thread::sleep(COOLDOWN);
    mark("faults");
    let mut anomalies = Vec::new();
    let mut notes = nemesis.heal();
    std::thread::sleep(RECOVERY);
    let mut clients = workload.stop();
    clients.extend(skewed.into_iter().map(SkewedReader::stop));
    nemesis.look_for_crashes();
    let (actions, crashes, spans) = (nemesis.log.clone(), nemesis.crashes.clone(), nemesis.spans.clone());
    anomalies.append(&mut nemesis.stuck);
    drop(nemesis);
    for crash in crashes {
        // A node that stops on a full disk fails safe (raft goes on
        // without it); one that dies of anything else is a bug.
        if crash.disk_full { notes.push(crash.line) } else { anomalies.push(crash.line) }
    }
    mark("heal");
    if let Err(e) = settle(&mut c, &rt, &mut notes) {
        anomalies.push(e);
    }
    mark("settle");
    rt.block_on(final_reads(&c, &keys, &bulk, &recorder, &mut anomalies));
    let snapshots_installed = rt.block_on(counter_sum(&c, "shard_snapshots_installed"));
    let node_logs = (0..c.len()).flat_map(|i| notable_log_lines(i, &c.log(i))).collect();
    let h = recorder.history();
    anomalies.extend(lost_writes(&h));
    judge_history(&keys, &h, &mut anomalies, &mut notes);
    let late = REQUEST_TIMEOUT + LATE_SLACK;
    for t in clients.iter().filter(|t| t.slowest > late) {
        anomalies.push(format!(
            "{}: an operation began at t={:.3}s took {} ms, past its {} ms deadline",
            t.label,
            t.slowest_at.as_secs_f64(),
            t.slowest.as_millis(),
            REQUEST_TIMEOUT.as_millis()
        ));
    }
    mark("checks");
    let writes = h.events.iter().filter(|e| matches!(e, history::Event::Return(_, _, RegisterRet::WriteOk))).count();
    Ok(Report {
        schedule: s.clone(),
        actions,
        ops: h.returned(),
        writes,
        clients,
        anomalies,
        notes,
        snapshots_installed,
        wall: began.elapsed(),
        timings,
        node_logs,
        history: h,
        spans,
        shard_of,
    })
}

/// Distinct warnings and errors per node quoted in a report.
const LOG_MESSAGES: usize = 8;

/// Node index `i`'s warnings, errors and panics, each distinct message
/// once (timestamps aside) with its count and the first one's line.
fn notable_log_lines(i: usize, log: &str) -> Vec<String> {
    let mut seen: Vec<(String, String, usize)> = Vec::new();
    for line in log.lines() {
        if !(line.contains("WARN") || line.contains("ERROR") || line.contains("panicked")) {
            continue;
        }
        // `TIMESTAMP LEVEL target: message`: the rest after the stamp.
        let msg = line.split_once(' ').map_or(line, |(_, rest)| rest).trim().to_string();
        match seen.iter_mut().find(|(m, _, _)| *m == msg) {
            Some(e) => e.2 += 1,
            None => seen.push((msg, line.to_string(), 1)),
        }
    }
    let shown = seen.len().min(LOG_MESSAGES);
    let mut out: Vec<String> =
        seen.iter().take(shown).map(|(_, first, n)| format!("node {} ({n}x): {first}", i + 1)).collect();
    if seen.len() > shown {
        out.push(format!("node {}: ... {} more distinct messages", i + 1, seen.len() - shown));
    }
    out
}

/// A large value, recognisable by its key's number.
fn bulk_value(i: usize) -> String {
    let head = format!("bulk {i} ");
    head.clone() + &"x".repeat(BULK_BYTES - head.len())
}

async fn put_within(c: &Client, k: &str, v: &str) -> Result<(), String> {
    let deadline = Instant::now() + SETTLE_DEADLINE;
    loop {
        match c.put(k, v).await {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(format!("PUT {k} failed for {SETTLE_DEADLINE:?}: {e}")),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// Stale reads, phantom reads, then (only if neither: the search is
/// slow exactly when it fails) the full search.
fn judge_history(keys: &[String], h: &history::History, anomalies: &mut Vec<String>, notes: &mut Vec<String>) {
    let stale = history::stale_reads(&h.events);
    for s in stale.iter().take(STALE_SHOWN) {
        anomalies.push(h.describe(s));
    }
    if stale.len() > STALE_SHOWN {
        anomalies.push(format!("... and {} more stale reads", stale.len() - STALE_SHOWN));
    }
    let phantoms = h.phantom_reads();
    anomalies.extend(phantoms.iter().take(STALE_SHOWN).cloned());
    if !stale.is_empty() || !phantoms.is_empty() {
        return;
    }
    let started = Instant::now();
    match history::full_search(keys, &h.events, SEARCH_BUDGET) {
        FullSearch::Linearizable => notes
            .push(format!("every key's history is linearizable (full search: {} ms)", started.elapsed().as_millis())),
        FullSearch::NotLinearizable(why) => {
            let mut lines = why.lines();
            let head = lines.next().unwrap_or_default().to_string();
            let shown: Vec<&str> = lines.take(60).collect();
            anomalies.push(format!("not linearizable (full search): {head}\n    {}", shown.join("\n    ")));
        }
        FullSearch::Inconclusive(why) => notes.push(format!("full linearizability search inconclusive: {why}")),
    }
}

/// Waits for the healed cluster to agree: every node up, every shard a
/// leader, each replica of it at the leader's applied index, every node
/// the same items. An anomaly (with what each node said) if it does not
/// within [`SETTLE_DEADLINE`]; a note if it took longer than
/// [`SLOW_SETTLE`], with what was behind then.
fn settle(c: &mut TestCluster, rt: &tokio::runtime::Runtime, notes: &mut Vec<String>) -> Result<(), String> {
    let start = Instant::now();
    let deadline = start + SETTLE_DEADLINE;
    let mut behind = None;
    loop {
        let down: Vec<usize> = (0..c.len()).filter(|&i| !c.running(i)).map(|i| i + 1).collect();
        let view = rt.block_on(agreement(c)).and_then(|()| match &down[..] {
            [] => Ok(()),
            d => Err(format!("nodes {d:?} not running")),
        });
        match view {
            Ok(()) => {
                if let Some(b) = behind {
                    notes.push(format!(
                        "the healed cluster took {:.1} s to agree; after {} s: {b}",
                        start.elapsed().as_secs_f64(),
                        SLOW_SETTLE.as_secs()
                    ));
                }
                return Ok(());
            }
            Err(e) if Instant::now() >= deadline => {
                return Err(format!("the healed cluster did not agree within {SETTLE_DEADLINE:?}: {e}"));
            }
            Err(e) if behind.is_none() && start.elapsed() >= SLOW_SETTLE => behind = Some(e),
            Err(_) => {}
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether every shard has a leader and every replica its applied index,
/// and every node the same items; if not, what each node said.
async fn agreement(c: &TestCluster) -> Result<(), String> {
    let mut applied: BTreeMap<u32, Vec<(usize, String, u64)>> = BTreeMap::new();
    let mut items = Vec::new();
    for i in 0..c.len() {
        let client = Client::connect_with(c.rpc(i), client_config(ReadPath::Rpc, None, true))
            .await
            .map_err(|e| format!("node {}: {e}", i + 1))?;
        let s = client.cluster_status().await.map_err(|e| format!("node {}: {e}", i + 1))?;
        for r in s.local {
            applied.entry(r.shard).or_default().push((i + 1, r.role, r.applied));
        }
        let stats = client.stats().await.map_err(|e| format!("node {}: {e}", i + 1))?;
        items.push(stats.get("items").copied().unwrap_or(0));
    }
    let mut wrong = Vec::new();
    for (shard, rs) in &applied {
        let leaders = rs.iter().filter(|r| r.1 == "leader").count();
        let holders = match *shard {
            dmkv_common::cluster::map::META_SHARD => c.len().min(dmkv_common::cluster::map::META_REPLICAS),
            _ => c.len(),
        };
        if leaders != 1 || rs.len() != holders || rs.iter().any(|r| r.2 != rs[0].2) {
            let each: Vec<String> = rs.iter().map(|(n, role, a)| format!("node {n} {role} applied {a}")).collect();
            wrong.push(format!("shard {shard}: {}", each.join(", ")));
        }
    }
    if items.iter().any(|&n| n != items[0]) {
        wrong.push(format!("items per node: {items:?}"));
    }
    if wrong.is_empty() { Ok(()) } else { Err(wrong.join("; ")) }
}

/// Reads every key once more on the healed cluster (recorded: a lost
/// acknowledged write shows as a stale read, and in [`lost_writes`]) and
/// checks the large values; each GET tried again until one deadline for
/// all ([`SETTLE_DEADLINE`]), as a cluster that did not settle may still
/// answer some shards.
async fn final_reads(
    c: &TestCluster,
    keys: &[String],
    bulk: &[(String, String)],
    rec: &Recorder,
    anomalies: &mut Vec<String>,
) {
    let client = match Client::connect_with(c.rpc(0), client_config(ReadPath::Rpc, None, true)).await {
        Ok(cl) => cl,
        Err(e) => return anomalies.push(format!("final reads: cannot connect: {e}")),
    };
    let deadline = Instant::now() + SETTLE_DEADLINE;
    let mut failed = Vec::new();
    for k in keys {
        loop {
            let t = rec.thread(FINAL_READER);
            rec.invoke(t, &[k.as_str()], RegisterOp::Read);
            match client.get(k).await.map_err(|e| e.to_string()).and_then(|v| parse_value(v.as_deref())) {
                Ok(v) => {
                    rec.ret(t, &[(k.as_str(), RegisterRet::ReadOk(v))]);
                    break;
                }
                Err(e) if Instant::now() >= deadline => {
                    failed.push(format!("{k}: {e}"));
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    if !failed.is_empty() {
        anomalies.push(format!(
            "{} of {} keys unreadable on the healed cluster: {}",
            failed.len(),
            keys.len(),
            failed.join(", ")
        ));
    }
    let mut lost = Vec::new();
    for (k, want) in bulk {
        let got = loop {
            match client.get(k).await {
                Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
                got => break got,
            }
        };
        match got {
            Ok(Some(v)) if v == want.as_bytes() => {}
            Ok(Some(v)) => lost.push(format!("{k} changed ({} bytes)", v.len())),
            Ok(None) => lost.push(format!("{k} missing")),
            Err(e) => lost.push(format!("{k} unreadable: {e}")),
        }
    }
    if !lost.is_empty() {
        anomalies.push(format!(
            "{} of {} large values written before the faults lost or unreadable: {}",
            lost.len(),
            bulk.len(),
            lost.join(", ")
        ));
    }
}

/// Keys whose final read (by [`FINAL_READER`], on the healed cluster) is
/// neither the value of the last write acknowledged before it began nor
/// one written after that: an acknowledged write lost. Each key has one
/// writer, whose writes follow one another, so what may be there is
/// exactly that.
fn lost_writes(h: &history::History) -> Vec<String> {
    struct W {
        value: u64,
        inv: usize,
        ret: Option<usize>,
    }
    let mut writes: BTreeMap<&str, Vec<W>> = BTreeMap::new();
    let mut finals: Vec<(&str, u64, usize)> = Vec::new();
    let mut open: BTreeMap<(usize, &str), usize> = BTreeMap::new();
    for (at, e) in h.events.iter().enumerate() {
        match e {
            Event::Invoke(t, k, op) => {
                if let RegisterOp::Write(v) = op {
                    writes.entry(k).or_default().push(W { value: *v, inv: at, ret: None });
                }
                open.insert((*t, k), at);
            }
            Event::Return(t, k, ret) => {
                let Some(inv) = open.remove(&(*t, k.as_str())) else { continue };
                match ret {
                    RegisterRet::WriteOk => {
                        if let Some(w) = writes.get_mut(k.as_str()).and_then(|ws| ws.iter_mut().find(|w| w.inv == inv))
                        {
                            w.ret = Some(at);
                        }
                    }
                    RegisterRet::ReadOk(v) if h.labels.get(*t).is_some_and(|l| l == FINAL_READER) => {
                        finals.push((k, *v, inv))
                    }
                    RegisterRet::ReadOk(_) => {}
                }
            }
        }
    }
    let show = |v: u64| if v == ABSENT { "absent".to_string() } else { v.to_string() };
    let mut lost = Vec::new();
    for (k, got, inv) in finals {
        let ws = writes.get(k).map(Vec::as_slice).unwrap_or_default();
        let from = ws.iter().rposition(|w| w.ret.is_some_and(|r| r < inv));
        let allowed: Vec<u64> = match from {
            Some(i) => ws[i..].iter().map(|w| w.value).collect(),
            None => std::iter::once(0).chain(ws.iter().map(|w| w.value)).collect(),
        };
        if !allowed.contains(&got) {
            lost.push(match from {
                Some(i) => format!(
                    "key {k}: the healed cluster returns {}, but write {} was acknowledged (t={:.3}s) and nothing after it wrote that",
                    show(got),
                    show(ws[i].value),
                    ws[i].ret.map_or(f64::NAN, |r| h.times[r].as_secs_f64()),
                ),
                None => format!("key {k}: the healed cluster returns {}, which no write wrote", show(got)),
            });
        }
    }
    lost
}

/// A STATS counter summed over the running nodes.
async fn counter_sum(c: &TestCluster, name: &str) -> u64 {
    let mut sum = 0;
    for i in 0..c.len() {
        if let Ok(client) = Client::connect_with(c.rpc(i), client_config(ReadPath::Rpc, None, true)).await
            && let Ok(s) = client.stats().await
        {
            sum += s.get(name).copied().unwrap_or(0);
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    fn history(events: Vec<Event>, labels: &[&str]) -> history::History {
        let times = (0..events.len()).map(|i| Duration::from_millis(i as u64)).collect();
        history::History { events, times, labels: labels.iter().map(|l| l.to_string()).collect() }
    }

    #[test]
    fn a_final_read_older_than_an_acknowledged_write_is_a_lost_write() {
        use RegisterOp::{Read, Write};
        use RegisterRet::{ReadOk, WriteOk};
        let k = || "k".to_string();
        let writes = vec![
            Event::Invoke(0, k(), Write(1)),
            Event::Return(0, k(), WriteOk),
            Event::Invoke(0, k(), Write(2)),
            Event::Return(0, k(), WriteOk),
            // A write that failed: it may or may not have taken effect.
            Event::Invoke(0, k(), Write(3)),
        ];
        let read = |v| vec![Event::Invoke(1, k(), Read), Event::Return(1, k(), ReadOk(v))];
        let labels = ["writer", FINAL_READER];
        for (v, lost) in [(1, true), (2, false), (3, false), (0, true), (ABSENT, true)] {
            let h = history([writes.clone(), read(v)].concat(), &labels);
            assert_eq!(!lost_writes(&h).is_empty(), lost, "final read of {v}: {:?}", lost_writes(&h));
        }
        // Only the final reader's reads count: a reader mid-run may see 1.
        let h = history([writes.clone(), read(1)].concat(), &["writer", "get rpc via 1"]);
        assert!(lost_writes(&h).is_empty());
    }

    #[test]
    fn node_logs_are_cut_to_distinct_warnings() {
        let log = "== the test starts node 1\n\
                   2026-12-01T00:00:01Z  INFO x: fine\n\
                   2026-12-01T00:00:02Z  WARN x: cannot reach peer\n\
                   2026-12-01T00:00:03Z  WARN x: cannot reach peer\n\
                   2026-12-01T00:00:04Z ERROR x: shard replica stopped\n";
        let lines = notable_log_lines(0, log);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("node 1 (2x): 2026-12-01T00:00:02Z  WARN"), "{lines:?}");
        assert!(lines[1].contains("ERROR x: shard replica stopped"));
    }
}
