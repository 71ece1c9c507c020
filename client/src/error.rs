//! Errors of the client SDK.

use std::time::Duration;

use dmkv_common::proto::ErrorCode;
use thiserror::Error;

use crate::read_path::Transport;
use dmkv_common::proto::{Response, response::Result as R};

/// Why a request failed. New reasons may be added: match with a `_` arm.
#[derive(Debug, Clone, Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The request was refused before sending (bad key or value).
    #[error("invalid request: {0}")]
    Invalid(#[from] dmkv_common::Error),
    /// No connection could be made to `addr`; `reason` says why (refused,
    /// unreachable, timed out, a failed TLS handshake, a TLS server met
    /// without TLS...).
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: String, reason: ConnectReason },
    /// A client given several seed addresses reached none of them; each
    /// seed's failure, in the order tried.
    #[error("cannot connect to any seed: {}", list(failures))]
    NoSeedAnswered { failures: Vec<ClientError> },
    /// The connection was lost before the reply came; a write may or may
    /// not have taken effect.
    #[error("connection closed")]
    ConnectionClosed,
    /// No reply within the request timeout; a write may or may not have
    /// taken effect.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The server answered with an error; nothing was changed, but for
    /// `Uncertain`: a cluster write that may or may not have taken effect
    /// (a leader change left it so, and the router could not send it again
    /// within its retry window).
    #[error("server error {code:?}: {message}")]
    Server { code: ErrorCode, message: String },
    /// The node does not lead the key's shard; nothing was changed. The
    /// cluster router retries at `leader` (if known) within the deadline.
    #[error("node does not lead the key's shard (leader: {})", leader.map_or("unknown".to_string(), |l| format!("node {l}")))]
    NotLeader { leader: Option<u64>, map_version: u64 },
    /// A call of the blocking client was made from inside an async
    /// runtime, where blocking would stall the runtime's worker; nothing
    /// was sent. Use the async client there.
    #[error("the blocking client was called inside an async runtime: use dmkv_client::Client there")]
    InsideRuntime,
    /// The server sent something this client does not understand.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The peer at `addr` accepted a connection but did not answer the
    /// HELLO every connection starts with as a dmkv server does: it closed,
    /// sent something else (the engine port, another service), or stayed
    /// silent. Nothing was sent but the HELLO.
    #[error("{addr} does not speak dmkv's RPC protocol: {detail}")]
    NotDmkv { addr: String, detail: String },
    /// One-sided reads were required (`ReadPath::OneSided`) but are not
    /// possible with this server.
    #[error("one-sided reads unavailable: {0}")]
    OneSidedUnavailable(String),
    /// At connect, the one-sided backend forced by `ClientConfig::transport`
    /// cannot be attached (the server does not offer it, is on another
    /// host, this client was built without it, or attaching failed);
    /// `reason` says which. The client is not made, rather than reading
    /// over another backend or RPC.
    #[error("transport {transport} unavailable: {reason}")]
    TransportUnavailable { transport: Transport, reason: String },
    /// The client's settings cannot be used (a bad token or TLS file).
    #[error("bad client configuration: {0}")]
    Config(String),
    /// The request would exceed the maximum frame size.
    #[error("request of {len} bytes exceeds the maximum frame of {max} bytes")]
    RequestTooLarge { len: usize, max: usize },
}

/// Why a connection could not be made. New reasons may be added.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConnectReason {
    /// The operating system refused: connection refused or reset, host or
    /// network unreachable, no such address... `kind` tells them apart.
    #[error("{message}")]
    Io { kind: std::io::ErrorKind, message: String },
    /// Neither a connection nor its handshake completed within the time.
    #[error("timed out after {0:?}")]
    TimedOut(Duration),
    /// The TCP connection was made but the TLS handshake failed.
    #[error("TLS handshake: {0}")]
    Tls(String),
    /// This client speaks plaintext and the server TLS.
    #[error("the server speaks TLS: give the CA that signed its certificate (ClientConfig::tls, --tls-ca)")]
    ServerSpeaksTls,
    /// The cluster map names no address for this node.
    #[error("not in the cluster map")]
    UnknownNode,
}

impl ConnectReason {
    /// The reason of a failed socket call.
    pub fn io(e: &std::io::Error) -> ConnectReason {
        ConnectReason::Io { kind: e.kind(), message: e.to_string() }
    }
}

/// Where a failure arose (see [`ClientError::origin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// This client refused the request before sending it: bad input, bad
    /// settings, or (at connect) a transport it was told to use that it
    /// cannot attach.
    Client,
    /// The way to the server failed: no connection, a lost one, no reply
    /// in time, a peer that is no dmkv server, or no working one-sided
    /// path for a GET that must read one-sided.
    Network,
    /// The server answered: an error it chose, or (`Protocol`) a reply
    /// this client does not understand.
    Server,
}

fn list(failures: &[ClientError]) -> String {
    failures.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

impl ClientError {
    /// Whether this client refused the request, the network failed, or
    /// the server answered.
    pub fn origin(&self) -> Origin {
        match self {
            ClientError::Invalid(_)
            | ClientError::InsideRuntime
            | ClientError::TransportUnavailable { .. }
            | ClientError::Config(_)
            | ClientError::RequestTooLarge { .. } => Origin::Client,
            ClientError::Connect { .. }
            | ClientError::NoSeedAnswered { .. }
            | ClientError::ConnectionClosed
            | ClientError::Timeout(_)
            | ClientError::NotDmkv { .. }
            | ClientError::OneSidedUnavailable(_) => Origin::Network,
            ClientError::Server { .. } | ClientError::NotLeader { .. } | ClientError::Protocol(_) => Origin::Server,
        }
    }

    /// The server's error code, if the server answered with an error.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            ClientError::NotLeader { .. } => Some(ErrorCode::NotLeader),
            _ => None,
        }
    }

    /// Whether a request that failed this way may have reached the server
    /// (and a write taken effect): not when it was refused before sending
    /// or no working connection was made.
    pub fn may_have_been_sent(&self) -> bool {
        !matches!(
            self,
            ClientError::Invalid(_)
                | ClientError::Connect { .. }
                | ClientError::NoSeedAnswered { .. }
                | ClientError::NotDmkv { .. }
                | ClientError::TransportUnavailable { .. }
                | ClientError::Config(_)
                | ClientError::RequestTooLarge { .. }
                | ClientError::InsideRuntime
        )
    }

    /// Whether the way to the server failed (no connection, connection
    /// lost, no reply in time, a peer that is no dmkv server) rather than
    /// the request itself.
    pub fn is_transport(&self) -> bool {
        matches!(
            self,
            ClientError::Connect { .. }
                | ClientError::NoSeedAnswered { .. }
                | ClientError::ConnectionClosed
                | ClientError::Timeout(_)
                | ClientError::NotDmkv { .. }
        )
    }
}

/// Turns a reply into its result, or the server's error into ours.
pub fn unwrap(resp: Response) -> Result<R, ClientError> {
    match resp.result {
        Some(R::Error(e)) if e.code == ErrorCode::NotLeader as i32 => {
            Err(ClientError::NotLeader { leader: (e.leader != 0).then_some(e.leader), map_version: e.map_version })
        }
        Some(R::Error(e)) => Err(ClientError::Server {
            code: ErrorCode::try_from(e.code).unwrap_or(ErrorCode::Unspecified),
            message: e.message,
        }),
        Some(r) => Ok(r),
        None => Err(ClientError::Protocol("reply without a result".into())),
    }
}

pub(crate) fn unexpected(r: &R) -> ClientError {
    ClientError::Protocol(format!("unexpected reply {r:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_refused_before_sending_were_not_sent() {
        let not_dmkv = ClientError::NotDmkv { addr: "a:1".into(), detail: "x".into() };
        assert!(not_dmkv.is_transport() && !not_dmkv.may_have_been_sent());
        let forced = ClientError::TransportUnavailable { transport: Transport::Rdma, reason: "r".into() };
        assert!(!forced.is_transport() && !forced.may_have_been_sent());
        assert_eq!(forced.to_string(), "transport rdma unavailable: r");
        assert!(ClientError::Timeout(Duration::from_secs(1)).may_have_been_sent());
    }

    #[test]
    fn refusals_network_failures_and_answers_are_told_apart() {
        let refused = ClientError::RequestTooLarge { len: 2, max: 1 };
        assert_eq!(refused.origin(), Origin::Client);
        let connect =
            ClientError::Connect { addr: "a:1".into(), reason: ConnectReason::TimedOut(Duration::from_secs(1)) };
        assert_eq!(connect.origin(), Origin::Network);
        assert_eq!(connect.to_string(), "cannot connect to a:1: timed out after 1s");
        let answered = ClientError::Server { code: ErrorCode::NotFound, message: "m".into() };
        assert_eq!(answered.origin(), Origin::Server);
        let seeds = ClientError::NoSeedAnswered { failures: vec![connect.clone(), connect] };
        assert!(seeds.is_transport() && !seeds.may_have_been_sent());
        assert_eq!(
            seeds.to_string(),
            "cannot connect to any seed: cannot connect to a:1: timed out after 1s; cannot connect to a:1: timed out after 1s"
        );
    }
}
