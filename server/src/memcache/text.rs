//! memcached's text protocol as pure code: [`parse`] takes bytes off the
//! front of a connection's input and names the request they make (the
//! reply encoders, in [`super::reply`], write what memcached writes).
//! Nothing here touches the store, so every input can be tested, and none
//! can panic.
//!
//! Limits are memcached's: a command line of at most [`MAX_LINE_LEN`]
//! bytes (retrieval lines, which carry many keys, [`MAX_KEYS_LINE_LEN`]),
//! keys of at most [`MAX_KEY_LEN`] bytes without NUL, CR or LF, values
//! of at most `limits::MAX_VALUE_LEN` (memcached's `-I` default, 1 MiB).

use super::meta;
pub use super::reply::{err, line, value};
pub use super::token::{MAX_KEY_LEN, key_ok, number};
use crate::kv::Mode;

/// Longest command line (memcached's bound: longer ones close the
/// connection, without a reply, unless they are a multi-key get).
pub const MAX_LINE_LEN: usize = 2048;
/// Longest get/gets/gat/gats line: the only lines that grow with the number
/// of keys. Bounds the keys of one get too (each takes at least 2 bytes).
pub const MAX_KEYS_LINE_LEN: usize = 64 * 1024;
/// Most tokens on a line other than a retrieval line (memcached's
/// MAX_TOKENS); meta commands allow fewer flags, see [`meta::MAX_FLAGS`].
pub const MAX_TOKENS: usize = 24;

/// What the input at hand holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// Not a whole request yet: read more.
    Incomplete,
    /// A request made of the first `len` bytes.
    Request { len: usize, req: Request<'a> },
}

/// One request of the text (or meta) protocol.
#[derive(Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// get, gets (`cas`), gat, gats (`touch`: the new exptime).
    Get {
        keys: Vec<&'a [u8]>,
        cas: bool,
        touch: Option<i64>,
    },
    Store(Store<'a>),
    /// delete (memcached's legacy `delete key 0` too).
    Delete {
        key: &'a [u8],
        noreply: bool,
    },
    /// incr, decr.
    Arith {
        key: &'a [u8],
        delta: u64,
        incr: bool,
        noreply: bool,
    },
    Touch {
        key: &'a [u8],
        exptime: i64,
        noreply: bool,
    },
    /// flush_all [delay]: `delay` is an exptime (seconds, or a unix time).
    FlushAll {
        delay: i64,
        noreply: bool,
    },
    Version,
    Verbosity {
        noreply: bool,
    },
    Quit,
    Stats(StatsKind),
    /// mg, ms, md, ma, me.
    Meta(meta::Meta<'a>),
    /// mn.
    MetaNoop,
    /// cache_memlimit: the megabytes asked for (at least 8, at most
    /// memcached's 1e9; other values are answered as memcached does).
    MemLimit {
        megabytes: u32,
        noreply: bool,
    },
    /// Input memcached closes the connection on without a word (a line
    /// too long, an HTTP request): `why` is logged.
    Close(&'static str),
    /// Answer `msg`; then skip `swallow` more bytes of input (the data
    /// block of a refused storage command), or close if `close`.
    Error {
        msg: &'static str,
        swallow: usize,
        close: bool,
    },
}

/// set, add, replace, append, prepend, cas.
#[derive(Debug, PartialEq, Eq)]
pub struct Store<'a> {
    pub mode: Mode,
    /// `cas` command: the unique it names.
    pub cas: Option<u64>,
    pub key: &'a [u8],
    pub flags: u32,
    pub exptime: i64,
    pub value: &'a [u8],
    pub noreply: bool,
}

/// Which `stats` was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsKind {
    /// `stats`: the general statistics.
    General,
    /// `stats settings|slabs|sizes|conns`: nothing dmkv keeps, so
    /// just END.
    Empty,
    /// `stats reset`.
    Reset,
    /// `stats items`: one class, dmkv's items are not in size classes.
    Items,
    /// `stats cachedump <class> <limit>`: up to `limit` items (0: as many
    /// as fit memcached's 2 MB) of class `class`.
    CacheDump { class: u32, limit: u32 },
    /// Anything else: ERROR.
    Unknown,
}

fn error(len: usize, msg: &'static str) -> Parsed<'static> {
    Parsed::Request { len, req: Request::Error { msg, swallow: 0, close: false } }
}

/// Parses the request at the front of `buf`. `max_value` bounds a storage
/// command's data block (larger ones are refused and skipped); it is
/// `MAX_VALUE_LEN` once a connection is authenticated.
pub fn parse(buf: &[u8], max_value: usize) -> Parsed<'_> {
    let nl = buf.iter().position(|&b| b == b'\n');
    let line_len = nl.map_or(buf.len(), |nl| nl + 1);
    if starts_with_retrieval(buf) {
        // memcached reads a get's keys without bound; dmkv stops at its own
        // and says so.
        if line_len > MAX_KEYS_LINE_LEN {
            return Parsed::Request {
                len: line_len,
                req: Request::Error { msg: err::LINE_TOO_LONG, swallow: 0, close: true },
            };
        }
    } else if line_len > MAX_LINE_LEN {
        return Parsed::Request { len: line_len, req: Request::Close("a command line longer than 2048 bytes") };
    }
    let Some(nl) = nl else { return Parsed::Incomplete };
    let line = buf[..nl].strip_suffix(b"\r").unwrap_or(&buf[..nl]);
    let mut toks = line.split(|&b| b == b' ').filter(|t| !t.is_empty());
    let Some(cmd) = toks.next() else { return error(line_len, err::ERROR) };
    let retrieval = matches!(cmd, b"get" | b"gets" | b"gat" | b"gats");
    let max_tokens = if retrieval { usize::MAX } else { MAX_TOKENS };
    let args: Vec<&[u8]> = toks.take(max_tokens).collect();
    if args.len() >= max_tokens {
        let msg =
            if cmd.len() == 2 && cmd[0] == b'm' { "CLIENT_ERROR options flags are too long" } else { err::BAD_FORMAT };
        return error(line_len, msg);
    }
    let noreply = args.last() == Some(&&b"noreply"[..]);
    let req = match cmd {
        b"get" | b"gets" => match keys(&args) {
            Ok(keys) => Request::Get { keys, cas: cmd == b"gets", touch: None },
            Err(msg) => Request::Error { msg, swallow: 0, close: false },
        },
        b"gat" | b"gats" => match args.split_first() {
            None => Request::Error { msg: err::ERROR, swallow: 0, close: false },
            Some((exp, rest)) => match (number::<i32>(exp), keys(rest)) {
                (None, _) => Request::Error { msg: err::BAD_EXPTIME, swallow: 0, close: false },
                (_, Err(msg)) => Request::Error { msg, swallow: 0, close: false },
                (Some(e), Ok(keys)) => Request::Get { keys, cas: cmd == b"gats", touch: Some(i64::from(e)) },
            },
        },
        b"set" | b"add" | b"replace" | b"append" | b"prepend" | b"cas" => {
            return storage(buf, line_len, cmd, &args, noreply, max_value);
        }
        b"delete" => match args.as_slice() {
            [key] | [key, _] | [key, _, _] if !key_ok(key) => {
                Request::Error { msg: err::BAD_FORMAT, swallow: 0, close: false }
            }
            [key] => Request::Delete { key, noreply: false },
            [key, b"noreply"] => Request::Delete { key, noreply: true },
            [key, b"0"] => Request::Delete { key, noreply: false },
            [key, b"0", b"noreply"] => Request::Delete { key, noreply: true },
            [] => Request::Error { msg: err::ERROR, swallow: 0, close: false },
            _ => Request::Error { msg: err::BAD_DELETE, swallow: 0, close: false },
        },
        b"incr" | b"decr" => match args.as_slice() {
            [key, delta] | [key, delta, b"noreply"] => {
                if !key_ok(key) {
                    Request::Error { msg: err::BAD_FORMAT, swallow: 0, close: false }
                } else {
                    match number::<u64>(delta) {
                        Some(delta) => Request::Arith { key, delta, incr: cmd == b"incr", noreply },
                        None => Request::Error { msg: err::BAD_DELTA, swallow: 0, close: false },
                    }
                }
            }
            _ => Request::Error { msg: err::ERROR, swallow: 0, close: false },
        },
        b"touch" => match args.as_slice() {
            [key, exp] | [key, exp, b"noreply"] => {
                if !key_ok(key) {
                    Request::Error { msg: err::BAD_FORMAT, swallow: 0, close: false }
                } else {
                    match number::<i32>(exp) {
                        Some(e) => Request::Touch { key, exptime: i64::from(e), noreply },
                        None => Request::Error { msg: err::BAD_EXPTIME, swallow: 0, close: false },
                    }
                }
            }
            _ => Request::Error { msg: err::ERROR, swallow: 0, close: false },
        },
        b"flush_all" => match args.as_slice() {
            [] | [b"noreply"] => Request::FlushAll { delay: 0, noreply },
            [d] | [d, b"noreply"] => match number::<i32>(d) {
                Some(d) => Request::FlushAll { delay: i64::from(d), noreply },
                None => Request::Error { msg: err::BAD_FORMAT, swallow: 0, close: false },
            },
            _ => Request::Error { msg: err::ERROR, swallow: 0, close: false },
        },
        b"version" => Request::Version,
        b"verbosity" if !args.is_empty() && args.len() <= 2 => Request::Verbosity { noreply },
        b"quit" => Request::Quit,
        b"stats" => match args.as_slice() {
            [] => Request::Stats(StatsKind::General),
            [b"settings" | b"slabs" | b"sizes" | b"conns"] => Request::Stats(StatsKind::Empty),
            [b"items"] => Request::Stats(StatsKind::Items),
            [b"reset"] => Request::Stats(StatsKind::Reset),
            [b"cachedump", rest @ ..] => cachedump(rest),
            _ => Request::Stats(StatsKind::Unknown),
        },
        b"cache_memlimit" if matches!(args.len(), 1 | 2) => match number::<u32>(args[0]) {
            None => Request::Error { msg: err::ERROR, swallow: 0, close: false },
            Some(megabytes) => Request::MemLimit { megabytes, noreply },
        },
        b"mn" => Request::MetaNoop,
        b"mg" | b"md" | b"ma" | b"me" => match meta::parse(cmd, &args, None) {
            Ok(m) => Request::Meta(m),
            Err(msg) => Request::Error { msg, swallow: 0, close: false },
        },
        b"ms" => return meta_set(buf, line_len, &args, max_value),
        // What a browser sends to the port (`GET / HTTP/1.1`, a form's
        // POST): memcached hangs up on it, so cross-protocol requests
        // from web pages get no further than the first line.
        _ if args.last().unwrap_or(&cmd).starts_with(b"HTTP/") => Request::Close("an HTTP request"),
        _ => Request::Error { msg: err::ERROR, swallow: 0, close: false },
    };
    Parsed::Request { len: line_len, req }
}

/// `stats cachedump <class> <limit>`, as memcached checks it.
fn cachedump(args: &[&[u8]]) -> Request<'static> {
    let error = |msg| Request::Error { msg, swallow: 0, close: false };
    let [class, limit, ..] = args else { return error(err::BAD_LINE) };
    match (number::<u32>(class), number::<u32>(limit)) {
        (Some(class), Some(_)) if class >= MAX_SLAB_CLASSES => error(err::BAD_SLAB_ID),
        (Some(class), Some(limit)) => Request::Stats(StatsKind::CacheDump { class, limit }),
        _ => error(err::BAD_FORMAT),
    }
}

/// memcached's bound on a slab class id (`MAX_NUMBER_OF_SLAB_CLASSES`).
pub const MAX_SLAB_CLASSES: u32 = 64;

/// Whether `buf` begins a line that may carry many keys.
fn starts_with_retrieval(buf: &[u8]) -> bool {
    [&b"get "[..], b"gets ", b"gat ", b"gats "].iter().any(|p| buf.starts_with(p))
}

fn keys<'a>(args: &[&'a [u8]]) -> Result<Vec<&'a [u8]>, &'static str> {
    if args.is_empty() {
        return Err(err::ERROR);
    }
    if !args.iter().all(|k| key_ok(k)) {
        return Err(err::BAD_FORMAT);
    }
    Ok(args.to_vec())
}

/// The data block of `vlen` bytes after a line of `line_len` bytes: the
/// request's length and the value, or why not.
fn data_block(buf: &[u8], line_len: usize, vlen: usize) -> Option<Result<(usize, &[u8]), usize>> {
    let end = line_len.checked_add(vlen)?.checked_add(2)?;
    if buf.len() < end {
        return None;
    }
    if &buf[end - 2..end] != b"\r\n" {
        return Some(Err(end));
    }
    Some(Ok((end, &buf[line_len..end - 2])))
}

fn storage<'a>(
    buf: &'a [u8],
    line_len: usize,
    cmd: &[u8],
    args: &[&'a [u8]],
    noreply: bool,
    max_value: usize,
) -> Parsed<'a> {
    let is_cas = cmd == b"cas";
    let need = if is_cas { 5 } else { 4 };
    if args.len() < need {
        return error(line_len, err::BAD_FORMAT);
    }
    // Without a length there is no knowing where the data block ends: the
    // line alone is refused, as memcached does.
    let Some(vlen) = number::<i32>(args[3]).filter(|&v| v <= i32::MAX - 2).and_then(|v| usize::try_from(v).ok()) else {
        return error(line_len, err::BAD_FORMAT);
    };
    let swallow = |msg| Parsed::Request { len: line_len, req: Request::Error { msg, swallow: vlen + 2, close: false } };
    let (key, flags, exptime) = (args[0], number::<u32>(args[1]), number::<i32>(args[2]));
    let cas = if is_cas { number::<u64>(args[4]) } else { Some(0) };
    let (Some(flags), Some(exptime), Some(cas)) = (flags, exptime, cas) else { return swallow(err::BAD_FORMAT) };
    if !key_ok(key) {
        return swallow(err::BAD_FORMAT);
    }
    if vlen > max_value {
        return swallow(err::TOO_LARGE);
    }
    let (len, value) = match data_block(buf, line_len, vlen) {
        None => return Parsed::Incomplete,
        Some(Err(len)) => return error(len, err::BAD_CHUNK),
        Some(Ok(v)) => v,
    };
    let mode = match cmd {
        b"add" => Mode::Add,
        b"replace" => Mode::Replace,
        b"append" => Mode::Append,
        b"prepend" => Mode::Prepend,
        _ => Mode::Set,
    };
    let cas = is_cas.then_some(cas);
    Parsed::Request {
        len,
        req: Request::Store(Store { mode, cas, key, flags, exptime: i64::from(exptime), value, noreply }),
    }
}

fn meta_set<'a>(buf: &'a [u8], line_len: usize, args: &[&'a [u8]], max_value: usize) -> Parsed<'a> {
    let Some(vlen) = args.get(1).and_then(|t| number::<i32>(t)).and_then(|v| usize::try_from(v).ok()) else {
        return error(line_len, err::BAD_FORMAT);
    };
    let swallow = |msg| Parsed::Request { len: line_len, req: Request::Error { msg, swallow: vlen + 2, close: false } };
    if vlen > max_value {
        return swallow(err::TOO_LARGE);
    }
    // Flags are checked before the data is waited for, so a refused ms
    // skips its data block however large.
    let mut args = args.to_vec();
    args.remove(1);
    if let Err(msg) = meta::parse(b"ms", &args, Some(&[])) {
        return swallow(msg);
    }
    let (len, value) = match data_block(buf, line_len, vlen) {
        None => return Parsed::Incomplete,
        Some(Err(len)) => return error(len, err::BAD_CHUNK),
        Some(Ok(v)) => v,
    };
    match meta::parse(b"ms", &args, Some(value)) {
        Ok(m) => Parsed::Request { len, req: Request::Meta(m) },
        Err(msg) => error(len, msg),
    }
}
