//! Client settings.

use std::sync::Arc;
use std::time::Duration;

use dmkv_common::auth::Token;
use dmkv_common::limits::MAX_CLIENT_FRAME_LEN;
use dmkv_common::path::PathConfig;

use crate::error::ClientError;
use crate::read_path::{ReadPath, Transport};
use crate::tls::TlsOptions;

/// Environment variable a client takes its secret from when its config
/// gives none.
pub const TOKEN_ENV: &str = "DMKV_TOKEN";

/// Most seed addresses [`crate::Client::connect_seeds`] takes: tried one
/// after another, each within the connect timeout.
pub const MAX_SEEDS: usize = 64;

/// Most keys whose item address is cached per server.
pub const DEFAULT_HINT_ENTRIES: usize = 64 * 1024;

/// Client settings. The defaults suit a server on the same network.
///
/// Built from [`ClientConfig::default`] with one method per setting, so
/// settings added later do not break callers:
///
/// ```
/// use std::time::Duration;
/// use dmkv_client::{ClientConfig, ReadPath, Transport};
///
/// let cfg = ClientConfig::default()
///     .read_path(ReadPath::Auto)
///     .transport(Transport::Shm)
///     .request_timeout(Duration::from_millis(500));
/// assert_eq!(cfg.transport, Some(Transport::Shm));
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClientConfig {
    /// Which way GETs go.
    pub read_path: ReadPath,
    /// Force one one-sided backend (default: the best one available).
    /// With `ReadPath::Auto` or `OneSided`, connecting fails with
    /// [`ClientError::TransportUnavailable`] when it cannot be attached,
    /// rather than reading over RPC. Should the attached path break later,
    /// `OneSided` GETs fail and `Auto` ones go over RPC while it is
    /// attached again. `ReadPath::Rpc` never uses it.
    pub transport: Option<Transport>,
    /// RPC connections kept to the server; requests are spread over them,
    /// and one that stays congested is replaced.
    pub pool_size: usize,
    /// Connections to the server's one-sided engine (TCP transport).
    pub engine_connections: usize,
    /// Congestion control and path selection settings.
    pub path: PathConfig,
    /// Longest wait for a reply. In a cluster, a request's whole time
    /// over every try; a write is sent again only within its retry window
    /// (this, at most `limits::MAX_WRITE_RETRY_WINDOW`) of a try that may
    /// have reached a shard, and is reported `Uncertain` after.
    pub request_timeout: Duration,
    /// Longest wait for a TCP connection.
    pub connect_timeout: Duration,
    /// Ceiling on the largest frame sent or accepted. Each connection
    /// learns the server's limit in its HELLO and uses the smaller of the
    /// two (the default ceiling, 64 MiB, lets the server decide); until
    /// then, and with a server that does not say, it is the default 2 MiB.
    pub max_frame: usize,
    /// Keys whose item address is cached for one-round-trip GETs.
    pub hint_cache_entries: usize,
    /// Abandon one-sided attempts that outlast the server's grace period
    /// (always, but for tests that provoke torn reads to show that
    /// verification alone catches them: [`ClientConfig::testing_grace`]).
    pub(crate) enforce_grace: bool,
    /// The secret to prove when the server requires authentication
    /// (default: none). The SDK never reads the environment for it: an
    /// application that wants `DMKV_TOKEN` asks
    /// [`ClientConfig::token_from_env`], as the `dmkv` CLI and `dmkv-ycsb`
    /// do.
    pub token: Option<Arc<Token>>,
    /// TLS for RPC and engine connections (the server must serve TLS).
    pub tls: Option<TlsOptions>,
    /// Check cluster leases (always, but for tests that show the check
    /// is needed: [`ClientConfig::testing_leases`]).
    pub(crate) check_leases: bool,
    /// How RPCs (PUTs, DELETEs, RPC GETs) travel to a node.
    pub rpc_transport: RpcTransport,
}

/// How a client's RPCs travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RpcTransport {
    /// Verbs messages where both ends have an RDMA device and the node has
    /// room for the link, TCP otherwise (and always with TLS: verbs
    /// messages are not encrypted).
    #[default]
    Auto,
    /// TCP only.
    Tcp,
    /// Verbs messages only: connecting fails where they cannot be used.
    Verbs,
}

/// One setter per setting, each taking the config and returning it; an
/// optional setting's takes the value or an `Option` of it.
macro_rules! setters {
    ($arg:ident; $($(#[$doc:meta])* $name:ident: $ty:ty;)*) => {
        impl ClientConfig {
            $(
                $(#[$doc])*
                #[must_use]
                pub fn $name(mut self, v: setters!(@$arg $ty)) -> Self {
                    self.$name = v.into();
                    self
                }
            )*
        }
    };
    (@plain $ty:ty) => { $ty };
    (@optional $ty:ty) => { impl Into<Option<$ty>> };
}

setters! { plain;
    /// Which way GETs go.
    read_path: ReadPath;
    /// RPC connections kept to the server.
    pool_size: usize;
    /// Connections to the server's one-sided engine.
    engine_connections: usize;
    /// Congestion control and path selection settings.
    path: PathConfig;
    /// Longest wait for a reply.
    request_timeout: Duration;
    /// Longest wait for a TCP connection.
    connect_timeout: Duration;
    /// Ceiling on the largest frame sent or accepted.
    max_frame: usize;
    /// Keys whose item address is cached for one-round-trip GETs.
    hint_cache_entries: usize;
    /// How RPCs travel.
    rpc_transport: RpcTransport;
}

setters! { optional;
    /// A transport to force, or `None` for the best available.
    transport: Transport;
    /// The secret to prove, or `None`.
    token: Arc<Token>;
    /// TLS options, or `None` for plaintext.
    tls: TlsOptions;
}

impl ClientConfig {
    /// For tests only: `false` keeps one-sided attempts going past the
    /// server's grace period, to show that verification alone catches
    /// torn reads.
    #[doc(hidden)]
    #[must_use]
    pub fn testing_grace(mut self, enforce: bool) -> Self {
        self.enforce_grace = enforce;
        self
    }

    /// For tests only: `false` believes cluster regions without their
    /// lease, to show that the check is needed.
    #[doc(hidden)]
    #[must_use]
    pub fn testing_leases(mut self, check: bool) -> Self {
        self.check_leases = check;
        self
    }
}

impl ClientConfig {
    /// The token in the `DMKV_TOKEN` environment variable, if it is set;
    /// an error if it is set but no valid token. For applications that
    /// take their secret from the environment, as the `dmkv` CLI and
    /// `dmkv-ycsb` do: the SDK never looks there itself.
    pub fn token_from_env() -> Result<Option<Arc<Token>>, ClientError> {
        match std::env::var(TOKEN_ENV) {
            Ok(v) => {
                Token::new(&v).map(|t| Some(Arc::new(t))).map_err(|e| ClientError::Config(format!("{TOKEN_ENV}: {e}")))
            }
            Err(_) => Ok(None),
        }
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            read_path: ReadPath::Auto,
            transport: None,
            pool_size: 2,
            engine_connections: 2,
            path: PathConfig::default(),
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(3),
            max_frame: MAX_CLIENT_FRAME_LEN,
            hint_cache_entries: DEFAULT_HINT_ENTRIES,
            enforce_grace: true,
            token: None,
            tls: None,
            check_leases: true,
            rpc_transport: RpcTransport::Auto,
        }
    }
}
