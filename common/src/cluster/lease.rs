//! Leader leases: when a shard leader's region may be read one-sided.
//!
//! A one-sided reader runs no code on the leader, so the leader cannot
//! refuse it after losing leadership; the reader must be able to tell
//! from what it reads. The leader therefore holds a lease, granted by a
//! quorum, that ends before any other node can be elected, and publishes
//! its end in its region's header; a reader trusts its reads only if they
//! ended before the lease did, by its own clock with a stated skew bound.
//!
//! Why the lease ends in time: a round (heartbeat or ReadIndex) sent at
//! time t0 on the leader's clock and acknowledged by a quorum means each
//! acknowledging follower heard from the leader at or after t0, and (with
//! raft's check-quorum, as raft-rs implements it) will not vote for
//! another candidate until its own election timeout has passed since. Any
//! new majority includes one of them (the leader fences itself before it
//! votes for anyone). With clock rates off true time by at most `drift`,
//! the earliest such vote is at true time t0 + timeout / (1 + drift); a
//! lease of L on the leader's clock ends by true time t0 + L / (1 - drift).
//! So L = timeout × (1 - drift) / (1 + drift), minus a margin.

use thiserror::Error;

/// Bounds the lease depends on. Times in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// The shortest election timeout of any replica, on its own clock.
    pub election_timeout_ns: u64,
    /// Most any clock's rate differs from true time, in parts per million.
    pub max_drift_ppm: u64,
    /// Most a client's wall clock differs from a leader's.
    pub max_skew_ns: u64,
    /// Taken off the lease for what the bounds above do not cover
    /// (scheduling between reading the clock and acting on it).
    pub margin_ns: u64,
}

/// A configuration whose lease would be empty.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "no lease is possible: election timeout {election_timeout_ns} ns, drift {max_drift_ppm} ppm, margin {margin_ns} ns"
)]
pub struct NoLease {
    pub election_timeout_ns: u64,
    pub max_drift_ppm: u64,
    pub margin_ns: u64,
}

impl LeaseConfig {
    /// The lease length on the leader's clock; errors if none is left.
    pub fn lease_ns(&self) -> Result<u64, NoLease> {
        let none = || NoLease {
            election_timeout_ns: self.election_timeout_ns,
            max_drift_ppm: self.max_drift_ppm,
            margin_ns: self.margin_ns,
        };
        if self.max_drift_ppm >= 1_000_000 {
            return Err(none());
        }
        let t = u128::from(self.election_timeout_ns);
        let (slow, fast) = (1_000_000 - u128::from(self.max_drift_ppm), 1_000_000 + u128::from(self.max_drift_ppm));
        // Rounded down, so the lease never exceeds the bound.
        let bound = (t * slow / fast) as u64;
        bound.checked_sub(self.margin_ns).filter(|&l| l > 0).ok_or_else(none)
    }
}

/// The leader's side: when its lease ends, and when it must fence.
#[derive(Debug, Clone)]
pub struct LeaderLease {
    lease_ns: u64,
    term: u64,
    /// End of the lease on the leader's monotonic clock (none yet).
    expiry: Option<u64>,
}

/// What the leader must do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseAction {
    /// Nothing: the lease holds, or there is none to lose.
    None,
    /// The lease has lapsed (or leadership was lost): stop one-sided
    /// reads of the region (new epoch, engine refusing, RDMA memory
    /// re-registered, shm handoffs closed) before doing anything else.
    Fence,
}

impl LeaderLease {
    /// A leader of `term` without a lease yet: one comes with the first
    /// round a quorum acknowledges.
    pub fn new(cfg: &LeaseConfig, term: u64) -> Result<LeaderLease, NoLease> {
        Ok(LeaderLease { lease_ns: cfg.lease_ns()?, term, expiry: None })
    }

    /// The term this lease belongs to.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// A round sent at `sent` (leader's clock) was acknowledged by a
    /// quorum: the lease runs until `sent` plus its length, if later.
    pub fn on_quorum_ack(&mut self, sent: u64) {
        let end = sent.saturating_add(self.lease_ns);
        self.expiry = Some(self.expiry.map_or(end, |e| e.max(end)));
    }

    /// Whether reads may be served at `now` (leader's clock).
    pub fn valid(&self, now: u64) -> bool {
        self.expiry.is_some_and(|e| now < e)
    }

    /// The lease's end on the leader's clock, if it has one.
    pub fn expiry(&self) -> Option<u64> {
        self.expiry
    }

    /// Checks the lease at `now`: once it has lapsed the leader fences
    /// (once; the lease is gone until a quorum grants a new one).
    pub fn poll(&mut self, now: u64) -> LeaseAction {
        match self.expiry {
            Some(e) if now >= e => {
                self.expiry = None;
                LeaseAction::Fence
            }
            _ => LeaseAction::None,
        }
    }
}

/// What a leader publishes in its region header for readers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// Bumped at every fence: a reader's map names the epoch it expects.
    pub epoch: u64,
    /// The lease's end in the leader's wall-clock time (unix ns).
    pub expiry_unix_ns: u64,
}

/// Why a reader does not trust what it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distrust {
    /// The region is not the epoch the reader's map names: re-route.
    Epoch,
    /// The lease may have ended before the reads did: retry, or ask the
    /// leader over RPC.
    Expired,
}

/// Whether reads that ended at `read_end_unix_ns` (the reader's wall
/// clock, taken after the last read completed) of a region whose header
/// said `p` (read in the same batch) may be trusted by a reader whose map
/// expects `epoch`.
pub fn trust(p: Published, epoch: u64, read_end_unix_ns: u64, cfg: &LeaseConfig) -> Result<(), Distrust> {
    if p.epoch != epoch {
        return Err(Distrust::Epoch);
    }
    if !lease_holds(p.expiry_unix_ns, read_end_unix_ns, cfg.max_skew_ns) {
        return Err(Distrust::Expired);
    }
    Ok(())
}

/// Whether a lease ending at `expiry_unix_ns` (leader's wall clock) covers
/// reads that ended at `read_end_unix_ns` (reader's wall clock), clocks
/// differing by at most `max_skew_ns`.
pub fn lease_holds(expiry_unix_ns: u64, read_end_unix_ns: u64, max_skew_ns: u64) -> bool {
    read_end_unix_ns.saturating_add(max_skew_ns) < expiry_unix_ns
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;

    fn cfg() -> LeaseConfig {
        LeaseConfig { election_timeout_ns: 1000 * MS, max_drift_ppm: 500, max_skew_ns: 5 * MS, margin_ns: 10 * MS }
    }

    #[test]
    fn the_lease_is_shorter_than_the_election_timeout_by_the_drift_and_margin() {
        let l = cfg().lease_ns().unwrap();
        assert!(l < 1000 * MS - 10 * MS && l > 980 * MS, "{l}");
        let none = LeaseConfig { margin_ns: 2000 * MS, ..cfg() };
        assert!(none.lease_ns().is_err());
        assert!(LeaseConfig { max_drift_ppm: 1_000_000, ..cfg() }.lease_ns().is_err());
    }

    #[test]
    fn a_leader_fences_once_when_its_lease_lapses() {
        let mut l = LeaderLease::new(&cfg(), 3).unwrap();
        assert!(!l.valid(0), "no lease before a quorum acknowledged");
        l.on_quorum_ack(100);
        let end = l.expiry().unwrap();
        assert!(l.valid(end - 1) && !l.valid(end));
        l.on_quorum_ack(50);
        assert_eq!(l.expiry(), Some(end), "an older round does not shorten it");
        assert_eq!(l.poll(end - 1), LeaseAction::None);
        assert_eq!(l.poll(end), LeaseAction::Fence);
        assert_eq!(l.poll(end + 1), LeaseAction::None, "fenced once");
        assert!(!l.valid(end + 1));
    }

    #[test]
    fn readers_trust_only_their_epoch_and_unexpired_leases() {
        let p = Published { epoch: 7, expiry_unix_ns: 1_000 * MS };
        let c = cfg();
        assert_eq!(trust(p, 7, 900 * MS, &c), Ok(()));
        assert_eq!(trust(p, 8, 900 * MS, &c), Err(Distrust::Epoch));
        assert_eq!(trust(p, 7, 996 * MS, &c), Err(Distrust::Expired), "within the skew of the end");
        assert_eq!(trust(p, 7, u64::MAX, &c), Err(Distrust::Expired));
    }

    proptest! {
        /// The leader's lease ends (in true time) before any follower that
        /// acknowledged the granting round could vote for someone else,
        /// and a reader's trusted reads end before the lease does, for any
        /// clock rates within the drift bound, any client clock offset
        /// within the skew bound and any message delays.
        #[test]
        fn leases_end_before_any_rival_can_be_elected(
            leader_ppm in -500i64..=500,
            follower_ppm in prop::collection::vec(-500i64..=500, 2..5),
            send_at in 0u64..10_000 * MS,
            delays in prop::collection::vec(0u64..300 * MS, 2..5),
            client_offset in -5i64 * MS as i64..=5 * MS as i64,
            read_len in 0u64..2000 * MS,
        ) {
            let c = cfg();
            // True time ↔ a clock running at (1 + ppm/1e6) of true speed.
            let clock = |ppm: i64, true_t: f64| true_t * (1.0 + ppm as f64 / 1e6);
            let true_of = |ppm: i64, clock_t: f64| clock_t / (1.0 + ppm as f64 / 1e6);
            // The leader sends at true time T0 (its clock reads `sent`).
            let t0 = send_at as f64;
            let sent = clock(leader_ppm, t0) as u64;
            let mut lease = LeaderLease::new(&c, 1).unwrap();
            lease.on_quorum_ack(sent);
            let expiry_true = true_of(leader_ppm, lease.expiry().unwrap() as f64);
            // Each acknowledging follower heard at T0 + delay and waits its
            // election timeout on its own clock before it would vote.
            for (ppm, d) in follower_ppm.iter().zip(&delays) {
                let heard = t0 + *d as f64;
                let earliest_vote = true_of(*ppm, clock(*ppm, heard) + c.election_timeout_ns as f64);
                prop_assert!(expiry_true <= earliest_vote, "lease ends {expiry_true} after a vote at {earliest_vote}");
            }
            // A reader whose wall clock is off by `client_offset`: if it
            // trusts reads that ended at true time `end`, end < expiry.
            // (Wall clocks: the leader publishes its wall-clock expiry.)
            let end = t0 + read_len as f64;
            let published = Published { epoch: 1, expiry_unix_ns: expiry_true as u64 };
            let client_now = (end + client_offset as f64).max(0.0) as u64;
            if trust(published, 1, client_now, &c).is_ok() {
                prop_assert!(end < expiry_true);
            }
        }
    }
}
