//! Moves that carry on by themselves. A move's record stays in the map
//! when its mover stops (its node died or lost the metadata group's
//! leadership, or a step failed past its tries); from its cut-over on,
//! writes to the partition are refused until some mover carries it
//! through. So the node leading the metadata group resumes a recorded
//! move that no mover has changed for [`RESUME_AFTER`], claiming it
//! (`move_claim.rs`: the old mover, should it still run, stops at its
//! next round or record write), and tries again with a growing pause while
//! it fails. A paused move waits for its operator.
//!
//! [`Resumer`] decides, with time passed in; [`spawn_move_resumer`] is
//! its driver.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dmkv_common::cluster::map::{MovePhase, Moving};
use tokio::sync::watch;

use super::node::ClusterNode;

/// How often the node leading the group looks at the move record.
pub const RESUME_POLL: Duration = Duration::from_secs(1);
/// How long a record must stay the same, with this node leading the group
/// all along, before it is resumed here: a mover that runs changes it at
/// its phases, and one deposed with the group's leadership stops at its
/// next round.
pub const RESUME_AFTER: Duration = Duration::from_secs(3);
/// Longest pause between two resumptions that failed.
pub const MAX_RESUME_BACKOFF: Duration = Duration::from_secs(60);

/// Decides when to resume a recorded move (see the module's text).
#[derive(Debug, Default)]
pub struct Resumer {
    /// Since when this node leads the group, as far as it looked.
    leading_since: Option<Instant>,
    /// The record last seen, and since when it is unchanged.
    seen: Option<(Moving, Instant)>,
    /// Not before this: the last resumption failed.
    next_try: Option<Instant>,
    backoff: Duration,
}

impl Resumer {
    /// What this node saw at `now`: whether it leads the group, whether a
    /// mover runs here, and the group's move record. Returns a move to
    /// resume now.
    pub fn poll(&mut self, now: Instant, leading: bool, running: bool, moving: Option<Moving>) -> Option<Moving> {
        if !leading {
            *self = Resumer { backoff: self.backoff, next_try: self.next_try, ..Resumer::default() };
            return None;
        }
        let since = *self.leading_since.get_or_insert(now);
        let Some(m) = moving.filter(|m| m.phase != MovePhase::Paused) else {
            // No move to carry on: the next one starts with no backoff.
            *self = Resumer { leading_since: self.leading_since, ..Resumer::default() };
            return None;
        };
        let at = match self.seen {
            Some((s, at)) if s == m => at,
            _ => {
                self.seen = Some((m, now));
                return None;
            }
        };
        if running
            || now.duration_since(at) < RESUME_AFTER
            || now.duration_since(since) < RESUME_AFTER
            || self.next_try.is_some_and(|t| now < t)
        {
            return None;
        }
        self.backoff = (self.backoff * 2).clamp(RESUME_AFTER, MAX_RESUME_BACKOFF);
        self.next_try = Some(now + self.backoff);
        Some(m)
    }
}

/// Resumes stopped moves while `node` leads the metadata group; ends when
/// `stop` turns true or the node is dropped.
pub fn spawn_move_resumer(node: &Arc<ClusterNode>, mut stop: watch::Receiver<bool>) {
    let weak = Arc::downgrade(node);
    tokio::spawn(async move {
        let mut resumer = Resumer::default();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(RESUME_POLL) => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
            let Some(node) = weak.upgrade() else { return };
            let leading = node.meta_replica().is_some_and(|r| r.status.is_leader());
            let moving = match leading {
                true => match node.meta_map().await {
                    Ok((map, _)) => map.moving,
                    Err(_) => continue,
                },
                false => None,
            };
            let running = node.mover_running.load(Ordering::Acquire);
            let Some(m) = resumer.poll(Instant::now(), leading, running, moving) else { continue };
            tracing::info!(
                partition = m.partition,
                from = m.from,
                to = m.to,
                phase = m.phase.name(),
                "resuming a stopped move"
            );
            match node.move_partition(m.partition, m.to, m.rate_bytes).await {
                Ok(r) => tracing::info!(partition = m.partition, version = r.version, "the resumed move ended"),
                Err(e) => tracing::warn!(partition = m.partition, "the resumed move stopped: {e:?}"),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(claim: u64, phase: MovePhase) -> Option<Moving> {
        Some(Moving { partition: 5, from: 0, to: 1, version: 9, claim, run: claim, phase, rate_bytes: 0 })
    }

    #[test]
    fn a_record_left_alone_is_resumed_with_a_growing_pause_and_a_paused_one_never() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut r = Resumer::default();
        let m = record(7, MovePhase::Releasing);
        // Not while the record is fresh, nor while a mover runs here.
        assert_eq!(r.poll(s(0), true, false, m), None);
        assert_eq!(r.poll(s(2), true, false, m), None);
        assert_eq!(r.poll(s(3), true, true, m), None);
        assert_eq!(r.poll(s(3), true, false, m), m);
        // The same record, failed again: 3 s, then 6, 12, ... to 60.
        assert_eq!(r.poll(s(5), true, false, m), None);
        assert_eq!(r.poll(s(6), true, false, m), m);
        assert_eq!(r.poll(s(11), true, false, m), None);
        assert_eq!(r.poll(s(12), true, false, m), m);
        // A changed record (a mover claimed it) waits its 3 s again.
        let other = record(8, MovePhase::Releasing);
        assert_eq!(r.poll(s(40), true, false, other), None);
        assert_eq!(r.poll(s(43), true, false, other), other);
        // Leadership lost and won again: 3 s of leading first.
        assert_eq!(r.poll(s(200), false, false, None), None);
        assert_eq!(r.poll(s(201), true, false, other), None);
        assert_eq!(r.poll(s(203), true, false, other), None);
        assert_eq!(r.poll(s(204), true, false, other), other);
        // Paused: never, however long.
        let paused = record(9, MovePhase::Paused);
        let mut r = Resumer::default();
        for t in 0..100 {
            assert_eq!(r.poll(s(t), true, false, paused), None);
        }
        // The move ended: the next starts with no backoff.
        assert_eq!(r.poll(s(100), true, false, None), None);
        let next = record(10, MovePhase::Copying);
        assert_eq!(r.poll(s(101), true, false, next), None);
        assert_eq!(r.poll(s(104), true, false, next), next);
    }
}
