//! Leader leases: when a shard leader's region may be read one-sided.
//!
//! A one-sided reader runs no code on the leader, so the leader cannot
//! refuse it after losing leadership; the reader must be able to tell
//! from what it reads. The leader therefore holds a lease, granted by a
//! quorum, that ends before any other node can be elected, and publishes
//! in its region's header when the lease's current run began and when it
//! ends ([`crate::layout::LeaseBlock`]). A reader trusts a batch of reads
//! only if the whole batch lies inside one run: the run had begun before
//! the batch's first read and had not ended when its last read did
//! ([`judge`]). Both ends are on the leader's monotonic clock: a reader on
//! its host reads that clock itself, a reader elsewhere bounds it from a
//! sample ([`ServerClock`]), and the engine stamps its batches with it.
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

use crate::layout::LeaseBlock;

/// Bounds the lease depends on. Times in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// The shortest election timeout of any replica, on its own clock.
    pub election_timeout_ns: u64,
    /// Most any clock's rate differs from true time, in parts per million.
    pub max_drift_ppm: u64,
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
    /// reads of the region (lease block cleared, which every reader reads
    /// last in each batch; new epoch, engine refusing, shm handoffs
    /// closed) before doing anything else.
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

/// Most any clock's rate is taken to differ from true time (ppm): the
/// bound of leases and of remote readers' bounds on a server's clock. Ten
/// times what a crystal oscillator without NTP drifts; NTP slews a clock by
/// at most 500 ppm.
pub const MAX_DRIFT_PPM: u64 = 1000;

/// A run of the lease must have begun at least this long before a
/// batch's first read. The leader reads its clock for a run's start after
/// the store's writes and a full fence, and a reader's first load may be
/// carried out a little before the clock read that precedes it: this
/// covers both, many times over.
pub const START_GUARD_NS: u64 = 50_000;

/// Where a batch of one-sided reads lies on the leader's clock: no read of
/// it began before `start`, none ended after `end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: u64,
    pub end: u64,
}

/// Why a reader does not trust what it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distrust {
    /// The region holds no lease (a follower's, a fenced leader's, or a
    /// block torn by a concurrent renewal).
    NoLease,
    /// The lease's run began after the batch did: the region may have
    /// lacked writes acknowledged before the batch's first read.
    NotYet,
    /// The lease may have ended before the batch's last read did.
    Expired,
    /// The shard's partitions changed at a later map version than the one
    /// the reader routed by: the key may have left the shard (ask for the
    /// map again and re-route; docs/elasticity.md).
    StaleMap,
}

/// Whether a batch of reads lying in `span`, of a key routed to this
/// shard by a map of version `routed_by`, may be believed, given the lease
/// block read after every other read of the batch (`None`: none that
/// decodes).
///
/// Why that suffices: the block names a run of one lease, of one leader
/// in one term. While the run lasts no other replica can be elected
/// ([`LeaseConfig::lease_ns`]), and it began only once the store held
/// every write acknowledged before the lease was granted; a replica that
/// fences (its lease lapsed or it stepped down) clears the block and
/// starts a new run if it leads again. So a block read after the data,
/// whose run began before the data's first read and ends after the last,
/// shows that every data read saw the region of the only leader, holding
/// every write acknowledged so far.
///
/// And the key is the shard's: a map version that changes a shard's
/// partitions is published only once the shard's leader has applied the
/// change (and published it in the block), so a block whose placement
/// version is at most `routed_by` shows the shard owned exactly what that
/// map gives it, the key's partition among them, when the block was read,
/// and (the set unchanged since) throughout the batch.
pub fn judge(block: Option<LeaseBlock>, span: Span, routed_by: u64) -> Result<(), Distrust> {
    let b = block.ok_or(Distrust::NoLease)?;
    if b.placement > routed_by {
        return Err(Distrust::StaleMap);
    }
    if span.start < b.start_ns.saturating_add(START_GUARD_NS) {
        return Err(Distrust::NotYet);
    }
    if span.end >= b.expiry_ns {
        return Err(Distrust::Expired);
    }
    Ok(())
}

/// One reading of a server's clock by a client: the client's clock when
/// it asked (`sent`) and when the answer came (`received`), and the
/// server's clock in between (`server`). Monotonic nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockSample {
    pub sent: u64,
    pub server: u64,
    pub received: u64,
}

/// What a client knows of a server's monotonic clock: either that it is
/// the client's own (same host and clock namespace), or bounds that
/// follow from a sample, widened as it ages by the rate of both clocks
/// (each within `drift_ppm` of true time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerClock {
    /// The client reads the server's clock itself.
    Shared,
    Sampled {
        sample: ClockSample,
        drift_ppm: u64,
    },
}

/// Why a clock sample was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum BadSample {
    #[error("the answer came before the question (client clock went back)")]
    Backwards,
    #[error("drift bound of {0} ppm is not below one million")]
    Drift(u64),
}

impl ServerClock {
    /// Bounds from `sample`, for clocks within `drift_ppm` of true time.
    pub fn sampled(sample: ClockSample, drift_ppm: u64) -> Result<ServerClock, BadSample> {
        if sample.received < sample.sent {
            return Err(BadSample::Backwards);
        }
        if drift_ppm >= 1_000_000 {
            return Err(BadSample::Drift(drift_ppm));
        }
        Ok(ServerClock::Sampled { sample, drift_ppm })
    }

    /// The earliest the server's clock can read when the client's reads
    /// `local`; `None` before the sample's answer came (the sample says
    /// nothing of earlier times).
    ///
    /// The server read its clock no later than the answer arrived, so at
    /// least `local - received` of the client's time has passed since: at
    /// least that over `(1 + drift)` of true time, and of the server's time
    /// at least `(1 - drift)` of that.
    pub fn earliest(&self, local: u64) -> Option<u64> {
        match *self {
            ServerClock::Shared => Some(local),
            ServerClock::Sampled { sample, drift_ppm } => {
                let since = u128::from(local.checked_sub(sample.received)?);
                let (slow, fast) = rates(drift_ppm);
                Some(sample.server.saturating_add((since * slow / fast) as u64))
            }
        }
    }

    /// The latest the server's clock can read when the client's reads
    /// `local`; `None` before the sample was asked for. At most `local -
    /// sent` of the client's time has passed since the server read its
    /// clock, at most that over `(1 - drift)` of true time, and of the
    /// server's time at most `(1 + drift)` of that.
    pub fn latest(&self, local: u64) -> Option<u64> {
        match *self {
            ServerClock::Shared => Some(local),
            ServerClock::Sampled { sample, drift_ppm } => {
                let since = u128::from(local.checked_sub(sample.sent)?);
                let (slow, fast) = rates(drift_ppm);
                let grown = since.saturating_mul(fast).div_ceil(slow).min(u128::from(u64::MAX)) as u64;
                Some(sample.server.saturating_add(grown))
            }
        }
    }

    /// Whether a later sample falls inside what this one predicts. If not,
    /// one of the two clocks broke the drift bound (it jumped, or runs
    /// fast or slow beyond it): a reader must not trust either sample.
    pub fn agrees(&self, later: &ClockSample) -> bool {
        match *self {
            ServerClock::Shared => true,
            ServerClock::Sampled { .. } => {
                let (lo, hi) = (self.earliest(later.sent), self.latest(later.received));
                lo.is_some_and(|lo| lo <= later.server) && hi.is_some_and(|hi| later.server <= hi)
            }
        }
    }

    /// How long ago (client's clock) the sample behind these bounds was
    /// taken, at `local`; zero for a shared clock.
    pub fn age(&self, local: u64) -> u64 {
        match *self {
            ServerClock::Shared => 0,
            ServerClock::Sampled { sample, .. } => local.saturating_sub(sample.received),
        }
    }
}

/// (1 - drift, 1 + drift) in parts per million.
fn rates(drift_ppm: u64) -> (u128, u128) {
    (u128::from(1_000_000 - drift_ppm.min(999_999)), u128::from(1_000_000 + drift_ppm))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;

    fn cfg() -> LeaseConfig {
        LeaseConfig { election_timeout_ns: 1000 * MS, max_drift_ppm: 500, margin_ns: 10 * MS }
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
    fn a_batch_is_believed_only_inside_one_run_of_a_lease() {
        let b = LeaseBlock { term: 7, start_ns: 1_000 * MS, expiry_ns: 1_120 * MS, applied: 9, placement: 4 };
        let span = |start, end| Span { start, end };
        let judge = |b, s| judge(b, s, 4);
        assert_eq!(judge(Some(b), span(1_010 * MS, 1_100 * MS)), Ok(()));
        assert_eq!(judge(None, span(1_010 * MS, 1_100 * MS)), Err(Distrust::NoLease));
        // Data read before the run began (the store may have lacked an
        // acknowledged write then), even if the lease holds at the end.
        assert_eq!(judge(Some(b), span(990 * MS, 1_100 * MS)), Err(Distrust::NotYet));
        assert_eq!(judge(Some(b), span(b.start_ns + START_GUARD_NS - 1, 1_100 * MS)), Err(Distrust::NotYet));
        assert_eq!(judge(Some(b), span(b.start_ns + START_GUARD_NS, 1_100 * MS)), Ok(()));
        assert_eq!(judge(Some(b), span(1_010 * MS, b.expiry_ns)), Err(Distrust::Expired));
        assert_eq!(judge(Some(b), span(1_010 * MS, u64::MAX)), Err(Distrust::Expired));
    }

    /// A reader that routed the key by a map older than the shard's last
    /// change of partitions does not believe the batch, however well the
    /// lease holds; one that routed by that map or a newer one does.
    #[test]
    fn a_batch_routed_by_an_older_map_than_the_placement_is_not_believed() {
        let b = LeaseBlock { term: 7, start_ns: 1_000 * MS, expiry_ns: 1_120 * MS, applied: 9, placement: 4 };
        let span = Span { start: 1_010 * MS, end: 1_100 * MS };
        assert_eq!(judge(Some(b), span, 3), Err(Distrust::StaleMap));
        assert_eq!(judge(Some(b), span, 0), Err(Distrust::StaleMap));
        assert_eq!(judge(Some(b), span, 4), Ok(()));
        assert_eq!(judge(Some(b), span, 9), Ok(()));
        // The lease is judged either way.
        assert_eq!(judge(None, span, 9), Err(Distrust::NoLease));
    }

    #[test]
    fn samples_bound_the_server_clock_and_refuse_nonsense() {
        let s = ClockSample { sent: 100 * MS, server: 5_000 * MS, received: 101 * MS };
        let c = ServerClock::sampled(s, 1000).unwrap();
        // At the answer: the server read its clock within the round trip.
        assert!(c.earliest(101 * MS) == Some(5_000 * MS) && c.latest(101 * MS) >= Some(5_001 * MS));
        assert_eq!((c.earliest(100 * MS), c.latest(99 * MS)), (None, None), "nothing before the sample");
        // A second later the bounds have widened by the drift of both.
        let (lo, hi) = (c.earliest(1_101 * MS).unwrap(), c.latest(1_101 * MS).unwrap());
        assert!(lo < 6_000 * MS && lo > 5_997 * MS, "{lo}");
        assert!(hi > 6_001 * MS && hi < 6_004 * MS, "{hi}");
        assert_eq!(c.age(1_101 * MS), 1_000 * MS);
        assert_eq!(ServerClock::sampled(ClockSample { received: 99 * MS, ..s }, 1000), Err(BadSample::Backwards));
        assert!(ServerClock::sampled(s, 1_000_000).is_err());
        // A later sample that agrees, and ones showing a jump either way.
        let later = |server| ClockSample { sent: 1_100 * MS, server, received: 1_101 * MS };
        assert!(c.agrees(&later(6_000 * MS)));
        assert!(!c.agrees(&later(6_100 * MS)), "server clock ran ahead");
        assert!(!c.agrees(&later(5_900 * MS)), "server clock fell behind");
        assert!(ServerClock::Shared.agrees(&later(0)) && ServerClock::Shared.earliest(3) == Some(3));
    }

    proptest! {
        /// The leader's lease ends (in true time) before any follower that
        /// acknowledged the granting round could vote for someone else,
        /// for any clock rates within the drift bound and any message
        /// delays.
        #[test]
        fn leases_end_before_any_rival_can_be_elected(
            leader_ppm in -500i64..=500,
            follower_ppm in prop::collection::vec(-500i64..=500, 2..5),
            send_at in 0u64..10_000 * MS,
            delays in prop::collection::vec(0u64..300 * MS, 2..5),
        ) {
            let c = cfg();
            // True time <-> a clock running at (1 + ppm/1e6) of true speed.
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
        }

        /// A remote reader's bounds hold the server's true clock reading,
        /// for any rates of both clocks within the bound, any offset
        /// between them and any round trip and wait.
        #[test]
        fn sampled_bounds_hold_the_server_clock(
            client_ppm in -1000i64..=1000,
            server_ppm in -1000i64..=1000,
            offset in 0u64..1_000_000 * MS,
            ask_at in 0u64..1_000 * MS,
            out in 0u64..5 * MS,
            back in 0u64..5 * MS,
            wait in 0u64..10_000 * MS,
        ) {
            let at = |ppm: i64, base: u64, t: u64| base + (t as f64 * (1.0 + ppm as f64 / 1e6)) as u64;
            let (client, server) = (|t| at(client_ppm, 0, t), |t| at(server_ppm, offset, t));
            let t_ask = ask_at;
            let t_read = t_ask + out;
            let t_back = t_read + back;
            let sample = ClockSample { sent: client(t_ask), server: server(t_read), received: client(t_back) };
            let c = ServerClock::sampled(sample, 1000).unwrap();
            let t = t_back + wait;
            // One nanosecond either way for the float conversions above.
            prop_assert!(c.earliest(client(t)).unwrap() <= server(t) + 1, "earliest after the truth");
            prop_assert!(c.latest(client(t)).unwrap() + 1 >= server(t), "latest before the truth");
        }
    }
}
