//! A shard leader cut off from the rest of the cluster by the network
//! while clients keep reading its region one-sided.
//!
//! Three nodes, each with its peer address on a loopback IP of its own
//! (`TestCluster`); nftables rules drop every packet between the leader
//! of shard 1 and the two other nodes, both ways, for 2 s (well past an
//! election, 150-300 ms, and a lease, ~120 ms). Unlike a frozen leader
//! (SIGSTOP, cluster_onesided.rs) the cut-off one runs on: it steps down,
//! fences its region (clears the lease block, re-registers it) and keeps
//! it mapped and served.
//!
//! A writer (RPC, through a majority node) overwrites the shard's keys,
//! which the majority's new leader acknowledges. Readers on the majority
//! side (shared memory and RPC, through a majority node) reach every
//! node; readers on the cut-off leader's side (shared memory, the TCP
//! engine and RPC, through the leader), as clients on its host would be,
//! reach only it: their packets to the other nodes' client ports are
//! dropped too. The history is checked as in `dmkv_tests::history`.
//!
//! With the lease check it is linearizable. Without it, it is not: the
//! deposed leader fences, its readers see the new registration, ask it
//! over RPC, get NOT_LEADER and try the next replica; those on its side
//! reach no other node, come back to it, attach to its region again and,
//! believing it without a lease, read values the writer has since
//! overwritten through the new leader. (Readers that reach the majority
//! may do the same while no new leader is known; the side's cut makes it
//! certain.)

use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

use dmkv_client::{Client, ReadPath, Transport};
use dmkv_tests::cluster::TestCluster;
use dmkv_tests::history::{self, Clients, Run};
use dmkv_tests::partition::{Dropped, Partition, join_side};

/// How long the leader stays cut off.
const PARTITION: Duration = Duration::from_millis(2000);
/// The shard whose leader is cut off.
const SHARD: u32 = 1;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// What the partition did, seen from the nodes.
#[derive(Debug, Default)]
struct Seen {
    /// The node a majority node named leader of the shard during the
    /// partition (not the cut-off one), and its term.
    new_leader: Option<(u64, u64)>,
    /// The role the cut-off node's replica reported once it was no
    /// longer leader.
    old_leader_role: Option<String>,
    /// Packets the rules dropped.
    dropped: Dropped,
}

/// Cuts off the leader of [`SHARD`] and its side's readers for
/// [`PARTITION`] while the clients run; `None` where partitions cannot be
/// made (outside CI).
fn partitioned_leader_run(test: &str, check_leases: bool) -> Option<(Run, Seen)> {
    if !Partition::available_or_skip(test) {
        return None;
    }
    let c = TestCluster::start(3, 3, 3, false, &[]);
    let rt = rt();
    let map = rt.block_on(c.leaders_known(0));
    let entry = &map.shards()[SHARD as usize];
    let (old, old_term) = (entry.leader.expect("a leader"), entry.term);
    let cut_off = old as usize - 1;
    let majority = [(cut_off + 1) % 3, (cut_off + 2) % 3];
    let shm = (ReadPath::OneSided, Some(Transport::Shm));
    let rpc = (ReadPath::Rpc, None);
    let mut clients = rt.block_on(Clients::connect(&c, majority[0], SHARD, 6, check_leases, &[shm, rpc]));
    // The cut-off side's readers run on threads of a group of their own,
    // which the rules cut from the majority's client ports.
    let side = 4_000_000_000 + std::process::id() % 1_000_000;
    let side_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .on_thread_start(move || join_side(side).expect("a thread of the cut-off side"))
        .enable_all()
        .build()
        .expect("runtime");
    let tcp = (ReadPath::OneSided, Some(Transport::Engine));
    clients.add_readers(&side_rt, &c, cut_off, check_leases, &[shm, tcp, rpc]);
    let endpoints: Vec<SocketAddrV4> = majority
        .iter()
        .flat_map(|&i| ["rpc", "engine"].map(|e| c.endpoint(i, e).expect("an endpoint").parse().expect("IPv4")))
        .collect();
    // Asked for each one's own view of the shard during the partition.
    let (watch_new, watch_old) = rt.block_on(async {
        (
            Client::connect(c.rpc(majority[0])).await.expect("connect"),
            Client::connect(c.rpc(cut_off)).await.expect("connect"),
        )
    });
    let mut seen = Seen::default();
    let run = history::record(&rt, clients, || {
        let start = Instant::now();
        let peers = majority.map(|i| c.peer_ip(i));
        let cut =
            Partition::isolate_with_clients(c.peer_ip(cut_off), &peers, Some(side), &endpoints).expect("partition");
        rt.block_on(async {
            // Bounded by the partition: each node's view of the shard.
            while Instant::now() < start + PARTITION && (seen.new_leader.is_none() || seen.old_leader_role.is_none()) {
                let replica = |s: dmkv_common::proto::ClusterMapReply| s.local.into_iter().find(|r| r.shard == SHARD);
                if let Ok(Some(r)) = watch_new.cluster_status().await.map(replica)
                    && r.leader != 0
                    && r.leader != old
                    && r.term > old_term
                {
                    seen.new_leader.get_or_insert((r.leader, r.term));
                }
                if let Ok(Some(r)) = watch_old.cluster_status().await.map(replica)
                    && r.role != "leader"
                {
                    seen.old_leader_role.get_or_insert(r.role);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        std::thread::sleep((start + PARTITION).saturating_duration_since(Instant::now()));
        seen.dropped = cut.dropped().expect("nft counters");
        cut.heal().expect("heal the partition");
    });
    println!(
        "lease check {}: {} writes ({} from the partition on), {} reads ({} one-sided), {} batches refused for want of a lease; {seen:?}; linearizable: {}",
        if check_leases { "on" } else { "off" },
        run.writes,
        run.writes_since_fault,
        run.reads,
        run.one_sided_gets,
        run.unleased,
        run.linearizable
    );
    // The partition took: the rules dropped raft traffic and the cut-off
    // side's requests, the majority elected another leader and the
    // cut-off one stepped down.
    assert!(seen.dropped.nodes > 0, "the rules dropped no raft traffic");
    assert!(seen.dropped.clients > 0, "the cut-off side's readers never tried the majority");
    assert!(seen.new_leader.is_some(), "the majority elected no other leader of shard {SHARD} while {old} was cut off");
    assert!(seen.old_leader_role.is_some(), "node {old}, cut off, went on leading shard {SHARD}");
    Some((run, seen))
}

#[test]
fn reads_of_a_partitioned_leaders_region_stay_linearizable() {
    let Some((run, _)) = partitioned_leader_run("reads_of_a_partitioned_leaders_region_stay_linearizable", true) else {
        return;
    };
    assert!(run.linearizable, "history is not linearizable:\n{}", run.counterexample);
    assert!(run.one_sided_gets > 0 && run.unleased > 0, "the readers did not meet the lapsed lease");
    assert!(run.writes_since_fault > 0, "no write was acknowledged from the partition on");
}

#[test]
fn without_the_lease_check_a_partitioned_leaders_region_reads_stale() {
    let Some((run, _)) =
        partitioned_leader_run("without_the_lease_check_a_partitioned_leaders_region_reads_stale", false)
    else {
        return;
    };
    println!("not linearizable: {}", run.counterexample.lines().next().unwrap_or_default());
    assert!(!run.linearizable, "the scenario no longer tells a checked reader from an unchecked one");
}
