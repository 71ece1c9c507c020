//! The shared-memory transport against hostile same-host clients: the
//! region cannot be written through the handed-over descriptor, a region
//! written behind the server's back does not crash it or stop its writes,
//! and the handoff wants a proof and the current rkey.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dmkv_client::onesided::shm::receive_descriptor;
use dmkv_client::{Client, ClientConfig, ClientError, ReadPath, Transport};
use dmkv_common::auth::{Keys, PROOF_LEN, Purpose, Token};
use dmkv_common::shm_handoff as handoff;
use dmkv_server::{Config, Server};
use dmkv_tests::ServerProcess;
use tokio::sync::oneshot;

/// EPERM: what the kernel answers a write to a sealed memfd.
const EPERM: i32 = 1;

fn cfg(path: ReadPath, transport: Option<Transport>, token: Option<&Token>) -> ClientConfig {
    ClientConfig::default().read_path(path).transport(transport).pool_size(1).token(token.cloned().map(Arc::new))
}

/// An in-process server with its own handoff socket; stops when dropped.
struct InProcess {
    rpc: String,
    shared: Arc<dmkv_server::service::Shared>,
    socket: PathBuf,
    _stop: oneshot::Sender<()>,
}

async fn start(name: &str, auth: Keys) -> InProcess {
    let socket = std::env::temp_dir().join(format!("dmkv-shmsec-{}-{name}.sock", std::process::id()));
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        memory: 16 << 20,
        buckets: 1 << 12,
        threads: 1,
        shm_socket: Some(socket.clone()),
        auth: Arc::new(auth),
        ..Config::default()
    };
    let server = Server::bind(&config).await.unwrap();
    let rpc = server.local_addr().to_string();
    let shared = server.shared_for_tests();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(server.serve(async {
        let _ = stopped.await;
    }));
    InProcess { rpc, shared, socket, _stop: stop }
}

/// This test process is the hostile client: it gets the descriptor by a
/// real handoff from a separate dmkvd and tries every way to write it.
#[tokio::test]
async fn a_client_that_reopens_the_region_read_write_gets_eperm() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let c = Client::connect_with(&srv.rpc, cfg(ReadPath::Rpc, None, None)).await.unwrap();
    c.put("k", "v").await.unwrap();
    let info = c.region_info_full().await.unwrap();
    let d = &info.regions[0];
    let (_conn, fd, len) =
        receive_descriptor(&info.shm_socket, d.rkey, d.epoch, None, Duration::from_secs(10)).await.unwrap();
    assert_eq!(len, d.length);
    // The descriptor itself is read-only.
    assert!((&fd).write(b"x").is_err());
    // Reopening it read-write succeeds (memfd inodes are mode 0777)...
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let rw = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    // ...but the seals refuse every way to write through it.
    let err = (&rw).write(b"garbage!").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(EPERM), "write(2): {err}");
    let err = std::os::unix::fs::FileExt::write_at(&rw, &[0xff; 8], 4096).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(EPERM), "pwrite(2): {err}");
    let err = memmap2::MmapOptions::new().len(len as usize).map_raw(&rw).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(EPERM), "mmap(PROT_WRITE, MAP_SHARED): {err}");
    assert!(rw.set_len(len / 2).is_err(), "shrinking the region must fail");
    assert!(rw.set_len(len * 2).is_err(), "growing the region must fail");
    // Nothing changed: the server still serves the value, one-sided too.
    let shm = Client::connect_with(&srv.rpc, cfg(ReadPath::OneSided, Some(Transport::Shm), None)).await.unwrap();
    assert_eq!(shm.get("k").await.unwrap().unwrap(), "v".as_bytes());
    assert_eq!(c.get("k").await.unwrap().unwrap(), "v".as_bytes());
}

fn value(i: u32, round: u32) -> String {
    format!("value-{i}-{round}-").repeat(i as usize % 7 + 1)
}

/// The reproduction, through a test hook since the seals now stop
/// clients: slot words with flipped offset bits (and garbled items) used to
/// panic the server's workers and poison its writer lock for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scribbled_region_does_not_crash_the_server_or_stop_its_writes() {
    let srv = start("scribble", Keys::default()).await;
    let rpc = Client::connect_with(&srv.rpc, cfg(ReadPath::Rpc, None, None)).await.unwrap();
    let auto = Client::connect_with(&srv.rpc, cfg(ReadPath::Auto, None, None)).await.unwrap();
    for i in 0..400u32 {
        rpc.put(format!("k{i}"), value(i, 0)).await.unwrap();
    }
    // k0..k29: slot words scribbled (and every empty slot of their
    // buckets); k20..k29: their items' bytes too, so those values are gone.
    let store = srv.shared.node.single().expect("a single node").store();
    for i in 0..30u32 {
        assert!(store.scribble_for_tests(format!("k{i}").as_bytes(), i >= 20));
    }
    let lost = |i: u32| (20..30).contains(&i);
    for (name, c) in [("rpc", &rpc), ("auto", &auto)] {
        for i in 0..400u32 {
            let got = c.get(format!("k{i}")).await.unwrap_or_else(|e| panic!("{name} GET k{i}: {e}"));
            let want = (!lost(i)).then(|| value(i, 0));
            assert_eq!(got.as_deref(), want.as_deref().map(str::as_bytes), "{name} GET k{i}");
        }
    }
    // Every write succeeds: scribbled keys, fresh keys, deletes.
    for i in 0..30u32 {
        rpc.put(format!("k{i}"), value(i, 1)).await.unwrap_or_else(|e| panic!("PUT k{i}: {e}"));
    }
    for i in 1000..1200u32 {
        rpc.put(format!("k{i}"), value(i, 0)).await.unwrap_or_else(|e| panic!("PUT k{i}: {e}"));
    }
    for i in (0..30u32).step_by(3) {
        assert!(rpc.delete(format!("k{i}")).await.unwrap(), "DELETE k{i}");
    }
    let stats = rpc.stats().await.unwrap();
    assert!(stats["foreign_slots"] >= 30, "{stats:?}");
    assert!(stats["corrupt_reads"] >= 10, "{stats:?}");
    assert_eq!(stats["items"], 400 + 200 - 10, "{stats:?}");
    // The writes restored the region's index: a one-sided reader that only
    // attaches now finds every value without asking the server.
    let shm = Client::connect_with(&srv.rpc, cfg(ReadPath::OneSided, Some(Transport::Shm), None)).await.unwrap();
    for i in (0..400u32).chain(1000..1200) {
        let want = match i {
            _ if i < 30 && i % 3 == 0 => None,
            _ if i < 30 => Some(value(i, 1)),
            _ => Some(value(i, 0)),
        };
        for (name, c) in [("rpc", &rpc), ("shm", &shm)] {
            let got = c.get(format!("k{i}")).await.unwrap_or_else(|e| panic!("{name} GET k{i}: {e}"));
            assert_eq!(got.as_deref(), want.as_deref().map(str::as_bytes), "{name} GET k{i} after the writes");
        }
    }
    assert_eq!(shm.read_stats().fallbacks, 0, "{:?}", shm.read_stats());
}

/// One raw handoff: the status the server answers. `prove` makes the proof
/// from the greeting's nonce.
async fn raw_handoff(socket: &PathBuf, prove: impl Fn(&[u8]) -> [u8; PROOF_LEN], rkey: u64, epoch: u64) -> u8 {
    // Blocking socket calls, off the runtime's task threads: the server
    // runs on them.
    tokio::task::block_in_place(|| {
        let mut s = UnixStream::connect(socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut greeting = [0u8; handoff::GREETING_LEN];
        s.read_exact(&mut greeting).unwrap();
        let (required, nonce) = handoff::decode_greeting(&greeting).unwrap();
        assert!(required, "the server has secrets: it must ask for a proof");
        s.write_all(&handoff::encode_request(&prove(&nonce), rkey, epoch)).unwrap();
        let mut reply = [0u8; handoff::REPLY_LEN];
        s.read_exact(&mut reply).unwrap();
        handoff::decode_reply(&reply).0
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shm_handoff_wants_a_proof_and_the_current_rkey() {
    let data = Token::new("shm-data-secret-0123456789").unwrap();
    let admin = Token::new("shm-admin-secret-0123456789").unwrap();
    let wrong = Token::new("not-the-secret-0123456789").unwrap();
    let srv = start("auth", Keys::new(vec![data.clone()], vec![admin.clone()]).unwrap()).await;
    let c = Client::connect_with(&srv.rpc, cfg(ReadPath::Rpc, None, Some(&data))).await.unwrap();
    c.put("k", "v").await.unwrap();
    let info = c.region_info_full().await.unwrap();
    let (rkey, epoch) = (info.regions[0].rkey, info.regions[0].epoch);
    let sock = &srv.socket;
    let shm = |t: &Token| {
        let t = t.clone();
        move |nonce: &[u8]| t.prove(Purpose::Shm, nonce)
    };

    // The right secrets and rkey: the descriptor, and a client that reads.
    assert_eq!(raw_handoff(sock, shm(&data), rkey, epoch).await, handoff::STATUS_OK);
    assert_eq!(raw_handoff(sock, shm(&admin), rkey, epoch).await, handoff::STATUS_OK, "admin may read too");
    let reader =
        Client::connect_with(&srv.rpc, cfg(ReadPath::OneSided, Some(Transport::Shm), Some(&data))).await.unwrap();
    assert_eq!(reader.get("k").await.unwrap().unwrap(), "v".as_bytes());
    assert_eq!(c.stats().await.unwrap()["gets"], 0, "the GET was one-sided");
    // A client without a token gets nowhere (its RPC connection is refused
    // first; the raw handoffs below show the socket refuses on its own).
    let err = Client::connect_with(&srv.rpc, cfg(ReadPath::OneSided, Some(Transport::Shm), None)).await.err();
    match err {
        Some(ClientError::OneSidedUnavailable(m)) => assert!(m.contains("requires authentication"), "{m}"),
        Some(e @ ClientError::Server { .. }) => assert_eq!(e.code(), Some(dmkv_client::ErrorCode::Unauthenticated)),
        other => panic!("attached without a token: {other:?}"),
    }

    // Failures, each counted against this uid (MAX_FAILURES = 5):
    // 1. no proof (zeros), 2. another secret, 3. the right secret's proof
    // for another listener, 4. a guessed rkey with the right proof.
    assert_eq!(raw_handoff(sock, |_| [0; PROOF_LEN], rkey, epoch).await, handoff::STATUS_UNAUTHENTICATED);
    assert_eq!(raw_handoff(sock, shm(&wrong), rkey, epoch).await, handoff::STATUS_UNAUTHENTICATED);
    let engine_proof = |nonce: &[u8]| data.prove(Purpose::Engine, nonce);
    assert_eq!(raw_handoff(sock, engine_proof, rkey, epoch).await, handoff::STATUS_UNAUTHENTICATED);
    let guess = rkey ^ 0x5a5a;
    assert_eq!(raw_handoff(sock, shm(&data), guess, epoch).await, handoff::STATUS_REFUSED, "guessed rkey");
    // A stale epoch is refused but not held against the client: that is
    // what a client that missed a re-registration sends.
    assert_eq!(raw_handoff(sock, shm(&data), rkey, epoch - 1).await, handoff::STATUS_REFUSED);
    // 5. another guess, and the uid is blocked: even the right request is
    // refused unchecked for a while.
    assert_eq!(raw_handoff(sock, shm(&data), guess + 1, epoch).await, handoff::STATUS_REFUSED);
    assert_eq!(raw_handoff(sock, shm(&data), rkey, epoch).await, handoff::STATUS_RATE_LIMITED);
    let err = Client::connect_with(&srv.rpc, cfg(ReadPath::OneSided, Some(Transport::Shm), Some(&data))).await.err();
    match err {
        Some(ClientError::TransportUnavailable { transport: Transport::Shm, reason }) => {
            assert!(reason.contains("too many failed attempts"), "{reason}")
        }
        other => panic!("attached while rate-limited: {other:?}"),
    }
    // The reader attached before keeps reading: its mapping is its own.
    assert_eq!(reader.get("k").await.unwrap().unwrap(), "v".as_bytes());
}
