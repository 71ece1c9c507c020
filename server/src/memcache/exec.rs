//! Runs the text protocol's requests against the store and writes
//! memcached's replies.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use super::backend::Error;
use bytes::BytesMut;
use dmkv_common::expiry::{RELATIVE_LIMIT_SECS, from_exptime};

use super::counters::count_store;
use super::meta::{self, error_line};
use super::service::{Service, VERSION};
use super::stats;
use super::text::{Request, StatsKind, Store, line, value};
use crate::kv::{Arith, Expiry, Mode, Write};

/// Why a memcached connection is closed.
#[derive(Debug)]
pub enum Close {
    /// The client said `quit`.
    Quit,
    /// A command before authenticating, or a failed authentication.
    Unauthenticated,
    /// Input memcached closes on (a line too long, an HTTP request).
    Protocol(&'static str),
}

impl std::fmt::Display for Close {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Close::Quit => f.write_str("quit"),
            Close::Unauthenticated => f.write_str("not authenticated"),
            Close::Protocol(msg) => f.write_str(msg),
        }
    }
}

/// What the connection does after a request.
#[derive(Debug)]
pub enum Step {
    /// The request is answered: take it off the input.
    Done,
    /// A get stopped part way (its reply filled the pending bytes): leave
    /// it in the input and go on from this key once the reply is written.
    Partial(usize),
    /// Answered; skip this many more input bytes (a refused data block).
    Swallow(usize),
    /// Answered; close the connection.
    Close(Close),
}

/// The answer to `cache_memlimit <megabytes>`, memcached's. dmkv's region
/// is mapped (and registered for one-sided reads) once, so it can neither
/// grow nor shrink: a limit at or above it is already met (OK), one below
/// it cannot be (memcached's answer when it cannot adjust, as with its
/// preallocated memory).
fn mem_limit(svc: &Service, megabytes: u32) -> &'static str {
    if megabytes < 8 {
        "MEMLIMIT_TOO_SMALL cannot set maxbytes to less than 8m"
    } else if megabytes > 1_000_000_000 {
        "MEMLIMIT_ADJUST_FAILED input value is megabytes not bytes"
    } else if u64::from(megabytes) << 20 >= svc.region_bytes() {
        "OK"
    } else {
        "MEMLIMIT_ADJUST_FAILED out of bounds or unable to adjust"
    }
}

/// Keys of a get looked up at once (on a cluster node, one request per
/// leader for them); the reply still goes out part by part.
pub const GET_PIECE: usize = 64;

/// Runs `req`, appending its reply to `out`. A get resumes at key `from`.
pub async fn execute(req: &Request<'_>, svc: &Service, out: &mut BytesMut, from: usize) -> Step {
    let (kv, c) = (&svc.kv(), &svc.counters);
    let reply = |out: &mut BytesMut, noreply: bool, s: &str| {
        if !noreply {
            line(out, s)
        }
    };
    match req {
        Request::Get { keys, cas, touch } => {
            let now = kv.now_ms();
            let mut i = from;
            while i < keys.len() {
                // Plain gets in pieces (one request per leader on a
                // cluster node); a gat touches key by key.
                let end = if touch.is_some() { i + 1 } else { (i + GET_PIECE).min(keys.len()) };
                let found = match touch {
                    Some(e) => {
                        c.cmd_touch.fetch_add(1, Relaxed);
                        vec![kv.touch(keys[i], from_exptime(*e, now)).await]
                    }
                    None => kv.get_many(&keys[i..end]).await,
                };
                for (j, found) in (i..end).zip(found) {
                    if j > from && out.len() >= crate::framed::MAX_PENDING_REPLY_BYTES {
                        return Step::Partial(j);
                    }
                    c.cmd_get.fetch_add(1, Relaxed);
                    match found {
                        Ok(Some(item)) => {
                            c.get_hits.fetch_add(1, Relaxed);
                            if touch.is_some() {
                                c.touch_hits.fetch_add(1, Relaxed);
                            }
                            value(out, keys[j], item.meta.flags, &item.value, cas.then_some(item.meta.version));
                        }
                        Ok(None) => {
                            c.get_misses.fetch_add(1, Relaxed);
                            if touch.is_some() {
                                c.touch_misses.fetch_add(1, Relaxed);
                            }
                        }
                        Err(e) => {
                            line(out, error_line(&e));
                            return Step::Done;
                        }
                    }
                }
                i = end;
            }
            line(out, "END");
        }
        Request::Store(s) => store(s, svc, out).await,
        Request::Delete { key, noreply } => match kv.delete(key, 0).await {
            Ok(true) => {
                c.delete_hits.fetch_add(1, Relaxed);
                reply(out, *noreply, "DELETED");
            }
            Ok(false) => {
                c.delete_misses.fetch_add(1, Relaxed);
                reply(out, *noreply, "NOT_FOUND");
            }
            Err(e) => line(out, error_line(&e)),
        },
        Request::Arith { key, delta, incr, noreply } => {
            let a = Arith { delta: *delta, incr: *incr, cas: 0, vivify: None, expiry: Expiry::Keep };
            let (hits, misses) = if *incr { (&c.incr_hits, &c.incr_misses) } else { (&c.decr_hits, &c.decr_misses) };
            match kv.arith(key, &a).await {
                Ok((n, _)) => {
                    hits.fetch_add(1, Relaxed);
                    reply(out, *noreply, &n.to_string());
                }
                Err(Error::NotFound) => {
                    misses.fetch_add(1, Relaxed);
                    reply(out, *noreply, "NOT_FOUND");
                }
                Err(e) => line(out, error_line(&e)),
            }
        }
        Request::Touch { key, exptime, noreply } => {
            c.cmd_touch.fetch_add(1, Relaxed);
            match kv.touch(key, from_exptime(*exptime, kv.now_ms())).await {
                Ok(Some(_)) => {
                    c.touch_hits.fetch_add(1, Relaxed);
                    reply(out, *noreply, "TOUCHED");
                }
                Ok(None) => {
                    c.touch_misses.fetch_add(1, Relaxed);
                    reply(out, *noreply, "NOT_FOUND");
                }
                Err(e) => line(out, error_line(&e)),
            }
        }
        Request::FlushAll { delay, noreply } => {
            c.cmd_flush.fetch_add(1, Relaxed);
            match kv.flush_all(Duration::from_secs(flush_delay(*delay, kv.now_ms()))).await {
                Ok(()) => reply(out, *noreply, "OK"),
                Err(e) => line(out, error_line(&e)),
            }
        }
        Request::Version => line(out, &format!("VERSION {}", VERSION)),
        Request::Verbosity { noreply } => reply(out, *noreply, "OK"),
        Request::Quit => return Step::Close(Close::Quit),
        Request::Stats(kind) => match kind {
            StatsKind::General => stats::general(svc, out),
            StatsKind::Empty => line(out, "END"),
            StatsKind::Reset => {
                c.reset();
                line(out, "RESET");
            }
            StatsKind::Items => stats::items(svc, out),
            StatsKind::CacheDump { class, limit } => stats::cachedump(svc, *class, *limit, out).await,
            StatsKind::Unknown => line(out, "ERROR"),
        },
        Request::MemLimit { megabytes, noreply } => reply(out, *noreply, mem_limit(svc, *megabytes)),
        Request::Close(why) => return Step::Close(Close::Protocol(why)),
        Request::Meta(m) => meta::execute(m, kv, c, out).await,
        Request::MetaNoop => line(out, "MN"),
        Request::Error { msg, swallow, close } => {
            line(out, msg);
            if *close {
                return Step::Close(Close::Protocol(msg));
            }
            if *swallow > 0 {
                return Step::Swallow(*swallow);
            }
        }
    }
    Step::Done
}

/// Seconds until a `flush_all` with `delay` takes effect: memcached reads
/// the delay by the exptime rules (above 30 days: a unix time).
pub fn flush_delay(delay: i64, now_ms: u64) -> u64 {
    let d = if delay > RELATIVE_LIMIT_SECS { delay - (now_ms / 1000) as i64 } else { delay };
    d.max(0) as u64
}

async fn store(s: &Store<'_>, svc: &Service, out: &mut BytesMut) {
    let (kv, c) = (&svc.kv(), &svc.counters);
    c.cmd_set.fetch_add(1, Relaxed);
    // Append and prepend keep the item's flags and expiry.
    let expiry = match s.mode {
        Mode::Append | Mode::Prepend => Expiry::Keep,
        _ => Expiry::At(from_exptime(s.exptime, kv.now_ms())),
    };
    let r = match s.cas {
        // No item has version 0 (the store's "unconditional"): memcached
        // answers such a cas by whether the item exists.
        Some(0) => match kv.get(s.key).await {
            Ok(Some(_)) => Err(Error::Exists),
            Ok(None) => Err(Error::NotFound),
            Err(e) => Err(e),
        },
        cas => {
            let w =
                Write { value: s.value, mode: s.mode, flags: s.flags, expiry, cas: cas.unwrap_or(0), vivify: false };
            kv.write(s.key, &w).await
        }
    };
    count_store(c, s.cas.is_some(), &r);
    let status = match r {
        Ok(_) => "STORED",
        Err(Error::NotStored) => "NOT_STORED",
        Err(Error::Exists) => "EXISTS",
        Err(Error::NotFound) => "NOT_FOUND",
        Err(e) => return line(out, error_line(&e)),
    };
    if !s.noreply {
        line(out, status);
    }
}
