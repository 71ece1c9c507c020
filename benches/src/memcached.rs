//! memcached's text protocol: `get` and `set`, and a parser of their replies.

use bytes::{Buf, Bytes, BytesMut};

use crate::pipe::Protocol;

/// Longest reply line accepted without its CRLF.
pub const MAX_LINE: usize = 8 * 1024;
/// Largest value accepted (memcached's own item limit is 1 MiB by default).
pub const MAX_VALUE: usize = 128 << 20;

/// A reply of memcached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `VALUE key flags len` block(s) followed by `END`; empty on a miss.
    Values(Vec<Bytes>),
    /// `STORED`.
    Stored,
    /// Any other status line (`NOT_STORED`, `EXISTS`, `NOT_FOUND`, `DELETED`...).
    Status(String),
    /// `ERROR`, `CLIENT_ERROR ...` or `SERVER_ERROR ...`.
    Error(String),
}

/// The memcached text protocol.
pub struct Memcached;

/// `get KEY\r\n`.
pub fn encode_get(key: &[u8]) -> Bytes {
    let mut b = Vec::with_capacity(key.len() + 6);
    b.extend_from_slice(b"get ");
    b.extend_from_slice(key);
    b.extend_from_slice(b"\r\n");
    Bytes::from(b)
}

/// `set KEY 0 0 LEN\r\nVALUE\r\n`.
pub fn encode_set(key: &[u8], value: &[u8]) -> Bytes {
    let mut b = Vec::with_capacity(key.len() + value.len() + 32);
    b.extend_from_slice(b"set ");
    b.extend_from_slice(key);
    b.extend_from_slice(format!(" 0 0 {}\r\n", value.len()).as_bytes());
    b.extend_from_slice(value);
    b.extend_from_slice(b"\r\n");
    Bytes::from(b)
}

/// The line starting at `at` (without CRLF) and the offset after it.
fn line(buf: &[u8], at: usize) -> Result<Option<(&[u8], usize)>, String> {
    let rest = &buf[at.min(buf.len())..];
    match rest.windows(2).position(|w| w == b"\r\n") {
        Some(n) => Ok(Some((&rest[..n], at + n + 2))),
        None if rest.len() > MAX_LINE => Err(format!("reply line longer than {MAX_LINE} bytes")),
        None => Ok(None),
    }
}

impl Protocol for Memcached {
    type Reply = Reply;

    fn parse(buf: &mut BytesMut) -> Result<Option<Reply>, String> {
        let mut at = 0;
        let mut values = Vec::new();
        // Offsets of values in `buf`, cut out once the whole reply is here.
        let mut spans = Vec::new();
        loop {
            let Some((l, next)) = line(buf, at)? else { return Ok(None) };
            if let Some(header) = l.strip_prefix(b"VALUE ") {
                let text = std::str::from_utf8(header).map_err(|_| "VALUE line is not text".to_string())?;
                let mut parts = text.split(' ');
                let (_key, _flags, len) = (parts.next(), parts.next(), parts.next());
                let len: usize = len
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| format!("bad VALUE line {:?}", String::from_utf8_lossy(l)))?;
                if len > MAX_VALUE {
                    return Err(format!("value of {len} bytes exceeds {MAX_VALUE}"));
                }
                if buf.len() < next + len + 2 {
                    return Ok(None);
                }
                if &buf[next + len..next + len + 2] != b"\r\n" {
                    return Err("value not followed by CRLF".into());
                }
                spans.push((next, len));
                at = next + len + 2;
                continue;
            }
            if !spans.is_empty() && l != b"END" {
                return Err(format!("expected END after values, got {:?}", String::from_utf8_lossy(l)));
            }
            let reply = match l {
                b"END" => {
                    let all = buf.split_to(next).freeze();
                    values.extend(spans.iter().map(|&(s, n)| all.slice(s..s + n)));
                    return Ok(Some(Reply::Values(values)));
                }
                b"STORED" => Reply::Stored,
                b"ERROR" => Reply::Error("ERROR".into()),
                _ if l.starts_with(b"CLIENT_ERROR") || l.starts_with(b"SERVER_ERROR") => {
                    Reply::Error(String::from_utf8_lossy(l).into_owned())
                }
                _ if !l.is_empty() && l.iter().all(|c| c.is_ascii_uppercase() || *c == b'_') => {
                    Reply::Status(String::from_utf8_lossy(l).into_owned())
                }
                _ => return Err(format!("unexpected reply line {:?}", String::from_utf8_lossy(l))),
            };
            buf.advance(next);
            return Ok(Some(reply));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipe::parse_split;

    #[test]
    fn replies_parse_at_every_split() {
        let stream = b"STORED\r\nVALUE user1 0 5\r\nhe\r\no\r\nEND\r\nEND\r\nNOT_STORED\r\n\
            SERVER_ERROR out of memory storing object\r\nVALUE k 3 0\r\n\r\nEND\r\nERROR\r\n";
        let want = vec![
            Reply::Stored,
            Reply::Values(vec![Bytes::from_static(b"he\r\no")]),
            Reply::Values(vec![]),
            Reply::Status("NOT_STORED".into()),
            Reply::Error("SERVER_ERROR out of memory storing object".into()),
            Reply::Values(vec![Bytes::new()]),
            Reply::Error("ERROR".into()),
        ];
        for cut in 0..=stream.len() {
            assert_eq!(parse_split::<Memcached>(stream, cut).unwrap(), want, "split at {cut}");
        }
    }

    #[test]
    fn incomplete_replies_consume_nothing() {
        let partial = &b"VALUE k 0 10\r\n01234"[..];
        let mut buf = BytesMut::from(partial);
        assert_eq!(Memcached::parse(&mut buf), Ok(None));
        assert_eq!(&buf[..], partial);
    }

    #[test]
    fn broken_streams_are_errors() {
        for bad in [&b"VALUE k 0 x\r\n"[..], b"VALUE k 0 2\r\nabXY", b"hello\r\n", b"VALUE k 0 1\r\na\r\nSTORED\r\n"] {
            assert!(Memcached::parse(&mut BytesMut::from(bad)).is_err(), "{bad:?}");
        }
        let long = vec![b'A'; MAX_LINE + 10];
        assert!(Memcached::parse(&mut BytesMut::from(&long[..])).is_err());
    }

    #[test]
    fn requests_encode() {
        assert_eq!(&encode_get(b"k1")[..], b"get k1\r\n");
        assert_eq!(&encode_set(b"k1", b"abc")[..], b"set k1 0 0 3\r\nabc\r\n");
    }
}
