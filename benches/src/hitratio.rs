//! Cache-aside hit ratio, the logic of `dmkv-hitratio`: a zipfian key
//! trace replayed against a cache (GET; on a miss, SET the value), with
//! hits counted over the measured part and per tenth of the run.
//!
//! The trace is YCSB's scrambled zipfian ([`ScrambledZipfian`]) and follows
//! from the seed alone, so two stores given the same settings see the same
//! keys in the same order and their hit ratios can be set side by side.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use bytes::BytesMut;
use dmkv_client::{ClientConfig, ReadPath};
use serde::Serialize;

use crate::generator::{Rng, ScrambledZipfian, ZIPFIAN_CONSTANT, derive, key_name};
use crate::memcached::{self, Memcached};
use crate::pipe::Protocol;

/// Most operations of a run: about an hour at the slowest loopback rates.
pub const MAX_OPS: u64 = 1_000_000_000;
/// Most keys: zeta for a constant other than 0.99 is summed once per key.
pub const MAX_KEYS: u64 = 100_000_000;
/// Largest value (memcached's default item limit).
pub const MAX_VALUE_SIZE: usize = 1 << 20;
/// Parts of the run reported on their own, to show the cache warming.
pub const PARTS: u64 = 10;
/// How long a memcached request may wait for its reply.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes read from a memcached socket per call.
const READ_CHUNK: usize = 64 * 1024;
/// Largest memcached reply accepted: one value and its header lines.
const MAX_REPLY: usize = MAX_VALUE_SIZE + 4 * memcached::MAX_LINE;
/// Stream of the seed the trace draws from (other uses of the seed get others).
const TRACE_STREAM: u64 = 0x0074_7261_6365; // "trace"

/// What to replay.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Settings {
    /// Distinct keys the trace draws from.
    pub keys: u64,
    /// Operations (GETs) in the trace.
    pub ops: u64,
    /// Bytes of each value.
    pub value_size: usize,
    /// Zipfian constant (YCSB's 0.99 by default).
    pub zipf: f64,
    /// Seed of the trace.
    pub seed: u64,
    /// Operations at the start whose GETs are not counted.
    pub warmup: u64,
}

impl Settings {
    /// Settings with the default warm-up (a fifth of the operations).
    pub fn new(keys: u64, ops: u64, value_size: usize, seed: u64) -> Settings {
        Settings { keys, ops, value_size, zipf: ZIPFIAN_CONSTANT, seed, warmup: ops / 5 }
    }

    /// Checks every bound; the message names the flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.keys == 0 || self.keys > MAX_KEYS {
            return Err(format!("--keys must be 1..={MAX_KEYS}, not {}", self.keys));
        }
        if self.ops == 0 || self.ops > MAX_OPS {
            return Err(format!("--ops must be 1..={MAX_OPS}, not {}", self.ops));
        }
        if self.value_size == 0 || self.value_size > MAX_VALUE_SIZE {
            return Err(format!("--value-size must be 1..={MAX_VALUE_SIZE}, not {}", self.value_size));
        }
        // Zipfian's alpha is 1 / (1 - theta): 1 and beyond are outside its formula.
        if !(self.zipf > 0.0 && self.zipf < 1.0) {
            return Err(format!("--zipf must be between 0 and 1 (exclusive), not {}", self.zipf));
        }
        if self.warmup >= self.ops {
            return Err(format!("--warmup ({}) must be less than --ops ({})", self.warmup, self.ops));
        }
        Ok(())
    }
}

/// The key numbers of a run, in order: `ops` draws over `0..keys`.
#[derive(Debug, Clone)]
pub struct Trace {
    chooser: ScrambledZipfian,
    rng: Rng,
    left: u64,
}

impl Trace {
    /// The trace of `s` (assumed valid).
    pub fn new(s: &Settings) -> Trace {
        let chooser = ScrambledZipfian::with_constant(0, s.keys.max(1) - 1, s.zipf);
        Trace { chooser, rng: Rng::new(derive(s.seed, TRACE_STREAM, 0)), left: s.ops }
    }
}

impl Iterator for Trace {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        Some(self.chooser.next(&mut self.rng))
    }
}

/// The value stored under key number `keynum`: recognisable, so a wrong
/// value read back is caught by its length or first byte.
pub fn value_of(keynum: u64, size: usize) -> Vec<u8> {
    vec![value_byte(keynum); size]
}

/// Every byte of key number `keynum`'s value.
pub fn value_byte(keynum: u64) -> u8 {
    b'a' + (keynum % 26) as u8
}

/// A cache as the replay sees it.
pub trait Cache {
    /// The stored value's first byte and length, or `None` on a miss.
    fn get(&mut self, key: &[u8]) -> Result<Option<(u8, usize)>, String>;
    /// Stores `value` under `key`.
    fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), String>;
}

/// GETs and their hits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub gets: u64,
    pub hits: u64,
}

impl Counts {
    /// hits / gets; `None` without GETs.
    pub fn ratio(&self) -> Option<f64> {
        (self.gets > 0).then(|| self.hits as f64 / self.gets as f64)
    }
}

/// One tenth of the run (warm-up included), operations `first..end`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Part {
    pub first: u64,
    pub end: u64,
    pub gets: u64,
    pub hits: u64,
    pub hit_ratio: Option<f64>,
}

/// What a replay measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Outcome {
    pub settings: Settings,
    /// GETs and hits after the warm-up.
    pub measured: Counts,
    /// measured hits / gets.
    pub hit_ratio: Option<f64>,
    /// SETs made (one per miss, warm-up included).
    pub sets: u64,
    /// Tenths of the whole run, warm-up included.
    pub parts: Vec<Part>,
}

/// Replays the trace of `s` against `cache`, cache-aside: a GET per
/// operation and, on a miss, a SET of the key's value. Stops at the first
/// error, naming the operation.
pub fn replay<C: Cache + ?Sized>(cache: &mut C, s: &Settings) -> Result<Outcome, String> {
    s.validate()?;
    let bounds: Vec<u64> = (0..=PARTS).map(|i| (s.ops as u128 * i as u128 / PARTS as u128) as u64).collect();
    let mut parts: Vec<Counts> = vec![Counts::default(); PARTS as usize];
    let mut measured = Counts::default();
    let mut sets = 0;
    let mut part = 0;
    for (op, keynum) in Trace::new(s).enumerate() {
        let op = op as u64;
        while op >= bounds[part + 1] {
            part += 1;
        }
        let key = key_name(keynum);
        let got = cache.get(key.as_bytes()).map_err(|e| format!("operation {op}: GET {key}: {e}"))?;
        let hit = match got {
            Some((first, len)) => {
                let want = value_byte(keynum);
                if len != s.value_size || first != want {
                    return Err(format!(
                        "operation {op}: GET {key}: wrong value ({len} B starting {first:#04x}; wanted {} B of {want:#04x})",
                        s.value_size
                    ));
                }
                true
            }
            None => {
                cache
                    .set(key.as_bytes(), &value_of(keynum, s.value_size))
                    .map_err(|e| format!("operation {op}: SET {key}: {e}"))?;
                sets += 1;
                false
            }
        };
        parts[part].gets += 1;
        parts[part].hits += hit as u64;
        if op >= s.warmup {
            measured.gets += 1;
            measured.hits += hit as u64;
        }
    }
    let parts = parts
        .iter()
        .enumerate()
        .map(|(i, c)| Part { first: bounds[i], end: bounds[i + 1], gets: c.gets, hits: c.hits, hit_ratio: c.ratio() })
        .collect();
    Ok(Outcome { settings: s.clone(), measured, hit_ratio: measured.ratio(), sets, parts })
}

fn percent(r: Option<f64>) -> String {
    r.map_or("–".to_string(), |r| format!("{:.2} %", r * 100.0))
}

/// The outcome as text: the measured hit ratio, then one line per tenth.
pub fn text(label: &str, o: &Outcome) -> String {
    let s = &o.settings;
    let mut out = format!(
        "{label}: {} keys, {} ops ({} warm-up), {} B values, zipfian {}, seed {}\n\
         hit ratio {} ({} hits / {} gets after warm-up), {} sets\n",
        s.keys,
        s.ops,
        s.warmup,
        s.value_size,
        s.zipf,
        s.seed,
        percent(o.hit_ratio),
        o.measured.hits,
        o.measured.gets,
        o.sets
    );
    for p in &o.parts {
        out.push_str(&format!("  ops {:>10}..{:<10} hit ratio {}\n", p.first, p.end, percent(p.hit_ratio)));
    }
    out
}

/// memcached's text protocol over one synchronous connection.
pub struct MemcachedCache {
    stream: TcpStream,
    buf: BytesMut,
}

impl MemcachedCache {
    /// Connects to `addr`, with [`IO_TIMEOUT`] on connecting and every reply.
    pub fn connect(addr: &str) -> Result<MemcachedCache, String> {
        let err = |e: &dyn std::fmt::Display| format!("cannot connect to {addr}: {e}");
        let sa = addr.to_socket_addrs().map_err(|e| err(&e))?.next().ok_or_else(|| err(&"no address"))?;
        let stream = TcpStream::connect_timeout(&sa, IO_TIMEOUT).map_err(|e| err(&e))?;
        stream.set_read_timeout(Some(IO_TIMEOUT)).map_err(|e| err(&e))?;
        stream.set_write_timeout(Some(IO_TIMEOUT)).map_err(|e| err(&e))?;
        // One small request at a time: Nagle would hold each for an ACK.
        stream.set_nodelay(true).map_err(|e| err(&e))?;
        Ok(MemcachedCache { stream, buf: BytesMut::with_capacity(READ_CHUNK) })
    }

    fn call(&mut self, request: &[u8]) -> Result<memcached::Reply, String> {
        self.stream.write_all(request).map_err(|e| e.to_string())?;
        let mut chunk = [0u8; READ_CHUNK];
        // Each pass reads at least one byte or fails, and the reply is
        // bounded by MAX_REPLY, so this ends.
        loop {
            if let Some(reply) = Memcached::parse(&mut self.buf)? {
                return Ok(reply);
            }
            if self.buf.len() > MAX_REPLY {
                return Err(format!("reply longer than {MAX_REPLY} bytes"));
            }
            let n = self.stream.read(&mut chunk).map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("connection closed".into());
            }
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

impl Cache for MemcachedCache {
    fn get(&mut self, key: &[u8]) -> Result<Option<(u8, usize)>, String> {
        match self.call(&memcached::encode_get(key))? {
            memcached::Reply::Values(v) if v.is_empty() => Ok(None),
            memcached::Reply::Values(v) if v.len() == 1 => Ok(Some((v[0].first().copied().unwrap_or(0), v[0].len()))),
            other => Err(format!("unexpected reply {other:?}")),
        }
    }

    fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        match self.call(&memcached::encode_set(key, value))? {
            memcached::Reply::Stored => Ok(()),
            other => Err(format!("not stored: {other:?}")),
        }
    }
}

/// dmkv through the SDK's blocking client (one pooled connection).
pub struct DmkvCache {
    client: dmkv_client::blocking::Client,
}

impl DmkvCache {
    /// Connects to `addr` with GETs going the `path` way.
    pub fn connect(addr: &str, path: ReadPath) -> Result<DmkvCache, String> {
        let cfg = ClientConfig::default().pool_size(1).read_path(path);
        let client = dmkv_client::blocking::Client::connect_with(addr, cfg).map_err(|e| e.to_string())?;
        Ok(DmkvCache { client })
    }
}

impl Cache for DmkvCache {
    fn get(&mut self, key: &[u8]) -> Result<Option<(u8, usize)>, String> {
        let v = self.client.get(key).map_err(|e| e.to_string())?;
        Ok(v.map(|v| (v.first().copied().unwrap_or(0), v.len())))
    }

    fn set(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        self.client.put(key, value).map(|_| ()).map_err(|e| e.to_string())
    }
}
