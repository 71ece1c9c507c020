//! A partition move survives a kill -9 of the source shard's leader, the
//! target shard's leader and the metadata group's leader, each in the
//! middle of a (paced, so slow) move: asked again until it answers, the
//! move completes (resumed, or abandoned and begun anew), the map puts the
//! partition on one shard, and every acknowledged write is there.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dmkv_client::{Client, ClientConfig, ClientError, blocking};
use dmkv_common::cluster::map::{META_SHARD, partition_of};
use dmkv_tests::cluster::TestCluster;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// Keys of the moving partition that hold its data, and their size: a
/// copy of about 3 MiB, at [`RATE_MIB`] long enough to kill a node in.
const BIG_KEYS: usize = 48;
const BIG_VALUE: usize = 64 << 10;
const RATE_MIB: u32 = 1;
/// Keys of the partition each round's writer writes, once each (a write
/// lost in the move is not hidden by a later one to the same key).
const WRITER_KEYS: usize = 1500;
/// Most the test asks for one move, again and again (a node restarting,
/// a move resumed or begun anew).
const MOVE_DEADLINE: Duration = Duration::from_secs(90);

/// Which leader a round kills: the moving partition's source shard's,
/// its target shard's, or the metadata group's.
#[derive(Debug, Clone, Copy)]
enum Victim {
    Source,
    Target,
    Meta,
}

/// Per key written: whether its PUT was acknowledged (else it failed, and
/// may or may not have applied).
type Written = Arc<Mutex<BTreeMap<String, bool>>>;

/// The node index leading `shard` (`META_SHARD`: the metadata group), as
/// the nodes themselves say.
fn leader_index(rt: &tokio::runtime::Runtime, addrs: &[String], shard: u32) -> Option<usize> {
    rt.block_on(async {
        for (i, a) in addrs.iter().enumerate() {
            let Ok(c) = Client::connect(a.clone()).await else { continue };
            let Ok(s) = c.cluster_status().await else { continue };
            if s.local.iter().any(|r| r.shard == shard && r.role == "leader") {
                return Some(i);
            }
        }
        None
    })
}

/// Asks for the move until one answer says it is done: a node that died
/// or restarted, a move running or stopped, are asked again.
/// `None`: an answer lost, the move found done when asked again.
type Moved = (Option<dmkv_common::proto::MovePartitionReply>, Vec<String>);

fn move_until_done(addrs: &[String], p: u32, to: u32) -> Result<Moved, String> {
    let deadline = Instant::now() + MOVE_DEADLINE;
    let mut seen = Vec::new();
    let cfg = ClientConfig::default().request_timeout(Duration::from_secs(120));
    while Instant::now() < deadline {
        for a in addrs {
            let answer = blocking::Client::connect_with(a.clone(), cfg.clone())
                .and_then(|c| c.move_partition(p, to, Some(RATE_MIB)));
            match answer {
                Ok(r) => return Ok((Some(r), seen)),
                Err(ClientError::NotLeader { .. }) => {}
                Err(e) => {
                    let e = e.to_string();
                    if e.contains(&format!("is on shard {to} already")) {
                        // Its answer was lost with a node: done before.
                        seen.push(e);
                        return Ok((None, seen));
                    }
                    if seen.last() != Some(&e) {
                        seen.push(e);
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    Err(format!("the move did not complete within {MOVE_DEADLINE:?}: {seen:?}"))
}

#[test]
fn a_move_completes_or_starts_over_when_a_leader_is_killed_mid_way() {
    let mut c = TestCluster::start(3, 2, 3, true, &["--memory", "96MiB"]);
    let addrs: Vec<String> = (0..3).map(|i| c.rpc(i).to_string()).collect();
    let rt = rt();
    let map = rt.block_on(c.leaders_known(0));
    let p = (0..)
        .map(|i| partition_of(format!("mf-{i}").as_bytes()))
        .find(|&p| map.shard_of_partition(p) == Some(0))
        .expect("a partition of shard 0");
    let keys: Vec<String> =
        (0..).map(|i| format!("mf-{i}")).filter(|k| partition_of(k.as_bytes()) == p).take(BIG_KEYS).collect();
    rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.expect("connect");
        for (i, k) in keys.iter().enumerate() {
            client.put(k, vec![i as u8; BIG_VALUE]).await.expect("fill");
        }
    });
    let mut from = 0u32;
    for (round, victim) in [Victim::Source, Victim::Target, Victim::Meta].into_iter().enumerate() {
        let to = 1 - from;
        // Keys of its own for each round's writer.
        let fresh: Vec<String> = (0..)
            .map(|i| format!("mfs{round}-{i}"))
            .filter(|k| partition_of(k.as_bytes()) == p)
            .take(WRITER_KEYS)
            .collect();
        let shard = match victim {
            Victim::Source => from,
            Victim::Target => to,
            Victim::Meta => META_SHARD,
        };
        let kill = leader_index(&rt, &addrs, shard).expect("a leader");
        let stop = Arc::new(AtomicBool::new(false));
        let written: Written = Arc::default();
        let writer = {
            let (stop, written, seed) = (Arc::clone(&stop), Arc::clone(&written), addrs[(kill + 1) % 3].clone());
            rt.spawn(async move {
                let cfg = ClientConfig::default().request_timeout(Duration::from_secs(10));
                let client = Client::connect_with(seed, cfg).await.expect("connect");
                let mut failed = 0;
                for k in fresh {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let ok = client.put(&k, k.as_bytes()).await.is_ok();
                    failed += u64::from(!ok);
                    written.lock().unwrap().insert(k, ok);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                failed
            })
        };
        let mover = {
            let addrs = addrs.clone();
            std::thread::spawn(move || move_until_done(&addrs, p, to))
        };
        std::thread::sleep(Duration::from_millis(1200));
        c.kill(kill);
        std::thread::sleep(Duration::from_millis(500));
        c.restart(kill);
        let outcome = mover.join().expect("mover thread");
        stop.store(true, Ordering::Relaxed);
        let failed = rt.block_on(writer).expect("writer");
        let writes = written.lock().unwrap().len();
        let (report, seen) = outcome.unwrap_or_else(|e| panic!("{victim:?} (node {}): {e}", kill + 1));
        println!(
            "{victim:?} (node {}) killed mid-move of partition {p} from shard {from} to {to}: {report:?}; answers \
             before: {seen:?}; writer: {writes} PUTs, {failed} failed",
            kill + 1,
        );
        rt.block_on(async {
            let check = Client::connect(addrs[(kill + 2) % 3].clone()).await.expect("connect");
            let map = check.cluster_map().await.expect("map");
            assert_eq!(map.shard_of_partition(p), Some(to), "{victim:?}: the map did not flip");
            assert!(map.moving.is_none(), "{victim:?}: the map still records a move: {:?}", map.moving);
            for (i, k) in keys.iter().enumerate() {
                let got = check.get(k).await.expect("get");
                assert_eq!(got.as_deref(), Some(&vec![i as u8; BIG_VALUE][..]), "{victim:?}: {k} lost or wrong");
            }
            let written = written.lock().unwrap().clone();
            assert!(written.len() < WRITER_KEYS, "the writer ran out of keys before the move ended");
            for (k, acked) in written {
                let got = check.get(&k).await.expect("get");
                match got {
                    Some(v) => assert_eq!(&v[..], k.as_bytes(), "{victim:?}: {k} holds another value"),
                    None => assert!(!acked, "{victim:?}: {k} was acknowledged and is lost"),
                }
            }
        });
        from = to;
    }
}

/// Keys of the moving partition the writer of the hand-over test deletes
/// (filled before the move with small values).
const DOOMED_KEYS: usize = 200;

/// The metadata group's leader hands over in the middle of a move while
/// its mover runs on: the new leader resumes the recorded move by itself
/// (no one asks again) under a newer claim, the old mover's copy still in
/// flight is refused by the shards and it stops, and the move completes:
/// every acknowledged write is there and no acknowledged delete comes
/// back (a stale copy landing after the new mover's could bring one back).
#[test]
fn a_move_goes_on_by_itself_when_the_metadata_leader_hands_over_mid_way() {
    let c = TestCluster::start(3, 2, 3, true, &["--memory", "96MiB"]);
    let addrs: Vec<String> = (0..3).map(|i| c.rpc(i).to_string()).collect();
    let rt = rt();
    let map = rt.block_on(c.leaders_known(0));
    let p = (0..)
        .map(|i| partition_of(format!("mh-{i}").as_bytes()))
        .find(|&p| map.shard_of_partition(p) == Some(0))
        .expect("a partition of shard 0");
    let of_p = |prefix: &'static str, n: usize| -> Vec<String> {
        (0..).map(|i| format!("{prefix}{i}")).filter(|k| partition_of(k.as_bytes()) == p).take(n).collect()
    };
    // Twice the other test's: the first mover's copy (6 s at 1 MiB/s)
    // still runs when the next mover's begins (3 s after the hand-over),
    // so its late chunks meet the next mover's copy.
    let keys = of_p("mh-", 2 * BIG_KEYS);
    let doomed = of_p("mhd-", DOOMED_KEYS);
    let fresh = of_p("mhf-", 4 * WRITER_KEYS);
    rt.block_on(async {
        let client = Client::connect(addrs[0].clone()).await.expect("connect");
        for (i, k) in keys.iter().enumerate() {
            client.put(k, vec![i as u8; BIG_VALUE]).await.expect("fill");
        }
        for k in &doomed {
            client.put(k, k.as_bytes()).await.expect("fill");
        }
    });
    let meta = leader_index(&rt, &addrs, META_SHARD).expect("a metadata leader");
    let next = (meta + 1) % 3;
    let stop = Arc::new(AtomicBool::new(false));
    let written: Written = Arc::default();
    let deleted: Arc<Mutex<Vec<String>>> = Arc::default();
    let writer = {
        let (stop, written, deleted, seed) =
            (Arc::clone(&stop), Arc::clone(&written), Arc::clone(&deleted), addrs[next].clone());
        rt.spawn(async move {
            let cfg = ClientConfig::default().request_timeout(Duration::from_secs(10));
            let client = Client::connect_with(seed, cfg).await.expect("connect");
            let mut doomed = doomed.into_iter();
            for (i, k) in fresh.into_iter().enumerate() {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let ok = client.put(&k, k.as_bytes()).await.is_ok();
                written.lock().unwrap().insert(k, ok);
                if i % 4 == 0
                    && let Some(d) = doomed.next()
                    && client.delete(&d).await.is_ok()
                {
                    deleted.lock().unwrap().push(d);
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };
    // Asked once, of the metadata leader; its answer is not awaited for.
    let mover = {
        let addr = addrs[meta].clone();
        std::thread::spawn(move || {
            let cfg = ClientConfig::default().request_timeout(Duration::from_secs(120));
            blocking::Client::connect_with(addr, cfg).and_then(|c| c.move_partition(p, 1, Some(RATE_MIB)))
        })
    };
    std::thread::sleep(Duration::from_millis(1200));
    let handed = rt.block_on(async {
        let cfg = ClientConfig::default().request_timeout(Duration::from_secs(20));
        let c = Client::connect_with(addrs[meta].clone(), cfg).await.expect("connect");
        c.transfer_leader(META_SHARD, next as u64 + 1).await
    });
    handed.unwrap_or_else(|e| panic!("the metadata group's leadership did not move: {e}"));
    let deadline = Instant::now() + MOVE_DEADLINE;
    let flipped = loop {
        let map = rt.block_on(async {
            let c = Client::connect(addrs[next].clone()).await.ok()?;
            c.cluster_map().await.ok()
        });
        if let Some(m) = map.filter(|m| m.shard_of_partition(p) == Some(1) && m.moving.is_none()) {
            break m;
        }
        assert!(Instant::now() < deadline, "the move was not carried on within {MOVE_DEADLINE:?}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let first = mover.join().expect("mover thread");
    stop.store(true, Ordering::Relaxed);
    rt.block_on(writer).expect("writer");
    let ended: Vec<_> = flipped.history.iter().filter(|h| h.partition == p).collect();
    println!("the first mover: {first:?}; the map's history of partition {p}: {ended:?}");
    assert!(ended.iter().any(|h| h.outcome == "done" && h.to == 1), "no move of {p} ended done: {ended:?}");
    rt.block_on(async {
        let check = Client::connect(addrs[(next + 1) % 3].clone()).await.expect("connect");
        for (i, k) in keys.iter().enumerate() {
            let got = check.get(k).await.expect("get");
            assert_eq!(got.as_deref(), Some(&vec![i as u8; BIG_VALUE][..]), "{k} lost or wrong");
        }
        let written = written.lock().unwrap().clone();
        assert!(written.len() < 4 * WRITER_KEYS, "the writer ran out of keys before the move ended");
        for (k, acked) in written {
            match check.get(&k).await.expect("get") {
                Some(v) => assert_eq!(&v[..], k.as_bytes(), "{k} holds another value"),
                None => assert!(!acked, "{k} was acknowledged and is lost"),
            }
        }
        let deleted = deleted.lock().unwrap().clone();
        assert!(!deleted.is_empty(), "the writer deleted nothing");
        for k in deleted {
            assert_eq!(check.get(&k).await.expect("get"), None, "{k} was deleted and came back");
        }
    });
}
