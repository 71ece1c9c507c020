//! What a token of a command line may be, in both the text and the meta
//! protocol: keys and decimal numbers as memcached reads them.

/// Longest key on the text protocol.
pub const MAX_KEY_LEN: usize = 250;

/// Whether `key` is a key the text protocol accepts: 1 to 250 bytes, no
/// NUL, CR or LF (spaces cannot be in a token). Other control bytes pass,
/// as they do in memcached, whose tokenizer splits on spaces only:
/// memcaslap's keys start with such bytes.
pub fn key_ok(key: &[u8]) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_LEN && key.iter().all(|&b| !matches!(b, 0 | b'\r' | b'\n'))
}

/// A decimal number as memcached reads one: digits (and a sign for signed
/// types), nothing else.
pub fn number<T: std::str::FromStr>(tok: &[u8]) -> Option<T> {
    if tok.is_empty()
        || tok.len() > 20
        || !tok.iter().enumerate().all(|(i, &b)| b.is_ascii_digit() || (i == 0 && b == b'-'))
    {
        return None;
    }
    std::str::from_utf8(tok).ok()?.parse().ok()
}

// A key the text protocol takes is one the store takes.
const _: () = assert!(MAX_KEY_LEN <= dmkv_common::limits::MAX_KEY_LEN);
