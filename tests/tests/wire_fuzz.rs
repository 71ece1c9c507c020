//! A bounded structured fuzz of a live `dmkvd` over the wire: valid-looking
//! frames with hostile field values on both listeners (RPC requests and
//! one-sided engine batches), pipelined many to a connection.
//!
//! The server may close a connection that sent a bad frame; it must never
//! panic (a panic in a connection's task would only kill that task, so its
//! stderr is searched), hang, or stop serving. At the end a fresh client
//! must PUT and GET, and the engine must serve a valid read.
//!
//! `DMKV_FUZZ_SEED` replays a run (the seed is printed); `DMKV_FUZZ_FRAMES`
//! sets how many frames are sent.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use dmkv_common::layout::{HEADER_ENCODED_LEN, HEADER_LEN, RegionHeader};
use dmkv_common::limits::{DEFAULT_MAX_FRAME_LEN, MAX_KEY_LEN, MAX_MULTI_GET_KEYS, MAX_VALUE_LEN};
use dmkv_common::onesided::{self, MAX_READ_LEN, MAX_READS_PER_BATCH, MAX_REQUEST_FRAME, ReadStatus, ReadWr};
use dmkv_common::proto::{self, Request, Response, request::Op, response::Result as R};
use dmkv_common::{PROTOCOL_VERSION, frame};
use dmkv_tests::ServerProcess;
use prost::Message;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

/// Frames sent when `DMKV_FUZZ_FRAMES` is not set: about half a minute in
/// a debug build on a 2-core machine.
const DEFAULT_FRAMES: u64 = 30_000;
/// A long run says how far it got this often (in frames).
const PROGRESS_EVERY: u64 = 1_000_000;
/// Longest the server may take to answer or close; more is a hang.
const IO_TIMEOUT: Duration = Duration::from_secs(60);
/// Most frames pipelined in one write.
const MAX_PIPELINE: usize = 64;
/// Keys PUT and read; few, so GETs hit and old items are retired.
const KEYS: u8 = 64;
/// Keys that may hold maximum-size values; few, so the region never fills.
const BIG_KEYS: u8 = 4;

/// Opens a connection to the RPC listener: the one place that knows how
/// an RPC connection is set up.
fn rpc_connect(addr: &str) -> TcpStream {
    plain_connect(addr)
}

/// Opens a connection to the one-sided engine and runs its handshake (the
/// server under test has no secrets, so the proof is zeros).
fn engine_connect(addr: &str) -> TcpStream {
    let (s, status) = dmkv_tests::engine_connect(addr, None);
    assert_eq!(status, dmkv_common::onesided::HANDSHAKE_OK, "engine handshake");
    s.set_nodelay(true).expect("nodelay");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("read timeout");
    s.set_write_timeout(Some(IO_TIMEOUT)).expect("write timeout");
    s
}

fn plain_connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_nodelay(true).expect("nodelay");
    s.set_read_timeout(Some(IO_TIMEOUT)).expect("read timeout");
    s.set_write_timeout(Some(IO_TIMEOUT)).expect("write timeout");
    s
}

/// Whether an IO error means the peer closed (allowed after a bad frame)
/// rather than that it stopped answering (a hang, never allowed).
fn closed_by_peer(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted)
}

/// What every connection observed; checked at the end.
#[derive(Default)]
struct Observed {
    hangs: AtomicU64,
    reply_bytes: AtomicU64,
}

/// One listener's current connection, reconnected when the server closes
/// it. A thread drains the replies so that the server never blocks on a
/// full socket while the fuzzer writes.
struct Link {
    addr: String,
    connect: fn(&str) -> TcpStream,
    conn: Option<(TcpStream, JoinHandle<()>)>,
    observed: Arc<Observed>,
    connections: u64,
    closed_by_server: u64,
}

impl Link {
    fn new(addr: &str, connect: fn(&str) -> TcpStream, observed: &Arc<Observed>) -> Link {
        Link {
            addr: addr.to_string(),
            connect,
            conn: None,
            observed: Arc::clone(observed),
            connections: 0,
            closed_by_server: 0,
        }
    }

    fn stream(&mut self) -> &mut TcpStream {
        if self.conn.is_none() {
            let s = (self.connect)(&self.addr);
            let mut rd = s.try_clone().expect("clone socket");
            let observed = Arc::clone(&self.observed);
            let drain = std::thread::spawn(move || {
                let mut buf = vec![0u8; 256 * 1024];
                loop {
                    match rd.read(&mut buf) {
                        Ok(0) => return,
                        Ok(n) => {
                            observed.reply_bytes.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        Err(e) if closed_by_peer(&e) => return,
                        Err(e) => {
                            eprintln!("wire fuzz: reading replies: {e}");
                            observed.hangs.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    }
                }
            });
            self.connections += 1;
            self.conn = Some((s, drain));
        }
        &mut self.conn.as_mut().expect("connected").0
    }

    /// Writes `bytes`; a connection the server closed is dropped (the next
    /// write reconnects).
    fn send(&mut self, bytes: &[u8]) {
        if let Err(e) = self.stream().write_all(bytes) {
            if !closed_by_peer(&e) {
                eprintln!("wire fuzz: writing frames: {e}");
                self.observed.hangs.fetch_add(1, Ordering::Relaxed);
            }
            self.closed_by_server += 1;
            self.close();
        }
    }

    /// Ends the connection: the server sees end of input, answers what it
    /// read and closes; waits until it has.
    fn close(&mut self) {
        if let Some((s, drain)) = self.conn.take() {
            let _ = s.shutdown(Shutdown::Write);
            drain.join().expect("drain thread");
        }
    }
}

/// The region as the server describes it, asked over a fresh connection.
fn region(rpc: &str) -> proto::RegionDescriptor {
    let mut s = rpc_connect(rpc);
    let mut buf = BytesMut::new();
    frame::encode(&Request { id: 1, op: Some(Op::RegionInfo(proto::RegionInfo {})) }, usize::MAX, &mut buf)
        .expect("encode");
    s.write_all(&buf).expect("send RegionInfo");
    let mut len = [0u8; 4];
    s.read_exact(&mut len).expect("RegionInfo reply");
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).expect("RegionInfo reply");
    match Response::decode(&body[..]).expect("a valid reply").result {
        Some(R::RegionInfo(r)) => r.regions.into_iter().next().expect("one region"),
        other => panic!("unexpected reply {other:?}"),
    }
}

/// One generated frame: its bytes, and whether the server will (or may)
/// close the connection after it, so that nothing is pipelined behind it.
struct Gen {
    bytes: Vec<u8>,
    last: bool,
    reregister: bool,
}

/// Generates hostile frames from a seeded RNG.
struct Fuzzer {
    rng: SmallRng,
    rkey: u64,
    region_len: u64,
}

impl Fuzzer {
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.rng.random_range(0..xs.len())]
    }

    fn bytes(&mut self, len: usize) -> Bytes {
        let mut v = vec![0u8; len];
        self.rng.fill_bytes(&mut v);
        v.into()
    }

    fn bytes_in(&mut self, lens: std::ops::Range<usize>) -> Bytes {
        let len = self.rng.random_range(lens);
        self.bytes(len)
    }

    fn key(&mut self) -> Bytes {
        match self.rng.random_range(0..100) {
            0..4 => Bytes::new(),
            4..6 => self.bytes(MAX_KEY_LEN),
            6..8 => self.bytes(MAX_KEY_LEN + 1),
            8..9 => self.bytes_in(MAX_KEY_LEN + 2..16 * 1024),
            9..20 => self.bytes_in(1..64),
            _ => Bytes::from(vec![b'k', self.rng.random_range(0..KEYS)]),
        }
    }

    /// A key for a PUT: hostile lengths as [`Fuzzer::key`], but from a
    /// bounded set of keys that can be stored, so that millions of PUTs
    /// overwrite rather than fill the region.
    fn put_key(&mut self) -> Bytes {
        let tag = self.rng.random_range(0..4u8);
        match self.rng.random_range(0..100) {
            0..4 => Bytes::new(),
            4..6 => Bytes::from(vec![tag; MAX_KEY_LEN]),
            6..8 => self.bytes(MAX_KEY_LEN + 1),
            8..9 => self.bytes_in(MAX_KEY_LEN + 2..16 * 1024),
            9..20 => Bytes::from(vec![tag; self.rng.random_range(1..64)]),
            _ => Bytes::from(vec![b'k', self.rng.random_range(0..KEYS)]),
        }
    }

    /// A key and a value for a PUT: the largest values only under the few
    /// big keys, so that live data stays far below the region's size.
    fn put(&mut self) -> proto::Put {
        let roll = self.rng.random_range(0..1000);
        if roll < 6 {
            let key = Bytes::from(vec![b'B', self.rng.random_range(0..BIG_KEYS)]);
            let len = self.pick(&[MAX_VALUE_LEN, MAX_VALUE_LEN - 1, MAX_VALUE_LEN / 2]);
            return proto::Put { key, value: self.bytes(len), ..Default::default() };
        }
        let value = match roll {
            6..10 => self.bytes(MAX_VALUE_LEN + 1),
            10..60 => Bytes::new(),
            60..100 => self.bytes_in(1000..20_000),
            _ => self.bytes_in(1..200),
        };
        proto::Put { key: self.put_key(), value, ..Default::default() }
    }

    fn op(&mut self) -> Option<Op> {
        Some(match self.rng.random_range(0..1000) {
            0..20 => return None,
            20..40 => Op::Hello(proto::Hello {
                protocol_version: self.pick(&[PROTOCOL_VERSION, 0, 2, u32::MAX]),
                client_name: "x".repeat(self.rng.random_range(0..2000)),
            }),
            40..300 => Op::Put(self.put()),
            300..600 => Op::Get(proto::Get { key: self.key() }),
            600..700 => Op::Delete(proto::Delete { key: self.key(), ..Default::default() }),
            700..900 => {
                let n = match self.rng.random_range(0..20) {
                    0 => 0,
                    1 => MAX_MULTI_GET_KEYS,
                    2 => MAX_MULTI_GET_KEYS + self.rng.random_range(1..500),
                    3 => self.rng.random_range(0..MAX_MULTI_GET_KEYS),
                    _ => self.rng.random_range(1..16),
                };
                // Big keys in a large multi-get would ask for gigabytes: a
                // few are enough to reach the reply limit.
                // keys mostly miss: replies stay small however many keys.
                let keys = (0..n)
                    .map(|i| match self.rng.random_range(0..100) {
                        0..10 if i < 3 => Bytes::from(vec![b'B', self.rng.random_range(0..BIG_KEYS)]),
                        _ if n <= 16 => self.key(),
                        0..2 => self.key(),
                        _ => self.bytes_in(1..8),
                    })
                    .collect();
                Op::MultiGet(proto::MultiGet { keys })
            }
            900..930 => Op::Stats(proto::Stats::default()),
            930..960 => Op::RegionInfo(proto::RegionInfo {}),
            960..999 => Op::RdmaConnect(proto::RdmaConnect { endpoint: self.bytes_in(0..300) }),
            _ => Op::Reregister(proto::Reregister {}),
        })
    }

    /// Appends an unknown field of a random wire type (a newer client's).
    fn unknown_field(&mut self, out: &mut Vec<u8>) {
        let field = self.rng.random_range(20u32..(1 << 29));
        let wire_type = self.pick(&[0u32, 1, 2, 5]);
        prost::encoding::encode_varint(u64::from(field << 3 | wire_type), out);
        match wire_type {
            0 => prost::encoding::encode_varint(self.rng.random(), out),
            1 => out.extend_from_slice(&self.rng.random::<u64>().to_le_bytes()),
            2 => {
                let n = self.rng.random_range(0..100);
                prost::encoding::encode_varint(n as u64, out);
                out.extend_from_slice(&self.bytes(n));
            }
            _ => out.extend_from_slice(&self.rng.random::<u32>().to_le_bytes()),
        }
    }

    /// Frames `body` with a correct prefix; `last` if the server will
    /// refuse it (too large, or not a `Request`).
    fn rpc_framed(body: Vec<u8>, reregister: bool) -> Gen {
        let last = body.len() > DEFAULT_MAX_FRAME_LEN || Request::decode(&body[..]).is_err();
        let mut bytes = Vec::with_capacity(4 + body.len());
        bytes.put_u32_le(body.len() as u32);
        bytes.extend_from_slice(&body);
        Gen { bytes, last, reregister: reregister && !last }
    }

    fn rpc_frame(&mut self) -> Gen {
        let any = self.rng.random();
        let id = self.pick(&[0, 1, u64::MAX, any]);
        let req = Request { id, op: self.op() };
        let reregister = matches!(req.op, Some(Op::Reregister(_)));
        let mut body = req.encode_to_vec();
        match self.rng.random_range(0..100) {
            // Valid frames with hostile values.
            0..80 => Self::rpc_framed(body, reregister),
            // Unknown fields, before or after the known ones.
            80..88 => {
                let mut extra = Vec::new();
                for _ in 0..self.rng.random_range(1..4) {
                    self.unknown_field(&mut extra);
                }
                if self.rng.random_bool(0.5) {
                    body.extend_from_slice(&extra);
                } else {
                    extra.extend_from_slice(&body);
                    body = extra;
                }
                Self::rpc_framed(body, reregister)
            }
            // A few bytes flipped, cut or added.
            88..94 => {
                for _ in 0..self.rng.random_range(1..4) {
                    if body.is_empty() {
                        break;
                    }
                    let at = self.rng.random_range(0..body.len());
                    match self.rng.random_range(0..3) {
                        0 => body[at] = self.rng.random(),
                        1 => body.truncate(at),
                        _ => body.insert(at, self.rng.random()),
                    }
                }
                Self::rpc_framed(body, false)
            }
            // Garbage.
            94..95 => Self::rpc_framed(self.bytes_in(0..64).to_vec(), false),
            // Wrong length prefix: the rest of the stream is out of step.
            95..97 => {
                let len = body.len() as u32;
                let wrong = self.pick(&[0, len.saturating_sub(1), len / 2, len + 1, len + 100]);
                let mut bytes = wrong.to_le_bytes().to_vec();
                bytes.extend_from_slice(&body);
                Gen { bytes, last: true, reregister: false }
            }
            // A length prefix beyond the largest frame.
            97..98 => {
                let len = self.pick(&[DEFAULT_MAX_FRAME_LEN as u32 + 1, u32::MAX, 1 << 30]);
                let mut bytes = len.to_le_bytes().to_vec();
                bytes.extend_from_slice(&body[..body.len().min(16)]);
                Gen { bytes, last: true, reregister: false }
            }
            // A frame cut short, then the connection ends.
            _ => {
                let mut full = Self::rpc_framed(body, false).bytes;
                full.truncate(self.rng.random_range(0..full.len()));
                Gen { bytes: full, last: true, reregister: false }
            }
        }
    }

    /// One read with hostile fields. In a batch of many reads (`many`)
    /// successful reads stay short, so replies stay far below the batch
    /// limit: its checks are fuzzed by the few long reads of small batches.
    fn read(&mut self, many: bool) -> ReadWr {
        let len = match self.rng.random_range(0..1000) {
            0..50 => 0,
            50..100 => 1,
            100..400 => 64,
            400..600 if many => 8,
            400..600 => self.rng.random_range(0..4096),
            600..602 if !many => MAX_READ_LEN,
            602..650 => MAX_READ_LEN + 1,
            650..700 => u32::MAX,
            700..702 if !many => self.rng.random_range(4096..MAX_READ_LEN),
            _ => 8,
        };
        let end = self.region_len;
        let l = u64::from(len);
        let offset = match self.rng.random_range(0..13) {
            0 => 0,
            1 => HEADER_LEN as u64,
            2 => end.wrapping_sub(l),
            3 => end.wrapping_sub(l).wrapping_add(1),
            4 => end,
            5 => end - 1,
            6 => u64::MAX,
            7 => (u64::MAX - l).wrapping_add(1),
            8 => u64::MAX - l,
            9 => self.rng.random(),
            _ => self.rng.random_range(0..end),
        };
        let rkey = match self.rng.random_range(0..20) {
            0 => 0,
            1 => self.rkey ^ 1,
            2 => u64::MAX,
            3 => self.rng.random(),
            _ => self.rkey,
        };
        ReadWr { rkey, offset, len }
    }

    fn engine_frame(&mut self) -> Gen {
        let count = match self.rng.random_range(0..100) {
            0..5 => 0,
            5..8 => MAX_READS_PER_BATCH,
            8..12 => self.rng.random_range(0..=MAX_READS_PER_BATCH),
            _ => self.rng.random_range(1..8),
        };
        let wrs: Vec<ReadWr> = (0..count).map(|_| self.read(count > 8)).collect();
        let id = self.rng.random();
        let mut frame = BytesMut::new();
        onesided::encode_request(id, &wrs, &mut frame);
        let mut bytes = frame.to_vec();
        let body_len = bytes.len() - 4;
        let set_len = |b: &mut Vec<u8>, len: u32| b[..4].copy_from_slice(&len.to_le_bytes());
        match self.rng.random_range(0..100) {
            0..85 => Gen { bytes, last: false, reregister: false },
            // A count above the limit, or one that does not match the body.
            85..91 => {
                let wrong = self.pick(&[
                    MAX_READS_PER_BATCH as u16 + 1,
                    u16::MAX,
                    (count as u16).wrapping_add(1),
                    (count as u16).wrapping_sub(1),
                ]);
                bytes[12..14].copy_from_slice(&wrong.to_le_bytes());
                Gen { bytes, last: true, reregister: false }
            }
            // A body shorter than its header, or a read cut in half.
            91..94 => {
                let cut = self.rng.random_range(0..body_len.min(14));
                bytes.truncate(4 + cut);
                set_len(&mut bytes, cut as u32);
                Gen { bytes, last: true, reregister: false }
            }
            // Wrong length prefix: the stream is out of step.
            94..97 => {
                let wrong = self.pick(&[0, body_len as u32 - 1, body_len as u32 + 1, body_len as u32 + 20]);
                set_len(&mut bytes, wrong);
                Gen { bytes, last: true, reregister: false }
            }
            // A length prefix beyond the largest request.
            97..99 => {
                set_len(&mut bytes, self.pick(&[MAX_REQUEST_FRAME as u32 + 1, u32::MAX]));
                Gen { bytes, last: true, reregister: false }
            }
            // Cut short, then the connection ends.
            _ => {
                bytes.truncate(self.rng.random_range(0..bytes.len()));
                Gen { bytes, last: true, reregister: false }
            }
        }
    }
}

/// Reads the region header through the engine: it still serves a valid read.
fn engine_reads_header(engine: &str, rkey: u64) -> RegionHeader {
    let mut s = engine_connect(engine);
    let mut out = BytesMut::new();
    onesided::encode_request(7, &[ReadWr { rkey, offset: 0, len: HEADER_ENCODED_LEN as u32 }], &mut out);
    s.write_all(&out).expect("send read");
    let mut len = [0u8; 4];
    s.read_exact(&mut len).expect("engine reply");
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).expect("engine reply");
    let reply = onesided::decode_reply(&body).expect("a valid reply");
    assert_eq!(reply.batch_id, 7);
    let (status, range) = reply.results[0].clone();
    assert_eq!(status, ReadStatus::Success);
    RegionHeader::decode(&body[range]).expect("the region header")
}

#[test]
fn live_server_survives_hostile_frames() {
    let seed = std::env::var("DMKV_FUZZ_SEED").ok().map(|s| s.parse::<u64>().expect("DMKV_FUZZ_SEED: a u64"));
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_nanos() as u64
    });
    let frames: u64 = std::env::var("DMKV_FUZZ_FRAMES")
        .ok()
        .map(|s| s.parse().expect("DMKV_FUZZ_FRAMES: a count"))
        .unwrap_or(DEFAULT_FRAMES);
    println!("wire fuzz: seed {seed} (DMKV_FUZZ_SEED={seed} replays), {frames} frames");

    let log_path = std::env::temp_dir().join(format!("dmkv-wire-fuzz-{}-{seed}.log", std::process::id()));
    let log = std::fs::File::create(&log_path).expect("server log");
    let mut srv = ServerProcess::start_logged(
        &[],
        "127.0.0.1:0",
        &["--memory", "128MiB", "--grace-ms", "20", "--no-shm"],
        Some(log),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let engine_addr = srv.endpoint("engine").expect("the engine is offered").to_string();
    let d = region(&srv.rpc);
    let mut fz = Fuzzer { rng: SmallRng::seed_from_u64(seed), rkey: d.rkey, region_len: d.length };

    let observed = Arc::new(Observed::default());
    let mut rpc = Link::new(&srv.rpc, rpc_connect, &observed);
    let mut engine = Link::new(&engine_addr, engine_connect, &observed);
    let (mut tried, mut rpc_frames, mut engine_frames) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    let mut buf = Vec::new();
    while tried < frames {
        let to_engine = fz.rng.random_bool(0.4);
        let n = fz.rng.random_range(1..=MAX_PIPELINE).min((frames - tried) as usize);
        buf.clear();
        let before = tried;
        let (mut last, mut reregister) = (false, false);
        for _ in 0..n {
            let g = if to_engine { fz.engine_frame() } else { fz.rpc_frame() };
            buf.extend_from_slice(&g.bytes);
            tried += 1;
            *(if to_engine { &mut engine_frames } else { &mut rpc_frames }) += 1;
            reregister |= g.reregister;
            if g.last {
                last = true;
                break;
            }
        }
        let link = if to_engine { &mut engine } else { &mut rpc };
        link.send(&buf);
        if last || reregister {
            link.close();
        }
        if tried / PROGRESS_EVERY != before / PROGRESS_EVERY {
            println!("wire fuzz: {tried} frames, {:.0} frames/s", tried as f64 / started.elapsed().as_secs_f64());
        }
        if reregister {
            // The rkey changed: valid reads need the new one.
            fz.rkey = region(&srv.rpc).rkey;
        }
    }
    rpc.close();
    engine.close();
    let took = started.elapsed();
    println!(
        "wire fuzz: {tried} frames ({rpc_frames} rpc, {engine_frames} engine) in {:.1} s, {:.0} frames/s; \
         {} connections ({} closed under a write); {} MB of replies; seed {seed}",
        took.as_secs_f64(),
        tried as f64 / took.as_secs_f64(),
        rpc.connections + engine.connections,
        rpc.closed_by_server + engine.closed_by_server,
        observed.reply_bytes.load(Ordering::Relaxed) >> 20,
    );

    assert!(srv.is_running(), "dmkvd exited during the fuzz; its log: {}", log_path.display());
    assert_eq!(observed.hangs.load(Ordering::Relaxed), 0, "the server stopped answering (seed {seed})");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let c = dmkv_client::Client::connect(&srv.rpc).await.expect("a fresh client connects");
        c.put("after-fuzz", "still here").await.expect("PUT after the fuzz");
        assert_eq!(c.get("after-fuzz").await.expect("GET").as_deref(), Some(&b"still here"[..]));
    });
    let rkey = region(&srv.rpc).rkey;
    assert_eq!(engine_reads_header(&engine_addr, rkey).region_len, d.length);
    srv.stop();
    let log = std::fs::read_to_string(&log_path).expect("server log");
    let panics: Vec<&str> = log.lines().filter(|l| l.contains("panicked")).take(5).collect();
    assert!(panics.is_empty(), "dmkvd panicked (seed {seed}, log {}):\n{}", log_path.display(), panics.join("\n"));
    let _ = std::fs::remove_file(&log_path);
}
