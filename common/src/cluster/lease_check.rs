//! A one-sided reader's lease check of a cluster shard's region: every
//! batch of reads of it ends with a read of the lease block, and is
//! believed only if the whole attempt, from before its first read to after
//! this batch's last, lies inside one run of the leader's lease
//! ([`judge`] says why that is enough). Pure: the client drives it over
//! its backends, the shard simulation over simulated clocks.
//!
//! The lease is published on the leader node's monotonic clock, so what a
//! reader needs is bounds on that clock around its reads:
//! - on the leader's host (and in its clock namespace) it reads the clock
//!   itself ([`LeaseClock::Shared`]);
//! - the engine stamps each batch with the clock before its first read and
//!   after its last ([`LeaseClock::Stamped`]): exact, nothing to assume;
//! - any other reader (RDMA, or shared memory across clock namespaces)
//!   bounds the clock from samples taken over RPC, widened by the drift
//!   bound as they age ([`LeaseClock::Sampled`]). A sample that falls
//!   outside what the previous one predicted means a clock broke the bound
//!   (it jumped, or runs fast or slow): the reader refuses every batch
//!   until two samples agree again.
//!
//! No wall clock is involved: stepping a client's or a server's clock
//! changes nothing here.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::lease::{BadSample, ClockSample, Distrust, MAX_DRIFT_PPM, ServerClock, Span, judge};
use crate::layout::LeaseBlock;

/// How often a sampled clock is sampled again.
pub const CLOCK_RESYNC_INTERVAL: Duration = Duration::from_secs(1);
/// A sample older than this is not used: its bounds have widened by twice
/// the drift bound of its age (10 ms at 5 s), and a reader whose resyncs
/// fail should stop reading one-sided rather than go on guessing.
pub const MAX_SAMPLE_AGE: Duration = Duration::from_secs(5);

/// How a reader bounds the leader's clock around its reads.
#[derive(Debug, Clone)]
pub enum LeaseClock {
    /// The reader's own monotonic clock is the leader's.
    Shared,
    /// The backend stamps every batch with the leader's clock.
    Stamped,
    /// Bounds from samples, refreshed in the background.
    Sampled(Arc<SampledClock>),
}

impl LeaseClock {
    /// The clock for a reader on a backend whose batches carry stamps
    /// (`stamped`) or not, given a sample taken when it attached: shared if
    /// the reader is on the server's host and in its time namespace
    /// (`same_clock`), and the sample agrees (the server's reading lies
    /// between the reader's own before and after); else sampled.
    pub fn choose(stamped: bool, same_clock: bool, sample: ClockSample) -> Result<LeaseClock, BadSample> {
        if stamped {
            return Ok(LeaseClock::Stamped);
        }
        if same_clock && sample.sent <= sample.server && sample.server <= sample.received {
            return Ok(LeaseClock::Shared);
        }
        SampledClock::new(sample).map(LeaseClock::Sampled)
    }
}

/// A remote server's clock as the samples bound it.
#[derive(Debug)]
pub struct SampledClock {
    state: Mutex<SampledState>,
}

#[derive(Debug, Clone, Copy)]
struct SampledState {
    clock: ServerClock,
    /// The sample before: an attempt that began before the last sample
    /// arrived is bounded by it (the last says nothing of earlier times).
    previous: Option<ServerClock>,
    /// The last two samples agreed (or there is only one).
    agreed: bool,
    drift_ppm: u64,
}

impl SampledClock {
    /// Bounds from `sample` for clocks within [`MAX_DRIFT_PPM`].
    pub fn new(sample: ClockSample) -> Result<Arc<SampledClock>, BadSample> {
        SampledClock::with_drift(sample, MAX_DRIFT_PPM)
    }

    /// Bounds from `sample` for clocks within `drift_ppm` of true time.
    pub fn with_drift(sample: ClockSample, drift_ppm: u64) -> Result<Arc<SampledClock>, BadSample> {
        let clock = ServerClock::sampled(sample, drift_ppm)?;
        let state = SampledState { clock, previous: None, agreed: true, drift_ppm };
        Ok(Arc::new(SampledClock { state: Mutex::new(state) }))
    }

    fn state(&self) -> SampledState {
        // Plain data: nothing a panic could leave half-written.
        *self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes a new sample; whether it agreed with the last one. One that
    /// did not (or that cannot be a sample) leaves every batch refused
    /// until the next one agrees with it.
    pub fn resample(&self, sample: ClockSample) -> bool {
        let mut s = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let agreed = s.clock.agrees(&sample);
        match ServerClock::sampled(sample, s.drift_ppm) {
            Ok(clock) => *s = SampledState { clock, previous: Some(s.clock), agreed, drift_ppm: s.drift_ppm },
            Err(_) => s.agreed = false,
        }
        agreed
    }

    /// Bounds on the server's clock over local times `start..end`, if the
    /// samples allow any.
    pub fn span(&self, start: u64, end: u64) -> Option<Span> {
        let s = self.state();
        if !s.agreed || s.clock.age(end) > MAX_SAMPLE_AGE.as_nanos() as u64 {
            return None;
        }
        // Both samples agreed, so either bounds the server's clock.
        let earliest = s.clock.earliest(start).or_else(|| s.previous?.earliest(start))?;
        Some(Span { start: earliest, end: s.clock.latest(end)? })
    }
}

/// Where an attempt's reads began: the reader's clock before the first
/// (early, never late), and the first batch's stamp where batches carry
/// them; and the version of the map its keys were routed by.
#[derive(Debug, Clone, Copy)]
pub struct AttemptStart {
    local: u64,
    stamped: Option<u64>,
    routed_by: u64,
}

impl AttemptStart {
    /// An attempt whose first read comes after the reader's clock read
    /// `local`, of keys routed to the shard by a map of version
    /// `routed_by` (any lower version is safe too, only more cautious).
    pub fn at(local: u64, routed_by: u64) -> AttemptStart {
        AttemptStart { local, stamped: None, routed_by }
    }
}

/// Judges one batch of an attempt: `block` is the lease block as read
/// last in the batch, `stamps` the batch's stamps (stamped backends), and
/// `local_end` the reader's clock after the batch completed (never early).
pub fn check(
    clock: &LeaseClock,
    hash_seed: u64,
    block: Option<&[u8]>,
    stamps: Option<(u64, u64)>,
    start: &mut AttemptStart,
    local_end: u64,
) -> Result<(), Distrust> {
    let span = match clock {
        LeaseClock::Shared => Span { start: start.local, end: local_end },
        LeaseClock::Stamped => {
            let (first, last) = stamps.ok_or(Distrust::NoLease)?;
            Span { start: *start.stamped.get_or_insert(first), end: last }
        }
        LeaseClock::Sampled(c) => c.span(start.local, local_end).ok_or(Distrust::NoLease)?,
    };
    judge(block.and_then(|b| LeaseBlock::decode(b, hash_seed)), span, start.routed_by)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn block(start: u64, end: u64) -> Vec<u8> {
        LeaseBlock { term: 3, start_ns: start, expiry_ns: end, applied: 1, placement: 1 }.encode(5).to_vec()
    }

    #[test]
    fn the_clock_is_shared_only_when_the_servers_reading_lies_inside_the_call() {
        let s = |server| ClockSample { sent: 100, server, received: 200 };
        assert!(matches!(LeaseClock::choose(false, true, s(150)), Ok(LeaseClock::Shared)));
        assert!(matches!(LeaseClock::choose(false, true, s(250)), Ok(LeaseClock::Sampled(_))));
        // Another host or namespace whose clock happens to agree.
        assert!(matches!(LeaseClock::choose(false, false, s(150)), Ok(LeaseClock::Sampled(_))));
        assert!(matches!(LeaseClock::choose(true, false, s(250)), Ok(LeaseClock::Stamped)));
    }

    #[test]
    fn an_attempt_counts_from_its_first_batch() {
        let b = block(100 * MS, 300 * MS);
        let c = LeaseClock::Stamped;
        // The first batch began after the run did; the second is judged
        // from the first batch's start, however late it came itself.
        let mut start = AttemptStart::at(0, 1);
        assert_eq!(check(&c, 5, Some(&b), Some((110 * MS, 111 * MS)), &mut start, 0), Ok(()));
        assert_eq!(check(&c, 5, Some(&b), Some((200 * MS, 201 * MS)), &mut start, 0), Ok(()));
        let mut early = AttemptStart::at(0, 1);
        assert_eq!(check(&c, 5, Some(&b), Some((90 * MS, 120 * MS)), &mut early, 0), Err(Distrust::NotYet));
        assert_eq!(check(&c, 5, Some(&b), Some((200 * MS, 201 * MS)), &mut early, 0), Err(Distrust::NotYet));
        assert_eq!(check(&c, 5, Some(&b), None, &mut AttemptStart::at(0, 1), 0), Err(Distrust::NoLease));
        // The shared clock is the reader's own.
        assert_eq!(check(&LeaseClock::Shared, 5, Some(&b), None, &mut AttemptStart::at(150 * MS, 1), 160 * MS), Ok(()));
        let late = check(&LeaseClock::Shared, 5, Some(&b), None, &mut AttemptStart::at(150 * MS, 1), 300 * MS);
        assert_eq!(late, Err(Distrust::Expired));
        assert_eq!(
            check(&LeaseClock::Shared, 6, Some(&b), None, &mut AttemptStart::at(150 * MS, 1), 160 * MS),
            Err(Distrust::NoLease),
            "another region's seed"
        );
    }

    #[test]
    fn a_sampled_clock_that_jumps_is_refused_until_samples_agree() {
        // The server's clock is the client's plus 1000 s.
        let off = 1_000_000 * MS;
        let sample = |at: u64, server_off: u64| ClockSample { sent: at, server: at + server_off, received: at + MS };
        let c = SampledClock::new(sample(10 * MS, off)).unwrap();
        let clock = LeaseClock::Sampled(Arc::clone(&c));
        let b = block(off, off + 500 * MS);
        let at = |s: u64, e: u64| check(&clock, 5, Some(&b), None, &mut AttemptStart::at(s, 1), e);
        assert_eq!(at(100 * MS, 110 * MS), Ok(()));
        assert_eq!(at(5 * MS, 110 * MS), Err(Distrust::NoLease), "began before the sample");
        // A resync in the middle of an attempt: the sample before bounds
        // its start.
        assert!(c.resample(sample(500 * MS, off)));
        let long = block(off, off + 3_000 * MS);
        assert_eq!(
            check(&clock, 5, Some(&long), None, &mut AttemptStart::at(450 * MS, 1), 510 * MS),
            Ok(()),
            "began before the new sample, ended after"
        );
        assert_eq!(at(100 * MS, 10_000 * MS), Err(Distrust::NoLease), "sample too old");
        // The client's clock jumped 50 ms ahead of where the bound allows.
        assert!(!c.resample(sample(1_010 * MS, off - 50 * MS)));
        assert_eq!(at(1_100 * MS, 1_110 * MS), Err(Distrust::NoLease), "refused after a jump");
        assert!(c.resample(sample(2_010 * MS, off - 50 * MS)), "the next agrees");
        assert_eq!(
            check(
                &clock,
                5,
                Some(&block(off, off + 3_000 * MS)),
                None,
                &mut AttemptStart::at(2_100 * MS, 1),
                2_110 * MS
            ),
            Ok(())
        );
    }
}
