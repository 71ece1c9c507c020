//! When a one-sided path is attached, as pure logic: no IO and no clock.
//! Every call carries `now`, so tests drive it on a simulated clock and
//! replay it from a seed; the session does the attaching (region info, a
//! connect) and reports back here.
//!
//! One [`AttachState`] follows one region: a single node's own, or one
//! shard region of a cluster node. Its caller asks [`AttachState::poll_attach`]
//! whether to try now; a yes is an [`AttachTicket`], the only one in flight,
//! which the caller hands back with the outcome
//! ([`AttachState::handle_attached`] or [`AttachState::handle_failed`]).
//! A failed try is retried only after its [`AttachPolicy::interval`];
//! GETs go over RPC meanwhile. An attached path that breaks is reported by
//! its [`Generation`] ([`AttachState::handle_detach`]), so a report about
//! an attachment that was already replaced changes nothing.

use std::time::{Duration, Instant};

/// How long after a failed try a single node's region is tried again.
pub const NODE_REATTACH_INTERVAL: Duration = Duration::from_millis(500);

/// How long after a failed try, or a failure of the attached path, a
/// cluster shard's region is tried again.
///
/// Shorter than a node's: a shard region stops being readable whenever
/// its leader moves, which is routine, and its GETs pay an RPC to the
/// leader until it is attached again.
pub const SHARD_REATTACH_INTERVAL: Duration = Duration::from_millis(200);

/// Where the interval after a failed try is counted from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackoffFrom {
    /// The start of the try: a try that took longer than the interval to
    /// fail may be followed by the next at once.
    Try,
    /// The end of the try.
    Failure,
}

/// The rules of one kind of region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttachPolicy {
    /// How long after a failure the next try may start.
    pub interval: Duration,
    pub backoff_from: BackoffFrom,
    /// Whether an attached path that failed waits out the interval before
    /// it is attached anew (else the next poll tries at once).
    pub detach_backs_off: bool,
}

impl AttachPolicy {
    /// A single node's region. Its attach runs in the background while
    /// GETs go over RPC, so a broken path is replaced at once; the
    /// interval is counted from the try, as it always was.
    pub const NODE: AttachPolicy =
        AttachPolicy { interval: NODE_REATTACH_INTERVAL, backoff_from: BackoffFrom::Try, detach_backs_off: false };

    /// A cluster shard's region. The GET that attaches it waits for the
    /// attach, so a region that just failed (its lease lapsed, its leader
    /// moved) is left alone for the interval rather than retried by every
    /// GET.
    pub const SHARD: AttachPolicy =
        AttachPolicy { interval: SHARD_REATTACH_INTERVAL, backoff_from: BackoffFrom::Failure, detach_backs_off: true };
}

/// Which successful attach an attached path came from. Each success gets
/// a greater one than the last, so a report about an older attachment is
/// told apart from one about the path attached now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(u64);

impl Generation {
    /// Its position among the attachments of its region, from 1.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// A try at attaching that [`AttachState::poll_attach`] granted: it must be
/// handed back with its outcome, or its region is never attached again
/// (debug builds panic when one is dropped). Only the state machine makes
/// them, and they cannot be copied, so at most one is in flight.
#[must_use = "hand the ticket back with handle_attached or handle_failed"]
#[derive(Debug)]
pub struct AttachTicket {
    attempt: u64,
    issued: Instant,
    returned: bool,
}

impl AttachTicket {
    /// When the try was granted.
    pub fn issued(&self) -> Instant {
        self.issued
    }

    fn hand_back(mut self) -> (u64, Instant) {
        self.returned = true;
        (self.attempt, self.issued)
    }
}

impl Drop for AttachTicket {
    fn drop(&mut self) {
        // A ticket lost mid-unwind is the panic's consequence, not a bug of
        // its own.
        if !std::thread::panicking() {
            debug_assert!(self.returned, "an attach ticket was dropped: its region stays Attaching for good");
        }
    }
}

/// Where a region is, as [`AttachState::phase`] tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Never attached, or its path failed and may be attached at once.
    Detached,
    /// A try is in flight, granted at `since`.
    Attaching { since: Instant },
    /// Attached at `since`.
    Attached { generation: Generation, since: Instant },
    /// The last try, or the attached path, failed; the interval is counted
    /// from `at`.
    Failed { at: Instant },
}

enum State<P> {
    Detached,
    Attaching { attempt: u64, since: Instant },
    Attached { generation: Generation, since: Instant, path: P },
    Failed { at: Instant },
}

/// One region's attach state machine; `P` is what an attach produces (the
/// session's path).
pub struct AttachState<P> {
    policy: AttachPolicy,
    state: State<P>,
    /// Tries granted so far: a ticket's number, checked when handed back.
    attempts: u64,
    /// Successful attaches so far: the last [`Generation`].
    generations: u64,
}

impl<P> AttachState<P> {
    /// A region not attached yet, which may be tried at once.
    pub fn new(policy: AttachPolicy) -> Self {
        AttachState { policy, state: State::Detached, attempts: 0, generations: 0 }
    }

    pub fn policy(&self) -> AttachPolicy {
        self.policy
    }

    /// The attached path and its generation, if any.
    pub fn attached(&self) -> Option<(Generation, &P)> {
        match &self.state {
            State::Attached { generation, path, .. } => Some((*generation, path)),
            _ => None,
        }
    }

    pub fn phase(&self) -> Phase {
        match self.state {
            State::Detached => Phase::Detached,
            State::Attaching { since, .. } => Phase::Attaching { since },
            State::Attached { generation, since, .. } => Phase::Attached { generation, since },
            State::Failed { at } => Phase::Failed { at },
        }
    }

    /// Whether a caller should try attaching now: not while attached or
    /// while another try is in flight, nor within the interval after a
    /// failure.
    pub fn poll_attach(&mut self, now: Instant) -> Option<AttachTicket> {
        match self.state {
            State::Failed { at } if now.saturating_duration_since(at) < self.policy.interval => None,
            _ => self.poll_forced_attach(now),
        }
    }

    /// [`AttachState::poll_attach`] for a caller that needs the path now
    /// whatever the last failure (a forced one-sided read path): only one
    /// try in flight still, but no interval.
    pub fn poll_forced_attach(&mut self, now: Instant) -> Option<AttachTicket> {
        match self.state {
            State::Attached { .. } | State::Attaching { .. } => None,
            State::Detached | State::Failed { .. } => {
                self.attempts += 1;
                self.state = State::Attaching { attempt: self.attempts, since: now };
                Some(AttachTicket { attempt: self.attempts, issued: now, returned: false })
            }
        }
    }

    /// The try of `ticket` attached `path`, now its region's. `None` (and
    /// `path` dropped) when the ticket is not this machine's try in
    /// flight: a caller's bug, which debug builds panic on.
    pub fn handle_attached(&mut self, ticket: AttachTicket, path: P, now: Instant) -> Option<Generation> {
        let (attempt, _) = ticket.hand_back();
        if !self.is_in_flight(attempt) {
            return None;
        }
        self.generations += 1;
        let generation = Generation(self.generations);
        self.state = State::Attached { generation, since: now, path };
        Some(generation)
    }

    /// The try of `ticket` failed; the next waits out the interval.
    pub fn handle_failed(&mut self, ticket: AttachTicket, now: Instant) {
        let (attempt, issued) = ticket.hand_back();
        if !self.is_in_flight(attempt) {
            return;
        }
        let at = match self.policy.backoff_from {
            BackoffFrom::Try => issued,
            BackoffFrom::Failure => now,
        };
        self.state = State::Failed { at };
    }

    /// The path of `generation` failed. True when it was the one attached
    /// and is forgotten now; a report about an attachment already replaced
    /// (or already detached) changes nothing.
    pub fn handle_detach(&mut self, generation: Generation, now: Instant) -> bool {
        match self.state {
            State::Attached { generation: g, .. } if g == generation => {
                self.state = if self.policy.detach_backs_off { State::Failed { at: now } } else { State::Detached };
                true
            }
            _ => false,
        }
    }

    fn is_in_flight(&self, attempt: u64) -> bool {
        let ok = matches!(self.state, State::Attaching { attempt: a, .. } if a == attempt);
        debug_assert!(ok, "attach ticket {attempt} handed back to a machine that did not grant it");
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Attaches `path` by a try granted at `now`.
    fn attach<P>(st: &mut AttachState<P>, path: P, now: Instant) -> Generation {
        let ticket = st.poll_attach(now).expect("a try");
        st.handle_attached(ticket, path, now).expect("the try in flight")
    }

    /// A policy like the shard's, and one like the node's.
    const POLICIES: [AttachPolicy; 2] = [AttachPolicy::SHARD, AttachPolicy::NODE];

    #[test]
    fn one_try_in_flight_at_a_time() {
        for policy in POLICIES {
            let t0 = Instant::now();
            let mut st = AttachState::<&str>::new(policy);
            let ticket = st.poll_attach(t0).expect("a new region is tried at once");
            assert!(st.poll_attach(t0).is_none(), "{policy:?}: a second try while one is in flight");
            assert!(st.poll_forced_attach(t0 + ms(10_000)).is_none(), "{policy:?}: a forced one too");
            assert_eq!(st.phase(), Phase::Attaching { since: t0 });
            let g = st.handle_attached(ticket, "p", t0 + ms(5)).expect("the ticket in flight");
            assert_eq!(st.attached(), Some((g, &"p")));
            assert!(st.poll_attach(t0 + ms(10_000)).is_none(), "{policy:?}: a try while attached");
        }
    }

    #[test]
    fn a_failed_try_waits_out_the_interval() {
        for policy in POLICIES {
            let t0 = Instant::now();
            let mut st = AttachState::<()>::new(policy);
            let ticket = st.poll_attach(t0).unwrap();
            let failed = t0 + ms(30);
            st.handle_failed(ticket, failed);
            let from = match policy.backoff_from {
                BackoffFrom::Try => t0,
                BackoffFrom::Failure => failed,
            };
            assert_eq!(st.phase(), Phase::Failed { at: from });
            let just_before = from + policy.interval - Duration::from_nanos(1);
            assert!(st.poll_attach(failed).is_none(), "{policy:?}: retried at once");
            assert!(st.poll_attach(just_before).is_none(), "{policy:?}: retried within the interval");
            let ticket = st.poll_attach(from + policy.interval).expect("retried after the interval");
            st.handle_failed(ticket, from + policy.interval);
        }
    }

    #[test]
    fn the_intervals_stay_as_they_were() {
        assert_eq!(AttachPolicy::NODE.interval, ms(500));
        assert_eq!(AttachPolicy::SHARD.interval, ms(200));
    }

    #[test]
    fn a_forced_try_ignores_the_interval() {
        let t0 = Instant::now();
        let mut st = AttachState::<()>::new(AttachPolicy::NODE);
        let ticket = st.poll_attach(t0).unwrap();
        st.handle_failed(ticket, t0);
        assert!(st.poll_attach(t0 + ms(1)).is_none());
        let ticket = st.poll_forced_attach(t0 + ms(1)).expect("forced callers do not wait");
        st.handle_attached(ticket, (), t0 + ms(2)).unwrap();
    }

    #[test]
    fn a_stale_detach_is_ignored() {
        for policy in POLICIES {
            let t0 = Instant::now();
            let mut st = AttachState::<u32>::new(policy);
            let first = attach(&mut st, 1, t0);
            assert!(st.handle_detach(first, t0 + ms(1)), "{policy:?}: the attached path is detached");
            assert!(!st.handle_detach(first, t0 + ms(2)), "{policy:?}: detached twice");
            let at = t0 + ms(1000);
            let second = attach(&mut st, 2, at);
            assert!(second > first);
            // A GET that still read the first path reports its failure late.
            assert!(!st.handle_detach(first, at + ms(1)), "{policy:?}: a stale detach detached the new path");
            assert_eq!(st.attached(), Some((second, &2)));
            // Nor does a detach of the old path while a new try is in flight
            // change anything.
            assert!(st.handle_detach(second, at + ms(2)));
            let ticket = st.poll_attach(at + ms(2000)).unwrap();
            assert!(!st.handle_detach(second, at + ms(2001)));
            assert!(matches!(st.phase(), Phase::Attaching { .. }));
            st.handle_failed(ticket, at + ms(2002));
        }
    }

    #[test]
    fn a_detached_path_is_attached_again() {
        let t0 = Instant::now();
        // A node's path is attached anew by the next poll...
        let mut node = AttachState::<()>::new(AttachPolicy::NODE);
        let g = attach(&mut node, (), t0);
        node.handle_detach(g, t0 + ms(1));
        assert_eq!(node.phase(), Phase::Detached);
        let ticket = node.poll_attach(t0 + ms(1)).expect("a node's broken path is replaced at once");
        node.handle_failed(ticket, t0 + ms(2));
        // ...a shard's after the interval.
        let mut shard = AttachState::<()>::new(AttachPolicy::SHARD);
        let g = attach(&mut shard, (), t0);
        let failed = t0 + ms(1);
        shard.handle_detach(g, failed);
        assert!(shard.poll_attach(failed + SHARD_REATTACH_INTERVAL - ms(1)).is_none());
        let ticket = shard.poll_attach(failed + SHARD_REATTACH_INTERVAL).expect("reattached after the interval");
        let g2 = shard.handle_attached(ticket, (), failed + SHARD_REATTACH_INTERVAL).unwrap();
        assert!(g2 > g);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "dropped")]
    fn a_dropped_ticket_is_caught() {
        let mut st = AttachState::<()>::new(AttachPolicy::SHARD);
        drop(st.poll_attach(Instant::now()));
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "did not grant it")]
    fn a_ticket_of_another_region_is_caught() {
        let t0 = Instant::now();
        let mut a = AttachState::<()>::new(AttachPolicy::SHARD);
        let mut b = AttachState::<()>::new(AttachPolicy::SHARD);
        let ta = a.poll_attach(t0).unwrap();
        let tb = b.poll_attach(t0).unwrap();
        b.handle_failed(tb, t0);
        // `b` has nothing in flight now.
        b.handle_failed(ta, t0);
    }

    // ------------------------------------------------------- simulation

    /// xorshift64*: tiny and seedable.
    struct Rng(u64);

    impl Rng {
        fn new(seed: u64) -> Self {
            Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
        }

        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Seeds each run uses, or the one in `ATTACH_SIM_SEED`.
    fn seeds() -> Vec<u64> {
        match std::env::var("ATTACH_SIM_SEED") {
            Ok(s) => vec![s.trim().parse().expect("ATTACH_SIM_SEED must be an integer")],
            Err(_) => (1..=200).collect(),
        }
    }

    /// What one simulated caller holds.
    enum Holding {
        Nothing,
        /// A try in flight, ending at the given time.
        Try(AttachTicket, Instant),
        /// A path read from the state, which may fail under it later.
        Path(Generation),
    }

    /// Several callers poll, attach (each try succeeding or failing after
    /// a random time), read the path they got and report it broken, on a
    /// simulated clock; the invariants are checked after every step.
    fn simulate(seed: u64, policy: AttachPolicy) {
        let mut rng = Rng::new(seed);
        let t0 = Instant::now();
        let mut now = t0;
        let mut st = AttachState::<Generation>::new(policy);
        let mut callers: Vec<Holding> = (0..5).map(|_| Holding::Nothing).collect();
        // The model's own record, to check the machine against.
        let mut in_flight = 0;
        let mut backoff_from: Option<Instant> = None;
        let mut last_generation: Option<Generation> = None;
        let (mut tries, mut attaches, mut detaches) = (0, 0, 0);
        for step in 0..5_000 {
            now += Duration::from_millis(rng.below(60));
            let ctx = || format!("seed {seed} {policy:?} step {step} at {:?}", now - t0);
            let c = rng.below(callers.len() as u64) as usize;
            match std::mem::replace(&mut callers[c], Holding::Nothing) {
                Holding::Nothing => {
                    if let Some((g, &p)) = st.attached() {
                        assert_eq!(g, p, "{}: the path is not its generation's", ctx());
                        callers[c] = Holding::Path(g);
                    } else {
                        let forced = rng.below(10) == 0;
                        let waited = backoff_from.is_none_or(|f| now.saturating_duration_since(f) >= policy.interval);
                        let free = in_flight == 0;
                        let ticket = if forced { st.poll_forced_attach(now) } else { st.poll_attach(now) };
                        // Granted exactly when none is in flight and (unless
                        // forced) the interval since the last failure is over.
                        assert_eq!(
                            ticket.is_some(),
                            free && (forced || waited),
                            "{}: forced {forced}, in flight {in_flight}, last failure {:?}",
                            ctx(),
                            backoff_from.map(|f| f - t0)
                        );
                        if let Some(ticket) = ticket {
                            tries += 1;
                            in_flight += 1;
                            callers[c] = Holding::Try(ticket, now + Duration::from_millis(rng.below(400)));
                        }
                    }
                }
                Holding::Try(ticket, ends) if now >= ends => {
                    in_flight -= 1;
                    if rng.below(3) == 0 {
                        let g = Generation(st.generations + 1);
                        let got = st.handle_attached(ticket, g, now);
                        assert_eq!(got, Some(g), "{}: the try in flight was refused", ctx());
                        assert!(last_generation < got, "{}: generation went back to {got:?}", ctx());
                        last_generation = got;
                        backoff_from = None;
                        attaches += 1;
                    } else {
                        let issued = ticket.issued();
                        st.handle_failed(ticket, now);
                        backoff_from = Some(match policy.backoff_from {
                            BackoffFrom::Try => issued,
                            BackoffFrom::Failure => now,
                        });
                    }
                }
                Holding::Try(ticket, ends) => callers[c] = Holding::Try(ticket, ends),
                Holding::Path(g) => {
                    // Most reads succeed; a failure may be about an older path.
                    if rng.below(4) == 0 {
                        let current = st.attached().map(|(g, _)| g);
                        let detached = st.handle_detach(g, now);
                        assert_eq!(detached, current == Some(g), "{}: detach of {g:?} (attached {current:?})", ctx());
                        if detached {
                            detaches += 1;
                            backoff_from = policy.detach_backs_off.then_some(now);
                        }
                    } else {
                        callers[c] = Holding::Path(g);
                    }
                }
            }
            // Invariants.
            assert!(in_flight <= 1, "{}: {in_flight} attaches in flight", ctx());
            assert_eq!(in_flight == 1, matches!(st.phase(), Phase::Attaching { .. }), "{}: phase", ctx());
            if let Phase::Attached { generation, .. } = st.phase() {
                assert_eq!(Some(generation), last_generation, "{}: attached an older generation", ctx());
            }
        }
        // Hand back what is still in flight.
        for h in callers {
            if let Holding::Try(ticket, _) = h {
                st.handle_failed(ticket, now);
            }
        }
        assert!(
            tries > 10 && attaches > 3 && detaches > 0,
            "seed {seed}: the run did little: {tries} {attaches} {detaches}"
        );
    }

    #[test]
    fn simulated_callers_keep_the_invariants() {
        for seed in seeds() {
            for policy in POLICIES {
                simulate(seed, policy);
            }
        }
    }
}
