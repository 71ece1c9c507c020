//! The shard thread: a thin driver around [`ShardCore`]. It owns the core,
//! takes inputs (proposals, peers' raft messages) from a bounded queue,
//! ticks raft on the wall clock, and hands raft's outgoing messages to the
//! node's transport. One thread per shard replica, so shards write in
//! parallel (and the store's writer lock is per shard).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dmkv_common::layout::{LEASE_LEN, LEASE_OFFSET, LeaseBlock};
use raft::prelude::Message;
use tokio::sync::oneshot;
use tracing::{error, info, warn};

use super::apply::Applied;
use super::replica::LogStore;
use super::shard::{JoinStep, ProposeError, ShardCore};
use crate::region::Region;
use crate::registration::Registration;

/// Inputs waiting for a shard thread at most; more are refused (`Busy`).
pub const MAX_INPUTS: usize = 8192;
/// Inputs taken from the queue before the core is polled: bounds how long
/// raft's messages wait while a burst of proposals is taken in.
pub const MAX_INPUTS_PER_POLL: usize = 256;
/// Raft's logical clock: one tick this often.
pub const TICK: Duration = Duration::from_millis(10);

/// Where a proposal's answer goes.
pub type Answer = oneshot::Sender<Result<Applied, ProposeError>>;
/// Where a read's permission goes.
pub type ReadAnswer = oneshot::Sender<Result<(), ProposeError>>;

enum Input {
    Propose(Vec<u8>, Answer),
    Read(ReadAnswer),
    Raft(Message),
    Join(u64, oneshot::Sender<Result<JoinStep, ProposeError>>),
    /// Start as the shard's first members' replica (see `ShardCore::bootstrap`).
    Bootstrap,
    /// Go on as a new replica with this id (see `ShardCore::replace`).
    Replace(u64, oneshot::Sender<Result<(), String>>),
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
    /// What is published: (term, end on the replica's monotonic clock).
    last: Option<(u64, u64)>,
}

impl LeasePublisher {
    pub fn new(region: Arc<Region>, reg: Arc<Registration>, hash_seed: u64) -> LeasePublisher {
        LeasePublisher { region, reg, hash_seed, last: None }
    }

    /// Stops one-sided reads of the region: the lease block cleared, then
    /// a new registration (next epoch, new rkey: the engine refuses the
    /// old one, shared-memory handoffs close, readers attach again).
    fn fence(&mut self) {
        self.region.write(LEASE_OFFSET, &[0u8; LEASE_LEN]);
        let epoch = self.reg.reregister(&self.region);
        self.last = None;
        info!(epoch, "lease lapsed or leadership lost: region fenced");
    }

    /// Publishes `lease` (term, end on the monotonic clock `now`) if it is
    /// new. Its end in wall-clock time is taken with the wall clock read
    /// first, so the published end is never later than the lease's.
    fn publish(&mut self, lease: Option<(u64, u64)>, applied: u64, clock: &Instant) {
        // A lease waiting for its round's index to apply keeps the last
        // one published: that one is still held, and its index applied.
        let Some((term, end)) = lease else { return };
        if self.last == Some((term, end)) {
            return;
        }
        let unix_now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let now = clock.elapsed().as_nanos() as u64;
        let block = LeaseBlock { term, expiry_unix_ns: unix_now.saturating_add(end.saturating_sub(now)), applied };
        self.region.write(LEASE_OFFSET, &block.encode(self.hash_seed));
        self.last = Some((term, end));
    }
}

/// A running shard thread.
pub struct ShardThread {
    tx: SyncSender<Input>,
    handle: Option<JoinHandle<()>>,
}

impl ShardThread {
    /// Starts the thread; `send` carries raft's messages to peers (it must
    /// not block: queue and drop, raft retransmits).
    pub fn spawn<S: LogStore + Send + 'static>(
        name: String,
        core: ShardCore<S, Answer, ReadAnswer>,
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
            run(core, rx, &guard.0, leases, send);
        })?;
        Ok(ShardThread { tx, handle: Some(handle) })
    }

    /// Asks for permission to read the store linearizably (see
    /// [`ShardCore::read`]); the answer comes on the returned channel.
    pub fn read(&self) -> oneshot::Receiver<Result<(), ProposeError>> {
        let (answer, rx) = oneshot::channel();
        if let Err(e) = self.tx.try_send(Input::Read(answer)) {
            let (TrySendError::Full(input) | TrySendError::Disconnected(input)) = e;
            if let Input::Read(a) = input {
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

    fn shutdown(&mut self) {
        let _ = self.tx.send(Input::Stop);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for ShardThread {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn run<S: LogStore>(
    mut core: ShardCore<S, Answer, ReadAnswer>,
    rx: Receiver<Input>,
    status: &ReplicaStatus,
    mut leases: Option<LeasePublisher>,
    mut send: impl FnMut(Vec<Message>),
) {
    // The replica's monotonic clock, for its lease.
    let clock = Instant::now();
    let mut next_tick = Instant::now() + TICK;
    status.publish(&core);
    loop {
        core.set_clock(clock.elapsed().as_nanos() as u64);
        let wait = next_tick.saturating_duration_since(Instant::now());
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
                Ok(Input::Read(answer)) => {
                    if let Err((answer, e)) = core.read(answer) {
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
                    Err(e) => {
                        error!("shard replica could not start: {e}");
                        return;
                    }
                },
                Ok(Input::Stop) | Err(RecvTimeoutError::Disconnected) => {
                    // The lease would lapse on its own; readers stop sooner.
                    if let Some(l) = leases.as_mut().filter(|l| l.last.is_some()) {
                        l.fence();
                    }
                    return;
                }
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
        if Instant::now() >= next_tick {
            core.tick();
            next_tick += TICK;
            status.publish(&core);
        }
        core.set_clock(clock.elapsed().as_nanos() as u64);
        match core.poll() {
            Ok(p) => {
                if let Some(l) = leases.as_mut() {
                    // Before any message goes out: a deposed leader's vote
                    // for a rival must not precede its fence.
                    if p.fence {
                        l.fence();
                    }
                    l.publish(core.lease(), core.applied(), &clock);
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
            Err(e) => {
                // The log or the store failed: this replica stops (the
                // others carry on; an operator replaces it).
                error!("shard replica stopped: {e}");
                if let Some(l) = leases.as_mut().filter(|l| l.last.is_some()) {
                    l.fence();
                }
                return;
            }
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

    type Inboxes = Arc<Mutex<Vec<Option<Box<dyn Fn(Message) + Send + Sync>>>>>;

    fn start(id: u64, inboxes: &Inboxes) -> (ShardThread, Arc<Store>) {
        let conf = ConfState { voters: vec![1, 2, 3], ..Default::default() };
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let replica = Replica::new(id, MemStorage::new_with_conf_state(conf), 10, &logger).unwrap();
        let store = Arc::new(
            Store::format(Arc::new(Region::create("drv", 2 << 20).unwrap()), 64, 5, 1, Duration::ZERO).unwrap(),
        );
        let net = Arc::clone(inboxes);
        let core = ShardCore::new(replica, Arc::clone(&store));
        let t = ShardThread::spawn(format!("shard-{id}"), core, Arc::default(), None, move |msgs| {
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
