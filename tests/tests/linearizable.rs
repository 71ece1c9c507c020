//! Recorded concurrent histories of one-sided GETs racing RPC PUTs, checked
//! for linearizability with stateright's tester (a register per round).
//!
//! Writers PUT unique values; readers GET one-sided over shared memory and
//! the TCP engine, mostly through cached item addresses, and one reader in
//! `auto` mixes RPC GETs and engine reads as its path controller decides. Every invocation
//! and return is logged under one lock at the moment it happens, so the log
//! respects real time. A reader that returned an overwritten value after
//! the overwrite was acknowledged would make the history non-linearizable.

use std::sync::{Arc, Barrier, Mutex};

use dmkv_client::{ClientConfig, ReadPath, Transport, blocking::Client};
use dmkv_tests::{Grower, ServerProcess};
use stateright::semantics::register::{Register, RegisterOp, RegisterRet};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester};

const ROUNDS: usize = 40;
/// Rounds go on past `ROUNDS` until the index has split and the compactor
/// has moved an item while they ran (on a fast host 40 rounds take half a
/// second, before the grower has filled a segment), but no further.
const MAX_ROUNDS: usize = 20_000;
const OPS_PER_THREAD: usize = 6;

#[derive(Debug, Clone)]
enum Event {
    Invoke(usize, RegisterOp<u64>),
    Return(usize, RegisterRet<u64>),
}

fn parse(v: Option<bytes::Bytes>) -> u64 {
    let v = v.expect("the key exists throughout the round");
    std::str::from_utf8(&v).unwrap().parse().unwrap()
}

#[test]
fn one_sided_gets_racing_puts_are_linearizable() {
    // The compactor moves every item again and again meanwhile: a move
    // must be as invisible to readers as it is to the history.
    // And the index grows from one segment meanwhile: reads race splits.
    let srv = ServerProcess::start(&["--memory", "32MiB", "--compactor", "continuous", "--buckets", "32"]);
    let rpc = |path| ClientConfig::default().read_path(path).pool_size(1);
    let setup = Client::connect_with(&srv.rpc, rpc(ReadPath::Rpc)).unwrap();
    // Threads 0-1 write over RPC; 2 reads over shm, 3 over the TCP engine,
    // 4 in auto (RPC or the engine, per GET).
    let clients: Vec<Arc<Client>> = vec![
        Arc::new(Client::connect_with(&srv.rpc, rpc(ReadPath::Rpc)).unwrap()),
        Arc::new(Client::connect_with(&srv.rpc, rpc(ReadPath::Rpc)).unwrap()),
        Arc::new(Client::connect_with(&srv.rpc, rpc(ReadPath::OneSided).transport(Some(Transport::Shm))).unwrap()),
        Arc::new(Client::connect_with(&srv.rpc, rpc(ReadPath::OneSided).transport(Some(Transport::Engine))).unwrap()),
        Arc::new(Client::connect_with(&srv.rpc, rpc(ReadPath::Auto).transport(Some(Transport::Engine))).unwrap()),
    ];
    let gets_before = setup.stats().unwrap()["gets"];
    let raced = || {
        let s = setup.stats().unwrap();
        s["index_splits"] > 0 && s["compactor_moves"] > 0
    };
    let grower = Grower::start(&srv.rpc);
    let mut round = 0;
    while round < ROUNDS || (round < MAX_ROUNDS && !raced()) {
        let key = format!("lin-{round}");
        setup.put(&key, "0").unwrap();
        let log: Arc<Mutex<Vec<Event>>> = Arc::default();
        let barrier = Arc::new(Barrier::new(clients.len()));
        let handles: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(t, c)| {
                let (c, log, barrier, key) = (Arc::clone(c), Arc::clone(&log), Arc::clone(&barrier), key.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    for i in 0..OPS_PER_THREAD {
                        if t < 2 {
                            let v = ((round * 10 + t) * 100 + i + 1) as u64;
                            log.lock().unwrap().push(Event::Invoke(t, RegisterOp::Write(v)));
                            c.put(&key, v.to_string()).unwrap();
                            log.lock().unwrap().push(Event::Return(t, RegisterRet::WriteOk));
                        } else {
                            log.lock().unwrap().push(Event::Invoke(t, RegisterOp::Read));
                            let v = parse(c.get(&key).unwrap());
                            log.lock().unwrap().push(Event::Return(t, RegisterRet::ReadOk(v)));
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let log = log.lock().unwrap().clone();
        let mut tester = LinearizabilityTester::new(Register(0u64));
        for e in &log {
            match e.clone() {
                Event::Invoke(t, op) => tester.on_invoke(t, op).map(|_| ()),
                Event::Return(t, ret) => tester.on_return(t, ret).map(|_| ()),
            }
            .expect("well-formed history");
        }
        assert!(tester.is_consistent(), "round {round}: history is not linearizable:\n{log:#?}");
        round += 1;
    }
    println!("{round} rounds");
    let grown = grower.stop();
    let splits = setup.stats().unwrap()["index_splits"];
    println!("{grown} keys added during the rounds, {splits} index segment splits");
    assert!(splits > 0, "the index did not grow: the rounds did not race splits");
    let moves = setup.stats().unwrap()["compactor_moves"];
    println!("the compactor moved {moves} items during the rounds");
    assert!(moves > 0, "the compactor moved nothing: the rounds did not race it");
    // Only the auto reader's GETs (and its background probes, at most one
    // still in flight) reach the server's KV code.
    let ran = setup.stats().unwrap()["gets"] - gets_before;
    let auto = clients[4].path_stats().controller.rpc;
    assert!(
        ran >= auto.requests && ran <= auto.requests + auto.probes + 1,
        "{ran} RPC GETs, the auto reader sent {} and {} probes: forced one-sided reads went over RPC",
        auto.requests,
        auto.probes
    );
    println!(
        "auto reader: {} GETs over RPC, {} one-sided",
        auto.requests,
        clients[4].path_stats().controller.one_sided.requests
    );
    for (name, c) in [("shm", &clients[2]), ("tcp", &clients[3])] {
        let rs = c.read_stats();
        println!("{name}: {rs:?}");
        assert!(rs.hint_hits > 0, "{name}: cached addresses were never used: {rs:?}");
    }
}
