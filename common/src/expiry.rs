//! Item expiry, as memcached defines it: an item carries the unix second
//! it expires at (0: never), and is gone once the server's clock reaches
//! it. The server publishes its clock in the region header
//! ([`crate::layout::CLOCK_OFFSET`]) so one-sided readers judge expiry by
//! the same clock as the server's own reads.

/// An `exptime` up to this many seconds is relative to now; above it, an
/// absolute unix time (memcached's 30-day rule).
pub const RELATIVE_LIMIT_SECS: i64 = 30 * 24 * 3600;

/// The `expires_at` of an item stored with memcached's `exptime` at server
/// time `now_ms` (unix ms): 0 for never, else the unix second it expires.
/// A negative `exptime`, or an absolute one already past, gives an item
/// that is expired at once (1, the earliest second that is not "never").
pub fn from_exptime(exptime: i64, now_ms: u64) -> u32 {
    let now_secs = (now_ms / 1000) as i64;
    let at = match exptime {
        0 => return 0,
        e if e < 0 => return 1,
        e if e <= RELATIVE_LIMIT_SECS => now_secs.saturating_add(e),
        e => e,
    };
    at.clamp(1, i64::from(u32::MAX)) as u32
}

/// The `expires_at` of an item that should live `ttl_secs` from `now_ms`
/// (0: for ever).
pub fn from_ttl(ttl_secs: u64, now_ms: u64) -> u32 {
    if ttl_secs == 0 {
        return 0;
    }
    (now_ms / 1000).saturating_add(ttl_secs).clamp(1, u64::from(u32::MAX)) as u32
}

/// Whether an item with `expires_at` is expired at server time `now_ms`.
pub fn expired(expires_at: u32, now_ms: u64) -> bool {
    expires_at != 0 && u64::from(expires_at) * 1000 <= now_ms
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memcached_exptime_rules() {
        let now = 1_700_000_000_500;
        assert_eq!(from_exptime(0, now), 0);
        assert_eq!(from_exptime(-1, now), 1);
        assert_eq!(from_exptime(10, now), 1_700_000_010);
        assert_eq!(from_exptime(RELATIVE_LIMIT_SECS, now), 1_700_000_000 + RELATIVE_LIMIT_SECS as u32);
        // Above 30 days: absolute.
        assert_eq!(from_exptime(RELATIVE_LIMIT_SECS + 1, now), RELATIVE_LIMIT_SECS as u32 + 1);
        assert!(expired(from_exptime(RELATIVE_LIMIT_SECS + 1, now), now));
        assert_eq!(from_exptime(i64::MAX, now), u32::MAX);
        assert!(!expired(0, u64::MAX));
        assert!(expired(1_700_000_000, now));
        assert!(!expired(1_700_000_001, now));
        assert!(expired(1_700_000_001, 1_700_000_001_000));
        assert_eq!(from_ttl(0, now), 0);
        assert_eq!(from_ttl(5, now), 1_700_000_005);
    }
}
