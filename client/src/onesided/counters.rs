//! Counters of one-sided reads.

use std::sync::atomic::{AtomicU64, Ordering};

use dmkv_common::read::Retry;

/// Counters of one-sided reads, for tests, benchmarks and operators.
#[derive(Debug, Default)]
pub struct ReadCounters {
    /// GETs answered one-sided (hit or miss).
    pub gets: AtomicU64,
    /// Of those, answered from a cached address in one round trip.
    pub hint_hits: AtomicU64,
    /// Attempts abandoned because an item failed verification.
    pub torn: AtomicU64,
    /// Attempts abandoned because a matching slot held another key.
    pub other_key: AtomicU64,
    /// Attempts abandoned because they outlasted the grace period.
    pub slow: AtomicU64,
    /// Attempts abandoned because the cached directory entry was stale
    /// (the segment had split): the entry is read again.
    pub stale_directory: AtomicU64,
    /// Attempts that found an item that can expire but no server clock to
    /// judge it by (the server answers those).
    pub no_clock: AtomicU64,
    /// Directory entries read (first use, or after a stale one).
    pub directory_reads: AtomicU64,
    /// GETs that used up their attempts and went over RPC.
    pub fallbacks: AtomicU64,
    /// Batches of a cluster shard's region refused for want of a lease.
    pub unleased: AtomicU64,
    /// Of those, refused because the lease's run began after the batch
    /// did (a renewal late or just granted).
    pub lease_not_yet: AtomicU64,
    /// Of those, refused because the lease may have ended before the
    /// batch's last read.
    pub lease_expired: AtomicU64,
    /// Of those, refused because the shard's partitions changed at a later
    /// map version than the one the key was routed by.
    pub stale_map: AtomicU64,
    /// Clock samples of a remote server that did not agree with the one
    /// before (a clock jumped or broke the drift bound): one-sided reads of
    /// its leased regions are refused until two agree again.
    pub clock_disagreements: AtomicU64,
    /// Keys read over RPC (GETs, each key of a multi-get, fallbacks and
    /// probes): kept here beside the one-sided count so the client's
    /// metrics can split all its reads by path (the server sees only these).
    pub rpc_gets: AtomicU64,
}

/// A snapshot of [`ReadCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    pub gets: u64,
    pub hint_hits: u64,
    pub torn: u64,
    pub other_key: u64,
    pub slow: u64,
    pub stale_directory: u64,
    pub no_clock: u64,
    pub directory_reads: u64,
    pub fallbacks: u64,
    pub unleased: u64,
    pub lease_not_yet: u64,
    pub lease_expired: u64,
    pub stale_map: u64,
    pub clock_disagreements: u64,
    pub rpc_gets: u64,
}

impl ReadCounters {
    /// The current values.
    pub fn snapshot(&self) -> ReadStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ReadStats {
            gets: l(&self.gets),
            hint_hits: l(&self.hint_hits),
            torn: l(&self.torn),
            other_key: l(&self.other_key),
            slow: l(&self.slow),
            stale_directory: l(&self.stale_directory),
            no_clock: l(&self.no_clock),
            directory_reads: l(&self.directory_reads),
            fallbacks: l(&self.fallbacks),
            unleased: l(&self.unleased),
            lease_not_yet: l(&self.lease_not_yet),
            lease_expired: l(&self.lease_expired),
            stale_map: l(&self.stale_map),
            clock_disagreements: l(&self.clock_disagreements),
            rpc_gets: l(&self.rpc_gets),
        }
    }

    pub(super) fn retry(&self, r: Retry) {
        let c = match r {
            Retry::Torn => &self.torn,
            Retry::OtherKey => &self.other_key,
            Retry::Slow => &self.slow,
            Retry::StaleDirectory => &self.stale_directory,
            Retry::NoClock => &self.no_clock,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}
