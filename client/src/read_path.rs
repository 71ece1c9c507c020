//! Which way a read goes: the mode a client is in ([`ReadPath`]) and the
//! backend of its one-sided reads ([`Transport`]). The bottom of the
//! client's layers: no crate imports.

/// Which way GETs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReadPath {
    /// Chosen per GET from measured delay, window and retries (see
    /// [`crate::path`]): one-sided where that is cheaper, else RPC; in a
    /// cluster by each node session's selector.
    #[default]
    Auto,
    /// One-sided reads only: `get` and `multi_get` fail with
    /// [`crate::ClientError::OneSidedUnavailable`] when no one-sided path
    /// works (after one try on a fresh path). Keys whose reads keep
    /// failing verification (a writer racing the reader) are still
    /// answered over RPC, never with unverified bytes.
    ///
    /// In a cluster, a shard's region is only believed under its leader's
    /// lease, which can lapse at any time (a failover, a stall): a read the
    /// lease does not cover, or of a region that cannot be attached, is
    /// asked of the leader over RPC rather than failed. Forcing a
    /// transport the seed node does not offer fails at connect.
    OneSided,
    /// RPC only.
    Rpc,
}

impl ReadPath {
    /// The name the CLI and config take (`auto`, `one-sided`, `rpc`).
    pub fn name(self) -> &'static str {
        match self {
            ReadPath::Auto => "auto",
            ReadPath::OneSided => "one-sided",
            ReadPath::Rpc => "rpc",
        }
    }
}

impl std::str::FromStr for ReadPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ReadPath::Auto),
            "one-sided" | "onesided" => Ok(ReadPath::OneSided),
            "rpc" => Ok(ReadPath::Rpc),
            _ => Err(format!("unknown path {s:?}: expected auto, one-sided or rpc")),
        }
    }
}

/// Backends of one-sided reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// The server's region mapped read-only (same host only).
    Shm,
    /// The server's software one-sided engine, over TCP (`engine`; the
    /// CLI and config also take its old name, `tcp`).
    Engine,
    /// RDMA READs by the NIC.
    Rdma,
}

impl Transport {
    /// The name the CLI and config take (`shm`, `engine`, `rdma`).
    pub fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Engine => "engine",
            Transport::Rdma => "rdma",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "shm" => Ok(Transport::Shm),
            // RPC runs over TCP too: `tcp` is the engine's old name.
            "engine" | "tcp" => Ok(Transport::Engine),
            "rdma" => Ok(Transport::Rdma),
            _ => Err(format!("unknown transport {s:?}: expected shm, engine (or tcp) or rdma")),
        }
    }
}
