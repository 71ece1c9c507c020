//! One-sided GETs: read the server's region without running its key-value
//! code, verify every byte, and fall back to RPC when that fails.
//!
//! [`OneSided`] drives the pure protocol of [`dmkv_common::read`] over a
//! backend: [`shm`] (the region mapped in this process), [`engine`] (the
//! server's software one-sided engine over TCP) or `rdma` (the NIC's
//! READs, feature `rdma`).

pub mod access_log;
mod attach;
mod attempt_clock;
mod backend;
mod counters;
mod directory;
pub mod engine;
mod hints;
mod local_get;
// The rdma backend's planner, pure: built and tested without the feature too.
#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
mod post_plan;
#[cfg(feature = "rdma")]
pub mod rdma;
mod region;
mod scratch;
pub mod shm;

pub use crate::config::DEFAULT_HINT_ENTRIES;
pub(crate) use attach::clock_sample;
pub use attach::{AttachOptions, NodeRdma, attach, offered};
pub use attempt_clock::mono_ns;
pub use backend::{BackendError, Reads};
pub use counters::{ReadCounters, ReadStats};
pub use region::{OneSided, OneSidedGet, Trace};
pub use scratch::{ItemMeta, LocalGet, Scratch, with_scratch};
