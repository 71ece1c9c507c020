//! Congestion-aware path selection for GETs, as pure logic: no IO and no
//! clock. Every input carries `now` in nanoseconds from any fixed origin, so
//! tests drive it with a virtual clock and replay it from a seed.
//!
//! A GET can go two ways: one-sided reads (one or two round trips, no
//! server CPU) or an RPC (one round trip through the server's workers).
//! Which is faster changes from moment to moment, so each path keeps:
//!
//! - [`delay`]: its base and smoothed round-trip delay;
//! - [`window`]: a Swift-style congestion window on outstanding GETs,
//!   grown below a target delay and cut above it;
//! - [`keys`]: (one-sided only) how many round trips recent GETs of a key
//!   took, so keys whose reads keep retrying are priced accordingly.
//!
//! [`select`] prices each GET on both paths and picks the cheaper, with
//! hysteresis and background probes of the other path; [`repath`] tells
//! when a connection has been congested long enough to move its traffic
//! to a fresh one (PLB).

pub mod delay;
pub mod keys;
pub mod repath;
pub mod rpc_price;
pub mod select;
pub mod units;
pub mod window;

pub use delay::DelayEstimator;
pub use repath::Repath;
pub use select::{Choice, Completion, Controller, ControllerStats, Path, PathConfig, PathSnapshot};
pub use units::{MICROS, MILLIS};
pub use window::Window;
