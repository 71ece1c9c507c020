//! The simulation's clients: writers that PUT fresh values through a
//! replica's shard thread, and readers on every path, as state machines
//! stepped on virtual time. One-sided readers read a replica's region with
//! the client's read protocol (`dmkv_common::read`) and judge the lease
//! block with the client's check (`dmkv_common::cluster::lease_check`);
//! RPC readers ask the replica's core for a read grant and read its store
//! as the service does. Any of them may be preempted between two steps.

use std::sync::Arc;

use dmkv_common::cluster::lease::{ClockSample, Span};
use dmkv_common::cluster::lease_check::{self, AttemptStart, LeaseClock, SampledClock};
use dmkv_common::layout::{LEASE_LEN, LEASE_OFFSET, LeaseBlock, key_hash};
use dmkv_common::read::{AfterBuckets, Lookup, Outcome as ReadOutcome, ReadSpec, dir_read, judge_dir_entry};
use rand::Rng;
use rand::rngs::SmallRng;

use super::history::{Read, Via};
use super::{Client, Get, Input, KEYS, Kind, MS, NODES, Phase, ReadRule, RpcGet, RpcPhase, State, Step, World, key};
use crate::cluster::apply::{Applied, encode_put};
use crate::cluster::shard::{ProposeError, ReadGrant};
use crate::store::Store;

/// Writers and readers of a run: three writers, two readers of each
/// one-sided kind and four over RPC: more clients than replicas.
fn clients(rng: &mut SmallRng) -> Vec<Client> {
    let kinds = [
        Kind::Writer,
        Kind::Writer,
        Kind::Writer,
        Kind::OneSided(Via::Shared),
        Kind::OneSided(Via::Shared),
        Kind::OneSided(Via::Stamped),
        Kind::OneSided(Via::Stamped),
        Kind::OneSided(Via::Sampled),
        Kind::OneSided(Via::Sampled),
        Kind::Rpc,
        Kind::Rpc,
        Kind::Rpc,
        Kind::Rpc,
    ];
    kinds
        .into_iter()
        .map(|kind| Client {
            kind,
            state: State::Idle { at: 0 },
            seq: 0,
            ppm: rng.random_range(-super::DRIFT_PPM..=super::DRIFT_PPM),
            offset: rng.random_range(0..1_000_000 * MS),
            samples: std::array::from_fn(|_| None),
        })
        .collect()
}

impl Client {
    /// The sampling reader's own monotonic clock at true time `t`.
    fn clock(&self, t: u64) -> u64 {
        self.offset + (t as f64 * (1.0 + self.ppm as f64 / 1e6)) as u64
    }

    fn next_id(&mut self, me: usize) -> u64 {
        self.seq += 1;
        ((me as u64) << 32) | self.seq
    }
}

/// How long a preempted client or task is away: often not at all, else up
/// to 300 ms (a loaded host).
fn preemption(w: &mut World) -> u64 {
    if !w.faults.preempt || !w.rng.random_ratio(1, 3) {
        return 0;
    }
    if w.rng.random_bool(0.7) { w.rng.random_range(0..20) * MS } else { w.rng.random_range(20..300) * MS }
}

/// The replica a client asks: the leader of the highest term it can see
/// (a client that routes well), or any replica (one whose map is stale).
fn target(w: &mut World) -> usize {
    let leader = (0..NODES).filter_map(|i| w.nodes[i].leads().map(|term| (term, i))).max().map(|(_, i)| i);
    match leader {
        Some(i) if w.rng.random_bool(0.7) => i,
        _ => w.rng.random_range(0..NODES),
    }
}

/// The store a one-sided reader of replica `i` reads: its region, or the
/// last region of a crashed incarnation, which stays mapped.
fn region_of(w: &World, i: usize) -> Option<Arc<Store>> {
    if w.nodes[i].up() {
        return Some(Arc::clone(&w.nodes[i].store));
    }
    w.frozen.iter().rev().find(|(j, _)| *j == i).map(|(_, s)| Arc::clone(s))
}

/// A one-sided read of `store`'s region (out of bounds: `Err`).
fn read_spec(store: &Store, spec: &ReadSpec) -> Result<Vec<u8>, ()> {
    let mut b = vec![0u8; spec.len as usize];
    store.region().try_read(spec.offset, &mut b).map(|()| b).map_err(|_| ())
}

/// The bucket batch of a GET of `key` (its directory entry read first):
/// done, or the items to read. `Err` where the protocol says retry.
fn bucket_batch(store: &Store, key: &[u8]) -> Result<Step, ()> {
    let header = *store.header();
    let kh = key_hash(key, header.hash_seed);
    let entry = read_spec(store, &dir_read(&kh, &header))?;
    let segment = judge_dir_entry(&entry, &header).ok_or(())?;
    let mut look = Lookup::with_hash(kh, &header, segment, None, 0).without_grace_check();
    let mut specs = Vec::new();
    look.first_reads(&mut specs);
    let bufs = specs.iter().map(|s| read_spec(store, s)).collect::<Result<Vec<_>, _>>()?;
    match look.after_buckets(key, [&bufs[0], &bufs[1]], None, 0, 0) {
        AfterBuckets::Miss => Ok(Step::Done(None)),
        AfterBuckets::ReadItems => Ok(Step::Items(Box::new(look))),
        AfterBuckets::Hit(_) | AfterBuckets::Retry(_) => Err(()),
    }
}

/// The item batch of a GET: the version found, `Ok(None)` for a miss.
fn item_batch(store: &Store, key: &[u8], look: &Lookup) -> Result<Option<u64>, ()> {
    let mut items = Vec::new();
    look.item_reads(&mut items);
    let bufs = items.iter().map(|s| read_spec(store, s)).collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<&[u8]> = bufs.iter().map(Vec::as_slice).collect();
    match look.after_items(key, &refs, 0, 0) {
        ReadOutcome::Hit(h) => Ok(Some(h.version)),
        ReadOutcome::Miss => Ok(None),
        ReadOutcome::Retry(_) => Err(()),
    }
}

/// Steps every client whose next event is due.
fn step_clients(w: &mut World) {
    for c in 0..w.clients.len() {
        step_client(w, c);
    }
}

fn step_client(w: &mut World, c: usize) {
    let t = w.t;
    enum Due {
        Start,
        GiveUp,
        OneSided,
        Rpc,
        Nothing,
    }
    let due = match &w.clients[c].state {
        State::Idle { at } if *at <= t => Due::Start,
        State::Writing { until, .. } if *until <= t => Due::GiveUp,
        State::OneSided(g) if g.at <= t => Due::OneSided,
        State::Rpc(g) => match g.phase {
            RpcPhase::Asked { until } if until <= t => Due::GiveUp,
            RpcPhase::Reading { at, .. } | RpcPhase::Replying { at, .. } if at <= t => Due::Rpc,
            _ => Due::Nothing,
        },
        _ => Due::Nothing,
    };
    match due {
        Due::Start => start(w, c),
        Due::GiveUp => {
            // No answer: the write may or may not have happened; the read
            // went to a replica that did not answer.
            w.out.refused += usize::from(matches!(w.clients[c].kind, Kind::Rpc));
            idle(w, c);
        }
        Due::OneSided => one_sided(w, c),
        Due::Rpc => rpc(w, c),
        Due::Nothing => {}
    }
}

fn idle(w: &mut World, c: usize) {
    let pause = w.rng.random_range(0..5) * MS;
    w.clients[c].state = State::Idle { at: w.t + pause };
}

fn start(w: &mut World, c: usize) {
    let t = w.t;
    let key = w.rng.random_range(0..KEYS);
    let node = target(w);
    match w.clients[c].kind {
        Kind::Writer => {
            // The last 600 ms of every second are quiet: a shard without
            // writes is where a stale replica's log is as long as anyone's
            // and it can win votes.
            if !w.nodes[node].up() || t % (1000 * MS) >= 400 * MS {
                return idle(w, c);
            }
            let id = w.clients[c].next_id(c);
            let data = encode_put(self::key(key).as_bytes(), format!("v{id}").as_bytes());
            w.send_request(node, Input::Propose(id, data));
            w.clients[c].state = State::Writing { id, key, until: t + 300 * MS };
        }
        Kind::Rpc => {
            if !w.nodes[node].up() {
                return idle(w, c);
            }
            let id = w.clients[c].next_id(c);
            w.send_request(node, Input::Read(id, true));
            let phase = RpcPhase::Asked { until: t + 400 * MS };
            w.clients[c].state = State::Rpc(RpcGet { id, key, invoked: t, node, phase });
        }
        Kind::OneSided(via) => {
            let Some(store) = region_of(w, node) else { return idle(w, c) };
            let (clock, local) = match via {
                Via::Shared => (LeaseClock::Shared, w.nodes[node].clock(t)),
                Via::Stamped => (LeaseClock::Stamped, 0),
                Via::Sampled => (LeaseClock::Sampled(sampled(w, c, node)), w.clients[c].clock(t)),
                Via::Rpc => unreachable!("one-sided kinds only"),
            };
            let at = t + preemption(w);
            w.clients[c].state = State::OneSided(Get {
                key,
                invoked: t,
                node,
                store,
                clock,
                start: AttemptStart::at(local, 1),
                phase: Phase::Buckets,
                at,
                step: Err(()),
                found: Err(()),
                stamps: (0, 0),
                block: [0; LEASE_LEN],
            });
        }
    }
}

/// A sampling reader's bounds on replica `i`'s clock, sampled again once a
/// second (a round trip of up to 2 ms).
fn sampled(w: &mut World, c: usize, i: usize) -> Arc<SampledClock> {
    let t = w.t;
    if let Some((s, at)) = &w.clients[c].samples[i]
        && t < at + 1000 * MS
    {
        return Arc::clone(s);
    }
    let rtt = w.rng.random_range(0..2 * MS);
    let server_at = t.saturating_sub(rtt / 2);
    let client = &w.clients[c];
    let sample = ClockSample {
        sent: client.clock(t.saturating_sub(rtt)),
        server: w.nodes[i].clock(server_at),
        received: client.clock(t),
    };
    let clock = match &w.clients[c].samples[i] {
        Some((s, _)) => {
            assert!(s.resample(sample), "seed {}: clocks within the drift bound disagreed", w.seed);
            Arc::clone(s)
        }
        None => SampledClock::with_drift(sample, super::DRIFT_PPM as u64).expect("a sample in order"),
    };
    w.clients[c].samples[i] = Some((Arc::clone(&clock), t));
    clock
}

fn one_sided(w: &mut World, c: usize) {
    let t = w.t;
    let pause = preemption(w);
    let rule = w.rules.read;
    // A resync may come in the middle of an attempt.
    let resync = match &w.clients[c].state {
        State::OneSided(g) if g.phase == Phase::Items && matches!(g.clock, LeaseClock::Sampled(_)) => Some(g.node),
        _ => None,
    };
    if let Some(node) = resync {
        let _ = sampled(w, c, node);
    }
    let own = w.clients[c].clock(t);
    let State::OneSided(g) = &mut w.clients[c].state else { return };
    let node = &w.nodes[g.node];
    let key_bytes = key(g.key);
    match g.phase {
        Phase::Buckets => {
            // The engine reads its clock before the batch's first read.
            g.stamps.0 = node.clock(t);
            g.step = bucket_batch(&g.store, key_bytes.as_bytes());
            g.phase = Phase::BucketsBlock;
            g.at = t + pause;
            return;
        }
        Phase::Items => {
            g.stamps.0 = node.clock(t);
            g.found = match &g.step {
                Ok(Step::Items(look)) => item_batch(&g.store, key_bytes.as_bytes(), look),
                _ => Err(()),
            };
            g.phase = Phase::ItemsBlock;
            g.at = t + pause;
            return;
        }
        Phase::BucketsBlock | Phase::ItemsBlock => {}
    }
    // The lease block, read after the batch's data, and the judgement.
    g.store.region().read(LEASE_OFFSET, &mut g.block);
    g.stamps.1 = node.clock(t);
    let local_end = match g.clock {
        LeaseClock::Shared => node.clock(t),
        _ => own,
    };
    let seed = g.store.header().hash_seed;
    let stamps = (g.clock_is_stamped()).then_some(g.stamps);
    let trusted = match rule {
        ReadRule::Run => lease_check::check(&g.clock, seed, Some(&g.block), stamps, &mut g.start, local_end).is_ok(),
        ReadRule::EndOnly => {
            let end = match &g.clock {
                LeaseClock::Shared => Some(local_end),
                LeaseClock::Stamped => Some(g.stamps.1),
                LeaseClock::Sampled(s) => s_latest(s, local_end),
            };
            let block = LeaseBlock::decode(&g.block, seed);
            matches!((block, end), (Some(b), Some(e)) if e < b.expiry_ns)
        }
    };
    let via = match g.clock {
        LeaseClock::Shared => Via::Shared,
        LeaseClock::Stamped => Via::Stamped,
        LeaseClock::Sampled(_) => Via::Sampled,
    };
    let result = match (trusted, g.phase, &g.step) {
        (false, _, _) | (_, Phase::BucketsBlock, Err(())) => None,
        (true, Phase::BucketsBlock, Ok(Step::Done(got))) => Some(Ok(*got)),
        (true, Phase::BucketsBlock, Ok(Step::Items(_))) => {
            g.phase = Phase::Items;
            g.at = t + pause;
            return;
        }
        (true, _, _) => Some(g.found),
    };
    match result {
        Some(Ok(got)) => {
            let r = Read { key: g.key, invoked: g.invoked, returned: t, got, via, node: g.node };
            w.history.reads.push(r);
        }
        _ => w.out.refused += 1,
    }
    idle(w, c);
}

impl Get {
    fn clock_is_stamped(&self) -> bool {
        matches!(self.clock, LeaseClock::Stamped)
    }
}

/// The end of a span as a sampled clock bounds it (the old rule's only
/// check).
fn s_latest(s: &SampledClock, local_end: u64) -> Option<u64> {
    s.span(local_end, local_end).map(|Span { end, .. }| end)
}

fn rpc(w: &mut World, c: usize) {
    let t = w.t;
    let post_check = w.rules.rpc_post_check;
    let generation_check = w.rules.rpc_generation_check;
    let delay = w.rng.random_range(0..3) * MS;
    let State::Rpc(g) = &mut w.clients[c].state else { return };
    match g.phase {
        RpcPhase::Reading { lease_until, generation, .. } => {
            let n = &w.nodes[g.node];
            if !n.process_up() {
                // The process went away with the request.
                w.out.refused += 1;
                return idle(w, c);
            }
            // The service reads the store it has, whatever happened to it
            // since the grant (a restart in place empties and refills it).
            let got = n.store.get(key(g.key).as_bytes()).unwrap().map(|(_, v)| v);
            if generation_check && n.store.generation() != generation {
                let (node, id) = (g.node, g.id);
                g.phase = RpcPhase::Asked { until: t + 400 * MS };
                w.send_request(node, Input::Read(id, true));
                return;
            }
            if post_check && lease_until.is_some_and(|until| n.clock(t) >= until) {
                // Read after the lease ended: ask again, under a round.
                let (node, id) = (g.node, g.id);
                g.phase = RpcPhase::Asked { until: t + 400 * MS };
                w.send_request(node, Input::Read(id, false));
                return;
            }
            g.phase = RpcPhase::Replying { at: t + delay, got };
        }
        RpcPhase::Replying { got, .. } => {
            let r = Read { key: g.key, invoked: g.invoked, returned: t, got, via: Via::Rpc, node: g.node };
            w.history.reads.push(r);
            idle(w, c);
        }
        RpcPhase::Asked { .. } => {}
    }
}

/// A client's id's owner, if the id is still what it waits for.
fn owner(w: &World, id: u64) -> Option<usize> {
    let c = (id >> 32) as usize;
    let waits = match w.clients.get(c).map(|c| &c.state) {
        Some(State::Writing { id: i, .. }) => *i == id,
        Some(State::Rpc(g)) => g.id == id && matches!(g.phase, RpcPhase::Asked { .. }),
        _ => false,
    };
    waits.then_some(c)
}

/// A replica answered write `id`.
fn answered(w: &mut World, i: usize, id: u64, r: Result<Applied, ProposeError>) {
    let Some(c) = owner(w, id) else { return };
    if let (State::Writing { key, .. }, Ok(Applied::Put { version })) = (&w.clients[c].state, &r) {
        let (key, version) = (*key, *version);
        w.acknowledge(i, key, version);
    }
    idle(w, c);
}

/// Replica `i` granted (or refused) RPC read `id`.
fn granted(w: &mut World, _i: usize, id: u64, r: Result<ReadGrant, ProposeError>) {
    let Some(c) = owner(w, id) else { return };
    let pause = preemption(w);
    let t = w.t;
    let State::Rpc(g) = &mut w.clients[c].state else { return };
    match r {
        Ok(grant) => {
            g.phase = RpcPhase::Reading { at: t + pause, lease_until: grant.lease_until, generation: grant.generation }
        }
        Err(_) => {
            w.out.refused += 1;
            idle(w, c);
        }
    }
}

/// A replica refused request `id` at once (not the leader, too busy).
fn refused(w: &mut World, id: u64) {
    if let Some(c) = owner(w, id) {
        if matches!(w.clients[c].kind, Kind::Rpc) {
            w.out.refused += 1;
        }
        idle(w, c);
    }
}

/// What the world asks of its clients: it names none of this module, so
/// the clients' steps sit on the world's state and not the other way.
impl World {
    /// Gives the world its clients (see [`clients`]).
    pub(super) fn add_clients(&mut self) {
        self.clients = clients(&mut self.rng);
    }

    /// Steps every client due now (see [`step_clients`]).
    pub(super) fn step_clients(&mut self) {
        step_clients(self)
    }

    /// A replica answered a client's proposal (see [`answered`]).
    pub(super) fn client_answered(&mut self, i: usize, id: u64, r: Result<Applied, ProposeError>) {
        answered(self, i, id, r)
    }

    /// A replica answered a client's read (see [`granted`]).
    pub(super) fn client_granted(&mut self, i: usize, id: u64, r: Result<ReadGrant, ProposeError>) {
        granted(self, i, id, r)
    }

    /// A client's request was refused (see [`refused`]).
    pub(super) fn client_refused(&mut self, id: u64) {
        refused(self, id)
    }
}
