//! The moves section of `dmkv cluster status`: what each node reports of
//! the partition moves it takes part in (its mover's phase, the copy it
//! sends as a source's leader) rendered with a progress bar, rate and ETA,
//! and the moves that ended as the map keeps them. Pure: the nodes'
//! answers in, text out.

use std::fmt::Write as _;

use dmkv_common::proto::{ClusterMapReply, MoveReport};

use crate::top::bytes;

/// Ended moves shown (the map keeps up to 16).
pub const SHOWN_HISTORY: usize = 5;
/// Characters of a progress bar.
const BAR: usize = 30;

/// Whether a report is of a move that ended.
fn ended(r: &MoveReport) -> bool {
    ["done", "failed", "abandoned", "stopped", "cancelled"].iter().any(|p| r.phase.starts_with(p))
}

/// The bytes of partition `p`'s shard `from` holds, estimated as that
/// shard's bytes over its partitions (hashing spreads keys evenly), from
/// the view of its leader in the highest term.
fn estimate(views: &[ClusterMapReply], from: u32) -> Option<u64> {
    let lead = views
        .iter()
        .flat_map(|v| v.local.iter())
        .filter(|r| r.shard == from && r.role == "leader")
        .max_by_key(|r| r.term)?;
    (lead.partitions > 0).then(|| lead.bytes / u64::from(lead.partitions))
}

fn rate(bytes: u64, ms: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20) / (ms.max(1) as f64 / 1000.0)
}

fn paced(r: &MoveReport) -> String {
    match r.rate_bytes {
        0 => "unpaced".into(),
        b => format!("paced at {} MiB/s", b >> 20),
    }
}

/// The section, empty if no node reports a move.
pub fn render(views: &[ClusterMapReply]) -> String {
    let mut out = String::new();
    for v in views {
        for r in v.moves.iter().filter(|r| !ended(r)) {
            let what = format!("partition {}: shard {} -> {}", r.partition, r.from, r.to);
            let secs = r.elapsed_ms as f64 / 1000.0;
            if r.phase == "sending" {
                // The copy as it goes: against the partition's estimated
                // size (a whole copy; a catch-up round sends far less).
                let mib_s = rate(r.bytes, r.elapsed_ms);
                // An estimate already passed (a partition fuller than the
                // others) says nothing: the bytes alone.
                let line = match estimate(views, r.from).filter(|&t| t > r.bytes) {
                    Some(total) => {
                        let done = (r.bytes as f64 / total as f64).min(0.99);
                        let filled = (done * BAR as f64) as usize;
                        let eta = match mib_s > 0.0 {
                            true => {
                                format!("{:.0} s", total.saturating_sub(r.bytes) as f64 / f64::from(1 << 20) / mib_s)
                            }
                            false => "-".into(),
                        };
                        format!(
                            "[{}{}] {:>3.0}% {} of ~{}, {} keys, {mib_s:.1} MiB/s ({}), ETA ~{eta}",
                            "#".repeat(filled),
                            "-".repeat(BAR - filled),
                            done * 100.0,
                            bytes(r.bytes),
                            bytes(total),
                            r.keys,
                            paced(r)
                        )
                    }
                    None => format!("{} sent, {} keys, {mib_s:.1} MiB/s ({})", bytes(r.bytes), r.keys, paced(r)),
                };
                let _ = writeln!(out, "  {what}: node {} sends the copy {line}, {secs:.1} s so far", v.node_id);
            } else {
                let _ = writeln!(
                    out,
                    "  {what}: node {}'s mover, phase {}, {} keys and {} copied so far in {secs:.1} s ({})",
                    v.node_id,
                    r.phase,
                    r.keys,
                    bytes(r.bytes),
                    paced(r)
                );
            }
        }
    }
    // Ended moves as the map keeps them (across restarts of the nodes
    // whose movers ran them): the newest map's.
    let newest = views.iter().max_by_key(|v| v.version);
    let history = newest.map_or(&[][..], |v| &v.history[..]);
    for r in &history[history.len().saturating_sub(SHOWN_HISTORY)..] {
        let _ = writeln!(
            out,
            "  ended: partition {}: shard {} -> {} (map version {}), {} in {:.1} s: {} keys, {}, writes paused {:.1} ms",
            r.partition,
            r.from,
            r.to,
            r.version,
            r.phase,
            r.elapsed_ms as f64 / 1000.0,
            r.keys,
            bytes(r.bytes),
            r.pause_us as f64 / 1000.0,
        );
    }
    // A mover's last run that stopped short (the map keeps only moves
    // that ended): why, for a move still recorded.
    for v in views {
        if let Some(r) = v.moves.iter().rev().find(|r| ended(r)).filter(|r| {
            newest.is_some_and(|n| n.moving.is_some_and(|m| m.partition == r.partition && m.version == r.version))
        }) {
            let _ = writeln!(out, "  node {}'s mover last ran it: {}", v.node_id, r.phase);
        }
    }
    if out.is_empty() { out } else { format!("MOVES\n{out}") }
}

/// A rebalance's plan as `dmkv cluster rebalance` prints it.
pub fn render_plan(r: &dmkv_common::proto::MovePartitionReply) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "imbalance (max/mean): shard fill {:.2} -> {:.2}, bytes per node {:.2} -> {:.2}",
        r.fill_before, r.fill_after, r.nodes_before, r.nodes_after
    );
    let bytes_moved: u64 = r.planned.iter().map(|m| m.bytes).sum();
    let _ = writeln!(
        out,
        "{} partition moves ({}), {} leader transfers",
        r.planned.len(),
        bytes(bytes_moved),
        r.leads.len()
    );
    for m in &r.planned {
        let _ = writeln!(out, "  move partition {}: shard {} -> {} ({})", m.partition, m.from, m.to, bytes(m.bytes));
    }
    for l in &r.leads {
        let _ = writeln!(out, "  lead shard {}: node {} -> {}", l.shard, l.from, l.to);
    }
    let _ = match (r.outcome.as_str(), r.planned.is_empty()) {
        ("started", _) => {
            writeln!(out, "the moves run one at a time in the background: `dmkv cluster status` shows them")
        }
        (_, true) => writeln!(out, "no partition needs to move"),
        _ => writeln!(out, "no partition moved (a plan only)"),
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_common::proto::ReplicaState;

    fn report(phase: &str, bytes: u64, elapsed_ms: u64) -> MoveReport {
        MoveReport {
            partition: 7,
            from: 0,
            to: 1,
            version: 3,
            phase: phase.into(),
            keys: 10,
            bytes,
            elapsed_ms,
            rate_bytes: 48 << 20,
            pause_us: 2500,
            ..Default::default()
        }
    }

    #[test]
    fn a_running_copy_gets_a_bar_and_an_eta_and_ended_moves_a_line() {
        // Shard 0's leader: 4 partitions of 400 MiB in all, so ~100 MiB.
        let leader = ReplicaState {
            shard: 0,
            role: "leader".into(),
            term: 2,
            partitions: 4,
            bytes: 400 << 20,
            ..Default::default()
        };
        let source = ClusterMapReply {
            node_id: 1,
            local: vec![leader],
            moves: vec![report("sending", 50 << 20, 2000)],
            ..Default::default()
        };
        let mover = ClusterMapReply {
            node_id: 2,
            version: 4,
            moves: vec![report("catch-up", 0, 2000), report("done", 100 << 20, 4100)],
            history: vec![report("done", 100 << 20, 4100)],
            ..Default::default()
        };
        let text = render(&[source, mover]);
        assert!(text.starts_with("MOVES\n"), "{text}");
        assert!(text.contains("[###############---------------]  50% 50.0MiB of ~100.0MiB"), "{text}");
        assert!(text.contains("25.0 MiB/s (paced at 48 MiB/s), ETA ~2 s"), "{text}");
        assert!(text.contains("node 2's mover, phase catch-up"), "{text}");
        assert!(text.contains("ended: partition 7: shard 0 -> 1 (map version 3), done in 4.1 s"), "{text}");
        assert!(text.contains("writes paused 2.5 ms"), "{text}");
        // Past its estimate: no bar.
        let skewed = ClusterMapReply {
            local: vec![ReplicaState {
                shard: 0,
                role: "leader".into(),
                partitions: 2048,
                bytes: 3 << 20,
                ..Default::default()
            }],
            moves: vec![report("sending", 1 << 20, 1000)],
            ..Default::default()
        };
        let text = render(&[skewed]);
        assert!(text.contains("sends the copy 1.0MiB sent, 10 keys, 1.0 MiB/s"), "{text}");
        // Nothing to say: nothing said.
        assert_eq!(render(&[ClusterMapReply::default()]), "");
    }
}
