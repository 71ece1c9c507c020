//! Errors of the client SDK.

use std::time::Duration;

use dmkv_common::proto::ErrorCode;
use thiserror::Error;

/// Why a request failed.
#[derive(Debug, Clone, Error)]
pub enum ClientError {
    /// The request was refused before sending (bad key or value).
    #[error("invalid request: {0}")]
    Invalid(#[from] dmkv_common::Error),
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: String },
    #[error("connection closed")]
    ConnectionClosed,
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The server answered with an error; nothing was changed.
    #[error("server error {code:?}: {message}")]
    Server { code: ErrorCode, message: String },
    /// The node does not lead the key's shard; nothing was changed. The
    /// cluster router retries at `leader` (if known) within the deadline.
    #[error("node does not lead the key's shard (leader: {})", leader.map_or("unknown".to_string(), |l| format!("node {l}")))]
    NotLeader { leader: Option<u64>, map_version: u64 },
    /// The server sent something this client does not understand.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// One-sided reads were required (`ReadPath::OneSided`) but are not
    /// possible with this server.
    #[error("one-sided reads unavailable: {0}")]
    OneSidedUnavailable(String),
    /// The client's settings cannot be used (a bad token or TLS file).
    #[error("bad client configuration: {0}")]
    Config(String),
    /// The request would exceed the maximum frame size.
    #[error("request of {len} bytes exceeds the maximum frame of {max} bytes")]
    RequestTooLarge { len: usize, max: usize },
}

impl ClientError {
    /// The server's error code, if the server answered with an error.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            ClientError::NotLeader { .. } => Some(ErrorCode::NotLeader),
            _ => None,
        }
    }

    /// Whether a request that failed this way may have reached the server
    /// (and a write taken effect): not when no connection was made.
    pub fn may_have_been_sent(&self) -> bool {
        !matches!(self, ClientError::Connect { .. })
    }

    /// Whether the way to the server failed (no connection, connection
    /// lost, no reply in time) rather than the request itself.
    pub fn is_transport(&self) -> bool {
        matches!(self, ClientError::Connect { .. } | ClientError::ConnectionClosed | ClientError::Timeout(_))
    }
}
