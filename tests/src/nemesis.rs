//! Carries a [`Schedule`] out against a [`TestCluster`] of real dmkvd
//! processes: kill -9 and restarts, SIGSTOP/SIGCONT, nftables cuts (one
//! way or both), a full data disk, restarts amid snapshot traffic. Each
//! step's role (the leader of shard 1, ...) is resolved to a node when
//! the step begins, from the nodes' own view (`cluster status`), and its
//! later actions (the restart, the SIGCONT, the heal) hit that same node.
//! Every action is logged with its time on the [`Recorder`]'s clock, so
//! that an anomaly's time in the history lines up with the faults.
//!
//! Steps that cannot apply when they are due (the role has no node now:
//! no leader mid-election; the node is down already) are logged as
//! skipped: real processes race the schedule, which fixes the steps and
//! their offsets only.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use dmkv_client::{Client, ReadPath};

use crate::cluster::TestCluster;
use crate::history::{Recorder, client_config};
use crate::partition::Partition;
use crate::schedule::{Fault, SNAPSHOT_VICTIM_DOWN, Schedule, SnapshotVictim, Step, Target};

/// How long a role may take to resolve (an election under way).
const RESOLVE_DEADLINE: Duration = Duration::from_millis(1500);
/// How long one node gets to answer `cluster status`.
const STATUS_TIMEOUT: Duration = Duration::from_millis(500);
/// Restarts tried per node when healing (a node whose disk was just
/// freed, or whose port is briefly taken, may fail once).
const RESTART_TRIES: usize = 3;
/// How long a pause timed to an acknowledgement waits for one.
const ACK_WAIT: Duration = Duration::from_millis(1000);
/// How long replicas stopped by a full disk get to resume once it is
/// freed: the supervisor's longest pause between tries (the server's
/// `MAX_RESTART_PAUSE`, 1 s), and 2 s to restore and replay. Polled: most
/// resume well before.
const RESUME_GRACE: Duration = Duration::from_millis(3000);
const RESUME_POLL: Duration = Duration::from_millis(100);
/// Lines of a node's log quoted when it exits by itself.
const LOG_TAIL: usize = 12;

/// The nemesis: a cluster and what has been done to it.
pub struct Nemesis<'a> {
    c: &'a mut TestCluster,
    rt: tokio::runtime::Runtime,
    clock: Recorder,
    /// What was done, a line each: `t=1.234s step 2: ...`.
    pub log: Vec<String>,
    /// Nodes that exited by themselves: a line each, with their log's tail.
    pub crashes: Vec<Crash>,
    /// Replicas that stopped (a shard thread that died) and did not come
    /// back once their fault was over: a line each. The nemesis restarts
    /// their node, so that the rest of the schedule meets a whole cluster.
    pub stuck: Vec<String>,
    /// Per step that applied, when it began and (once over) ended, on
    /// the recorder's clock, and the node it hit first.
    pub spans: BTreeMap<usize, Span>,
    /// Per step, the nodes its roles resolved to.
    resolved: BTreeMap<usize, Vec<usize>>,
    /// Each history key's shard, for faults timed to a write of a shard.
    shard_of: BTreeMap<String, u32>,
    cuts: BTreeMap<usize, Partition>,
    paused: BTreeSet<usize>,
    /// Killed by the nemesis (or exited), to be restarted.
    down: BTreeSet<usize>,
    full: BTreeSet<usize>,
}

/// When a step was in force, and on which node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub node: usize,
    pub begin: Duration,
    pub end: Option<Duration>,
}

/// A node that exited without being killed.
#[derive(Debug, Clone)]
pub struct Crash {
    pub node: usize,
    /// Whether its data disk was full then.
    pub disk_full: bool,
    pub line: String,
}

impl<'a> Nemesis<'a> {
    /// A nemesis for `c`, logging times on `clock`'s.
    pub fn new(c: &'a mut TestCluster, clock: &Recorder) -> Result<Nemesis<'a>, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start a runtime: {e}"))?;
        Ok(Nemesis {
            c,
            rt,
            clock: clock.clone(),
            log: Vec::new(),
            crashes: Vec::new(),
            stuck: Vec::new(),
            spans: BTreeMap::new(),
            resolved: BTreeMap::new(),
            shard_of: BTreeMap::new(),
            cuts: BTreeMap::new(),
            paused: BTreeSet::new(),
            down: BTreeSet::new(),
            full: BTreeSet::new(),
        })
    }

    /// Tells the nemesis each key's shard (for [`Fault::PauseAfterAck`]).
    pub fn with_shards(mut self, shard_of: BTreeMap<String, u32>) -> Self {
        self.shard_of = shard_of;
        self
    }

    /// Runs every step of `s` at its offset from now; returns when the
    /// last action is done.
    pub fn run(&mut self, s: &Schedule) {
        let start = Instant::now();
        let mut timeline: Vec<(Duration, usize, usize)> = Vec::new();
        for (i, step) in s.steps.iter().enumerate() {
            for (phase, at) in phases(step).into_iter().enumerate() {
                timeline.push((at, i, phase));
            }
        }
        timeline.sort();
        let last: BTreeMap<usize, usize> = timeline.iter().map(|&(_, i, p)| (i, p)).collect();
        for (at, i, phase) in timeline {
            std::thread::sleep((start + at).saturating_duration_since(Instant::now()));
            self.act(i, &s.steps[i], phase);
            let now = self.clock.elapsed();
            match self.resolved.get(&i).and_then(|v| v.first()) {
                Some(&node) if phase == 0 => {
                    self.spans.insert(i, Span { node, begin: now, end: None });
                }
                _ if last.get(&i) == Some(&phase) => {
                    if let Some(span) = self.spans.get_mut(&i) {
                        span.end = Some(now);
                        self.note_leaders(i);
                    }
                }
                _ => {}
            }
            self.look_for_crashes();
        }
    }

    /// Ends every fault still on: SIGCONT, cuts healed, disks freed, nodes
    /// that are down (killed, or exited) started again. Problems, a line
    /// each (a node that would not start).
    pub fn heal(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        for n in std::mem::take(&mut self.paused) {
            self.c.signal(n, "CONT");
            self.note(None, format!("heal: SIGCONT node {}", n + 1));
        }
        for (_, p) in std::mem::take(&mut self.cuts) {
            if let Err(e) = p.heal() {
                problems.push(format!("heal: {e}"));
            }
        }
        for n in std::mem::take(&mut self.full) {
            if let Some(Err(e)) = self.c.disk(n).map(|d| d.drain()) {
                problems.push(format!("heal: node {}: {e}", n + 1));
            }
            self.note(None, format!("heal: freed the disk of node {}", n + 1));
        }
        self.look_for_crashes();
        for n in self.down.clone() {
            let mut last = Ok(());
            for _ in 0..RESTART_TRIES {
                last = self.c.try_restart(n);
                if last.is_ok() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            match last {
                Ok(()) => {
                    self.down.remove(&n);
                    self.note(None, format!("heal: restarted node {}", n + 1));
                }
                Err(e) => problems.push(format!("heal: node {} would not start: {e}", n + 1)),
            }
        }
        problems
    }

    /// Nodes that exited by themselves since the last look: reaped (so
    /// that heal restarts them) and reported with their log's tail.
    pub fn look_for_crashes(&mut self) {
        for n in 0..self.c.len() {
            if self.down.contains(&n) || !self.c.started(n) || self.c.running(n) {
                continue;
            }
            let status = self.c.reap(n).map_or("unknown status".into(), |s| s.to_string());
            self.down.insert(n);
            self.paused.remove(&n);
            let disk_full = self.full.contains(&n);
            let log = self.c.log(n);
            let tail: Vec<&str> = log.lines().rev().take(LOG_TAIL).collect::<Vec<_>>().into_iter().rev().collect();
            let line = format!(
                "node {} exited by itself ({status}){}; its log ends:\n    {}",
                n + 1,
                if disk_full { " while its data disk was full" } else { "" },
                tail.join("\n    ")
            );
            self.note(None, format!("node {} exited by itself ({status})", n + 1));
            self.crashes.push(Crash { node: n, disk_full, line });
        }
    }

    fn note(&mut self, step: Option<usize>, what: String) {
        let at = self.clock.elapsed().as_secs_f64();
        let line = match step {
            Some(i) => format!("t={at:.3}s step {i}: {what}"),
            None => format!("t={at:.3}s {what}"),
        };
        self.log.push(line);
    }

    fn act(&mut self, i: usize, step: &Step, phase: usize) {
        let name = |n: usize| format!("node {}", n + 1);
        match (step.fault, phase) {
            (Fault::Kill(t), 0) => {
                if let Some(n) = self.begin(i, &[t]).map(|v| v[0]) {
                    self.kill(i, n, &t.describe());
                }
            }
            (Fault::Kill(_), _) => self.for_resolved(i, |me, n| me.restart(i, n)),
            (Fault::Pause(t), 0) => {
                let Some(n) = self.begin(i, &[t]).map(|v| v[0]) else { return };
                if self.down.contains(&n) || !self.c.signal(n, "STOP") {
                    self.note(Some(i), format!("skipped SIGSTOP: {} is down", name(n)));
                    self.resolved.remove(&i);
                    return;
                }
                self.paused.insert(n);
                self.note(Some(i), format!("SIGSTOP {} ({})", name(n), t.describe()));
            }
            (Fault::PauseAfterAck(shard), 0) => {
                let Some(n) = self.begin(i, &[Target::Leader(shard)]).map(|v| v[0]) else { return };
                let shard_of = &self.shard_of;
                let acked = self.clock.await_ack(|k| shard_of.get(k) == Some(&shard), ACK_WAIT);
                // The signal sent directly: spawning `kill` takes
                // milliseconds, in which the leader tells its followers.
                let pid = self.c.pid(n).map(|p| rustix::process::Pid::from_raw(p as i32));
                let sent = pid
                    .flatten()
                    .is_some_and(|p| rustix::process::kill_process(p, rustix::process::Signal::STOP).is_ok());
                if !sent {
                    self.note(Some(i), format!("skipped SIGSTOP: {} is down", name(n)));
                    self.resolved.remove(&i);
                    return;
                }
                self.paused.insert(n);
                let after = if acked { "right after an acknowledged write" } else { "(no write acknowledged in time)" };
                self.note(Some(i), format!("SIGSTOP {} (the leader of shard {shard}) {after}", name(n)));
            }
            (Fault::Pause(_) | Fault::PauseAfterAck(_), _) => self.for_resolved(i, |me, n| {
                if me.paused.remove(&n) {
                    me.c.signal(n, "CONT");
                    me.note(Some(i), format!("SIGCONT {}", name(n)));
                }
            }),
            (Fault::Cut(a, b), 0) => {
                let Some(v) = self.begin(i, &[a, b]) else { return };
                let (from, to) = (v[0], v[1]);
                let what = format!("{} ({}) to {} ({})", name(from), a.describe(), name(to), b.describe());
                match Partition::one_way(&[(self.c.peer_ip(from), self.c.peer_ip(to))]) {
                    Ok(p) => {
                        self.cuts.insert(i, p);
                        self.note(Some(i), format!("cut packets from {what}"));
                    }
                    Err(e) => self.note(Some(i), format!("skipped the cut from {what}: {e}")),
                }
            }
            (Fault::Isolate(t), 0) => {
                let Some(n) = self.begin(i, &[t]).map(|v| v[0]) else { return };
                let others: Vec<_> = (0..self.c.len()).filter(|&o| o != n).map(|o| self.c.peer_ip(o)).collect();
                match Partition::isolate(self.c.peer_ip(n), &others) {
                    Ok(p) => {
                        self.cuts.insert(i, p);
                        self.note(Some(i), format!("isolated {} ({})", name(n), t.describe()));
                    }
                    Err(e) => self.note(Some(i), format!("skipped isolating {}: {e}", name(n))),
                }
            }
            (Fault::Cut(..) | Fault::Isolate(_), _) => {
                if let Some(p) = self.cuts.remove(&i) {
                    let dropped = p.dropped().map_or(0, |d| d.nodes);
                    let healed = p.heal().err().map_or(String::new(), |e| format!(" ({e})"));
                    self.note(Some(i), format!("healed the cut ({dropped} packets dropped){healed}"));
                }
            }
            (Fault::FullDisk(t), 0) => {
                let Some(n) = self.begin(i, &[t]).map(|v| v[0]) else { return };
                match self.c.disk(n).map(|d| d.fill()) {
                    Some(Ok(free)) => {
                        self.full.insert(n);
                        self.note(
                            Some(i),
                            format!("filled the disk of {} ({}), {free} bytes left", name(n), t.describe()),
                        );
                    }
                    Some(Err(e)) => self.note(Some(i), format!("could not fill the disk of {}: {e}", name(n))),
                    None => self.note(Some(i), format!("skipped: {} has no disk of its own", name(n))),
                }
            }
            (Fault::FullDisk(_), _) => self.for_resolved(i, |me, n| {
                if me.full.remove(&n) {
                    let r = me.c.disk(n).map(|d| d.drain());
                    let e = match r {
                        Some(Err(e)) => format!(" ({e})"),
                        _ => String::new(),
                    };
                    me.note(Some(i), format!("freed the disk of {}{e}", name(n)));
                    me.revive_stopped(i, n);
                }
            }),
            (Fault::SnapshotKill { shard, .. }, 0) => {
                let t = Target::Follower(shard, 0);
                if let Some(n) = self.begin(i, &[t]).map(|v| v[0]) {
                    self.kill(i, n, &format!("{}, to catch up by snapshot", t.describe()));
                }
            }
            (Fault::SnapshotKill { .. }, 1) => self.for_resolved(i, |me, n| me.restart(i, n)),
            (Fault::SnapshotKill { shard, victim, .. }, 2) => {
                let Some(&receiver) = self.resolved.get(&i).and_then(|v| v.first()) else { return };
                let (n, role) = match victim {
                    SnapshotVictim::Receiver => (Some(receiver), "the snapshot's receiver".to_string()),
                    SnapshotVictim::Sender => (
                        self.resolve(&[Target::Leader(shard)]).map(|v| v[0]),
                        format!("the snapshot's sender, leader of shard {shard}"),
                    ),
                };
                let Some(n) = n else {
                    self.note(Some(i), format!("skipped killing {role}: not found"));
                    return;
                };
                self.resolved.insert(i, vec![receiver, n]);
                // Where in the snapshot's course the kill lands, as far
                // as the nodes' counters tell.
                let installed = self.counter(receiver, "shard_snapshots_installed");
                let built = self.counter(n, "shard_snapshots_built");
                let seen = |v: Option<u64>| v.map_or("?".to_string(), |v| v.to_string());
                let role = format!(
                    "{role}; snapshots installed by the receiver since its restart: {}, built by the victim: {}",
                    seen(installed),
                    seen(built)
                );
                self.kill(i, n, &role);
            }
            (Fault::SnapshotKill { .. }, _) => {
                if let Some(&n) = self.resolved.get(&i).and_then(|v| v.get(1)) {
                    self.restart(i, n);
                }
            }
        }
    }

    /// Resolves a step's roles and remembers the nodes (or logs the skip).
    fn begin(&mut self, i: usize, targets: &[Target]) -> Option<Vec<usize>> {
        match self.resolve(targets) {
            Some(v) if v.windows(2).all(|w| w[0] != w[1]) => {
                self.resolved.insert(i, v.clone());
                Some(v)
            }
            got => {
                let roles: Vec<String> = targets.iter().map(Target::describe).collect();
                let why = if got.is_some() { "the same node" } else { "no such node now" };
                self.note(Some(i), format!("skipped: {} resolve to {why}", roles.join(" and ")));
                None
            }
        }
    }

    fn for_resolved(&mut self, i: usize, f: impl FnOnce(&mut Self, usize)) {
        if let Some(&n) = self.resolved.get(&i).and_then(|v| v.first()) {
            f(self, n);
        }
    }

    /// After a fault that may have stopped node `n`'s replicas (their raft
    /// log could not be written): if any is still stopped
    /// [`RESUME_GRACE`] later, says so in [`Nemesis::stuck`] and restarts
    /// the node (kill -9, then from its data directory).
    fn revive_stopped(&mut self, i: usize, n: usize) {
        if self.down.contains(&n) {
            return;
        }
        let addr = self.c.rpc(n).to_string();
        let freed = std::time::Instant::now();
        let stopped = loop {
            let status = self.rt.block_on(async {
                let ask = async {
                    let c = Client::connect_with(&addr, client_config(ReadPath::Rpc, None, true)).await.ok()?;
                    c.cluster_status().await.ok()
                };
                tokio::time::timeout(STATUS_TIMEOUT, ask).await.ok().flatten()
            });
            let stopped: Vec<u32> = match status {
                Some(s) => s.local.iter().filter(|r| r.role == "stopped").map(|r| r.shard).collect(),
                None => Vec::new(),
            };
            if stopped.is_empty() {
                return;
            }
            if freed.elapsed() >= RESUME_GRACE {
                break stopped;
            }
            std::thread::sleep(RESUME_POLL);
        };
        self.stuck.push(format!(
            "node {}: its replicas of shards {stopped:?} stopped while its disk was full and had not resumed {} ms after it was freed (the process runs on, so no supervisor would restart it)",
            n + 1,
            RESUME_GRACE.as_millis()
        ));
        self.note(Some(i), format!("replicas of shards {stopped:?} on node {} stayed stopped: restarting it", n + 1));
        self.kill(i, n, "its replicas stopped");
        self.restart(i, n);
    }

    fn kill(&mut self, i: usize, n: usize, role: &str) {
        if self.down.contains(&n) {
            self.note(Some(i), format!("skipped kill -9: node {} is down", n + 1));
            return;
        }
        self.c.kill(n);
        self.down.insert(n);
        self.paused.remove(&n);
        self.note(Some(i), format!("kill -9 node {} ({role})", n + 1));
    }

    fn restart(&mut self, i: usize, n: usize) {
        if !self.down.contains(&n) {
            return;
        }
        match self.c.try_restart(n) {
            Ok(()) => {
                self.down.remove(&n);
                self.note(Some(i), format!("restarted node {}", n + 1));
            }
            Err(e) => self.note(Some(i), format!("restart of node {} failed (healing retries): {e}", n + 1)),
        }
    }

    /// The nodes `targets` name now, from one view of the cluster: the
    /// leader of a shard is the node whose replica says so with the
    /// highest term among those that answer (a deposed leader cut off may
    /// still believe it leads, under an older term).
    fn resolve(&mut self, targets: &[Target]) -> Option<Vec<usize>> {
        let deadline = Instant::now() + RESOLVE_DEADLINE;
        loop {
            let leaders = self.leaders();
            let one = |t: &Target| -> Option<usize> {
                match *t {
                    Target::Node(n) => Some(n),
                    Target::Leader(s) => leaders.get(&s).copied(),
                    Target::Follower(s, k) => {
                        let l = *leaders.get(&s)?;
                        (0..self.c.len()).filter(|&n| n != l).nth(k)
                    }
                }
            };
            let got: Option<Vec<usize>> = targets.iter().map(one).collect();
            if got.is_some() || Instant::now() >= deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// A STATS counter of node `n` (none if it does not answer at once).
    fn counter(&self, n: usize, name: &str) -> Option<u64> {
        let addr = self.c.rpc(n).to_string();
        self.rt.block_on(async {
            let ask = async {
                let c = Client::connect_with(&addr, client_config(ReadPath::Rpc, None, true)).await.ok()?;
                c.stats().await.ok()
            };
            tokio::time::timeout(STATUS_TIMEOUT, ask).await.ok().flatten()?.get(name).copied()
        })
    }

    /// Shard → leading node index, as the running, unpaused nodes see it.
    fn leaders(&self) -> BTreeMap<u32, usize> {
        self.leaders_and_terms().into_iter().map(|(s, (_, n))| (s, n)).collect()
    }

    /// Shard → (term, leading node index), as the running, unpaused nodes
    /// see it.
    fn leaders_and_terms(&self) -> BTreeMap<u32, (u64, usize)> {
        let asked: Vec<(usize, String)> = (0..self.c.len())
            .filter(|n| !self.paused.contains(n) && !self.down.contains(n))
            .map(|n| (n, self.c.rpc(n).to_string()))
            .collect();
        let views = self.rt.block_on(async {
            let mut views = Vec::new();
            for (n, addr) in asked {
                let ask = async {
                    let c = Client::connect_with(&addr, client_config(ReadPath::Rpc, None, true)).await.ok()?;
                    c.cluster_status().await.ok()
                };
                if let Ok(Some(s)) = tokio::time::timeout(STATUS_TIMEOUT, ask).await {
                    views.push((n, s));
                }
            }
            views
        });
        let mut best: BTreeMap<u32, (u64, usize)> = BTreeMap::new();
        for (n, s) in views {
            for r in s.local.iter().filter(|r| r.role == "leader") {
                let e = best.entry(r.shard).or_insert((r.term, n));
                if r.term > e.0 {
                    *e = (r.term, n);
                }
            }
        }
        best
    }

    /// Logs who leads each shard now, and in which term: whether a fault
    /// moved leadership is half of what a report has to say.
    fn note_leaders(&mut self, i: usize) {
        let line: Vec<String> =
            self.leaders_and_terms().iter().map(|(s, (t, n))| format!("shard {s}: node {} term {t}", n + 1)).collect();
        self.note(
            Some(i),
            format!("leaders now: {}", if line.is_empty() { "none known".into() } else { line.join(", ") }),
        );
    }
}

/// When each of a step's actions is due, from the start of the faults.
fn phases(step: &Step) -> Vec<Duration> {
    match step.fault {
        Fault::SnapshotKill { delay, .. } => {
            let back = step.at + step.hold;
            vec![step.at, back, back + delay, back + delay + SNAPSHOT_VICTIM_DOWN]
        }
        _ => vec![step.at, step.at + step.hold],
    }
}
