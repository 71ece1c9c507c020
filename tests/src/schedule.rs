//! Fault schedules: what the nemesis does to a test cluster, when, to
//! whom and for how long, decided by one `u64` seed (or written out by
//! hand for a directed scenario). Pure data: [`crate::nemesis`] carries a
//! schedule out against real processes.
//!
//! A step names its target by role (the leader of shard 1, a follower of
//! shard 2) rather than by node, because which node leads changes under
//! faults; the nemesis resolves the role when the step begins and logs
//! the node. So the seed fixes the steps exactly, while their timing
//! against the cluster's own (elections, snapshots, the scheduler of a
//! 2-core machine) is not deterministic: a replay repeats the same faults
//! at the same offsets, not the same interleaving.

use std::time::Duration;

use dmkv_client::{ReadPath, Transport};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::skewed::Skew;

/// Shards of the fault clusters.
pub const SHARDS: u32 = 3;
/// Nodes of the fault clusters.
pub const NODES: usize = 3;

/// Who a step hits, resolved when it begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The node leading the shard.
    Leader(u32),
    /// The shard's `n`-th follower (0 or 1, by node id).
    Follower(u32, usize),
    /// Node index `i`, whatever it leads.
    Node(usize),
}

/// Which node a snapshot fault kills a second time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotVictim {
    /// The follower receiving (and saving, installing) the snapshot.
    Receiver,
    /// The leader building and sending it.
    Sender,
}

/// One fault; it lasts its step's `hold`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// kill -9, restarted from its data directory after the hold.
    Kill(Target),
    /// SIGSTOP, SIGCONT after the hold.
    Pause(Target),
    /// SIGSTOP the leader of the shard the moment (as far as the test can
    /// tell) after it acknowledged a write of one of the shard's keys:
    /// its followers may have the entry without knowing it is committed.
    PauseAfterAck(u32),
    /// Packets from the first node's peer IP to the second's dropped,
    /// nothing the other way.
    Cut(Target, Target),
    /// Every packet between the node's peer IP and the others' dropped.
    Isolate(Target),
    /// The node's data directory full (a ballast file), freed after.
    FullDisk(Target),
    /// A follower of the shard killed for the hold while writes go on
    /// (the leader's log is cut past it: it must catch up by snapshot),
    /// restarted, and `delay` after the restart the victim killed again,
    /// amid the snapshot's transfer or installation, and restarted
    /// [`SNAPSHOT_VICTIM_DOWN`] later.
    SnapshotKill { shard: u32, victim: SnapshotVictim, delay: Duration },
}

/// How long a snapshot fault's second victim stays down.
pub const SNAPSHOT_VICTIM_DOWN: Duration = Duration::from_millis(700);

/// A fault at an offset from the start of the faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub at: Duration,
    pub hold: Duration,
    pub fault: Fault,
}

/// The clients of a schedule, besides the default set (see
/// [`crate::faults`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clients {
    /// Readers in child processes with their clocks off.
    pub skewed: Vec<Skew>,
    /// Sleep before each in-process read.
    pub pace: Duration,
    /// One-sided readers (shm and engine) on top of the default set, to
    /// keep more threads runnable than there are cores.
    pub extra_one_sided: usize,
    /// Padding of each written value, bytes (see
    /// [`crate::workload::ClientSpec::pad`]).
    pub pad: usize,
}

/// Default padding of written values: a node's log grows by about a
/// megabyte a second, so a full disk stops its appends within a second
/// or two (raft-engine allocates its files 2 MiB ahead).
pub const DEFAULT_PAD: usize = 1024;

impl Default for Clients {
    fn default() -> Self {
        Clients { skewed: Vec::new(), pace: Duration::from_millis(2), extra_one_sided: 0, pad: DEFAULT_PAD }
    }
}

/// A whole schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    pub name: String,
    pub seed: u64,
    pub steps: Vec<Step>,
    /// How long the faults run (the last step may end later: the run
    /// waits for every hold).
    pub length: Duration,
    pub clients: Clients,
}

impl Target {
    /// What it is, for a step's line.
    pub fn describe(&self) -> String {
        match self {
            Target::Leader(s) => format!("the leader of shard {s}"),
            Target::Follower(s, n) => format!("follower {n} of shard {s}"),
            Target::Node(i) => format!("node {}", i + 1),
        }
    }
}

impl Step {
    /// One line: when, what, to whom, how long.
    pub fn describe(&self) -> String {
        let (at, hold) = (self.at.as_secs_f64(), self.hold.as_millis());
        let what = match self.fault {
            Fault::Kill(t) => format!("kill -9 {}, restart after {hold} ms", t.describe()),
            Fault::Pause(t) => format!("SIGSTOP {} for {hold} ms", t.describe()),
            Fault::PauseAfterAck(s) => {
                format!("SIGSTOP the leader of shard {s} right after it acknowledged a write, for {hold} ms")
            }
            Fault::Cut(a, b) => {
                format!("drop packets from {} to {} (one way) for {hold} ms", a.describe(), b.describe())
            }
            Fault::Isolate(t) => format!("isolate {} (both ways) for {hold} ms", t.describe()),
            Fault::FullDisk(t) => format!("fill the data disk of {} for {hold} ms", t.describe()),
            Fault::SnapshotKill { shard, victim, delay } => format!(
                "kill -9 follower 0 of shard {shard} for {hold} ms of writes, restart it, {} ms later kill -9 the snapshot's {} (down {} ms)",
                delay.as_millis(),
                match victim {
                    SnapshotVictim::Receiver => "receiver",
                    SnapshotVictim::Sender => "sender (the leader)",
                },
                SNAPSHOT_VICTIM_DOWN.as_millis()
            ),
        };
        format!("t+{at:.3}s: {what}")
    }

    /// When its last action is due, from the start of the faults.
    pub fn end(&self) -> Duration {
        match self.fault {
            Fault::SnapshotKill { delay, .. } => self.at + self.hold + delay + SNAPSHOT_VICTIM_DOWN,
            _ => self.at + self.hold,
        }
    }
}

impl Schedule {
    /// Every step, a line each, for reports.
    pub fn describe(&self) -> Vec<String> {
        let mut lines = vec![format!(
            "schedule {} seed={} ({} steps over {:.1} s)",
            self.name,
            self.seed,
            self.steps.len(),
            self.length.as_secs_f64()
        )];
        // Skewed readers connect through the nodes in turn (faults::run).
        let clocks = self.clients.skewed.iter().enumerate().map(|(n, s)| format!("  clock: {}", s.label(n % NODES)));
        lines.extend(clocks);
        lines.extend(self.steps.iter().map(|s| format!("  {}", s.describe())));
        lines
    }

    /// When the last step's last action is due.
    pub fn end(&self) -> Duration {
        self.steps.iter().map(Step::end).max().unwrap_or_default().max(self.length)
    }

    /// The schedule `seed` makes: steps of every kind at random offsets
    /// over `length`, overlapping at times, on random roles; sometimes
    /// readers with their clocks ±5 s off.
    pub fn random(seed: u64, length: Duration) -> Schedule {
        let mut rng = StdRng::seed_from_u64(seed);
        let ms = |rng: &mut StdRng, lo: u64, hi: u64| Duration::from_millis(rng.random_range(lo..=hi));
        let mut steps = Vec::new();
        let mut at = ms(&mut rng, 300, 1000);
        while at + Duration::from_millis(500) < length {
            let target = |rng: &mut StdRng| {
                let shard = rng.random_range(0..SHARDS);
                match rng.random_range(0..5) {
                    0 | 1 => Target::Leader(shard),
                    2 | 3 => Target::Follower(shard, rng.random_range(0..2)),
                    _ => Target::Node(rng.random_range(0..NODES)),
                }
            };
            let (fault, hold) = match rng.random_range(0..100) {
                0..14 => (Fault::Kill(target(&mut rng)), ms(&mut rng, 200, 2000)),
                14..28 => (Fault::Pause(target(&mut rng)), ms(&mut rng, 10, 90)),
                28..38 => (Fault::Pause(target(&mut rng)), ms(&mut rng, 1000, 3000)),
                38..44 => (Fault::PauseAfterAck(rng.random_range(0..SHARDS)), ms(&mut rng, 700, 2000)),
                44..62 => {
                    let shard = rng.random_range(0..SHARDS);
                    let f = Target::Follower(shard, rng.random_range(0..2));
                    let (a, b) =
                        if rng.random_bool(0.5) { (Target::Leader(shard), f) } else { (f, Target::Leader(shard)) };
                    (Fault::Cut(a, b), ms(&mut rng, 300, 2500))
                }
                62..70 => (Fault::Isolate(target(&mut rng)), ms(&mut rng, 300, 2000)),
                70..84 => (Fault::FullDisk(target(&mut rng)), ms(&mut rng, 500, 3000)),
                _ => {
                    let victim = if rng.random_bool(0.5) { SnapshotVictim::Receiver } else { SnapshotVictim::Sender };
                    let delay = ms(&mut rng, 0, 1500);
                    (
                        Fault::SnapshotKill { shard: rng.random_range(0..SHARDS), victim, delay },
                        ms(&mut rng, 2500, 4000),
                    )
                }
            };
            let step = Step { at, hold, fault };
            steps.push(step);
            // The next one begins during this one at times, after it mostly.
            at += if rng.random_bool(0.3) { ms(&mut rng, 100, 600) } else { step.end() - at + ms(&mut rng, 200, 1200) };
        }
        let mut clients = Clients::default();
        if rng.random_bool(0.5) {
            let offset_ms = if rng.random_bool(0.5) { -5000 } else { 5000 };
            let (path, transport) = match rng.random_range(0..3) {
                0 => (ReadPath::OneSided, Some(Transport::Shm)),
                1 => (ReadPath::OneSided, Some(Transport::Engine)),
                _ => (ReadPath::Auto, None),
            };
            clients.skewed.push(Skew { offset_ms, path, transport });
        }
        Schedule { name: "random".into(), seed, steps, length, clients }
    }
}

/// A seed from the clock, for runs not told one.
pub fn fresh_seed() -> u64 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    splitmix(t ^ u64::from(std::process::id()) << 32)
}

/// The `n`-th seed derived from `seed` (a run of many schedules from one).
pub fn derive(seed: u64, n: u64) -> u64 {
    splitmix(seed.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)))
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_makes_one_schedule() {
        let len = Duration::from_secs(12);
        assert_eq!(Schedule::random(7, len), Schedule::random(7, len));
        assert_ne!(Schedule::random(7, len).steps, Schedule::random(8, len).steps);
        let kinds: std::collections::BTreeSet<String> = (0..200)
            .flat_map(|s| Schedule::random(s, len).steps)
            .map(|s| format!("{:?}", s.fault).split('(').next().unwrap().split(' ').next().unwrap().to_string())
            .collect();
        assert_eq!(kinds.len(), 7, "every kind of fault comes up: {kinds:?}");
        for s in (0..50).map(|s| Schedule::random(s, len)) {
            assert!(!s.steps.is_empty() && s.steps.iter().all(|st| st.at < len), "{:?}", s.describe());
        }
    }
}
