//! What a read returns.

use bytes::Bytes;

/// A value read with the version the server gave its write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub value: Bytes,
    pub version: u64,
    /// The item's client flags (memcached's).
    pub flags: u32,
    /// Unix second the item expires at, by the server's clock; 0: never.
    pub expires_at: u32,
}
