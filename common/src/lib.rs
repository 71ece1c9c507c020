//! dmkv-common: the parts of dmkv that client and server share, as pure
//! logic with no IO: the wire protocol and its framing, the remote-memory
//! layout (region header, index buckets, items), and the limits. The one
//! exception is [`host::host_id`], which reads the kernel's boot id.
//!
//! Where a GET goes: [`layout`] says what the bytes in a server's region
//! mean; [`frame`] and [`proto`] carry requests over TCP.

pub mod auth;
pub mod cluster;
pub mod credit;
pub mod error;
pub mod expiry;
pub mod frame;
#[doc(hidden)]
pub mod fuzz;
pub mod host;
pub mod layout;
pub mod limits;
pub mod msglink;
pub mod onesided;
pub mod path;
pub mod pem;
pub mod racy;
pub mod read;
pub mod request;
pub mod shm_handoff;

/// Messages generated from `proto/dmkv.proto`.
pub mod proto {
    #![allow(missing_docs, clippy::all)]
    include!(concat!(env!("OUT_DIR"), "/dmkv.v1.rs"));
}

pub use error::{Error, LayoutError};

/// The version of the wire protocol spoken by this build.
pub const PROTOCOL_VERSION: u32 = 1;
