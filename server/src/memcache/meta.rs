//! memcached's meta protocol (mg, ms, md, ma, me): [`parse`] reads a meta
//! command's flags (pure), [`execute`] runs it against the store.
//!
//! Flags dmkv cannot honour are refused with `CLIENT_ERROR invalid flag`
//! rather than ignored: E (set the CAS value: versions are the store's),
//! I (invalidate/stale items), R (recache wins), x (keep the key, drop the
//! value). `h` and `l` answer 0 (dmkv does not track hits or access time);
//! `u` has nothing to skip (there is no LRU).

use std::borrow::Cow;
use std::sync::atomic::Ordering::Relaxed;

use super::backend::Error;
use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use dmkv_common::expiry::from_exptime;

use super::backend::McKv as Kv;
use super::counters::{Counters, count_store};
use super::reply::err;
use super::token::{MAX_KEY_LEN, number};
use crate::kv::{Arith, Expiry, Item, ItemMeta, Mode, Write};

/// Most flags on one meta command (memcached's MFLAG_MAX_OPT_LENGTH).
pub const MAX_FLAGS: usize = 20;
/// Longest opaque (`O`) token.
pub const MAX_OPAQUE_LEN: usize = 32;

/// Which meta command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmd {
    Get,
    Set,
    Delete,
    Arith,
    Debug,
}

/// One parsed meta command.
#[derive(Debug, PartialEq, Eq)]
pub struct Meta<'a> {
    pub cmd: Cmd,
    /// The key to use (base64-decoded with `b`).
    pub key: Cow<'a, [u8]>,
    /// The key as sent, returned by `k`.
    pub raw_key: &'a [u8],
    /// The flag tokens in the order sent: replies echo them in that order.
    pub flags: Vec<&'a [u8]>,
    /// ms: the data block.
    pub value: &'a [u8],
    pub quiet: bool,
    /// v: return the value.
    pub want_value: bool,
    /// C: compare CAS.
    pub cas: Option<u64>,
    /// T: TTL (exptime rules).
    pub ttl: Option<i64>,
    /// N: vivify on miss with this TTL.
    pub vivify: Option<i64>,
    /// F: client flags (ms).
    pub client_flags: u32,
    /// M: mode character (ms: E A P R S; ma: I + D -).
    pub mode: Option<u8>,
    /// D: delta (ma), default 1.
    pub delta: u64,
    /// J: initial value on vivify (ma).
    pub initial: u64,
}

/// The flags each command takes.
fn allowed(cmd: Cmd) -> &'static [u8] {
    match cmd {
        Cmd::Get => b"bcfhklOqstuvNTPL",
        Cmd::Set => b"bcCFkOqsSTMNPL",
        Cmd::Delete => b"bCkOqTPL",
        Cmd::Arith => b"bCNJDTMOqtcvkPL",
        Cmd::Debug => b"b",
    }
}

const BAD_TOKEN: &str = "CLIENT_ERROR bad token in command line format";

/// Parses `cmd` (mg, ms, md, ma, me) with its key and flags `args`; `value`
/// is ms's data block (ms's length token already removed).
pub fn parse<'a>(cmd: &[u8], args: &[&'a [u8]], value: Option<&'a [u8]>) -> Result<Meta<'a>, &'static str> {
    let cmd = match cmd {
        b"mg" => Cmd::Get,
        b"ms" => Cmd::Set,
        b"md" => Cmd::Delete,
        b"ma" => Cmd::Arith,
        b"me" => Cmd::Debug,
        _ => return Err(err::ERROR),
    };
    let Some((&raw_key, flags)) = args.split_first() else { return Err(err::BAD_FORMAT) };
    if raw_key.is_empty() || raw_key.len() > MAX_KEY_LEN {
        return Err(err::BAD_FORMAT);
    }
    if flags.len() > MAX_FLAGS {
        return Err("CLIENT_ERROR options flags are too long");
    }
    let mut m = Meta {
        cmd,
        key: Cow::Borrowed(raw_key),
        raw_key,
        flags: flags.to_vec(),
        value: value.unwrap_or_default(),
        quiet: false,
        want_value: false,
        cas: None,
        ttl: None,
        vivify: None,
        client_flags: 0,
        mode: None,
        delta: 1,
        initial: 0,
    };
    let mut seen = [false; 128];
    let mut base64 = false;
    for tok in flags {
        let (f, arg) = (tok[0], &tok[1..]);
        if f >= 128 || seen[f as usize] {
            return Err("CLIENT_ERROR duplicate flag");
        }
        seen[f as usize] = true;
        if !allowed(cmd).contains(&f) {
            return Err("CLIENT_ERROR invalid flag");
        }
        let exptime = |arg: &[u8]| number::<i32>(arg).map(i64::from).ok_or(BAD_TOKEN);
        match f {
            b'b' => base64 = true,
            b'q' => m.quiet = true,
            b'v' => m.want_value = true,
            b'C' => m.cas = Some(number::<u64>(arg).ok_or(BAD_TOKEN)?),
            b'T' => m.ttl = Some(exptime(arg)?),
            b'N' => m.vivify = Some(exptime(arg)?),
            b'F' => m.client_flags = number::<u32>(arg).ok_or(err::BAD_FORMAT)?,
            b'D' => m.delta = number::<u64>(arg).ok_or("CLIENT_ERROR invalid numeric delta value")?,
            b'J' => m.initial = number::<u64>(arg).ok_or("CLIENT_ERROR invalid numeric initial value")?,
            b'O' if arg.len() > MAX_OPAQUE_LEN => return Err("CLIENT_ERROR opaque token too long"),
            b'M' => {
                let mode = arg.first().map(u8::to_ascii_uppercase);
                let ok = match cmd {
                    Cmd::Set => matches!(mode, Some(b'E' | b'A' | b'P' | b'R' | b'S')),
                    _ => matches!(mode, Some(b'I' | b'+' | b'D' | b'-')),
                };
                if !ok || arg.len() != 1 {
                    return Err(match cmd {
                        Cmd::Set => "CLIENT_ERROR invalid mode for ms M token",
                        _ => "CLIENT_ERROR invalid mode for ma M token",
                    });
                }
                m.mode = mode;
            }
            _ => {}
        }
    }
    if base64 {
        match base64::engine::general_purpose::STANDARD.decode(raw_key) {
            Ok(k) if !k.is_empty() => m.key = Cow::Owned(k),
            _ => return Err("CLIENT_ERROR error decoding key"),
        }
    }
    Ok(m)
}

/// What a reply's flags may show about the item.
struct Shown {
    meta: ItemMeta,
    size: usize,
    now_secs: u64,
}

/// Appends the return flags of `m` that are in `which`, in request order.
fn ret_flags(out: &mut BytesMut, m: &Meta, which: &[u8], item: Option<&Shown>) {
    let wants_key = m.flags.iter().any(|t| t[0] == b'k');
    for tok in &m.flags {
        let f = tok[0];
        if !which.contains(&f) {
            continue;
        }
        let text = match (f, item) {
            (b'O', _) => {
                out.extend_from_slice(b" ");
                out.extend_from_slice(tok);
                continue;
            }
            (b'k', _) => {
                out.extend_from_slice(b" k");
                out.extend_from_slice(m.raw_key);
                continue;
            }
            // Says the returned key is base64.
            (b'b', _) if wants_key => " b".to_string(),
            (b'c', Some(i)) => format!(" c{}", i.meta.version),
            (b'f', Some(i)) => format!(" f{}", i.meta.flags),
            (b's', Some(i)) => format!(" s{}", i.size),
            (b't', Some(i)) => format!(" t{}", ttl(i.meta.expires_at, i.now_secs)),
            (b'h', Some(_)) => " h0".to_string(),
            (b'l', Some(_)) => " l0".to_string(),
            _ => continue,
        };
        out.extend_from_slice(text.as_bytes());
    }
}

/// Seconds an item has left: -1 for never.
fn ttl(expires_at: u32, now_secs: u64) -> i64 {
    if expires_at == 0 { -1 } else { (i64::from(expires_at) - now_secs as i64).max(0) }
}

/// The line of a store error; `None` for the codes with a status of their own.
pub fn error_line(e: &Error) -> &'static str {
    match e {
        Error::ValueTooLarge(_) => err::TOO_LARGE,
        Error::OutOfMemory | Error::IndexFull => err::NO_MEMORY,
        Error::NotNumeric => err::NON_NUMERIC,
        Error::EmptyKey | Error::KeyTooLarge(_) => err::BAD_FORMAT,
        Error::NotStored => "NS",
        Error::Exists => "EX",
        Error::NotFound => "NF",
        Error::Unavailable => err::UNAVAILABLE,
        Error::Uncertain => err::UNCERTAIN,
    }
}

fn status(out: &mut BytesMut, code: &str, m: &Meta, which: &[u8], item: Option<&Shown>) {
    out.extend_from_slice(code.as_bytes());
    ret_flags(out, m, which, item);
    out.extend_from_slice(b"\r\n");
}

/// Runs `m`, appending its reply (none for a quiet success) to `out`.
pub async fn execute(m: &Meta<'_>, kv: &Kv<'_>, c: &Counters, out: &mut BytesMut) {
    let now_ms = kv.now_ms();
    let now_secs = now_ms / 1000;
    let result = match m.cmd {
        Cmd::Get => get(m, kv, c, now_ms, out).await,
        Cmd::Set => set(m, kv, c, now_ms, out).await,
        Cmd::Delete => delete(m, kv, c, out).await,
        Cmd::Arith => arith(m, kv, c, now_ms, out).await,
        Cmd::Debug => match kv.get(&m.key).await {
            Ok(Some(i)) => {
                out.extend_from_slice(b"ME ");
                out.extend_from_slice(m.raw_key);
                let exp = ttl(i.meta.expires_at, now_secs);
                let rest = format!(" exp={exp} la=0 cas={} fetch=no cls=1 size={}\r\n", i.meta.version, i.value.len());
                out.extend_from_slice(rest.as_bytes());
                Ok(())
            }
            Ok(None) => {
                out.extend_from_slice(b"EN\r\n");
                Ok(())
            }
            Err(e) => Err(e),
        },
    };
    if let Err(e) = result {
        super::reply::line(out, error_line(&e));
    }
}

async fn get(m: &Meta<'_>, kv: &Kv<'_>, c: &Counters, now_ms: u64, out: &mut BytesMut) -> Result<(), Error> {
    c.cmd_get.fetch_add(1, Relaxed);
    let found = match m.ttl {
        Some(t) => {
            c.cmd_touch.fetch_add(1, Relaxed);
            let found = kv.touch(&m.key, from_exptime(t, now_ms)).await?;
            let hit = if found.is_some() { &c.touch_hits } else { &c.touch_misses };
            hit.fetch_add(1, Relaxed);
            found
        }
        None => kv.get(&m.key).await?,
    };
    let (item, won) = match (found, m.vivify) {
        (Some(i), _) => (i, false),
        (None, Some(n)) => {
            // A stub item for whoever wins the right to fill it (W); a
            // client that lost the race to create it sees the stub.
            let w = Write {
                value: b"",
                mode: Mode::Add,
                flags: 0,
                expiry: Expiry::At(from_exptime(n, now_ms)),
                cas: 0,
                vivify: false,
            };
            match kv.write(&m.key, &w).await {
                Ok(meta) => (Item { value: Bytes::new(), meta }, true),
                Err(Error::NotStored) => match kv.get(&m.key).await? {
                    Some(i) => (i, false),
                    None => return miss(m, c, out),
                },
                Err(e) => return Err(e),
            }
        }
        (None, None) => return miss(m, c, out),
    };
    c.get_hits.fetch_add(1, Relaxed);
    let shown = Shown { meta: item.meta, size: item.value.len(), now_secs: now_ms / 1000 };
    let value = m.want_value && m.cas != Some(item.meta.version);
    if value {
        out.extend_from_slice(format!("VA {}", item.value.len()).as_bytes());
    } else {
        out.extend_from_slice(b"HD");
    }
    ret_flags(out, m, b"bcfhklOst", Some(&shown));
    if won {
        out.extend_from_slice(b" W");
    }
    out.extend_from_slice(b"\r\n");
    if value {
        out.extend_from_slice(&item.value);
        out.extend_from_slice(b"\r\n");
    }
    Ok(())
}

fn miss(m: &Meta, c: &Counters, out: &mut BytesMut) -> Result<(), Error> {
    c.get_misses.fetch_add(1, Relaxed);
    if !m.quiet {
        out.extend_from_slice(b"EN\r\n");
    }
    Ok(())
}

async fn set(m: &Meta<'_>, kv: &Kv<'_>, c: &Counters, now_ms: u64, out: &mut BytesMut) -> Result<(), Error> {
    c.cmd_set.fetch_add(1, Relaxed);
    let mode = match m.mode {
        Some(b'E') => Mode::Add,
        Some(b'A') => Mode::Append,
        Some(b'P') => Mode::Prepend,
        Some(b'R') => Mode::Replace,
        _ => Mode::Set,
    };
    let concat = matches!(mode, Mode::Append | Mode::Prepend);
    // Append and prepend keep the item's expiry; a vivified one gets N's.
    let expiry = match (concat, m.vivify) {
        (true, Some(n)) => Expiry::At(from_exptime(n, now_ms)),
        (true, None) => Expiry::Keep,
        (false, _) => Expiry::At(m.ttl.map_or(0, |t| from_exptime(t, now_ms))),
    };
    let w = Write {
        value: m.value,
        mode,
        flags: m.client_flags,
        expiry,
        cas: m.cas.unwrap_or(0),
        vivify: concat && m.vivify.is_some(),
    };
    let r = kv.write(&m.key, &w).await;
    count_store(c, m.cas.is_some(), &r);
    match r {
        Ok(meta) => {
            if !m.quiet {
                let size = if concat {
                    kv.get(&m.key).await.ok().flatten().map_or(m.value.len(), |i| i.value.len())
                } else {
                    m.value.len()
                };
                let shown = Shown { meta, size, now_secs: now_ms / 1000 };
                status(out, "HD", m, b"bcOks", Some(&shown));
            }
            Ok(())
        }
        Err(e @ (Error::NotStored | Error::Exists | Error::NotFound)) => {
            status(out, error_line(&e), m, b"bOk", None);
            Ok(())
        }
        Err(e) => Err(e),
    }
}

async fn delete(m: &Meta<'_>, kv: &Kv<'_>, c: &Counters, out: &mut BytesMut) -> Result<(), Error> {
    match kv.delete(&m.key, m.cas.unwrap_or(0)).await {
        Ok(true) => {
            c.delete_hits.fetch_add(1, Relaxed);
            if !m.quiet {
                status(out, "HD", m, b"bOk", None);
            }
        }
        Ok(false) => {
            c.delete_misses.fetch_add(1, Relaxed);
            status(out, "NF", m, b"bOk", None);
        }
        Err(Error::Exists) => status(out, "EX", m, b"bOk", None),
        Err(e) => return Err(e),
    }
    Ok(())
}

async fn arith(m: &Meta<'_>, kv: &Kv<'_>, c: &Counters, now_ms: u64, out: &mut BytesMut) -> Result<(), Error> {
    let incr = matches!(m.mode, None | Some(b'I' | b'+'));
    let a = Arith {
        delta: m.delta,
        incr,
        cas: m.cas.unwrap_or(0),
        vivify: m.vivify.map(|n| (m.initial, from_exptime(n, now_ms))),
        expiry: m.ttl.map_or(Expiry::Keep, |t| Expiry::At(from_exptime(t, now_ms))),
    };
    let (hits, misses) = if incr { (&c.incr_hits, &c.incr_misses) } else { (&c.decr_hits, &c.decr_misses) };
    match kv.arith(&m.key, &a).await {
        Ok((n, meta)) => {
            hits.fetch_add(1, Relaxed);
            if m.quiet {
                return Ok(());
            }
            let digits = n.to_string();
            let shown = Shown { meta, size: digits.len(), now_secs: now_ms / 1000 };
            if m.want_value {
                out.extend_from_slice(format!("VA {}", digits.len()).as_bytes());
            } else {
                out.extend_from_slice(b"HD");
            }
            ret_flags(out, m, b"bcOkt", Some(&shown));
            out.extend_from_slice(b"\r\n");
            if m.want_value {
                out.extend_from_slice(digits.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
        }
        Err(Error::NotFound) => {
            misses.fetch_add(1, Relaxed);
            status(out, "NF", m, b"bOk", None);
        }
        Err(e @ (Error::Exists | Error::NotStored)) => status(out, error_line(&e), m, b"bOk", None),
        Err(e) => return Err(e),
    }
    Ok(())
}
