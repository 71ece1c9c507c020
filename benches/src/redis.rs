//! Redis' RESP2: commands as arrays of bulk strings, and a parser of every
//! RESP2 reply type.

use bytes::{Buf, Bytes, BytesMut};

use crate::pipe::Protocol;

/// Longest simple-string, error or integer line accepted.
pub const MAX_LINE: usize = 64 * 1024;
/// Largest bulk string accepted (Redis' own limit is 512 MiB).
pub const MAX_BULK: usize = 512 << 20;
/// Deepest nesting of arrays accepted.
pub const MAX_DEPTH: usize = 8;
/// Most elements of one array accepted.
pub const MAX_ARRAY: usize = 1 << 20;

/// A RESP2 value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `+OK`.
    Simple(String),
    /// `-ERR ...`.
    Error(String),
    /// `:42`.
    Int(i64),
    /// `$len` and bytes; `None` for `$-1` (nil).
    Bulk(Option<Bytes>),
    /// `*n` and elements; `None` for `*-1`.
    Array(Option<Vec<Value>>),
}

/// The RESP2 protocol.
pub struct Resp;

/// A command: an array of bulk strings.
pub fn encode(args: &[&[u8]]) -> Bytes {
    let len: usize = args.iter().map(|a| a.len() + 16).sum();
    let mut b = Vec::with_capacity(len + 16);
    b.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        b.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        b.extend_from_slice(a);
        b.extend_from_slice(b"\r\n");
    }
    Bytes::from(b)
}

/// The line at `at` (without CRLF) and the offset after it.
fn line(buf: &[u8], at: usize) -> Result<Option<(&[u8], usize)>, String> {
    let rest = &buf[at.min(buf.len())..];
    match rest.windows(2).position(|w| w == b"\r\n") {
        Some(n) => Ok(Some((&rest[..n], at + n + 2))),
        None if rest.len() > MAX_LINE => Err(format!("reply line longer than {MAX_LINE} bytes")),
        None => Ok(None),
    }
}

fn int(l: &[u8]) -> Result<i64, String> {
    std::str::from_utf8(l).ok().and_then(|s| s.parse().ok()).ok_or_else(|| format!("bad number {l:?}"))
}

/// Parses the value at `at`: the value and the offset after it, or `None`
/// if the buffer ends first.
fn value(buf: &[u8], at: usize, depth: usize) -> Result<Option<(Value, usize)>, String> {
    if depth > MAX_DEPTH {
        return Err(format!("arrays nested deeper than {MAX_DEPTH}"));
    }
    let Some((l, next)) = line(buf, at)? else { return Ok(None) };
    let Some((&kind, body)) = l.split_first() else { return Err("empty reply line".into()) };
    let text = || String::from_utf8_lossy(body).into_owned();
    Ok(Some(match kind {
        b'+' => (Value::Simple(text()), next),
        b'-' => (Value::Error(text()), next),
        b':' => (Value::Int(int(body)?), next),
        b'$' => {
            let n = int(body)?;
            if n == -1 {
                return Ok(Some((Value::Bulk(None), next)));
            }
            let n = usize::try_from(n).map_err(|_| format!("bad bulk length {n}"))?;
            if n > MAX_BULK {
                return Err(format!("bulk of {n} bytes exceeds {MAX_BULK}"));
            }
            if buf.len() < next + n + 2 {
                return Ok(None);
            }
            if &buf[next + n..next + n + 2] != b"\r\n" {
                return Err("bulk not followed by CRLF".into());
            }
            (Value::Bulk(Some(Bytes::copy_from_slice(&buf[next..next + n]))), next + n + 2)
        }
        b'*' => {
            let n = int(body)?;
            if n == -1 {
                return Ok(Some((Value::Array(None), next)));
            }
            let n = usize::try_from(n).map_err(|_| format!("bad array length {n}"))?;
            if n > MAX_ARRAY {
                return Err(format!("array of {n} elements exceeds {MAX_ARRAY}"));
            }
            let mut items = Vec::with_capacity(n.min(64));
            let mut at = next;
            for _ in 0..n {
                let Some((v, after)) = value(buf, at, depth + 1)? else { return Ok(None) };
                items.push(v);
                at = after;
            }
            (Value::Array(Some(items)), at)
        }
        other => return Err(format!("unknown reply type {:?}", other as char)),
    }))
}

impl Protocol for Resp {
    type Reply = Value;

    fn parse(buf: &mut BytesMut) -> Result<Option<Value>, String> {
        match value(buf, 0, 0)? {
            Some((v, used)) => {
                buf.advance(used);
                Ok(Some(v))
            }
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipe::parse_split;

    #[test]
    fn replies_parse_at_every_split() {
        let stream = b"+OK\r\n$5\r\nhe\r\no\r\n$-1\r\n-ERR wrong type\r\n:1234\r\n$0\r\n\r\n\
            *3\r\n$1\r\na\r\n*-1\r\n*1\r\n:-7\r\n*0\r\n";
        let want = vec![
            Value::Simple("OK".into()),
            Value::Bulk(Some(Bytes::from_static(b"he\r\no"))),
            Value::Bulk(None),
            Value::Error("ERR wrong type".into()),
            Value::Int(1234),
            Value::Bulk(Some(Bytes::new())),
            Value::Array(Some(vec![
                Value::Bulk(Some(Bytes::from_static(b"a"))),
                Value::Array(None),
                Value::Array(Some(vec![Value::Int(-7)])),
            ])),
            Value::Array(Some(vec![])),
        ];
        for cut in 0..=stream.len() {
            assert_eq!(parse_split::<Resp>(stream, cut).unwrap(), want, "split at {cut}");
        }
    }

    #[test]
    fn incomplete_replies_consume_nothing() {
        let partial = &b"*2\r\n$3\r\nabc\r\n$4\r\nab"[..];
        let mut buf = BytesMut::from(partial);
        assert_eq!(Resp::parse(&mut buf), Ok(None));
        assert_eq!(&buf[..], partial);
    }

    #[test]
    fn broken_streams_are_errors() {
        for bad in [&b"?x\r\n"[..], b"$x\r\n", b"$3\r\nabcXY", b":1.5\r\n", b"\r\n", b"$-2\r\n"] {
            assert!(Resp::parse(&mut BytesMut::from(bad)).is_err(), "{bad:?}");
        }
        let deep = "*1\r\n".repeat(MAX_DEPTH + 2);
        assert!(Resp::parse(&mut BytesMut::from(deep.as_bytes())).is_err());
    }

    #[test]
    fn commands_encode() {
        assert_eq!(&encode(&[b"GET", b"k"])[..], b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
        assert_eq!(&encode(&[b"SET", b"k", b""])[..], b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n");
    }
}
