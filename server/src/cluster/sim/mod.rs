//! A deterministic simulation of one shard, on virtual time, from one seed:
//! three replicas (each a [`ShardCore`] with its store, the lease
//! publisher and the shard thread's tick rule), clients that write and
//! read over every path (one-sided on the leader host's clock, through the
//! engine's stamps, or by bounds from clock samples; RPC under the lease
//! or after a quorum round), and faults: messages lost, duplicated,
//! delayed and reordered; partitions of a node, and of one direction
//! between two; crashes and restarts from what was persisted; replicas
//! started again in place over their emptied store; stores with no room;
//! stalls of any replica's thread; readers preempted in the middle of a
//! batch; clock rates apart by the drift bound.
//!
//! It checks what one-sided and RPC reads rest on, at every step: every
//! lease block that holds at that true time belongs to one replica in one
//! term (a crashed replica's region keeps its last block), and its region
//! holds every write acknowledged before; and, at the end, that the
//! clients' history has no stale read and no read back in time
//! ([`history`]). The rules under test can be switched to the ones they
//! replaced ([`Rules`]), so each test shows the old rule failing on the
//! schedules the new one passes.
//!
//! `DMKV_SIM_SEEDS=N` runs N seeds per test instead of the default, and
//! `DMKV_SIM_SEED=S` runs seed S alone; a failure names its seed. Every
//! random choice comes from the seed, raft's election timeouts too
//! (`draw_election_timeout`); what the seed does not fix is when the
//! store's epoch-based reclamation frees space, which other threads of the
//! process share: a seed replays step for step in a test run alone
//! (`-- --test-threads=1`).

pub mod history;
mod reader;

use std::sync::Arc;

use dmkv_common::cluster::lease::LeaseConfig;
use dmkv_common::cluster::lease_check::{AttemptStart, LeaseClock, SampledClock};
use dmkv_common::layout::{LEASE_LEN, LEASE_OFFSET, LeaseBlock};
use dmkv_common::read::Lookup;
use raft::StateRole;
use raft::prelude::{ConfState, Message};
use raft::storage::MemStorage;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::driver::{LeasePublisher, TICK, Ticker};
use super::leasing::LeaseKeeper;
use super::replica::Replica;
use super::shard::ShardCore;
use crate::region::Region;
use crate::registration::Registration;
use crate::store::Store;
use history::{History, Via};

pub const NODES: usize = 3;
pub const ELECTION_TICKS: usize = 10;
pub const MS: u64 = 1_000_000;
/// One step of virtual time.
const STEP: u64 = MS;
const TICK_NS: u64 = TICK.as_nanos() as u64;
/// Clock rates differ from true time by at most this much: far more than
/// real clocks, so that the bounds are what the rules stand on.
pub const DRIFT_PPM: i64 = 20_000;
/// Keys the clients write and read: few, so that reads race writes.
pub const KEYS: usize = 6;

/// The rules under test, or the ones they replaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    pub tick: TickRule,
    pub read: ReadRule,
    /// RPC reads granted under the lease count only if they ended before
    /// it did, on the replica's clock read after the read.
    pub rpc_post_check: bool,
    /// RPC reads count only if the store was not emptied (and refilled)
    /// since their grant.
    pub rpc_generation_check: bool,
    /// As it was: a lease is published once a quorum granted it, whether
    /// or not the store has applied the index its round read.
    pub publish_unapplied: bool,
    /// A restarted replica refuses votes for an election timeout.
    pub quiet: bool,
    /// The election timeout the lease is computed from (ticks); raft's is
    /// [`ELECTION_TICKS`]. A larger one makes leases too long.
    pub lease_timeout_ticks: u64,
    /// How a leader hands over.
    pub hand_over: HandOver,
}

/// How a leader that is told to hand over does it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandOver {
    /// As built (`ShardCore::transfer_leadership`): the lease given up
    /// first and not taken again in that term.
    Built,
    /// Fenced first, but the lease may be taken again in that term (while
    /// the transfer's TimeoutNow may still be on its way).
    FenceOnly,
    /// Raft asked to transfer, the lease kept.
    KeepLease,
}

/// How a shard thread ticks raft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TickRule {
    /// As built: [`Ticker`], before the inputs, missed ticks dropped.
    Ticker,
    /// As it was: inputs first, then every tick missed since the last, in
    /// a burst.
    Backlog,
}

/// How a one-sided reader judges a batch by the lease block it read last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadRule {
    /// As built: the attempt must lie inside one run of the lease.
    Run,
    /// As it was: the lease must only outlast the batch.
    EndOnly,
}

impl Rules {
    pub fn built() -> Rules {
        Rules {
            tick: TickRule::Ticker,
            read: ReadRule::Run,
            rpc_post_check: true,
            rpc_generation_check: true,
            publish_unapplied: false,
            quiet: true,
            lease_timeout_ticks: ELECTION_TICKS as u64,
            hand_over: HandOver::Built,
        }
    }
}

/// What goes wrong in a run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    /// Messages lost and duplicated (delay and reordering are always on).
    pub loss: bool,
    pub crashes: bool,
    /// A node cut off from the others for a while.
    pub cuts: bool,
    /// One direction between two nodes cut for a while.
    pub one_way: bool,
    /// A replica's thread stalled for up to 1.5 s.
    pub stalls: bool,
    /// Readers (and the RPC service's reading task) preempted between
    /// their reads for up to 300 ms.
    pub preempt: bool,
    /// A leader that just acknowledged a write is cut off, now and then,
    /// before its commit index reached the others.
    pub cut_after_ack: bool,
    /// At this true time (ms), the replica holding a lease crashes for
    /// good, its region (and lease block) left for readers.
    pub crash_holder_at: Option<u64>,
    /// Every few seconds: the leader's messages to one follower are
    /// dropped, and a little later the other follower's thread stalls for
    /// about an election timeout, then runs on.
    pub stalled_follower: bool,
    /// Every few seconds: the leader is cut off and its thread stalls for
    /// longer than its lease; it resumes polling on the clock it read
    /// before the stall.
    pub stalled_leader: bool,
    /// As `stalled_follower`, but the follower crashes and restarts at
    /// once instead of stalling (it forgets when it last heard from the
    /// leader).
    pub restarted_follower: bool,
    /// A replica's store runs out of room for a while (its memory filled
    /// behind raft's back): it applies nothing meanwhile.
    pub apply_stalls: bool,
    /// Every 2 s: a follower's store is filled for 1.5 s just before the
    /// writers' busy time, and amid it the leader is cut off: the full
    /// follower may win, its log ahead of its store.
    pub full_follower: bool,
    /// A replica fails and its thread starts it again in place: the same
    /// store, emptied and refilled from the log (as the supervisor does),
    /// under RPC reads granted before.
    pub in_place_restarts: bool,
    /// Now and then the leader is told to hand its leadership over, as a
    /// node that is being stopped is.
    pub hand_overs: bool,
}

impl Faults {
    pub fn all() -> Faults {
        Faults {
            loss: true,
            crashes: true,
            cuts: true,
            one_way: true,
            stalls: true,
            preempt: true,
            cut_after_ack: true,
            crash_holder_at: None,
            stalled_follower: true,
            stalled_leader: true,
            restarted_follower: true,
            apply_stalls: true,
            full_follower: true,
            in_place_restarts: true,
            hand_overs: true,
        }
    }
}

/// What a run saw.
#[derive(Debug, Default)]
pub struct Outcome {
    pub acked: usize,
    pub reads: usize,
    /// One-sided batches refused for want of a lease covering them.
    pub refused: usize,
    /// Terms in which a lease was published.
    pub leases: usize,
    pub stalls: usize,
    pub violation: Option<String>,
}

type Core = ShardCore<MemStorage, u64, u64>;

/// One replica and the node it runs on.
pub(crate) struct Node {
    core: Option<Core>,
    /// The raft log: what a crashed replica restarts from.
    storage: MemStorage,
    pub(crate) store: Arc<Store>,
    publisher: LeasePublisher,
    ppm: i64,
    offset: u64,
    ticker: Ticker,
    /// [`TickRule::Backlog`]'s next tick.
    next_tick: u64,
    stalled_until: u64,
    /// The clock the thread read just before it stalled: its first poll
    /// after the stall uses it.
    stale_clock: Option<u64>,
    /// Inputs that arrived while the thread was stalled.
    backlog: Vec<Input>,
    down_until: u64,
    /// A replica started again in place comes back at this time (0: not
    /// restarting); meanwhile its process and store live on, emptied.
    restarting_until: u64,
    /// Raft's (term, role, leader) when its election timeout was last
    /// drawn from the seed.
    drawn_for: Option<(u64, StateRole, u64)>,
    /// Bumped at every restart (a new store and region).
    pub(crate) incarnation: u64,
    /// Junk filling the store, and when it goes: (keys, until).
    full_until: Option<u64>,
}

/// An input of a shard thread.
pub(crate) enum Input {
    Raft(Message),
    /// Hand leadership over (a node about to stop).
    HandOver,
    /// An RPC read: the client's read id, whether the lease may grant it.
    Read(u64, bool),
    /// A PUT: the client's write id and the command.
    Propose(u64, Vec<u8>),
}

impl Node {
    /// This node's monotonic clock at true time `t`.
    pub(crate) fn clock(&self, t: u64) -> u64 {
        self.offset + (t as f64 * (1.0 + self.ppm as f64 / 1e6)) as u64
    }

    pub(crate) fn up(&self) -> bool {
        self.core.is_some()
    }

    /// Whether the node's process runs (its replica may be restarting).
    pub(crate) fn process_up(&self) -> bool {
        self.core.is_some() || self.restarting_until != 0
    }

    pub(crate) fn leads(&self) -> Option<u64> {
        let r = &self.core.as_ref()?.replica().raft().raft;
        (r.state == StateRole::Leader).then_some(r.term)
    }
}

/// The simulated world.
pub(crate) struct World {
    pub(crate) rng: SmallRng,
    seed: u64,
    pub(crate) faults: Faults,
    pub(crate) rules: Rules,
    pub(crate) t: u64,
    pub(crate) nodes: Vec<Node>,
    /// Messages in flight: (arrive at, input for node).
    net: Vec<(u64, usize, Input)>,
    /// A node cut off from the others until a time.
    cut: Option<(usize, u64)>,
    /// Messages from one node to another dropped until a time.
    one_way: Vec<(usize, usize, u64)>,
    /// A leader to mute towards a follower once the follower's stall ends:
    /// (leader, follower, from).
    mute_at: Option<(usize, usize, u64)>,
    /// A follower to stall once its leader checked its quorum: (follower,
    /// leader, not before).
    stall_at: Option<(usize, usize, u64)>,
    trace_last: String,
    /// Regions of crashed incarnations, for readers that still read them
    /// and for the lease check: (node, store).
    pub(crate) frozen: Vec<(usize, Arc<Store>)>,
    pub(crate) history: History,
    pub(crate) clients: Vec<Client>,
    pub(crate) out: Outcome,
    lease_terms: std::collections::BTreeSet<u64>,
    /// Per key: (highest version acknowledged, when).
    acked: Vec<(u64, u64)>,
}

fn lease_cfg(timeout_ticks: u64) -> LeaseConfig {
    LeaseConfig {
        // A follower's refusal starts at a message and ends whole ticks
        // later: one tick may be lost to where the message fell.
        election_timeout_ns: (timeout_ticks - 1) * TICK_NS,
        max_drift_ppm: DRIFT_PPM as u64,
        margin_ns: MS,
    }
}

/// raft-rs draws a replica's election timeout from the thread's random
/// source whenever it resets (a new term, role or leader): draw it again
/// from the seed, so that a run is the same every time.
fn draw_election_timeout(core: &mut Core, drawn_for: &mut Option<(u64, StateRole, u64)>, rng: &mut SmallRng) {
    let r = &mut core.replica_mut().raft_mut().raft;
    let now = (r.term, r.state, r.leader_id);
    if *drawn_for != Some(now) {
        *drawn_for = Some(now);
        let e = ELECTION_TICKS;
        r.set_randomized_election_timeout(rng.random_range(e..2 * e));
    }
}

fn new_store() -> Arc<Store> {
    let region = Arc::new(Region::create("shard-sim", 2 << 20).unwrap());
    Arc::new(Store::format(region, 64, 5, 1, std::time::Duration::ZERO).unwrap())
}

fn publisher(store: &Arc<Store>) -> LeasePublisher {
    let reg = Arc::new(Registration::new(*store.header()));
    LeasePublisher::new(Arc::clone(store.region()), reg, store.header().hash_seed)
}

impl World {
    fn new(seed: u64, faults: Faults, rules: Rules) -> World {
        let mut rng = SmallRng::seed_from_u64(seed);
        let conf = ConfState { voters: (1..=NODES as u64).collect(), ..Default::default() };
        let mut nodes = Vec::new();
        for _ in 0..NODES {
            let storage = MemStorage::new_with_conf_state(conf.clone());
            let store = new_store();
            let (ppm, offset) = (rng.random_range(-DRIFT_PPM..=DRIFT_PPM), rng.random_range(0..1000 * MS));
            nodes.push(Node {
                core: None,
                restarting_until: 0,
                drawn_for: None,
                publisher: publisher(&store),
                storage,
                store,
                ppm,
                offset,
                ticker: Ticker::new(0),
                next_tick: 0,
                stalled_until: 0,
                stale_clock: None,
                backlog: Vec::new(),
                down_until: 0,
                incarnation: 0,
                full_until: None,
            });
        }
        let mut w = World {
            rng,
            seed,
            faults,
            rules,
            t: 0,
            nodes,
            net: Vec::new(),
            cut: None,
            one_way: Vec::new(),
            mute_at: None,
            stall_at: None,
            trace_last: String::new(),
            frozen: Vec::new(),
            history: History::default(),
            clients: Vec::new(),
            out: Outcome::default(),
            lease_terms: Default::default(),
            acked: vec![(0, 0); KEYS],
        };
        for i in 0..NODES {
            w.boot(i);
        }
        w.add_clients();
        w
    }

    fn boot(&mut self, i: usize) {
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let n = &mut self.nodes[i];
        let replica = Replica::new(i as u64 + 1, n.storage.clone(), ELECTION_TICKS, &logger).unwrap();
        let quiet = if self.rules.quiet { ELECTION_TICKS as u64 } else { 0 };
        let keeper = LeaseKeeper::new(lease_cfg(self.rules.lease_timeout_ticks)).unwrap();
        n.core = Some(ShardCore::new(replica, Arc::clone(&n.store)).with_leases(keeper, quiet));
        n.drawn_for = None;
        draw_election_timeout(n.core.as_mut().expect("booted"), &mut n.drawn_for, &mut self.rng);
        let now = n.clock(self.t);
        n.ticker = Ticker::new(now);
        n.next_tick = now + TICK_NS;
        n.backlog.clear();
    }

    /// Crashes node `i` until `until`: its memory is gone, its log stays;
    /// its region (and lease block) stays for readers that mapped it.
    fn crash(&mut self, i: usize, until: u64) {
        let n = &mut self.nodes[i];
        n.core = None;
        n.down_until = until;
        self.frozen.push((i, Arc::clone(&n.store)));
        // The oldest are long over.
        if self.frozen.len() > 8 {
            self.frozen.remove(0);
        }
    }

    fn restart(&mut self, i: usize) {
        let n = &mut self.nodes[i];
        n.store = new_store();
        n.publisher = publisher(&n.store);
        n.incarnation += 1;
        n.stalled_until = 0;
        n.full_until = None;
        self.boot(i);
    }

    /// What the shard thread's supervisor does with a replica that failed:
    /// fence, empty the store, and start a replica again over the same log
    /// and store (it replays the log).
    fn restart_in_place(&mut self, i: usize) {
        let until = self.t + self.rng.random_range(10..200) * MS;
        let n = &mut self.nodes[i];
        n.core = None;
        n.publisher.fence();
        n.store.clear(1).unwrap();
        n.full_until = None;
        n.stalled_until = 0;
        n.restarting_until = until;
    }

    /// Node `i`'s store has no room until `until` (its memory filled
    /// behind raft's back): it applies no write meanwhile.
    fn fill(&mut self, i: usize, until: u64) {
        self.nodes[i].full_until = Some(until);
    }

    /// Whether a message from `from` to `to` is dropped by a partition now.
    fn blocked(&self, from: usize, to: usize) -> bool {
        self.cut.is_some_and(|(c, _)| c == from || c == to)
            || self.one_way.iter().any(|&(f, t, _)| f == from && t == to)
    }

    /// Sends raft messages from node `from`: delayed up to 20 ms, some lost
    /// or duplicated.
    fn send(&mut self, from: usize, msgs: Vec<Message>) {
        for m in msgs {
            let to = m.to as usize - 1;
            if self.blocked(from, to) {
                continue;
            }
            let lossy = self.faults.loss;
            match self.rng.random_range(if lossy { 0 } else { 4 }..50) {
                0..=2 => {}
                3 => {
                    let (a, b) = (self.rng.random_range(0..30) * MS, self.rng.random_range(0..30) * MS);
                    self.net.push((self.t + a, to, Input::Raft(m.clone())));
                    self.net.push((self.t + b, to, Input::Raft(m)));
                }
                _ => {
                    let d = self.rng.random_range(0..20) * MS;
                    self.net.push((self.t + d, to, Input::Raft(m)));
                }
            }
        }
    }

    /// Hands a client's request to node `i` after a network delay.
    pub(crate) fn send_request(&mut self, i: usize, input: Input) {
        let d = self.rng.random_range(0..3) * MS;
        self.net.push((self.t + d, i, input));
    }

    fn faults(&mut self) {
        let t = self.t;
        if self.cut.is_some_and(|(_, until)| t >= until) {
            self.cut = None;
        }
        self.one_way.retain(|&(_, _, until)| t < until);
        if self.faults.cuts && self.cut.is_none() && self.rng.random_ratio(1, 1500) {
            self.cut = Some((self.rng.random_range(0..NODES), t + self.rng.random_range(50..600) * MS));
        }
        if self.faults.one_way && self.one_way.is_empty() && self.rng.random_ratio(1, 800) {
            let from = self.rng.random_range(0..NODES);
            let to = (from + self.rng.random_range(1..NODES)) % NODES;
            self.one_way.push((from, to, t + self.rng.random_range(50..1500) * MS));
        }
        if self.faults.crash_holder_at == Some(t / MS)
            && let Some(i) = (0..NODES).find(|&i| self.nodes[i].up() && self.nodes[i].publisher.last.is_some())
        {
            if std::env::var("DMKV_SIM_TRACE").is_ok() {
                println!("t={} ms crash holder {} block {:?}", t / MS, i + 1, self.nodes[i].publisher.last);
            }
            self.crash(i, u64::MAX);
        }
        if (self.faults.stalled_follower || self.faults.restarted_follower)
            && self.one_way.is_empty()
            && t % (1000 * MS) == 500 * MS
        {
            let leader = (0..NODES).find(|&i| self.nodes[i].leads().is_some() && self.nodes[i].stalled_until <= t);
            if let Some(l) = leader {
                let (g, f) = ((l + 1) % NODES, (l + 2) % NODES);
                self.one_way.push((l, g, t + 700 * MS));
                self.stall_at = Some((f, l, t + 120 * MS));
            }
        }
        // Once the stalled follower has the leader's last messages, the
        // leader falls silent towards it too (its own thread stalls, or
        // its link does): only the follower's promise not to vote keeps a
        // rival from being elected within the lease its answer granted.
        if let Some((l, f, at)) = self.mute_at
            && t >= at
        {
            self.one_way.push((l, f, t + 500 * MS));
            self.mute_at = None;
        }
        // The follower stalls just after its leader checked its quorum,
        // for a little longer than its own election timeout: it resumes
        // before the leader misses it, and its missed ticks reach the
        // timeout.
        if let Some((f, l, after)) = self.stall_at
            && t >= after
        {
            let raft = |i: usize| self.nodes[i].core.as_ref().map(|c| &c.replica().raft().raft);
            match (raft(l), raft(f)) {
                (Some(lr), Some(fr)) if lr.state == StateRole::Leader => {
                    if lr.election_elapsed == 0 {
                        let len = (fr.randomized_election_timeout() as u64 * TICK_NS) + 15 * MS;
                        self.stall_at = None;
                        if self.faults.restarted_follower
                            && (!self.faults.stalled_follower || self.rng.random_bool(0.5))
                        {
                            // Back in a few ms, from its log.
                            self.crash(f, t + 5 * MS);
                            self.mute_at = Some((l, f, t + 6 * MS));
                        } else {
                            self.stall(f, t + len);
                            self.nodes[f].stale_clock = None;
                            self.mute_at = Some((l, f, t + len + MS));
                        }
                    }
                }
                _ => self.stall_at = None,
            }
        }
        if self.faults.full_follower && t % (2000 * MS) == 1900 * MS {
            let leader = (0..NODES).find(|&i| self.nodes[i].leads().is_some());
            if let Some(l) = leader {
                let f = (l + self.rng.random_range(1..NODES)) % NODES;
                if self.nodes[f].up() && self.nodes[f].full_until.is_none() {
                    self.fill(f, t + 1500 * MS);
                }
            }
        }
        if self.faults.full_follower
            && self.cut.is_none()
            && t % (2000 * MS) == 300 * MS
            && let Some(l) = (0..NODES).find(|&i| self.nodes[i].leads().is_some())
        {
            self.cut = Some((l, t + 600 * MS));
        }
        if self.faults.stalled_leader && self.cut.is_none() && t % (2000 * MS) == 200 * MS {
            let leader = (0..NODES).find(|&i| self.nodes[i].leads().is_some() && self.nodes[i].stalled_until <= t);
            if let Some(l) = leader {
                self.cut = Some((l, t + 900 * MS));
                let until = t + self.rng.random_range(300..600) * MS;
                self.stall(l, until);
            }
        }
        for i in 0..NODES {
            if self.nodes[i].full_until.is_some_and(|until| t >= until) {
                self.nodes[i].full_until = None;
            } else if self.faults.apply_stalls
                && self.nodes[i].up()
                && self.nodes[i].full_until.is_none()
                && self.rng.random_ratio(1, 3000)
            {
                let until = t + self.rng.random_range(50..600) * MS;
                self.fill(i, until);
            }
            if self.faults.in_place_restarts && self.nodes[i].up() && self.rng.random_ratio(1, 3000) {
                self.restart_in_place(i);
            }
            if self.faults.hand_overs && self.nodes[i].leads().is_some() && self.rng.random_ratio(1, 1500) {
                self.net.push((t, i, Input::HandOver));
            }
            let n = &self.nodes[i];
            if n.restarting_until != 0 {
                if t >= n.restarting_until {
                    self.nodes[i].restarting_until = 0;
                    self.boot(i);
                }
            } else if self.faults.crashes && n.up() && self.rng.random_ratio(1, 2500) {
                // Often back at once (a process restarted by its
                // supervisor), sometimes after a while.
                let down = if self.rng.random_bool(0.5) {
                    self.rng.random_range(0..30)
                } else {
                    self.rng.random_range(0..400)
                };
                self.crash(i, t + down * MS);
            } else if !n.up() && t >= n.down_until {
                self.restart(i);
            } else if self.faults.stalls && n.up() && n.stalled_until <= t && self.rng.random_ratio(1, 1500) {
                // A long fsync, a snapshot, CPU starvation, SIGSTOP.
                let d = if self.rng.random_bool(0.5) {
                    self.rng.random_range(5..100)
                } else {
                    self.rng.random_range(100..1500)
                };
                self.stall(i, t + d * MS);
            }
        }
    }

    /// Stalls node `i`'s thread until `until`, half the time between its
    /// clock read and its poll.
    fn stall(&mut self, i: usize, until: u64) {
        let n = &mut self.nodes[i];
        n.stalled_until = until;
        n.stale_clock = self.rng.random_bool(0.5).then(|| n.clock(self.t));
        self.out.stalls += 1;
    }

    /// Runs node `i`'s shard thread for this step, as the driver does.
    fn drive(&mut self, i: usize, arrived: Vec<Input>) {
        let t = self.t;
        let n = &mut self.nodes[i];
        if n.core.is_none() {
            return;
        }
        if n.stalled_until > t {
            n.backlog.extend(arrived);
            return;
        }
        let mut inputs = std::mem::take(&mut n.backlog);
        inputs.extend(arrived);
        // A thread that stalled right after reading its clock goes on with
        // that reading: through its ticks, its inputs and its first poll.
        let stale = n.stale_clock.take();
        let now = stale.unwrap_or(n.clock(t));
        let core = n.core.as_mut().expect("up");
        core.set_clock(now);
        core.set_store_full(n.full_until.is_some());
        let mut extra_ticks = 0;
        match self.rules.tick {
            TickRule::Ticker => {
                if n.ticker.due(now) {
                    core.tick();
                    draw_election_timeout(core, &mut n.drawn_for, &mut self.rng);
                }
            }
            TickRule::Backlog => {
                while now >= n.next_tick {
                    extra_ticks += 1;
                    n.next_tick += TICK_NS;
                }
            }
        }
        let mut refused = Vec::new();
        for input in inputs {
            match input {
                Input::Raft(m) => {
                    let _ = core.step(m);
                    draw_election_timeout(core, &mut n.drawn_for, &mut self.rng);
                }
                Input::Read(id, lease_ok) => {
                    if let Err((id, _)) = core.read(id, lease_ok) {
                        refused.push(id);
                    }
                }
                Input::Propose(id, data) => {
                    if let Err((id, _)) = core.propose(data, id) {
                        refused.push(id);
                    }
                }
                Input::HandOver if self.rules.hand_over == HandOver::Built => {
                    let _ = core.transfer_leadership(None);
                }
                Input::HandOver if self.rules.hand_over == HandOver::FenceOnly => {
                    let _ = core.transfer_leadership(None);
                    core.forget_hand_over();
                }
                Input::HandOver => {
                    // As a transfer without the lease given up would: to
                    // the next voter, the lease kept.
                    let raft = &core.replica().raft().raft;
                    if raft.state == StateRole::Leader {
                        let to = raft.id % NODES as u64 + 1;
                        core.replica_mut().transfer_leader(to);
                    }
                }
            }
        }
        self.poll(i, stale);
        // The old driver ran the ticks it missed after the inputs, one per
        // loop, looping at once while behind.
        for _ in 0..extra_ticks {
            let n = &mut self.nodes[i];
            let core = n.core.as_mut().expect("up");
            core.tick();
            draw_election_timeout(core, &mut n.drawn_for, &mut self.rng);
            self.poll(i, None);
        }
        for id in refused {
            self.client_refused(id);
        }
    }

    /// Polls node `i`'s core and carries out what it says, in the driver's
    /// order: fence, publish, send, answer.
    fn poll(&mut self, i: usize, stale: Option<u64>) {
        let t = self.t;
        let n = &mut self.nodes[i];
        let now = n.clock(t);
        let Some(core) = n.core.as_mut() else { return };
        // The core's clock only moves forward: a stale reading leaves it
        // where the last one put it.
        core.set_clock(stale.unwrap_or(now));
        let p = match core.poll() {
            Ok(p) => p,
            Err(e) => panic!("seed {}: replica {} failed: {e}", self.seed, i + 1),
        };
        if p.fence {
            n.publisher.fence();
        }
        let lease = if self.rules.publish_unapplied { core.lease_unapplied() } else { core.lease() };
        let applied = core.applied();
        let placement = core.placement().version();
        if std::env::var("DMKV_SIM_TRACE").is_ok() && lease.is_some() && n.publisher.last.is_none() {
            let committed = core.replica().raft().raft.raft_log.committed;
            println!(
                "t={} ms node {} publishes {lease:?} (now {now}), applied {applied} of {committed}",
                t / MS,
                i + 1
            );
        }
        n.publisher.publish(lease, applied, placement, || now);
        if let Some((term, _)) = lease {
            self.lease_terms.insert(term);
        }
        self.send(i, p.messages);
        for (id, r) in p.answers {
            self.client_answered(i, id, r);
        }
        for (id, r) in p.reads {
            self.client_granted(i, id, r);
        }
    }

    fn step(&mut self) {
        self.faults();
        if std::env::var("DMKV_SIM_TRACE").is_ok() {
            let roles: Vec<String> = self
                .nodes
                .iter()
                .map(|n| match &n.core {
                    None => "down".into(),
                    Some(c) => {
                        let r = &c.replica().raft().raft;
                        format!("{:?}/{}{}", r.state, r.term, if n.stalled_until > self.t { "/stalled" } else { "" })
                    }
                })
                .collect();
            let line = format!("{roles:?} cut {:?} one-way {:?}", self.cut, self.one_way);
            if self.trace_last != line {
                println!("t={} ms {line}", self.t / MS);
                self.trace_last = line;
            }
        }
        let t = self.t;
        let mut arrived: Vec<Vec<Input>> = (0..NODES).map(|_| Vec::new()).collect();
        let mut later = Vec::new();
        let mut due = Vec::new();
        for (at, to, m) in std::mem::take(&mut self.net) {
            if at <= t { due.push((to, m)) } else { later.push((at, to, m)) }
        }
        self.net = later;
        // Reordered.
        for j in (1..due.len()).rev() {
            due.swap(j, self.rng.random_range(0..=j));
        }
        for (to, m) in due {
            if let Input::Raft(r) = &m
                && self.blocked(r.from as usize - 1, to)
            {
                continue;
            }
            arrived[to].push(m);
        }
        for (i, a) in arrived.into_iter().enumerate() {
            self.drive(i, a);
        }
        self.step_clients();
        self.check_leases();
    }

    /// Every lease block that holds now belongs to one replica in one term,
    /// and its region holds every write acknowledged before now.
    fn check_leases(&mut self) {
        if self.out.violation.is_some() {
            return;
        }
        let t = self.t;
        let mut holders: Vec<(usize, u64, Arc<Store>)> = Vec::new();
        let live = (0..NODES).filter(|&i| self.nodes[i].up()).map(|i| (i, Arc::clone(&self.nodes[i].store)));
        for (i, store) in live.chain(self.frozen.iter().cloned()) {
            let mut b = [0u8; LEASE_LEN];
            store.region().read(LEASE_OFFSET, &mut b);
            let now = self.nodes[i].clock(t);
            if let Some(l) = LeaseBlock::decode(&b, store.header().hash_seed)
                && l.start_ns <= now
                && now < l.expiry_ns
            {
                holders.push((i, l.term, store));
            }
        }
        // The lease's promise itself: while a replica's lease holds, no
        // replica leads a later term.
        for i in 0..NODES {
            let Some((term, end)) = self.nodes[i].core.as_ref().and_then(|c| c.lease_held()) else { continue };
            if self.nodes[i].clock(t) >= end {
                continue;
            }
            if let Some(j) = (0..NODES).find(|&j| self.nodes[j].leads().is_some_and(|tj| tj > term)) {
                self.out.violation = Some(format!(
                    "replica {} leads term {} at {} ms while replica {}'s lease of term {term} holds",
                    j + 1,
                    self.nodes[j].leads().unwrap_or(0),
                    t / MS,
                    i + 1
                ));
                return;
            }
        }
        if let Some((i, term, _)) = holders.first()
            && holders.iter().any(|(j, tm, _)| (j, tm) != (i, term))
        {
            let who: Vec<(usize, u64)> = holders.iter().map(|(j, tm, _)| (j + 1, *tm)).collect();
            self.out.violation = Some(format!("leases held at once (replica, term) at {} ms: {who:?}", t / MS));
            return;
        }
        if let Some((i, _, store)) = holders.first() {
            for (k, &(version, at)) in self.acked.iter().enumerate() {
                if version == 0 || at >= t {
                    continue;
                }
                let has = store.get(key(k).as_bytes()).unwrap().map_or(0, |(_, v)| v);
                if has < version {
                    self.out.violation = Some(format!(
                        "replica {} holds a lease at {} ms but has version {has} of key {k}, version {version} acknowledged at {} ms",
                        i + 1,
                        t / MS,
                        at / MS
                    ));
                    return;
                }
            }
        }
    }

    /// Node `i` acknowledged `version` of `key`.
    pub(crate) fn acknowledge(&mut self, i: usize, key: usize, version: u64) {
        self.history.acks.push((self.t, key, version));
        if version > self.acked[key].0 {
            self.acked[key] = (version, self.t);
        }
        if self.faults.cut_after_ack && self.cut.is_none() && self.rng.random_ratio(1, 40) {
            self.cut = Some((i, self.t + self.rng.random_range(300..800) * MS));
        }
    }
}

// The clients' state ([`reader`] steps it): here, with the world that
// holds it.

/// The key named by number `k`.
pub fn key(k: usize) -> String {
    format!("k{k}")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Writer,
    OneSided(Via),
    Rpc,
}

pub(crate) struct Client {
    kind: Kind,
    state: State,
    seq: u64,
    /// A sampling reader's own clock (rate and origin).
    ppm: i64,
    offset: u64,
    /// A sampling reader's bounds on each replica's clock, and when (true
    /// time) they were last sampled.
    samples: [Option<(Arc<SampledClock>, u64)>; NODES],
}

enum State {
    Idle { at: u64 },
    Writing { id: u64, key: usize, until: u64 },
    OneSided(Get),
    Rpc(RpcGet),
}

/// A one-sided GET in progress: as the client's, two batches (buckets,
/// then items), each read by its backend, then its lease block read last
/// and judged, the attempt's start carried from the first to the second.
struct Get {
    key: usize,
    invoked: u64,
    node: usize,
    store: Arc<Store>,
    clock: LeaseClock,
    start: AttemptStart,
    phase: Phase,
    /// When the next phase is due.
    at: u64,
    /// What the bucket batch said.
    step: Result<Step, ()>,
    /// What the item batch found.
    found: Result<Option<u64>, ()>,
    /// The engine's stamps of the batch: before its data, after its block.
    stamps: (u64, u64),
    block: [u8; LEASE_LEN],
}

/// Where a GET stands after its bucket batch.
#[derive(Debug, Clone)]
enum Step {
    Done(Option<u64>),
    Items(Box<Lookup>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Buckets,
    BucketsBlock,
    Items,
    ItemsBlock,
}

/// An RPC GET in progress.
struct RpcGet {
    id: u64,
    key: usize,
    invoked: u64,
    node: usize,
    phase: RpcPhase,
}

enum RpcPhase {
    /// Waiting for the replica's grant, until a deadline.
    Asked { until: u64 },
    /// Granted; the service reads the store at `at`.
    Reading { at: u64, lease_until: Option<u64>, generation: u64 },
    /// The answer reaches the client at `at`.
    Replying { at: u64, got: Option<u64> },
}

/// Runs `steps` steps of 1 ms from `seed`.
pub fn run(seed: u64, steps: u64, faults: Faults, rules: Rules) -> Outcome {
    let mut w = World::new(seed, faults, rules);
    for s in 0..steps {
        w.t = s * STEP;
        w.step();
        if w.out.violation.is_some() {
            break;
        }
    }
    let mut out = std::mem::take(&mut w.out);
    if out.violation.is_none() {
        out.violation = w.history.check();
    }
    out.acked = w.history.acks.len();
    out.reads = w.history.reads.len();
    out.leases = w.lease_terms.len();
    out.violation = out.violation.map(|v| format!("seed {seed}: {v}"));
    out
}

/// The seeds a test runs: `DMKV_SIM_SEED` alone, or `DMKV_SIM_SEEDS` of
/// them (else `default`), from `base`.
pub fn seeds(base: u64, default: u64) -> Vec<u64> {
    if let Some(s) = std::env::var("DMKV_SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        return vec![s];
    }
    let n = std::env::var("DMKV_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    (0..n).map(|i| base.wrapping_add(i)).collect()
}

#[cfg(test)]
mod tests;
