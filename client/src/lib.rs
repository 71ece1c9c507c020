//! The dmkv client SDK.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dmkv_client::ClientError> {
//! let client = dmkv_client::Client::connect("127.0.0.1:7070").await?;
//! client.put("user:1", "alice").await?;
//! assert_eq!(client.get("user:1").await?.as_deref(), Some(&b"alice"[..]));
//! # Ok(()) }
//! ```
//!
//! Where a GET goes: [`Client`] picks a pooled [`conn::Conn`], which sends
//! it as a framed request and matches the reply by id.

pub mod blocking;
pub mod client;
pub mod conn;
pub mod error;

pub use client::{Client, ClientConfig, ReadPath, Transport, Versioned};
pub use dmkv_common::proto::ErrorCode;
pub use error::ClientError;
