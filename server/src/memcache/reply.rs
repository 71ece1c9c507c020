//! What the memcached port writes back, in both the text and the meta
//! protocol: memcached's error lines and reply encoders.

use bytes::BytesMut;

/// The error lines, exactly as memcached writes them (without CRLF).
pub mod err {
    pub const ERROR: &str = "ERROR";
    pub const BAD_FORMAT: &str = "CLIENT_ERROR bad command line format";
    pub const BAD_LINE: &str = "CLIENT_ERROR bad command line";
    pub const BAD_SLAB_ID: &str = "CLIENT_ERROR Illegal slab id";
    pub const BAD_DELETE: &str = "CLIENT_ERROR bad command line format.  Usage: delete <key> [noreply]";
    pub const BAD_CHUNK: &str = "CLIENT_ERROR bad data chunk";
    pub const LINE_TOO_LONG: &str = "CLIENT_ERROR line too long";
    pub const TOO_LARGE: &str = "SERVER_ERROR object too large for cache";
    pub const NO_MEMORY: &str = "SERVER_ERROR out of memory storing object";
    pub const NON_NUMERIC: &str = "CLIENT_ERROR cannot increment or decrement non-numeric value";
    pub const BAD_DELTA: &str = "CLIENT_ERROR invalid numeric delta argument";
    pub const BAD_EXPTIME: &str = "CLIENT_ERROR invalid exptime argument";
    pub const UNAUTHENTICATED: &str = "CLIENT_ERROR unauthenticated";
    pub const AUTH_FAILED: &str = "CLIENT_ERROR authentication failure";
    /// dmkv's own (a cluster node): the key's shard has no leader this
    /// node can reach now; nothing was done. Clients treat SERVER_ERROR as
    /// a failed command and may retry.
    pub const UNAVAILABLE: &str = "SERVER_ERROR temporarily unavailable: the key's shard has no reachable leader";
    /// dmkv's own: a write passed on to its shard's leader lost its
    /// answer; it may or may not have been applied.
    pub const UNCERTAIN: &str = "SERVER_ERROR the write may or may not have been applied: read before retrying";
}

/// Appends `line` and CRLF.
pub fn line(out: &mut BytesMut, line: &str) {
    out.extend_from_slice(line.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends one item of a get reply: `VALUE key flags bytes [cas]` and the
/// data block.
pub fn value(out: &mut BytesMut, key: &[u8], flags: u32, value: &[u8], cas: Option<u64>) {
    out.extend_from_slice(b"VALUE ");
    out.extend_from_slice(key);
    let head = match cas {
        Some(c) => format!(" {flags} {} {c}\r\n", value.len()),
        None => format!(" {flags} {}\r\n", value.len()),
    };
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}
