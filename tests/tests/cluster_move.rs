//! Partition moves in a cluster of real dmkvd processes
//! (docs/elasticity.md): `dmkv cluster move-partition` copies a partition
//! to another shard while a writer overwrites its keys and readers read
//! them one-sided (shared memory and the TCP engine, routed by maps from
//! before the move) and over RPC. The recorded history is checked for
//! linearizability; every key is then read where the map puts it, the
//! source holds none of the partition any more, and versions only went up.

use std::time::Duration;

use dmkv_client::{Client, ClientConfig, ReadPath, Transport, blocking};
use dmkv_common::cluster::map::partition_of;
use dmkv_tests::cluster::TestCluster;
use dmkv_tests::history::{self, Clients};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// Moves `p` to shard `to` through node `via`, following NOT_LEADER to
/// the metadata group's leader, as `dmkv cluster move-partition` does.
fn move_partition(c: &TestCluster, p: u32, to: u32) -> dmkv_common::proto::MovePartitionReply {
    let mut last = String::new();
    for _ in 0..50 {
        for i in 0..3 {
            let admin = blocking::Client::connect_with(c.rpc(i).to_string(), ClientConfig::default()).expect("connect");
            match admin.move_partition(p, to, None) {
                Ok(r) => return r,
                Err(dmkv_client::ClientError::NotLeader { .. }) => continue,
                Err(e) => last = format!("node {}: {e}", i + 1),
            }
        }
        if !last.is_empty() {
            panic!("the move failed: {last}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("no node leads the metadata group");
}

/// A partition moves while its keys are written and read one-sided and
/// over RPC: the history stays linearizable, the writes go on, readers
/// read the target's region after the move, and nothing is lost.
#[test]
fn a_partition_moves_while_it_is_written_and_read_one_sided() {
    let c = TestCluster::start(3, 2, 3, false, &[]);
    let rt = rt();
    let (clients, p, from, to) = rt.block_on(async {
        let map = c.leaders_known(0).await;
        // The partition of the first key on shard 0, and eight of its keys.
        let p = (0..)
            .map(|i| format!("mv-{i}"))
            .map(|k| partition_of(k.as_bytes()))
            .find(|&p| map.shard_of_partition(p) == Some(0))
            .expect("a partition of shard 0");
        let keys: Vec<String> =
            (0..).map(|i| format!("mv-{i}")).filter(|k| partition_of(k.as_bytes()) == p).take(8).collect();
        let paths = [
            (ReadPath::OneSided, Some(Transport::Shm)),
            (ReadPath::OneSided, Some(Transport::Engine)),
            (ReadPath::Rpc, None),
        ];
        let clients = Clients::connect_keys(&c, 0, keys, true, &paths).await;
        (clients, p, 0u32, 1u32)
    });
    let keys = clients.keys.clone();
    let readers: Vec<Client> = clients.readers.iter().map(|r| r.client.clone()).collect();
    let mut report = None;
    let run = history::record(&rt, clients, || report = Some(move_partition(&c, p, to)));
    let report = report.expect("moved");
    println!(
        "partition {p}: {} writes ({} after the move began), {} reads ({} one-sided, {} after the move); moved {} keys \
         in {} rounds, writes paused {} us, {} ms in all",
        run.writes,
        run.writes_since_fault,
        run.reads,
        run.one_sided_gets,
        run.one_sided_after_fault,
        report.keys,
        report.rounds,
        report.pause_us,
        report.total_ms
    );
    assert!(run.linearizable, "not linearizable across the move: {}", run.counterexample);
    assert_eq!(report.from, from);
    assert!(run.writes_since_fault > 0, "no write went through after the move");
    assert!(run.one_sided_after_fault > 0, "no one-sided GET after the move: the target's region went unread");
    rt.block_on(async {
        // Every node's map puts the partition on the target, and the
        // target serves every key; the source holds none of it.
        let check = Client::connect(c.rpc(1)).await.expect("connect");
        let map = check.cluster_map().await.expect("map");
        assert_eq!(map.shard_of_partition(p), Some(to), "the map did not flip");
        assert_eq!(map.version, report.version);
        for k in &keys {
            assert!(check.get(k).await.expect("get").is_some(), "{k} lost in the move");
        }
        for r in &readers {
            for k in &keys {
                assert!(r.get(k).await.expect("get").is_some(), "{k} lost for a reader");
            }
        }
    });
    // The move back, through the CLI pointed at the last node (it finds
    // the metadata group's leader): the records of the first move were
    // forgotten, and the source's copy went.
    let out = std::process::Command::new(dmkv_tests::bin_path("dmkv"))
        .args(["--server", c.rpc(2), "cluster", "move-partition", &p.to_string(), "--to", &from.to_string()])
        .output()
        .expect("run dmkv cluster move-partition");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "move-partition failed: {}", String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(text.contains(&format!("partition {p} moved from shard {to} to shard {from}")), "{text}");
    rt.block_on(async {
        let check = Client::connect(c.rpc(2)).await.expect("connect");
        for k in &keys {
            assert!(check.get(k).await.expect("get").is_some(), "{k} lost in the move back");
            // Written on the shard that purged its copy in the first move.
            history::put_surely(&check, k, "3").await;
        }
    });
    // And out again: a shard that was a source (and purged its copy) and
    // a target can be either once more, its versions within bounds.
    let again = move_partition(&c, p, to);
    assert_eq!(again.from, from);
    assert!(again.keys >= keys.len() as u64, "{again:?}");
    rt.block_on(async {
        let check = Client::connect(c.rpc(0)).await.expect("connect");
        for k in &keys {
            let got = check.get_versioned(k).await.expect("get").expect("kept");
            assert_eq!(&got.value[..], b"3");
            assert!(got.version < 1 << 40, "{k} got version {}: a purge raised the skew", got.version);
        }
    });
}

/// What cannot be moved is refused by name, and changes nothing.
#[test]
fn bad_moves_are_refused_by_name() {
    let c = TestCluster::start(3, 2, 3, false, &[]);
    let p = (0..4096).find(|&p| p % 2 == 0).unwrap();
    let mut errors = Vec::new();
    for (partition, to) in [(4096, 1), (p, 7)] {
        let mut answered = None;
        for i in 0..3 {
            let admin = blocking::Client::connect_with(c.rpc(i).to_string(), ClientConfig::default()).expect("connect");
            match admin.move_partition(partition, to, None) {
                Err(dmkv_client::ClientError::NotLeader { .. }) => continue,
                other => answered = Some(other),
            }
        }
        match answered {
            Some(Err(e)) => errors.push(e.to_string()),
            other => panic!("move of {partition} to {to}: {other:?}"),
        }
    }
    assert!(errors[0].contains("does not exist"), "{errors:?}");
    assert!(errors[1].contains("does not exist"), "{errors:?}");
}

/// `dmkv cluster status` shows a move as it goes (its mover's phase, the
/// source's copy with a progress bar) and, once ended, in the history.
#[test]
fn status_shows_a_move_as_it_goes_and_after() {
    let c = TestCluster::start(3, 2, 3, false, &["--memory", "64MiB"]);
    let rt = rt();
    let p = rt.block_on(async {
        let map = c.leaders_known(0).await;
        let p = (0..)
            .map(|i| partition_of(format!("st-{i}").as_bytes()))
            .find(|&p| map.shard_of_partition(p) == Some(0))
            .expect("a partition of shard 0");
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        let keys = (0..).map(|i| format!("st-{i}")).filter(|k| partition_of(k.as_bytes()) == p).take(48);
        for k in keys {
            client.put(k, vec![7u8; 64 << 10]).await.expect("fill");
        }
        p
    });
    let dmkv = |args: &[&str]| {
        let (ok, out) = c.cli(1, args);
        assert!(ok, "dmkv {args:?}: {out}");
        out
    };
    // About 3 MiB at 1 MiB/s: seconds to look at it.
    let (p_arg, mover) = (p.to_string(), c.rpc(2).to_string());
    let moving = std::thread::spawn(move || {
        std::process::Command::new(dmkv_tests::bin_path("dmkv"))
            .args(["--server", &mover, "cluster", "move-partition", &p_arg, "--to", "1", "--rate-mib", "1"])
            .output()
            .expect("run dmkv cluster move-partition")
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (mut bar, mut phase) = (None, None);
    while (bar.is_none() || phase.is_none()) && std::time::Instant::now() < deadline {
        let status = dmkv(&["cluster", "status"]);
        for line in status.lines() {
            if line.contains(&format!("partition {p}: shard 0 -> 1: node"))
                && line.contains("sends the copy ")
                && !line.contains(" 0B")
            {
                bar.get_or_insert_with(|| line.to_string());
            }
            if line.contains(&format!("partition {p}: shard 0 -> 1: node")) && line.contains("'s mover, phase copy") {
                phase.get_or_insert_with(|| line.to_string());
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = moving.join().expect("mover thread");
    assert!(out.status.success(), "the move failed: {}", String::from_utf8_lossy(&out.stderr));
    println!("{bar:?}\n{phase:?}");
    assert!(bar.is_some_and(|l| l.contains("paced at 1 MiB/s")), "no copy progress seen while the copy ran");
    assert!(phase.is_some(), "no mover phase seen while the copy ran");
    let status = dmkv(&["cluster", "status"]);
    println!("{status}");
    assert!(
        status.contains(&format!("ended: partition {p}: shard 0 -> 1 (map version")) && status.contains(", done in "),
        "{status}"
    );
}

/// `dmkv cluster pause-move` stops a running move before its cut-over
/// (writes go on, nothing resumes it by itself), `cancel-move` undoes it
/// (the partition stays, every key is read back), `move-partition` to the
/// same shard carries a paused move on; the map keeps how each ended,
/// across a restart of every node.
#[test]
fn a_move_is_paused_resumed_and_cancelled_and_its_history_outlives_the_nodes() {
    let mut c = TestCluster::start(3, 2, 3, true, &["--memory", "64MiB"]);
    let rt = rt();
    let (p, keys) = rt.block_on(async {
        let map = c.leaders_known(0).await;
        let p = (0..)
            .map(|i| partition_of(format!("pz-{i}").as_bytes()))
            .find(|&p| map.shard_of_partition(p) == Some(0))
            .expect("a partition of shard 0");
        let client = Client::connect(c.rpc(0)).await.expect("connect");
        let keys: Vec<String> =
            (0..).map(|i| format!("pz-{i}")).filter(|k| partition_of(k.as_bytes()) == p).take(48).collect();
        for (i, k) in keys.iter().enumerate() {
            client.put(k, vec![i as u8; 64 << 10]).await.expect("fill");
        }
        (p, keys)
    });
    let dmkv = |c: &TestCluster, args: &[&str]| c.cli(1, args);
    let p_arg = p.to_string();
    // Starts a move at 1 MiB/s (about 3 s of copy) and waits until its
    // mover copies.
    let start_move = |c: &TestCluster| {
        let (p_arg, via) = (p_arg.clone(), c.rpc(2).to_string());
        let run = std::thread::spawn(move || {
            std::process::Command::new(dmkv_tests::bin_path("dmkv"))
                .args(["--server", &via, "cluster", "move-partition", &p_arg, "--to", "1", "--rate-mib", "1"])
                .output()
                .expect("run dmkv cluster move-partition")
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let (_, status) = dmkv(c, &["cluster", "status"]);
            if status.contains("'s mover, phase copy") {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the move never began copying: {status}");
            std::thread::sleep(Duration::from_millis(100));
        }
        run
    };
    let read_all = |c: &TestCluster| {
        rt.block_on(async {
            let client = Client::connect(c.rpc(0)).await.expect("connect");
            for (i, k) in keys.iter().enumerate() {
                let got = client.get(k).await.expect("get");
                assert_eq!(got.as_deref(), Some(&vec![i as u8; 64 << 10][..]), "{k} lost or wrong");
            }
            // Nodes take a change of the map within a second.
            for _ in 0..50 {
                let map = client.cluster_map().await.expect("map");
                if map.moving.is_none() {
                    return map;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("the map still records a move");
        })
    };
    let (ok, text) = dmkv(&c, &["cluster", "pause-move", &p_arg]);
    assert!(!ok && text.contains("no move is under way"), "pausing nothing: {text}");

    // Paused: its mover stops, writes go on, nothing resumes it.
    let run = start_move(&c);
    let (ok, text) = dmkv(&c, &["cluster", "pause-move", &p_arg]);
    assert!(ok && text.contains(": paused"), "{text}");
    let out = run.join().expect("mover thread");
    let stopped = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stopped.contains("this mover stopped"), "the paused mover: {stopped}");
    rt.block_on(async {
        let client = Client::connect(c.rpc(1)).await.expect("connect");
        client.put(&keys[0], vec![0u8; 64 << 10]).await.expect("a write to a paused move's partition");
    });
    std::thread::sleep(Duration::from_secs(5));
    let (_, status) = dmkv(&c, &["cluster", "status"]);
    assert!(status.contains(&format!("moving: partition {p} from shard 0 to shard 1 (paused;")), "{status}");

    // Cancelled: undone, the partition stays on shard 0.
    let (ok, text) = dmkv(&c, &["cluster", "cancel-move", &p_arg]);
    assert!(ok && text.contains("cancelled; it stays on shard 0"), "{text}");
    let map = read_all(&c);
    assert_eq!((map.shard_of_partition(p), map.moving), (Some(0), None));

    // Paused, then moved again: it goes on (unpaced) to the end.
    let run = start_move(&c);
    let (ok, text) = dmkv(&c, &["cluster", "pause-move", &p_arg]);
    assert!(ok && text.contains(": paused"), "{text}");
    run.join().expect("mover thread");
    let (ok, text) = dmkv(&c, &["cluster", "move-partition", &p_arg, "--to", "1", "--rate-mib", "0"]);
    assert!(ok && text.contains(&format!("partition {p} moved from shard 0 to shard 1")), "{text}");
    let map = read_all(&c);
    assert_eq!((map.shard_of_partition(p), map.moving), (Some(1), None));
    let (ok, text) = dmkv(&c, &["cluster", "cancel-move", &p_arg]);
    assert!(!ok && text.contains("no move is under way"), "cancelling a move that ended: {text}");

    // Every node restarted: the map still says how both ended.
    c.restart_all();
    rt.block_on(c.leaders_known(0));
    let (_, status) = dmkv(&c, &["cluster", "status"]);
    println!("{status}");
    let cancelled = format!("ended: partition {p}: shard 0 -> 1 (map version");
    assert_eq!(status.matches(&cancelled).count(), 2, "{status}");
    assert!(status.contains(", cancelled in ") && status.contains(", done in "), "{status}");
    read_all(&c);
}
