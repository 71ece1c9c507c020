//! A deterministic simulation of three shard replicas with leases: a true
//! clock, replica clocks that drift within the bound, messages delayed,
//! lost, duplicated and reordered, replicas crashing and restarting from
//! what they persisted, all from one seed. It checks what makes one-sided
//! reads of a leader's region linearizable:
//!
//! - at any true time, every lease that is published and not yet over
//!   belongs to one replica in one term (a crashed leader's region keeps
//!   its last header: its lease counts until it ends);
//! - a replica whose published lease holds at true time t has applied
//!   every write acknowledged before t.

use std::collections::VecDeque;
use std::sync::Arc;

use dmkv_common::cluster::lease::LeaseConfig;
use proptest::prelude::*;
use raft::prelude::{ConfState, Message};
use raft::storage::MemStorage;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::apply::{Applied, encode_put};
use super::leasing::LeaseKeeper;
use super::replica::Replica;
use super::shard::{ProposeError, ShardCore};
use crate::region::Region;
use crate::store::Store;

const NODES: usize = 3;
const ELECTION_TICKS: usize = 10;
const MS: u64 = 1_000_000;
const TICK_NS: u64 = 10 * MS;
/// Clock rates differ from true time by at most this much.
const DRIFT_PPM: i64 = 20_000;

fn lease_cfg(timeout_ticks: u64) -> LeaseConfig {
    LeaseConfig {
        // A follower's refusal starts at a message and ends whole ticks
        // later: one tick may be lost to where the message fell.
        election_timeout_ns: (timeout_ticks - 1) * TICK_NS,
        max_drift_ppm: DRIFT_PPM as u64,
        max_skew_ns: 0,
        margin_ns: MS,
    }
}

type Core = ShardCore<MemStorage, u64, u64>;

struct Node {
    core: Option<Core>,
    storage: MemStorage,
    store: Arc<Store>,
    ppm: i64,
    offset: u64,
    next_tick: u64,
    down_until: u64,
    /// Last published lease: (term, end in true ns).
    published: Option<(u64, f64)>,
    /// Acknowledged writes (a prefix) found in `store` so far.
    checked: usize,
}

impl Node {
    fn clock(&self, t: u64) -> u64 {
        self.offset + (t as f64 * (1.0 + self.ppm as f64 / 1e6)) as u64
    }

    fn true_of(&self, clock: u64) -> f64 {
        (clock.saturating_sub(self.offset)) as f64 / (1.0 + self.ppm as f64 / 1e6)
    }
}

fn store() -> Arc<Store> {
    let region = Arc::new(Region::create("lease-sim", 2 << 20).unwrap());
    Arc::new(Store::format(region, 64, 5, 1, std::time::Duration::ZERO).unwrap())
}

fn boot(id: u64, storage: MemStorage, store: &Arc<Store>, faults: &Faults) -> Core {
    let logger = slog::Logger::root(slog::Discard, slog::o!());
    let replica = Replica::new(id, storage, ELECTION_TICKS, &logger).unwrap();
    let quiet_ticks = if faults.quiet { ELECTION_TICKS as u64 } else { 0 };
    let keeper = LeaseKeeper::new(lease_cfg(faults.lease_timeout_ticks)).unwrap();
    ShardCore::new(replica, Arc::clone(store)).with_leases(keeper, quiet_ticks)
}

/// What goes wrong in a run, and the rules under test.
#[derive(Debug, Clone)]
pub struct Faults {
    /// Random crashes, partitions, loss and duplication.
    pub random: bool,
    /// At this true time (ms), the replica holding a lease crashes for
    /// good, its region (and lease block) left for readers.
    pub crash_holder_at: Option<u64>,
    /// The restart rule: a replica refuses votes for an election timeout.
    pub quiet: bool,
    /// The election timeout the lease is computed from (ticks); raft's is
    /// [`ELECTION_TICKS`]. A larger one makes leases too long.
    pub lease_timeout_ticks: u64,
}

impl Faults {
    /// Random faults and the rules as built.
    pub fn random() -> Faults {
        Faults { random: true, crash_holder_at: None, quiet: true, lease_timeout_ticks: ELECTION_TICKS as u64 }
    }
}

/// What a run saw.
#[derive(Debug, Default)]
pub struct Outcome {
    pub acked: usize,
    pub leases: usize,
    pub violation: Option<String>,
}

/// Runs `steps` steps of 1 ms from `seed` with `faults`.
pub fn run(seed: u64, steps: u64, faults: &Faults) -> Outcome {
    let mut rng = SmallRng::seed_from_u64(seed);
    let conf = ConfState { voters: (1..=NODES as u64).collect(), ..Default::default() };
    let mut nodes: Vec<Node> = (0..NODES)
        .map(|i| {
            let storage = MemStorage::new_with_conf_state(conf.clone());
            let store = store();
            Node {
                core: Some(boot(i as u64 + 1, storage.clone(), &store, faults)),
                storage,
                store,
                ppm: rng.random_range(-DRIFT_PPM..=DRIFT_PPM),
                offset: rng.random_range(0..1000 * MS),
                next_tick: 0,
                down_until: 0,
                published: None,
                checked: 0,
            }
        })
        .collect();
    for n in &mut nodes {
        n.next_tick = n.clock(0) + TICK_NS;
    }
    // Messages in flight: (deliver at true ns, message).
    let mut net: VecDeque<(u64, Message)> = VecDeque::new();
    // Acknowledged writes: (true ns, key).
    let mut acked: Vec<(u64, String)> = Vec::new();
    let mut out = Outcome::default();
    let mut next_key = 0u64;
    let mut lease_terms = std::collections::BTreeSet::new();
    // A node cut off from the others until a time: (node, until).
    let mut cut: Option<(usize, u64)> = None;
    for step in 0..steps {
        let t = step * MS;
        if cut.is_some_and(|(_, until)| t >= until) {
            cut = None;
        }
        if faults.random && cut.is_none() && rng.random_ratio(1, 1500) {
            cut = Some((rng.random_range(0..NODES), t + rng.random_range(50..600) * MS));
        }
        // Crashes and restarts.
        if faults.crash_holder_at == Some(t / MS)
            && let Some(n) = nodes.iter_mut().find(|n| n.published.is_some_and(|(_, end)| end > t as f64))
        {
            n.core = None;
            n.down_until = u64::MAX;
        }
        for (i, n) in nodes.iter_mut().enumerate() {
            if faults.random && n.core.is_some() && rng.random_ratio(1, 2500) {
                n.core = None;
                // Often back at once (a process restarted by its
                // supervisor), sometimes after a while.
                let down = if rng.random_bool(0.5) { rng.random_range(0..30) } else { rng.random_range(0..400) };
                n.down_until = t + down * MS;
            } else if n.core.is_none() && t >= n.down_until {
                // Memory is gone; the log is what it persisted. (The old
                // region's header, and so `published`, stays for readers
                // that mapped it.)
                n.store = store();
                n.checked = 0;
                n.core = Some(boot(i as u64 + 1, n.storage.clone(), &n.store, faults));
                n.next_tick = n.clock(t) + TICK_NS;
            }
        }
        // Clocks and ticks.
        for n in nodes.iter_mut() {
            let now = n.clock(t);
            let Some(core) = n.core.as_mut() else { continue };
            core.set_clock(now);
            while now >= n.next_tick {
                core.tick();
                n.next_tick += TICK_NS;
            }
        }
        // Clients write anywhere; only the leader takes it.
        // Every other second is idle: a shard without writes is where a
        // stale candidate's log is as long as anyone's.
        if (t / (1000 * MS)).is_multiple_of(2) && rng.random_ratio(1, 3) {
            let i = rng.random_range(0..NODES);
            if let Some(core) = nodes[i].core.as_mut() {
                let key = format!("w{next_key}");
                next_key += 1;
                let _ = core.propose(encode_put(key.as_bytes(), b"v"), next_key - 1);
            }
        }
        // Deliver what is due, in random order.
        let mut due: Vec<Message> = Vec::new();
        net.retain(|(at, m)| {
            if *at <= t {
                due.push(m.clone());
                false
            } else {
                true
            }
        });
        for j in (1..due.len()).rev() {
            due.swap(j, rng.random_range(0..=j));
        }
        for m in due {
            if cut.is_some_and(|(c, _)| m.to as usize - 1 == c || m.from as usize - 1 == c) {
                continue;
            }
            if let Some(core) = nodes[m.to as usize - 1].core.as_mut() {
                let _ = core.step(m);
            }
        }
        // Poll: send, acknowledge, fence, publish.
        for n in nodes.iter_mut() {
            let Some(core) = n.core.as_mut() else { continue };
            let p = core.poll().unwrap();
            if p.fence {
                n.published = None;
            }
            for m in p.messages {
                match rng.random_range(if faults.random { 0 } else { 4 }..50) {
                    0..=2 => {}
                    3 => {
                        net.push_back((t + rng.random_range(0..30) * MS, m.clone()));
                        net.push_back((t + rng.random_range(0..30) * MS, m));
                    }
                    _ => net.push_back((t + rng.random_range(0..20) * MS, m)),
                }
            }
            for (key, r) in p.answers {
                match r {
                    Ok(Applied::Put { .. }) => acked.push((t, format!("w{key}"))),
                    Ok(other) => panic!("a put applied as {other:?}"),
                    Err(ProposeError::Unknown | ProposeError::Dropped | ProposeError::NotLeader { .. }) => {}
                    Err(e) => panic!("unexpected {e:?}"),
                }
            }
            let lease = core.lease().map(|(term, end)| (term, n.true_of(end)));
            if let Some((term, _)) = lease {
                lease_terms.insert(term);
            }
            if lease.is_some() {
                n.published = lease;
            }
        }
        // The checks, at true time t.
        let holders: Vec<(usize, u64)> = nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.published.filter(|(_, end)| *end > t as f64).map(|(term, _)| (i, term)))
            .collect();
        if holders.len() > 1 {
            out.violation = Some(format!("seed {seed}, t = {} ms: leases held at once: {holders:?}", t / MS));
            break;
        }
        if let Some(&(i, _)) = holders.first() {
            // The store only gains keys (no deletes here): check each
            // acknowledged write once per store.
            let n = &mut nodes[i];
            while let Some((at, key)) = acked.get(n.checked).filter(|(at, _)| *at < t) {
                if n.store.get(key.as_bytes()).unwrap().is_none() {
                    out.violation = Some(format!(
                        "seed {seed}, t = {} ms: replica {} holds a lease but lacks {key}, acknowledged at {} ms",
                        t / MS,
                        i + 1,
                        at / MS
                    ));
                    break;
                }
                n.checked += 1;
            }
            if out.violation.is_some() {
                break;
            }
        }
    }
    out.acked = acked.len();
    out.leases = lease_terms.len();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn one_lease_at_a_time_and_it_covers_every_acknowledged_write(seed in any::<u64>()) {
        let o = run(seed, 12_000, &Faults::random());
        prop_assert!(o.violation.is_none(), "{}", o.violation.unwrap());
        prop_assert!(o.acked > 100 && o.leases >= 1, "seed {seed}: too little happened: {o:?}");
    }
}

/// A lease holder that crashes leaves its lease in its region: the next
/// leader must not publish one before it ends. Seeded, no other faults.
#[test]
fn a_crashed_holders_lease_ends_before_the_next_one_begins() {
    let crash = Faults { random: false, crash_holder_at: Some(1500), ..Faults::random() };
    let mut next_leases = 0;
    for seed in 0..20 {
        let o = run(seed, 3000, &crash);
        assert!(o.violation.is_none(), "{}", o.violation.unwrap());
        next_leases += usize::from(o.leases >= 2);
    }
    assert!(next_leases >= 18, "a new leader published a lease in only {next_leases} of 20 runs");
    // The simulation can tell: leases computed from three times the
    // election timeout overlap the next leader's.
    // (Leases 1.5 or 2 times too long went unseen in these 20 runs: a
    // rival is elected after raft's randomized timeout, 1-2 times the
    // bound's, plus two rounds of votes. The seeded runs are fixed, so
    // the count is too: 8 of 20 when this was written.)
    let too_long = Faults { lease_timeout_ticks: 3 * ELECTION_TICKS as u64, ..crash };
    let caught = (0..20).filter(|&seed| run(seed, 3000, &too_long).violation.is_some()).count();
    assert!(caught >= 4, "leases three times too long overlapped in only {caught} of 20 runs");
}
