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
//! Where a GET goes: [`Client`] checks it and hands it to one
//! [`Session`] (a single node) or to the [`router::Router`], which picks
//! the key's shard leader and that node's session. The session asks its
//! [`path`] selector which way is cheaper right now; one-sided, an
//! attached region ([`onesided::OneSided`]) reads the server's memory
//! directly (RDMA, shared memory on the same host, the server's software
//! engine over TCP elsewhere), every item verified; over RPC, a framed
//! request goes on a connection of the node's [`pool::RpcPool`] and is
//! matched to its reply by id. PUTs and DELETEs always go over RPC.

pub mod attach_state;
pub mod blocking;
pub mod client;
pub mod config;
pub mod conn;
pub mod error;
#[cfg(feature = "prometheus")]
pub mod metrics;
#[cfg(feature = "cli")]
pub mod moves;
pub mod onesided;
pub mod ops;
mod outbox;
pub mod path;
pub mod pipeline;
pub mod pool;
pub mod read_path;
pub mod route_view;
pub mod router;
pub mod session;
pub mod tls;
pub mod top;
pub mod value;
#[cfg(feature = "rdma")]
pub mod verbs_rpc;

pub use client::Client;
pub use config::{ClientConfig, RpcTransport};
pub use dmkv_common::auth::Token;
// `Path` stays in `path` (as `dmkv_client::path::Path`): at the root a
// glob import would shadow std's.
pub use dmkv_common::path::PathConfig;
pub use dmkv_common::proto::ErrorCode;
pub use error::{ClientError, ConnectReason, Origin};
pub use onesided::{ItemMeta, ReadStats};
pub use ops::{PutMode, PutOptions};
pub use read_path::{ReadPath, Transport};
pub use session::{PathStats, Session};
pub use tls::TlsOptions;
pub use value::Versioned;

/// The README's Rust examples, compiled by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;
