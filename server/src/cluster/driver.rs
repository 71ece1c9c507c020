//! The shard thread: a thin driver around [`ShardCore`]. It owns the core,
//! takes inputs (proposals, peers' raft messages) from a bounded queue,
//! ticks raft on the monotonic clock, and hands raft's outgoing messages to
//! the node's transport. One thread per shard replica, so shards write in
//! parallel (and the store's writer lock is per shard).
//!
//! Ticks ([`Ticker`]) are what a follower's promise not to vote rests on:
//! having heard from its leader at time `h`, it refuses votes and does not
//! campaign until it has counted an election timeout of ticks, and the
//! leader's lease assumes that takes at least `(ELECTION_TICKS - 1) ×
//! TICK` of real time. So a tick is taken only at the top of a loop, before
//! the inputs waiting then are stepped (a tick taken after a message
//! counts from it), at most one per loop, and never sooner than `TICK`
//! after the previous one: a thread that was stalled (an fsync, CPU
//! starvation, SIGSTOP) drops the ticks it missed instead of running them
//! in a burst right after the message it queued meanwhile.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use dmkv_common::cluster::map::NodeId;
use dmkv_common::layout::{LEASE_LEN, LEASE_OFFSET, LeaseBlock};
use raft::prelude::Message;
use tokio::sync::oneshot;
use tracing::{error, info, warn};

use super::apply::Applied;
use super::move_ask::{MoveAnswer, MoveAsk};
use super::replica::LogStore;
use super::shard::{JoinStep, ProposeError, ReadGrant, ShardCore};
use crate::clock::mono_ns;
use crate::region::Region;
use crate::registration::Registration;

/// Inputs waiting for a shard thread at most; more are refused (`Busy`).
pub const MAX_INPUTS: usize = 8192;
/// A replica that failed is started again after this pause, doubling up to
/// [`MAX_RESTART_PAUSE`] while it keeps failing (a full disk, a log that
/// cannot be read): meanwhile it is fenced, answers `NOT_LEADER` and is
/// not named leader, so clients go to the other replicas. A durable
/// replica's restart first checks that its disk takes writes, so a short
/// longest pause costs little while the disk stays full, and the replica
/// is back within about a second of the disk having room.
pub const MIN_RESTART_PAUSE: Duration = Duration::from_millis(100);
pub const MAX_RESTART_PAUSE: Duration = Duration::from_secs(1);
/// A replica that ran this long before failing starts again after the
/// shortest pause: it was not failing at once.
pub const STEADY_RUN: Duration = Duration::from_secs(60);
/// Inputs taken from the queue before the core is polled: bounds how long
/// raft's messages wait while a burst of proposals is taken in.
pub const MAX_INPUTS_PER_POLL: usize = 256;
/// Raft's logical clock: one tick this often, at most.
pub const TICK: Duration = Duration::from_millis(10);
/// A shard thread's answer to a hand-over: the voter chosen, or why none.
pub type HandOverAnswer = Result<u64, super::shard::NoHandOver>;
const TICK_NS: u64 = TICK.as_nanos() as u64;

/// When raft's logical clock ticks (see the module's comment): at most one
/// tick per call, never sooner than [`TICK`] after the last, and ticks
/// missed while the caller was away are dropped, not made up. Time is
/// passed in (monotonic ns), so the simulation runs the same rule.
#[derive(Debug, Clone, Copy)]
pub struct Ticker {
    next: u64,
}

impl Ticker {
    /// A ticker whose first tick is due a tick after `now`.
    pub fn new(now: u64) -> Ticker {
        Ticker { next: now.saturating_add(TICK_NS) }
    }

    /// Whether to tick at `now`.
    pub fn due(&mut self, now: u64) -> bool {
        if now < self.next {
            return false;
        }
        // From now, not from when it was due: a late tick does not make
        // the next one early.
        self.next = now.saturating_add(TICK_NS);
        true
    }

    /// How long from `now` until the next tick is due.
    pub fn wait(&self, now: u64) -> Duration {
        Duration::from_nanos(self.next.saturating_sub(now))
    }
}

/// Builds a replica anew after it failed: the number of restarts so far.
/// Durable replicas recover from their log and snapshot; others join as a
/// new incarnation.
pub type Restart<S> = Box<dyn FnMut(u64) -> Result<ShardCore<S, Answer, ReadAnswer>, String> + Send>;

/// Why a shard thread's run ended.
enum Exit {
    /// Asked to stop (or every sender of inputs is gone).
    Stopped,
    /// The log or the store failed, or the core broke an invariant.
    Failed(String),
}

/// Where a proposal's answer goes.
pub type Answer = oneshot::Sender<Result<Applied, ProposeError>>;
/// Where a read's permission goes.
pub type ReadAnswer = oneshot::Sender<Result<ReadGrant, ProposeError>>;

enum Input {
    Propose(Vec<u8>, Answer),
    /// A read; whether it may be granted under the lease.
    Read(ReadAnswer, bool),
    Raft(Message),
    Join(u64, oneshot::Sender<Result<JoinStep, ProposeError>>),
    /// A node's replicas leave the shard; the nodes it is placed on.
    Leave(u64, Vec<u64>, oneshot::Sender<Result<JoinStep, ProposeError>>),
    /// Start as the shard's first members' replica (see `ShardCore::bootstrap`).
    Bootstrap,
    /// Go on as a new replica with this id (see `ShardCore::replace`).
    Replace(u64, oneshot::Sender<Result<(), String>>),
    /// A snapshot for this follower did not reach it.
    SnapshotFailed(u64, u64),
    /// Hand leadership over (see `ShardCore::transfer_leadership`);
    /// answered with the voter chosen, or why none.
    /// To that node's voter only, and not after that instant (the asker
    /// stopped waiting: it must not begin then).
    HandOver(Option<(NodeId, std::time::Instant)>, std::sync::mpsc::SyncSender<HandOverAnswer>),
    /// What a partition move needs of the leader's store (see [`MoveAsk`]).
    Moving(MoveAsk, oneshot::Sender<Result<MoveAnswer, ProposeError>>),
    Stop,
}

/// A replica's raft state as last published by its thread (every tick),
/// for routing answers, the map and `dmkv cluster status`.
#[derive(Default)]
pub struct ReplicaStatus {
    /// `raft::StateRole` as a number (see [`ReplicaStatus::role`]); 4: the
    /// thread stopped.
    role: AtomicU64,
    pub term: AtomicU64,
    pub leader: AtomicU64,
    pub commit: AtomicU64,
    pub applied: AtomicU64,
    /// RPC reads answered under the lease (no quorum round).
    pub lease_reads: AtomicU64,
    /// Of those, reads that ended after the lease did (a preempted thread)
    /// and were asked again under a quorum round.
    pub lease_read_retries: AtomicU64,
    /// Tries to apply a committed command that found no room.
    pub apply_stalls: AtomicU64,
    /// Snapshots built for followers.
    pub snapshots_built: AtomicU64,
    /// Snapshots taken from a leader.
    pub snapshots_installed: AtomicU64,
    /// Leader only: (follower, entries behind).
    lag: std::sync::Mutex<Vec<(u64, u64)>>,
    /// The replica's raft id.
    pub id: AtomicU64,
    /// The members (voters, learners) as this replica applied them.
    members: std::sync::Mutex<(Vec<u64>, Vec<u64>)>,
    /// Times the leader this replica knows changed to another known one.
    pub leader_changes: AtomicU64,
    /// The last leader known (never 0 once one was): a leader lost and
    /// found again (A, none, A) is no change.
    known_leader: AtomicU64,
    /// Bytes of the last snapshot built for followers.
    pub snapshot_bytes: AtomicU64,
    /// Times the replica failed and was started again.
    pub restarts: AtomicU64,
    /// The shard, for log lines.
    shard: u32,
}

impl ReplicaStatus {
    /// The status of a replica of `shard`.
    pub fn for_shard(shard: u32) -> ReplicaStatus {
        ReplicaStatus { shard, ..Default::default() }
    }

    /// The role's name.
    pub fn role(&self) -> &'static str {
        match self.role.load(Ordering::Relaxed) {
            0 => "follower",
            1 => "candidate",
            2 => "leader",
            3 => "pre-candidate",
            _ => "stopped",
        }
    }

    /// Whether this replica leads (as of the last tick).
    pub fn is_leader(&self) -> bool {
        self.role.load(Ordering::Relaxed) == 2
    }

    /// Followers' lag, when this replica leads.
    pub fn lag(&self) -> Vec<(u64, u64)> {
        crate::lock::lock(&self.lag).clone()
    }

    /// The shard's (voters, learners) as this replica applied them.
    pub fn members(&self) -> (Vec<u64>, Vec<u64>) {
        crate::lock::lock(&self.members).clone()
    }

    /// Whether this replica is a voter and the only member on its node:
    /// nothing left for it to join.
    pub fn joined(&self) -> bool {
        let id = self.id.load(Ordering::Relaxed);
        let (voters, learners) = self.members();
        let node = dmkv_common::cluster::map::node_of(id);
        voters.contains(&id)
            && voters.iter().chain(&learners).all(|&m| m == id || dmkv_common::cluster::map::node_of(m) != node)
    }

    fn publish<S: LogStore, P, R>(&self, core: &ShardCore<S, P, R>) {
        let r = &core.replica().raft().raft;
        let role = match r.state {
            raft::StateRole::Follower => 0,
            raft::StateRole::Candidate => 1,
            raft::StateRole::Leader => 2,
            raft::StateRole::PreCandidate => 3,
        };
        self.role.store(role, Ordering::Relaxed);
        self.term.store(r.term, Ordering::Relaxed);
        self.leader.store(r.leader_id, Ordering::Relaxed);
        let known = if r.leader_id != 0 { self.known_leader.swap(r.leader_id, Ordering::Relaxed) } else { 0 };
        if r.leader_id != 0 && known != r.leader_id {
            self.leader_changes.fetch_add(1, Ordering::Relaxed);
            // One line per change, with the fields to grep for.
            info!(
                shard = self.shard,
                term = r.term,
                leader = dmkv_common::cluster::map::node_of(r.leader_id),
                leads = role == 2,
                "shard leader changed"
            );
        }
        self.commit.store(r.raft_log.committed, Ordering::Relaxed);
        self.applied.store(core.applied(), Ordering::Relaxed);
        self.lease_reads.store(core.lease_reads(), Ordering::Relaxed);
        self.apply_stalls.store(core.apply_stalls(), Ordering::Relaxed);
        let (built, installed) = core.snapshot_counts();
        self.snapshots_built.store(built, Ordering::Relaxed);
        self.snapshots_installed.store(installed, Ordering::Relaxed);
        self.snapshot_bytes.store(core.snapshot_bytes(), Ordering::Relaxed);
        let last = r.raft_log.last_index();
        let lag = if role == 2 {
            r.prs().iter().filter(|(id, _)| **id != r.id).map(|(id, p)| (*id, last.saturating_sub(p.matched))).collect()
        } else {
            Vec::new()
        };
        *crate::lock::lock(&self.lag) = lag;
        self.id.store(r.id, Ordering::Relaxed);
        let conf = r.prs().conf().to_conf_state();
        *crate::lock::lock(&self.members) = (conf.voters, conf.learners);
    }

    /// The thread ended (returned or panicked): no role, no leader known,
    /// so routing and readiness stop counting on this replica.
    fn stopped(&self) {
        self.role.store(4, Ordering::Relaxed);
        self.leader.store(0, Ordering::Relaxed);
    }
}

/// Where a shard thread publishes its lease for one-sided readers of its
/// region (the lease block of the header page), and how it fences.
pub struct LeasePublisher {
    region: Arc<Region>,
    reg: Arc<Registration>,
    hash_seed: u64,
    /// What is published: (term, end on the node's monotonic clock,
    /// placement version).
    pub(crate) last: Option<(u64, u64, u64)>,
    /// The run of the lease published since the last fence: (term, when
    /// it began). Every block of a run carries its start; a fence ends it.
    run: Option<(u64, u64)>,
}

impl LeasePublisher {
    pub fn new(region: Arc<Region>, reg: Arc<Registration>, hash_seed: u64) -> LeasePublisher {
        LeasePublisher { region, reg, hash_seed, last: None, run: None }
    }

    /// Stops one-sided reads of the region: the lease block cleared, then
    /// a new registration (next epoch, new rkey: the engine refuses the
    /// old one, shared-memory handoffs close, readers attach again). The
    /// run of the lease ends: a lease published later starts a new one.
    pub(crate) fn fence(&mut self) {
        self.region.write(LEASE_OFFSET, &[0u8; LEASE_LEN]);
        let epoch = self.reg.reregister(&self.region);
        self.last = None;
        self.run = None;
        info!(epoch, "lease lapsed or leadership lost: region fenced");
    }

    /// Publishes `lease` (term, end on the node's monotonic clock) and the
    /// shard's placement version if either is new. A lease published after
    /// a fence starts a run, stamped with `clock` read now: after the store
    /// applied what the lease needs (`LeaseKeeper::published`) and after a
    /// full fence, so every write the store made before is visible to a
    /// reader that read its own clock later. Readers believe only batches
    /// that began after a run's start (`dmkv_common::cluster::lease::judge`).
    ///
    /// A lease waiting for its round's index to apply (`None`) keeps the
    /// last one published: that one is still held, and its index applied.
    /// A new placement is published at once all the same, under that lease:
    /// it must be in the block before the change is answered (the mover
    /// goes on only then; docs/elasticity.md).
    pub(crate) fn publish(
        &mut self,
        lease: Option<(u64, u64)>,
        applied: u64,
        placement: u64,
        clock: impl FnOnce() -> u64,
    ) {
        let kept = self.last.filter(|&(_, _, p)| p != placement).map(|(t, e, _)| (t, e));
        let Some((term, end)) = lease.or(kept) else { return };
        if self.last == Some((term, end, placement)) {
            return;
        }
        let start = match self.run {
            Some((run_term, start)) => {
                // Leading in another term fences first (`LeaseKeeper::on_role`).
                assert_eq!(run_term, term, "a run of the lease belongs to one term");
                start
            }
            None => {
                std::sync::atomic::fence(Ordering::SeqCst);
                let start = clock();
                self.run = Some((term, start));
                start
            }
        };
        let block = LeaseBlock { term, start_ns: start, expiry_ns: end, applied, placement };
        self.region.write(LEASE_OFFSET, &block.encode(self.hash_seed));
        self.last = Some((term, end, placement));
    }
}

/// A running shard thread.
pub struct ShardThread {
    tx: SyncSender<Input>,
    /// Taken by whoever stops the thread first.
    handle: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl ShardThread {
    /// Starts the thread; `send` carries raft's messages to peers (it must
    /// not block: queue and drop, raft retransmits). If the replica fails
    /// (an error of its log or store, or a panic), the thread fences its
    /// region, marks it stopped, and starts it again with `restart` after a
    /// pause; a restart that fails is tried again, pausing longer.
    pub fn spawn<S: LogStore + Send + 'static>(
        name: String,
        core: ShardCore<S, Answer, ReadAnswer>,
        restart: Restart<S>,
        status: Arc<ReplicaStatus>,
        leases: Option<LeasePublisher>,
        send: impl FnMut(Vec<Message>) + Send + 'static,
    ) -> std::io::Result<ShardThread> {
        let (tx, rx) = sync_channel(MAX_INPUTS);
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            // Marks the replica stopped however the thread ends, a panic
            // included.
            struct Stopped(Arc<ReplicaStatus>);
            impl Drop for Stopped {
                fn drop(&mut self) {
                    self.0.stopped();
                }
            }
            let guard = Stopped(status);
            supervise(core, restart, rx, &guard.0, leases, send);
        })?;
        Ok(ShardThread { tx, handle: std::sync::Mutex::new(Some(handle)) })
    }

    /// Asks for permission to read the store linearizably (see
    /// [`ShardCore::read`]); the answer comes on the returned channel.
    pub fn read(&self, lease_ok: bool) -> oneshot::Receiver<Result<ReadGrant, ProposeError>> {
        let (answer, rx) = oneshot::channel();
        if let Err(e) = self.tx.try_send(Input::Read(answer, lease_ok)) {
            let (TrySendError::Full(input) | TrySendError::Disconnected(input)) = e;
            if let Input::Read(a, _) = input {
                let _ = a.send(Err(ProposeError::Busy));
            }
        }
        rx
    }

    /// Asks the replica, if it leads, for what a partition move needs.
    pub fn moving(&self, ask: MoveAsk) -> oneshot::Receiver<Result<MoveAnswer, ProposeError>> {
        let (answer, rx) = oneshot::channel();
        if let Err(e) = self.tx.try_send(Input::Moving(ask, answer)) {
            let (TrySendError::Full(input) | TrySendError::Disconnected(input)) = e;
            if let Input::Moving(_, a) = input {
                let _ = a.send(Err(ProposeError::Busy));
            }
        }
        rx
    }

    /// Proposes a command; the answer comes on the returned channel.
    pub fn propose(&self, data: Vec<u8>) -> oneshot::Receiver<Result<Applied, ProposeError>> {
        let (answer, rx) = oneshot::channel();
        if let Err(e) = self.tx.try_send(Input::Propose(data, answer)) {
            let (TrySendError::Full(input) | TrySendError::Disconnected(input)) = e;
            if let Input::Propose(_, a) = input {
                let _ = a.send(Err(ProposeError::Busy));
            }
        }
        rx
    }

    /// Asks the replica, if it leads, to take the next step making
    /// `replica` a member (see [`ShardCore::join`]).
    pub fn join(&self, replica: u64) -> oneshot::Receiver<Result<JoinStep, ProposeError>> {
        let (answer, rx) = oneshot::channel();
        if let Err(e) = self.tx.try_send(Input::Join(replica, answer)) {
            let (TrySendError::Full(input) | TrySendError::Disconnected(input)) = e;
            if let Input::Join(_, a) = input {
                let _ = a.send(Err(ProposeError::Busy));
            }
        }
        rx
    }

    /// Asks the replica, if it leads, to take the next step taking node
    /// `node`'s replicas out of the shard, placed on the nodes `placed`
    /// (see [`ShardCore::leave`]).
    pub fn leave(&self, node: u64, placed: Vec<u64>) -> oneshot::Receiver<Result<JoinStep, ProposeError>> {
        let (answer, rx) = oneshot::channel();
        if let Err(e) = self.tx.try_send(Input::Leave(node, placed, answer)) {
            let (TrySendError::Full(input) | TrySendError::Disconnected(input)) = e;
            if let Input::Leave(_, _, a) = input {
                let _ = a.send(Err(ProposeError::Busy));
            }
        }
        rx
    }

    /// Replaces the replica by a new one, `id`, with no state (see
    /// `ShardCore::replace`).
    pub fn replace(&self, id: u64) -> oneshot::Receiver<Result<(), String>> {
        let (answer, rx) = oneshot::channel();
        if let Err(e) = self.tx.try_send(Input::Replace(id, answer)) {
            let (TrySendError::Full(input) | TrySendError::Disconnected(input)) = e;
            if let Input::Replace(_, a) = input {
                let _ = a.send(Err("the shard's replica is busy or stopped".into()));
            }
        }
        rx
    }

    /// Starts the replica as one of the shard's first members (see
    /// `ShardCore::bootstrap`), for whoever decides it.
    pub fn bootstrapper(&self) -> Box<dyn Fn() + Send + Sync> {
        let tx = self.tx.clone();
        Box::new(move || {
            let _ = tx.send(Input::Bootstrap);
        })
    }

    /// How the transport says the snapshot at `index` did not reach
    /// follower `to`.
    pub fn snapshot_failer(&self) -> Box<dyn Fn(u64, u64) + Send + Sync> {
        let tx = self.tx.clone();
        Box::new(move |to, index| {
            let _ = tx.try_send(Input::SnapshotFailed(to, index));
        })
    }

    /// Hands the thread a peer's raft message (dropped if its queue is
    /// full: raft retransmits).
    pub fn deliver(&self, m: Message) {
        let _ = self.tx.try_send(Input::Raft(m));
    }

    /// A sender of raft messages into this thread, for the transport.
    pub fn inbox(&self) -> impl Fn(Message) + Send + Sync + 'static {
        let tx = self.tx.clone();
        move |m| {
            let _ = tx.try_send(Input::Raft(m));
        }
    }

    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    /// Asks the replica to hand its leadership to another voter, if it
    /// leads (the node is about to stop); where its answer will come, or
    /// `None` if the thread takes no input now. Does not wait: the caller
    /// collects the answers of every shard it asked, and the replica's
    /// status says when it no longer leads.
    /// With `to`, to that node's voter only (see
    /// `ShardCore::transfer_leadership`), and only if the thread takes the
    /// ask before the instant given.
    pub fn hand_over(
        &self,
        to: Option<(NodeId, std::time::Instant)>,
    ) -> Option<std::sync::mpsc::Receiver<HandOverAnswer>> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.tx.try_send(Input::HandOver(to, tx)).ok().map(|()| rx)
    }

    /// Stops the thread (its replica fences first) and waits for it.
    pub fn halt(&self) {
        let _ = self.tx.send(Input::Stop);
        if let Some(h) = crate::lock::lock(&self.handle).take() {
            let _ = h.join();
        }
    }

    fn shutdown(&mut self) {
        self.halt();
    }
}

impl Drop for ShardThread {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Runs the replica, and starts it again each time it fails (see
/// [`ShardThread::spawn`]), until it is asked to stop.
fn supervise<S: LogStore>(
    first: ShardCore<S, Answer, ReadAnswer>,
    mut restart: Restart<S>,
    rx: Receiver<Input>,
    status: &ReplicaStatus,
    mut leases: Option<LeasePublisher>,
    mut send: impl FnMut(Vec<Message>),
) {
    let mut core = Some(first);
    let mut pause = MIN_RESTART_PAUSE;
    loop {
        let started = std::time::Instant::now();
        let exit = match core.take() {
            // A panic must not take the node's other replicas with it: the
            // shard is fenced and started again like any failed replica.
            Some(c) => {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(c, &rx, status, &mut leases, &mut send)))
                    .unwrap_or_else(|p| Exit::Failed(format!("panicked: {}", panic_text(&p))))
            }
            None => Exit::Failed("not started".into()),
        };
        // Readers stop before anything else happens to the store; the
        // lease would lapse on its own, but later.
        if let Some(l) = leases.as_mut() {
            l.fence();
        }
        let why = match exit {
            Exit::Stopped => return,
            Exit::Failed(why) => why,
        };
        status.stopped();
        if started.elapsed() >= STEADY_RUN {
            pause = MIN_RESTART_PAUSE;
        }
        error!(shard = status.shard, "shard replica failed ({why}); starting it again in {pause:?}");
        // Asked meanwhile to start as one of the shard's first members: the
        // replica started again does (the asker does not ask twice).
        let mut bootstrap = false;
        loop {
            if !refuse_until(&rx, std::time::Instant::now() + pause, &mut bootstrap) {
                return;
            }
            let n = status.restarts.fetch_add(1, Ordering::Relaxed) + 1;
            pause = (pause * 2).min(MAX_RESTART_PAUSE);
            match restart(n) {
                Ok(mut c) => {
                    info!(shard = status.shard, restarts = n, "shard replica started again");
                    if bootstrap && let Err(e) = c.bootstrap() {
                        error!(shard = status.shard, "shard replica could not start as a first member: {e}");
                    }
                    core = Some(c);
                    break;
                }
                Err(e) => {
                    error!(shard = status.shard, "shard replica could not start again ({e}); next try in {pause:?}")
                }
            }
        }
    }
}

/// Answers inputs while the replica is down: every request is refused as
/// a follower with no leader known would refuse it, so the client tries
/// another replica, and raft messages are dropped. False if the thread
/// was asked to stop.
fn refuse_until(rx: &Receiver<Input>, until: std::time::Instant, bootstrap: &mut bool) -> bool {
    let down = || ProposeError::NotLeader { leader: None };
    loop {
        let wait = until.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(wait) {
            Ok(Input::Propose(_, a)) => drop(a.send(Err(down()))),
            Ok(Input::Read(a, _)) => drop(a.send(Err(down()))),
            Ok(Input::Join(_, a) | Input::Leave(_, _, a)) => drop(a.send(Err(down()))),
            Ok(Input::Replace(_, a)) => drop(a.send(Err("the shard's replica is starting again".into()))),
            Ok(Input::Bootstrap) => *bootstrap = true,
            Ok(Input::HandOver(_, answer)) => drop(answer.try_send(Err(super::shard::NoHandOver::NotLeader))),
            Ok(Input::Moving(_, a)) => drop(a.send(Err(down()))),
            Ok(Input::Raft(_) | Input::SnapshotFailed(..)) => {}
            Ok(Input::Stop) | Err(RecvTimeoutError::Disconnected) => return false,
            Err(RecvTimeoutError::Timeout) => return true,
        }
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Runs `core` until it fails or is asked to stop.
fn run<S: LogStore>(
    mut core: ShardCore<S, Answer, ReadAnswer>,
    rx: &Receiver<Input>,
    status: &ReplicaStatus,
    leases: &mut Option<LeasePublisher>,
    send: &mut impl FnMut(Vec<Message>),
) -> Exit {
    let mut ticker = Ticker::new(mono_ns());
    status.publish(&core);
    loop {
        let now = mono_ns();
        core.set_clock(now);
        if ticker.due(now) {
            core.tick();
            status.publish(&core);
        }
        let wait = ticker.wait(mono_ns());
        // One input, then whatever else is queued (up to a bound): one
        // ready for all of them, so one log write and one message per
        // peer carry a whole batch of proposals (group commit).
        let mut next = rx.recv_timeout(wait);
        let mut taken = 0;
        loop {
            match next {
                Ok(Input::Propose(data, answer)) => {
                    if let Err((answer, e)) = core.propose(data, answer) {
                        let _ = answer.send(Err(e));
                    }
                }
                Ok(Input::Read(answer, lease_ok)) => {
                    if let Err((answer, e)) = core.read(answer, lease_ok) {
                        let _ = answer.send(Err(e));
                    }
                }
                Ok(Input::Raft(m)) => {
                    // Addressed to an earlier incarnation of this node's
                    // replica: what it answered, this one never knew.
                    if m.to == core.id()
                        && let Err(e) = core.step(m)
                    {
                        warn!("raft message refused: {e}");
                    }
                }
                Ok(Input::Join(replica, answer)) => {
                    let _ = answer.send(core.join(replica));
                }
                Ok(Input::Leave(node, placed, answer)) => {
                    let _ = answer.send(core.leave(node, &placed));
                }
                Ok(Input::SnapshotFailed(to, index)) => core.snapshot_failed(to, index),
                Ok(Input::Moving(ask, answer)) => {
                    let _ = answer.send(core.moving(ask));
                }
                Ok(Input::HandOver(Some((_, until)), answer)) if std::time::Instant::now() >= until => {
                    let _ = answer.try_send(Err(super::shard::NoHandOver::Behind));
                }
                Ok(Input::HandOver(named, answer)) => {
                    let node = named.map(|(n, _)| n);
                    let to = core.transfer_leadership(node);
                    match (to, node) {
                        (Ok(to), None) => info!(to, "handing leadership over: the node is stopping"),
                        (Ok(to), Some(_)) => info!(to, "handing leadership over, as an operator asked"),
                        _ => {}
                    }
                    let _ = answer.try_send(to);
                }
                Ok(Input::Replace(id, answer)) => {
                    // Readers stop before the store empties.
                    if let Some(l) = leases.as_mut() {
                        l.fence();
                    }
                    match core.replace(id) {
                        Ok(pending) => {
                            for p in pending {
                                let _ = p.send(Err(ProposeError::Unknown));
                            }
                            info!(id, "replica replaced: joining the shard as a new replica");
                            let _ = answer.send(Ok(()));
                        }
                        Err(e) => {
                            let _ = answer.send(Err(e.to_string()));
                        }
                    }
                }
                Ok(Input::Bootstrap) => match core.bootstrap() {
                    Ok(true) => info!(id = core.id(), "replica starts as one of the shard's first members"),
                    Ok(false) => {}
                    Err(e) => return Exit::Failed(format!("could not start as a first member: {e}")),
                },
                Ok(Input::Stop) | Err(RecvTimeoutError::Disconnected) => return Exit::Stopped,
                Err(RecvTimeoutError::Timeout) => break,
            }
            taken += 1;
            if taken >= MAX_INPUTS_PER_POLL {
                break;
            }
            next = match rx.try_recv() {
                Ok(input) => Ok(input),
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => Err(RecvTimeoutError::Disconnected),
            };
        }
        core.set_clock(mono_ns());
        match core.poll() {
            Ok(p) => {
                if let Some(l) = leases.as_mut() {
                    // Before any message goes out: a deposed leader's vote
                    // for a rival must not precede its fence.
                    if p.fence {
                        l.fence();
                    }
                    l.publish(core.lease(), core.applied(), core.placement().version(), mono_ns);
                }
                if !p.messages.is_empty() {
                    send(p.messages);
                }
                for (answer, result) in p.answers {
                    let _ = answer.send(result);
                }
                for (answer, result) in p.reads {
                    let _ = answer.send(result);
                }
            }
            Err(e) => return Exit::Failed(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::apply::encode_put;
    use super::super::replica::Replica;
    use super::*;
    use crate::region::Region;
    use crate::store::Store;
    use raft::prelude::ConfState;
    use raft::storage::MemStorage;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    type Inboxes = Arc<Mutex<Vec<Option<Box<dyn Fn(Message) + Send + Sync>>>>>;

    /// A change of the shard's partitions is in the block at once, under
    /// the lease published last when the next one waits for its index;
    /// a fenced region publishes nothing until a lease comes again.
    #[test]
    fn a_new_placement_is_published_at_once_under_the_lease_held() {
        let store = Store::format(Arc::new(Region::create("pub", 2 << 20).unwrap()), 64, 5, 1, Duration::ZERO).unwrap();
        let seed = store.header().hash_seed;
        let region = Arc::clone(store.region());
        let reg = Arc::new(Registration::new(*store.header()));
        let mut p = LeasePublisher::new(Arc::clone(&region), reg, seed);
        let block = || {
            let mut b = [0u8; LEASE_LEN];
            region.read(LEASE_OFFSET, &mut b);
            LeaseBlock::decode(&b, seed)
        };
        p.publish(Some((3, 500)), 10, 1, || 100);
        assert_eq!(block().map(|b| (b.term, b.start_ns, b.expiry_ns, b.placement)), Some((3, 100, 500, 1)));
        // The next lease waits for its round's index: the block keeps the
        // last one, and takes the new placement.
        p.publish(None, 12, 2, || 200);
        assert_eq!(
            block().map(|b| (b.term, b.start_ns, b.expiry_ns, b.applied, b.placement)),
            Some((3, 100, 500, 12, 2))
        );
        p.publish(Some((3, 700)), 13, 2, || 300);
        assert_eq!(block().map(|b| (b.start_ns, b.expiry_ns, b.placement)), Some((100, 700, 2)), "the same run");
        p.fence();
        p.publish(None, 14, 3, || 400);
        assert_eq!(block(), None, "no lease, nothing to publish under");
        p.publish(Some((4, 900)), 15, 3, || 450);
        assert_eq!(block().map(|b| (b.term, b.start_ns, b.placement)), Some((4, 450, 3)));
    }

    fn start(id: u64, inboxes: &Inboxes) -> (ShardThread, Arc<Store>) {
        let conf = ConfState { voters: vec![1, 2, 3], ..Default::default() };
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let replica = Replica::new(id, MemStorage::new_with_conf_state(conf), 10, &logger).unwrap();
        let store = Arc::new(
            Store::format(Arc::new(Region::create("drv", 2 << 20).unwrap()), 64, 5, 1, Duration::ZERO).unwrap(),
        );
        let net = Arc::clone(inboxes);
        let core = ShardCore::new(replica, Arc::clone(&store));
        let restart: Restart<MemStorage> = Box::new(|_| Err("not in this test".into()));
        let t = ShardThread::spawn(format!("shard-{id}"), core, restart, Arc::default(), None, move |msgs| {
            let boxes = net.lock().unwrap();
            for m in msgs {
                if let Some(Some(f)) = boxes.get(m.to as usize - 1) {
                    f(m);
                }
            }
        })
        .unwrap();
        (t, store)
    }

    /// Proposes on every thread until one (the leader) applies it.
    fn put_anywhere(threads: &[Option<ShardThread>], key: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            for t in threads.iter().flatten() {
                let rx = t.propose(encode_put(key.as_bytes(), b"v"));
                if let Ok(Ok(Applied::Put { .. })) = rx.blocking_recv() {
                    return true;
                }
            }
            std::thread::sleep(TICK);
        }
        false
    }

    /// Three shard threads wired to each other, a first PUT taken.
    fn three_threads() -> (Inboxes, Vec<Option<ShardThread>>, Vec<Arc<Store>>) {
        let inboxes: Inboxes = Arc::new(Mutex::new(vec![None, None, None]));
        let mut threads = Vec::new();
        let mut stores = Vec::new();
        for id in 1..=3 {
            let (t, s) = start(id, &inboxes);
            inboxes.lock().unwrap()[id as usize - 1] = Some(Box::new(t.inbox()));
            threads.push(Some(t));
            stores.push(s);
        }
        assert!(put_anywhere(&threads, "before"), "no leader took a PUT");
        (inboxes, threads, stores)
    }

    /// The leader: the thread whose proposal succeeds.
    fn leader_of(threads: &[Option<ShardThread>]) -> usize {
        (0..threads.len())
            .find(|&i| {
                let rx = threads[i].as_ref().unwrap().propose(encode_put(b"probe", b"v"));
                matches!(rx.blocking_recv(), Ok(Ok(_)))
            })
            .expect("a leader")
    }

    #[test]
    fn ticks_come_a_tick_apart_and_missed_ones_are_dropped() {
        let mut t = Ticker::new(0);
        assert!(!t.due(TICK_NS - 1));
        assert!(t.due(TICK_NS));
        assert!(!t.due(TICK_NS), "one tick per call");
        // Late by 3 ms: the next is a whole tick after this one.
        assert!(t.due(2 * TICK_NS + 3_000_000));
        assert!(!t.due(3 * TICK_NS + 2_999_999));
        assert!(t.due(3 * TICK_NS + 3_000_000));
        // A stall of a second: one tick, then a tick later the next; the
        // hundred missed are not made up.
        let back = 3 * TICK_NS + 1_000_000_000;
        assert!(t.due(back));
        assert!(!t.due(back + 1) && !t.due(back + TICK_NS - 1));
        assert_eq!(t.wait(back), TICK);
    }

    #[test]
    fn three_shard_threads_elect_replicate_and_fail_over() {
        let (inboxes, mut threads, stores) = three_threads();
        // The leader is the one whose proposals succeed: stop it.
        let leader = leader_of(&threads);
        inboxes.lock().unwrap()[leader] = None;
        threads[leader].take().unwrap().stop();
        let t0 = Instant::now();
        assert!(put_anywhere(&threads, "after"), "no new leader took a PUT");
        println!("failover to the first acknowledged PUT: {:?}", t0.elapsed());
        for (i, s) in stores.iter().enumerate() {
            if i != leader {
                let deadline = Instant::now() + Duration::from_secs(5);
                while s.get(b"after").unwrap().is_none() && Instant::now() < deadline {
                    std::thread::sleep(TICK);
                }
                assert!(s.get(b"before").unwrap().is_some() && s.get(b"after").unwrap().is_some(), "replica {i}");
            }
        }
    }

    /// A log whose writes fail while `fail` is set (a full disk).
    #[derive(Clone)]
    struct FailingLog {
        mem: MemStorage,
        fail: Arc<std::sync::atomic::AtomicBool>,
    }

    impl raft::Storage for FailingLog {
        fn initial_state(&self) -> raft::Result<raft::RaftState> {
            self.mem.initial_state()
        }
        fn entries(
            &self,
            low: u64,
            high: u64,
            max: impl Into<Option<u64>>,
            ctx: raft::GetEntriesContext,
        ) -> raft::Result<Vec<raft::prelude::Entry>> {
            self.mem.entries(low, high, max, ctx)
        }
        fn term(&self, idx: u64) -> raft::Result<u64> {
            self.mem.term(idx)
        }
        fn first_index(&self) -> raft::Result<u64> {
            self.mem.first_index()
        }
        fn last_index(&self) -> raft::Result<u64> {
            self.mem.last_index()
        }
        fn snapshot(&self, i: u64, to: u64) -> raft::Result<raft::prelude::Snapshot> {
            self.mem.snapshot(i, to)
        }
    }

    impl LogStore for FailingLog {
        fn persist(
            &self,
            e: &[raft::prelude::Entry],
            hs: Option<&raft::prelude::HardState>,
            sn: Option<&raft::prelude::Snapshot>,
        ) -> raft::Result<()> {
            if self.fail.load(Ordering::Relaxed) {
                return Err(raft::Error::Store(raft::StorageError::Other("no space left on device".into())));
            }
            self.mem.persist(e, hs, sn)
        }
        fn set_commit(&self, c: u64) -> raft::Result<()> {
            self.mem.set_commit(c)
        }
        fn compact(&self, to: u64) -> raft::Result<()> {
            self.mem.compact(to)
        }
        fn set_conf(&self, cs: &ConfState) -> raft::Result<()> {
            self.mem.set_conf(cs)
        }
    }

    /// A replica whose log fails: its thread fences, says it stopped,
    /// refuses requests as a follower without a leader (clients go on to
    /// the others), answers nothing for what was on its way (the node
    /// reports that as may-have-happened), and comes back from its log
    /// once writes work again.
    #[test]
    fn a_failed_replica_is_fenced_refuses_requests_and_comes_back() {
        let inboxes: Inboxes = Arc::new(Mutex::new(vec![None, None, None]));
        let mut threads = Vec::new();
        let mut parts = Vec::new();
        for id in 1..=3u64 {
            let conf = ConfState { voters: vec![1, 2, 3], ..Default::default() };
            let log = FailingLog { mem: MemStorage::new_with_conf_state(conf), fail: Arc::default() };
            let store = Arc::new(
                Store::format(Arc::new(Region::create("fail", 2 << 20).unwrap()), 64, 5, 1, Duration::ZERO).unwrap(),
            );
            let logger = slog::Logger::root(slog::Discard, slog::o!());
            let core = ShardCore::new(Replica::new(id, log.clone(), 10, &logger).unwrap(), Arc::clone(&store));
            let (again, again_store) = (log.clone(), Arc::clone(&store));
            let restart: Restart<FailingLog> = Box::new(move |_| {
                again_store.clear(1).map_err(|e| e.to_string())?;
                let replica = Replica::new(id, again.clone(), 10, &logger).map_err(|e| e.to_string())?;
                Ok(ShardCore::new(replica, Arc::clone(&again_store)))
            });
            let status = Arc::new(ReplicaStatus::for_shard(0));
            let net = Arc::clone(&inboxes);
            let t = ShardThread::spawn(format!("fail-{id}"), core, restart, Arc::clone(&status), None, move |msgs| {
                let boxes = net.lock().unwrap();
                for m in msgs {
                    if let Some(Some(f)) = boxes.get(m.to as usize - 1) {
                        f(m);
                    }
                }
            })
            .unwrap();
            inboxes.lock().unwrap()[id as usize - 1] = Some(Box::new(t.inbox()));
            threads.push(Some(t));
            parts.push((log, store, status));
        }
        assert!(put_anywhere(&threads, "before"), "no leader took a PUT");
        let leader = leader_of(&threads);
        let (log, store, status) = &parts[leader];
        log.fail.store(true, Ordering::Relaxed);
        let t = threads[leader].as_ref().unwrap();
        let pending = t.propose(encode_put(b"doomed", b"v"));
        assert!(pending.blocking_recv().is_err(), "a write in flight when the replica fails gets no answer");
        let deadline = Instant::now() + Duration::from_secs(5);
        while status.role() != "stopped" && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(status.role(), "stopped");
        assert_eq!(
            t.propose(encode_put(b"k", b"v")).blocking_recv().unwrap(),
            Err(ProposeError::NotLeader { leader: None })
        );
        assert_eq!(t.read(true).blocking_recv().unwrap(), Err(ProposeError::NotLeader { leader: None }));
        // The others go on without it; it keeps failing while the log does.
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut moved_on = false;
        while !moved_on && Instant::now() < deadline {
            for (i, t) in threads.iter().enumerate() {
                if i != leader
                    && matches!(t.as_ref().unwrap().propose(encode_put(b"after", b"v")).blocking_recv(), Ok(Ok(_)))
                {
                    moved_on = true;
                }
            }
            std::thread::sleep(TICK);
        }
        assert!(moved_on, "the other replicas took no write");
        assert!(status.restarts.load(Ordering::Relaxed) >= 1, "it was started again");
        // The disk has room again: it comes back, from its log, and has
        // what the others wrote meanwhile.
        log.fail.store(false, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(15);
        while store.get(b"after").unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(TICK);
        }
        assert!(store.get(b"before").unwrap().is_some() && store.get(b"after").unwrap().is_some());
        assert_ne!(status.role(), "stopped");
    }

    #[test]
    fn a_follower_without_room_applies_later_and_skips_nothing() {
        let (_, threads, stores) = three_threads();
        let leader = leader_of(&threads);
        let f = (leader + 1) % 3;
        let deadline = Instant::now() + Duration::from_secs(5);
        while stores[f].get(b"probe").unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(TICK);
        }
        // The follower's memory fills up behind raft's back (as grace
        // periods and compaction can leave replicas with different room).
        let junk = vec![7u8; 16 << 10];
        let mut n = 0;
        while stores[f].put(format!("junk{n}").as_bytes(), &junk).is_ok() {
            n += 1;
        }
        let big = vec![1u8; 64 << 10];
        let rx = threads[leader].as_ref().unwrap().propose(encode_put(b"big", &big));
        assert!(matches!(rx.blocking_recv(), Ok(Ok(Applied::Put { .. }))), "the leader applied it");
        let rx = threads[leader].as_ref().unwrap().propose(encode_put(b"after", b"v"));
        assert!(matches!(rx.blocking_recv(), Ok(Ok(Applied::Put { .. }))));
        std::thread::sleep(Duration::from_millis(200));
        assert!(stores[f].get(b"big").unwrap().is_none(), "no room: not applied yet");
        assert!(stores[f].get(b"after").unwrap().is_none(), "nothing after it either");
        for i in 0..n {
            stores[f].delete(format!("junk{i}").as_bytes()).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while stores[f].get(b"after").unwrap().is_none() && Instant::now() < deadline {
            std::thread::sleep(TICK);
        }
        assert_eq!(stores[f].get(b"big").unwrap().map(|v| v.0.len()), Some(big.len()), "applied once room came");
        assert!(stores[f].get(b"after").unwrap().is_some(), "and what followed");
    }
}
