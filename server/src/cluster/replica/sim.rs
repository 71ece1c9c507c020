//! Three replicas over a simulated network that drops, duplicates and
//! reorders messages, with replicas crashing and restarting from what
//! they persisted, all from one seed. Checks raft's promises as the
//! store relies on them: replicas apply the same commands in the same
//! order, and no command acknowledged to a client (applied on the
//! leader that took it) is ever lost.

use super::*;
use crate::cluster::apply::{apply, encode_delete, encode_put};
use crate::region::Region;
use crate::store::Store;
use proptest::prelude::*;
use raft::StateRole;
use raft::prelude::ConfState;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const NODES: u64 = 3;
const ELECTION_TICK: usize = 10;

struct Node<S: LogStore> {
    replica: Option<Replica<S>>,
    /// The replica's state machine: rebuilt from the log at each
    /// restart (raft replays committed entries from the start).
    store: Store,
}

const KEYS: u64 = 40;

fn store() -> Store {
    let region = std::sync::Arc::new(Region::create("sim", 2 << 20).unwrap());
    Store::format(region, 64, 5, 1, std::time::Duration::ZERO).unwrap()
}

/// Every key's (value, version) in `s`.
fn dump(s: &Store) -> Vec<Option<(Vec<u8>, u64)>> {
    (0..KEYS).map(|k| s.get(format!("k{k}").as_bytes()).unwrap().map(|(v, ver)| (v.to_vec(), ver))).collect()
}

fn logger() -> slog::Logger {
    slog::Logger::root(slog::Discard, slog::o!())
}

fn boot<S: LogStore>(storage: S, id: u64) -> Replica<S> {
    Replica::new(id, storage, ELECTION_TICK, &logger()).unwrap()
}

fn conf() -> ConfState {
    ConfState { voters: (1..=NODES).collect(), ..Default::default() }
}

/// Runs `steps` steps from `seed` over stores that `open(node)` opens
/// (first boot and after every crash: what the node persisted);
/// returns (acknowledged, committed log of each node) after healing
/// everything and letting it settle.
/// `power_cycle` is called, now and then, with every replica down: the
/// stores must then come back from what they made durable.
fn run<S: LogStore>(
    seed: u64,
    steps: usize,
    open: impl Fn(usize) -> S,
    power_cycle: impl Fn(),
) -> (Vec<Vec<u8>>, Vec<Vec<Vec<u8>>>) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut nodes: Vec<Node<S>> =
        (0..NODES as usize).map(|i| Node { replica: Some(boot(open(i), i as u64 + 1)), store: store() }).collect();
    let mut net: Vec<Message> = Vec::new();
    let mut acked: Vec<Vec<u8>> = Vec::new();
    // Proposals in flight at a leader: (node, term, data).
    let mut pending: Vec<(usize, u64, Vec<u8>)> = Vec::new();
    let mut next = 0u64;
    for step in 0..steps + 400 {
        let faults = step < steps;
        if faults && rng.random_ratio(1, 200) {
            // Every replica stops at once, and restarts from its store.
            for n in nodes.iter_mut() {
                n.replica = None;
                n.store = store();
            }
            pending.clear();
            power_cycle();
            for (i, n) in nodes.iter_mut().enumerate() {
                n.replica = Some(boot(open(i), i as u64 + 1));
            }
        }
        for (i, n) in nodes.iter_mut().enumerate() {
            let Some(r) = n.replica.as_mut() else {
                // A crashed node restarts after a while, from its storage.
                if !faults || rng.random_ratio(1, 20) {
                    n.replica = Some(boot(open(i), i as u64 + 1));
                }
                continue;
            };
            r.tick();
            if faults && rng.random_ratio(1, 300) {
                n.replica = None;
                n.store = store();
                // Applied state is rebuilt from the log on restart:
                // raft replays from the start (no snapshots here).
                pending.retain(|&(p, _, _)| p != i);
                continue;
            }
            // Proposals stop with the faults, so the commit index can
            // reach every replica before the logs are compared.
            if faults && r.raft().raft.state == StateRole::Leader && rng.random_ratio(1, 3) {
                // Unique commands (the value names the proposal), over
                // a few keys, with some deletes.
                let key = format!("k{}", next % KEYS);
                let data = if next % 7 == 3 {
                    encode_delete(key.as_bytes())
                } else {
                    encode_put(key.as_bytes(), format!("v{next}").as_bytes())
                };
                next += 1;
                if r.propose(data.clone()).is_ok() {
                    pending.push((i, r.raft().raft.term, data));
                }
            }
        }
        // Deliver some of the network, in random order, with losses
        // and duplicates while faults are on.
        let mut deliver = std::mem::take(&mut net);
        if faults {
            let mut kept = Vec::new();
            for m in deliver.drain(..) {
                match rng.random_range(0..20) {
                    0 => {}
                    1 => {
                        kept.push(m.clone());
                        kept.push(m);
                    }
                    2 => net.push(m),
                    _ => kept.push(m),
                }
            }
            let len = kept.len();
            for j in (1..len).rev() {
                kept.swap(j, rng.random_range(0..=j));
            }
            deliver = kept;
        }
        for m in deliver {
            let to = (m.to - 1) as usize;
            if let Some(r) = nodes[to].replica.as_mut() {
                let _ = r.step(m);
            }
        }
        for (i, n) in nodes.iter_mut().enumerate() {
            let Some(r) = n.replica.as_mut() else { continue };
            while let Some(out) = r.ready().unwrap() {
                net.extend(out.messages);
                if let Some(last) = out.committed.last() {
                    let last = last.index;
                    r.applied_to(last);
                }
                for e in out.committed {
                    if e.data.is_empty() {
                        continue;
                    }
                    apply(&n.store, e.index, &e.data).unwrap();
                    // Acknowledged: applied on the leader that took it.
                    if let Some(k) = pending.iter().position(|(p, _, d)| *p == i && d[..] == e.data[..]) {
                        acked.push(pending.swap_remove(k).2);
                    }
                }
            }
        }
    }
    // A restarted replica re-applies from its log: compare committed
    // logs instead of what each applied in memory.
    let logs = nodes
        .iter()
        .map(|n| {
            let s = n.replica.as_ref().expect("every node is up after the settling").raft().store();
            let commit = s.initial_state().unwrap().hard_state.commit;
            let first = s.first_index().unwrap();
            s.entries(first, commit + 1, None, raft::GetEntriesContext::empty(false))
                .unwrap()
                .into_iter()
                .filter(|e| !e.data.is_empty())
                .map(|e| e.data.to_vec())
                .collect()
        })
        .collect();
    // Every replica's store holds the same keys, values and versions.
    let first = dump(&nodes[0].store);
    for (i, n) in nodes.iter().enumerate().skip(1) {
        assert_eq!(dump(&n.store), first, "seed {seed}: replica {} differs from replica 1", i + 1);
    }
    (acked, logs)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn replicas_agree_and_keep_every_acknowledged_command(seed in any::<u64>()) {
        // In memory: a crashed node keeps what it persisted.
        let stores: Vec<MemStorage> = (0..NODES).map(|_| MemStorage::new_with_conf_state(conf())).collect();
        let (acked, logs) = run(seed, 1500, |i| stores[i].clone(), || {});
        check(seed, &acked, &logs)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4, ..ProptestConfig::default() })]

    /// The same over raft-engine logs in files: the three replicas'
    /// logs share one engine (raft-engine's read cache is per thread
    /// and keyed by file position, so two engines in one thread would
    /// read each other's blocks; a node has one engine for all its
    /// shards), and a power cycle closes it and reopens it from disk.
    #[test]
    fn replicas_on_raft_engine_logs_recover_what_they_persisted(seed in any::<u64>()) {
        use crate::cluster::log::RaftLog;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_str().unwrap().to_string();
        let engine = std::cell::RefCell::new(Some(RaftLog::open_engine(&path).unwrap().0));
        let log = |i: usize| RaftLog::new(engine.borrow().clone().expect("engine open"), i as u64 + 1);
        for i in 0..NODES as usize {
            log(i).set_conf_state(&conf()).unwrap();
        }
        let cycle = || {
            let old = engine.borrow_mut().take().expect("engine open");
            assert_eq!(std::sync::Arc::strong_count(&old), 1, "every replica is down");
            drop(old);
            *engine.borrow_mut() = Some(RaftLog::open_engine(&path).unwrap().0);
        };
        let (acked, logs) = run(seed, 600, log, cycle);
        check(seed, &acked, &logs)?;
    }
}

fn check(seed: u64, acked: &[Vec<u8>], logs: &[Vec<Vec<u8>>]) -> Result<(), TestCaseError> {
    prop_assert!(!acked.is_empty(), "seed {seed}: nothing was acknowledged");
    // The same commands in the same order: committed logs are prefixes
    // of the longest.
    let longest = logs.iter().max_by_key(|l| l.len()).unwrap();
    for l in logs {
        prop_assert_eq!(&longest[..l.len()], &l[..], "seed {}: logs diverge", seed);
    }
    // Every acknowledged command is committed (healed, every replica
    // has them all).
    for a in acked {
        for l in logs {
            prop_assert!(l.contains(a), "seed {}: acknowledged {:?} lost", seed, String::from_utf8_lossy(a));
        }
    }
    Ok(())
}
