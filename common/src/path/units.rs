//! Time units for the path logic: every duration here is in nanoseconds.

/// Nanoseconds in a microsecond, for readable constants.
pub const MICROS: u64 = 1_000;
/// Nanoseconds in a millisecond.
pub const MILLIS: u64 = 1_000_000;
