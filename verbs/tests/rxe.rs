//! RDMA READ tests against a real device (Soft-RoCE `rxe0` in the test VM, see tests/rdma-vm).
//!
//! Each test builds a "server" (a registered memmap2 region and a responder QP) and a "client"
//! (a local buffer and a requester QP) in one process, exchanges endpoints through their wire
//! encoding and connects them over the device's loopback.
//!
//! Without a device the tests skip with a message, unless `DMKV_RDMA_TESTS` is set: then a
//! missing device fails them, so a broken VM setup cannot pass silently.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dmkv_verbs::{
    Completion, Context, Endpoint, LocalBuffer, MAX_READS_PER_BATCH, MemoryRegion, QueuePair, ReadRequest, VerbsError,
    WC_STATUS_REM_ACCESS_ERR,
};
use memmap2::MmapMut;

const REGION_LEN: usize = 1 << 20;
const LOCAL_LEN: usize = 4 << 20;
const QP_DEPTH: u32 = 1024;
/// Generous: under software emulation a batch can take milliseconds.
const BATCH_TIMEOUT: Duration = Duration::from_secs(20);
const SOCKET_TIMEOUT: Duration = Duration::from_secs(30);

fn device() -> Option<Arc<Context>> {
    let required = std::env::var_os("DMKV_RDMA_TESTS").is_some_and(|v| !v.is_empty() && v != "0");
    match Context::open(None) {
        Ok(ctx) => {
            eprintln!("using {ctx:?}");
            Some(ctx)
        }
        Err(VerbsError::NoDevice) if !required => {
            eprintln!("SKIPPED: no RDMA device (set DMKV_RDMA_TESTS=1 to make this a failure)");
            None
        }
        Err(e) => panic!("cannot open an RDMA device: {e}"),
    }
}

/// splitmix64: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = Rng(seed);
    (0..len).map(|_| rng.next() as u8).collect()
}

/// The server side: a registered anonymous mapping. Field order matters: the MR is dropped
/// before the mapping it covers.
struct Region {
    mr: MemoryRegion,
    map: MmapMut,
}

impl Region {
    fn new(ctx: &Arc<Context>, seed: u64) -> Region {
        let mut map = MmapMut::map_anon(REGION_LEN).expect("mmap");
        map.copy_from_slice(&pattern(seed, REGION_LEN));
        // SAFETY: the mapping lives in the same struct and outlives the MR (field order).
        let mr = unsafe { MemoryRegion::register_remote_read(ctx, map.as_mut_ptr(), map.len()) }.expect("reg_mr");
        Region { mr, map }
    }
}

/// A connected requester (client) QP and its responder (server) peer.
fn connected_pair(ctx: &Arc<Context>) -> (QueuePair, QueuePair) {
    let mut server = QueuePair::create(ctx, QP_DEPTH).expect("server QP");
    let mut client = QueuePair::create(ctx, QP_DEPTH).expect("client QP");
    // Endpoints travel through the same encoding as over dmkv's TCP control connection.
    let server_ep = Endpoint::from_bytes(&server.endpoint().to_bytes()).unwrap();
    let client_ep = Endpoint::from_bytes(&client.endpoint().to_bytes()).unwrap();
    assert_eq!(server_ep, server.endpoint());
    server.connect(&client_ep).expect("server connect");
    client.connect(&server_ep).expect("client connect");
    (client, server)
}

fn deadline() -> Instant {
    Instant::now() + BATCH_TIMEOUT
}

/// `n` reads of random offsets and lengths (1..=max_len) from the region, packed into the
/// local buffer.
fn random_reads(rng: &mut Rng, region: &MemoryRegion, n: usize, max_len: u32) -> Vec<ReadRequest> {
    let mut local_offset = 0;
    (0..n)
        .map(|i| {
            let len = 1 + rng.below(max_len as u64) as u32;
            let off = rng.below((region.len() - len as usize + 1) as u64);
            let r = ReadRequest {
                wr_id: i as u64,
                remote_addr: region.addr() + off,
                rkey: region.rkey(),
                len,
                local_offset,
            };
            local_offset += len as usize;
            r
        })
        .collect()
}

fn check_reads(reads: &[ReadRequest], region: &Region, local: &LocalBuffer) {
    for r in reads {
        let off = (r.remote_addr - region.mr.addr()) as usize;
        let got = local.slice(r.local_offset, r.len as usize).expect("buffer idle");
        assert!(got == &region.map[off..off + r.len as usize], "read {} ({} bytes at {off}) differs", r.wr_id, r.len);
    }
}

/// Asserts a remote access error and returns the wr_id it names.
fn expect_access_error(result: Result<(), VerbsError>) -> u64 {
    match result {
        Err(VerbsError::Completion { wr_id, status, status_str }) => {
            eprintln!("expected completion error: wr {wr_id}: {status_str} ({status})");
            assert_eq!(status, WC_STATUS_REM_ACCESS_ERR, "{status_str}");
            wr_id
        }
        other => panic!("expected a remote access error, got {other:?}"),
    }
}

#[test]
fn read_batches_match_region() {
    let Some(ctx) = device() else { return };
    let region = Region::new(&ctx, 1);
    let mut local = MemoryRegion::register_local(&ctx, LOCAL_LEN).unwrap();
    let (mut client, _server) = connected_pair(&ctx);
    let mut rng = Rng(42);
    for round in 0..8 {
        let reads = random_reads(&mut rng, &region.mr, 64, 4096);
        local.as_mut_slice().unwrap().fill(0);
        client.read_batch(&reads, &mut local, deadline()).unwrap_or_else(|e| panic!("round {round}: {e}"));
        check_reads(&reads, &region, &local);
    }
    // The largest batch, and reads crossing page boundaries with multi-packet lengths (MTU 1024).
    let reads = random_reads(&mut rng, &region.mr, MAX_READS_PER_BATCH, 3 * 4096);
    client.read_batch(&reads, &mut local, deadline()).unwrap();
    check_reads(&reads, &region, &local);
    // The whole region in one read.
    let whole = ReadRequest {
        wr_id: 7,
        remote_addr: region.mr.addr(),
        rkey: region.mr.rkey(),
        len: REGION_LEN as u32,
        local_offset: 0,
    };
    client.read_batch(&[whole], &mut local, deadline()).unwrap();
    assert!(local.slice(0, REGION_LEN).unwrap() == &region.map[..]);
    assert_eq!(client.outstanding(), 0);
}

/// A batch whose last read is fenced reads what an unfenced one reads, for batches of one
/// (nothing to fence) up to the largest; the fence's ordering itself is the NIC's promise
/// (IBV_SEND_FENCE), which Soft-RoCE keeps by executing reads in order anyway.
#[test]
fn a_batch_with_its_last_read_fenced_reads_the_same_bytes() {
    let Some(ctx) = device() else { return };
    let region = Region::new(&ctx, 3);
    let mut local = MemoryRegion::register_local(&ctx, LOCAL_LEN).unwrap();
    let (mut client, _server) = connected_pair(&ctx);
    let mut rng = Rng(99);
    for n in [1, 2, 17, MAX_READS_PER_BATCH] {
        let reads = random_reads(&mut rng, &region.mr, n, 2048);
        local.as_mut_slice().unwrap().fill(0);
        let seq = client.post_reads_last_fenced(&reads, &mut local).unwrap();
        let end = deadline();
        loop {
            if let Some(done) = client.try_finish(seq).unwrap() {
                done.unwrap_or_else(|e| panic!("fenced batch of {n}: {e}"));
                break;
            }
            assert!(Instant::now() < end, "fenced batch of {n} did not complete");
            std::thread::yield_now();
        }
        check_reads(&reads, &region, &local);
    }
    assert_eq!(client.outstanding(), 0);
}

#[test]
fn pipelined_batches_via_poll() {
    let Some(ctx) = device() else { return };
    let region = Region::new(&ctx, 2);
    let (mut client, _server) = connected_pair(&ctx);
    let mut rng = Rng(7);
    // One buffer per batch: a buffer is busy until its batch completes.
    let mut bufs: Vec<LocalBuffer> = (0..4).map(|_| MemoryRegion::register_local(&ctx, 64 * 1024).unwrap()).collect();
    let mut batches = Vec::new();
    for (b, buf) in bufs.iter_mut().enumerate() {
        let mut reads = random_reads(&mut rng, &region.mr, 16, 1024);
        for r in &mut reads {
            r.wr_id += 100 * b as u64;
        }
        client.post_reads(&reads, buf).unwrap();
        // Completions are only consumed by poll, so the buffer stays busy until then.
        assert!(buf.is_busy());
        assert_eq!(buf.as_slice().err(), Some(VerbsError::BufferBusy));
        batches.push(reads);
    }
    let mut done: Vec<Completion> = Vec::new();
    let end = deadline();
    while done.len() < 64 {
        assert!(Instant::now() < end, "only {} of 64 completions before the deadline", done.len());
        client.poll(&mut done).unwrap();
    }
    assert!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    let mut ids: Vec<u64> = done.iter().map(|c| c.wr_id).collect();
    ids.sort_unstable();
    let mut want: Vec<u64> = batches.iter().flatten().map(|r| r.wr_id).collect();
    want.sort_unstable();
    assert_eq!(ids, want);
    for (reads, buf) in batches.iter().zip(&bufs) {
        assert!(!buf.is_busy());
        check_reads(reads, &region, buf);
    }
}

#[test]
fn invalid_requests_are_rejected_before_posting() {
    let Some(ctx) = device() else { return };
    let region = Region::new(&ctx, 3);
    let mut local = MemoryRegion::register_local(&ctx, 4096).unwrap();
    let read =
        ReadRequest { wr_id: 1, remote_addr: region.mr.addr(), rkey: region.mr.rkey(), len: 64, local_offset: 0 };

    let mut unconnected = QueuePair::create(&ctx, 4).unwrap();
    assert!(matches!(unconnected.post_reads(&[read], &mut local), Err(VerbsError::InvalidState(_))));
    assert!(matches!(QueuePair::create(&ctx, 0), Err(VerbsError::InvalidRequest(_))));

    let (mut client, _server) = connected_pair(&ctx);
    assert!(matches!(client.post_reads(&[], &mut local), Err(VerbsError::InvalidRequest(_))));
    let too_many = vec![read; MAX_READS_PER_BATCH + 1];
    assert!(matches!(client.post_reads(&too_many, &mut local), Err(VerbsError::InvalidRequest(_))));
    let outside = ReadRequest { local_offset: 4090, ..read };
    assert!(matches!(client.post_reads(&[outside], &mut local), Err(VerbsError::InvalidRequest(_))));
    let empty = ReadRequest { len: 0, ..read };
    assert!(matches!(client.post_reads(&[empty], &mut local), Err(VerbsError::InvalidRequest(_))));

    let mut small = QueuePair::create(&ctx, 4).unwrap();
    let mut peer = QueuePair::create(&ctx, 4).unwrap();
    small.connect(&peer.endpoint()).unwrap();
    peer.connect(&small.endpoint()).unwrap();
    assert!(matches!(small.post_reads(&[read; 5], &mut local), Err(VerbsError::QueueFull)));
    assert!(matches!(small.connect(&peer.endpoint()), Err(VerbsError::InvalidState(_))));
    // Nothing was posted by the rejected calls: the QP still works.
    small.read_batch(&[read; 4], &mut local, deadline()).unwrap();
    assert!(local.slice(0, 64).unwrap() == &region.map[..64]);
}

#[test]
fn wrong_rkey_fails_the_batch_and_a_fresh_qp_works() {
    let Some(ctx) = device() else { return };
    let region = Region::new(&ctx, 4);
    let mut local = MemoryRegion::register_local(&ctx, LOCAL_LEN).unwrap();
    let (mut client, _server) = connected_pair(&ctx);
    let good = ReadRequest {
        wr_id: 1,
        remote_addr: region.mr.addr() + 100,
        rkey: region.mr.rkey(),
        len: 256,
        local_offset: 0,
    };
    let bad = ReadRequest { wr_id: 2, rkey: region.mr.rkey() ^ 0x5a5a_0000, local_offset: 256, ..good };
    let failed = expect_access_error(client.read_batch(&[good, bad], &mut local, deadline()));
    assert_eq!(failed, bad.wr_id, "the error names the read with the wrong rkey");
    assert!(client.is_failed());
    assert_eq!(client.post_reads(&[good], &mut local), Err(VerbsError::QpFailed));
    assert!(!local.is_busy(), "a failed batch releases its buffer");

    // Every read of the failed batch is reported through poll as well.
    let (mut client, _server) = connected_pair(&ctx);
    client.post_reads(&[good, bad], &mut local).unwrap();
    let mut out = Vec::new();
    let end = deadline();
    while out.len() < 2 {
        assert!(Instant::now() < end, "no completion before the deadline");
        client.poll(&mut out).unwrap();
    }
    assert_eq!(out.iter().map(|c| c.wr_id).collect::<Vec<_>>(), vec![1, 2]);
    for c in out {
        let _ = expect_access_error(c.result);
    }

    let (mut client, _server) = connected_pair(&ctx);
    client.read_batch(&[good], &mut local, deadline()).unwrap();
    assert!(local.slice(0, 256).unwrap() == &region.map[100..356]);
}

#[test]
fn read_beyond_the_region_fails() {
    let Some(ctx) = device() else { return };
    let region = Region::new(&ctx, 5);
    let mut local = MemoryRegion::register_local(&ctx, 4096).unwrap();
    let (mut client, _server) = connected_pair(&ctx);
    let tail = ReadRequest {
        wr_id: 9,
        remote_addr: region.mr.addr() + REGION_LEN as u64 - 16,
        rkey: region.mr.rkey(),
        len: 64,
        local_offset: 0,
    };
    expect_access_error(client.read_batch(&[tail], &mut local, deadline()));

    let (mut client, _server) = connected_pair(&ctx);
    let last = ReadRequest { len: 16, ..tail };
    client.read_batch(&[last], &mut local, deadline()).unwrap();
    assert!(local.slice(0, 16).unwrap() == &region.map[REGION_LEN - 16..]);
}

#[test]
fn reregistering_gives_a_new_rkey_and_revokes_the_old_one() {
    let Some(ctx) = device() else { return };
    let Region { mr, mut map } = Region::new(&ctx, 6);
    let old_rkey = mr.rkey();
    mr.deregister().expect("dereg_mr");
    // SAFETY: `map` outlives `mr2` (dropped explicitly below).
    let mr2 = unsafe { MemoryRegion::register_remote_read(&ctx, map.as_mut_ptr(), map.len()) }.unwrap();
    assert_ne!(mr2.rkey(), old_rkey);
    let mut local = MemoryRegion::register_local(&ctx, 4096).unwrap();

    let (mut client, _server) = connected_pair(&ctx);
    let read = ReadRequest { wr_id: 3, remote_addr: mr2.addr(), rkey: old_rkey, len: 512, local_offset: 0 };
    expect_access_error(client.read_batch(&[read], &mut local, deadline()));

    let (mut client, _server) = connected_pair(&ctx);
    client.read_batch(&[ReadRequest { rkey: mr2.rkey(), ..read }], &mut local, deadline()).unwrap();
    assert!(local.slice(0, 512).unwrap() == &map[..512]);
    drop(mr2);
}

/// Server and client in two threads, endpoints and the region's address/rkey over real TCP.
#[test]
fn endpoints_over_tcp() {
    let Some(ctx) = device() else { return };
    const SEED: u64 = 77;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server_ctx = Arc::clone(&ctx);
    let server = std::thread::spawn(move || {
        let (mut sock, _) = listener.accept().unwrap();
        sock.set_read_timeout(Some(SOCKET_TIMEOUT)).unwrap();
        let region = Region::new(&server_ctx, SEED);
        let mut qp = QueuePair::create(&server_ctx, 16).unwrap();
        let mut hello = qp.endpoint().to_bytes().to_vec();
        hello.extend_from_slice(&region.mr.addr().to_le_bytes());
        hello.extend_from_slice(&region.mr.rkey().to_le_bytes());
        sock.write_all(&hello).unwrap();
        let mut peer = [0u8; Endpoint::WIRE_LEN];
        sock.read_exact(&mut peer).unwrap();
        qp.connect(&Endpoint::from_bytes(&peer).unwrap()).unwrap();
        sock.write_all(b"R").unwrap();
        // Keep QP and region alive until the client is done reading.
        let mut done = [0u8; 1];
        sock.read_exact(&mut done).unwrap();
        assert_eq!(&done, b"D");
    });

    let mut sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(SOCKET_TIMEOUT)).unwrap();
    let mut hello = [0u8; Endpoint::WIRE_LEN + 12];
    sock.read_exact(&mut hello).unwrap();
    let server_ep = Endpoint::from_bytes(&hello[..Endpoint::WIRE_LEN]).unwrap();
    let remote_addr = u64::from_le_bytes(hello[30..38].try_into().unwrap());
    let rkey = u32::from_le_bytes(hello[38..42].try_into().unwrap());
    let mut qp = QueuePair::create(&ctx, 16).unwrap();
    qp.connect(&server_ep).unwrap();
    sock.write_all(&qp.endpoint().to_bytes()).unwrap();
    let mut ready = [0u8; 1];
    sock.read_exact(&mut ready).unwrap();
    assert_eq!(&ready, b"R");

    let expected = pattern(SEED, REGION_LEN);
    let mut local = MemoryRegion::register_local(&ctx, 16 * 1024).unwrap();
    let mut rng = Rng(99);
    let reads: Vec<ReadRequest> = (0..16)
        .map(|i| {
            let off = rng.below((REGION_LEN - 1024) as u64);
            ReadRequest { wr_id: i, remote_addr: remote_addr + off, rkey, len: 1024, local_offset: i as usize * 1024 }
        })
        .collect();
    qp.read_batch(&reads, &mut local, deadline()).unwrap();
    for r in &reads {
        let off = (r.remote_addr - remote_addr) as usize;
        assert!(local.slice(r.local_offset, 1024).unwrap() == &expected[off..off + 1024]);
    }
    sock.write_all(b"D").unwrap();
    server.join().unwrap();
}

#[test]
fn open_by_name_and_bogus_name() {
    let Some(ctx) = device() else { return };
    let again = Context::open(Some(ctx.device_name())).unwrap();
    assert_eq!(again.device_name(), ctx.device_name());
    assert_eq!(Context::open(Some("no-such-device")).err(), Some(VerbsError::DeviceNotFound("no-such-device".into())));
    if ctx.is_roce() {
        let gid = ctx.gid();
        let v4_mapped = gid[..10].iter().all(|&b| b == 0) && gid[10..12] == [0xff, 0xff];
        eprintln!("gid index {} = {gid:02x?}", ctx.gid_index());
        // The test VM's rxe0 has ::ffff:10.0.2.15 at index 1.
        if ctx.device_name().starts_with("rxe") {
            assert!(v4_mapped, "expected the IPv4-mapped RoCE v2 GID");
        }
    }
}
