//! End-to-end tests of the listeners' bounds against real dmkvd processes:
//! a connection flood past the cap, slow-loris clients, and a server out of
//! file descriptors. In each, a well-behaved client must still be served.

use std::ffi::OsString;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use dmkv_client::{Client, ClientConfig, ReadPath};
use dmkv_common::onesided::{ReadWr, decode_reply, encode_request};
use dmkv_tests::{ServerProcess, wait_until};

/// How long a well-behaved client may wait behind a flood: the flood is
/// cleared by idle timeouts of a second, a cap's worth at a time.
const SERVED_DEADLINE: Duration = Duration::from_secs(60);
/// Connections a flood opens: far past the caps the tests set.
const FLOOD: usize = 50;
/// Connection cap of the flood tests.
const CAP: usize = 8;

fn good_config() -> ClientConfig {
    ClientConfig::default()
        .read_path(ReadPath::Rpc)
        .pool_size(1)
        .request_timeout(SERVED_DEADLINE)
        .connect_timeout(SERVED_DEADLINE)
}

/// A PUT and a GET by a well-behaved client; returns how long they took.
async fn served(rpc: &str, key: &str) -> Duration {
    let t0 = Instant::now();
    let c = Client::connect_with(rpc, good_config()).await.expect("connect while the server is under attack");
    c.put(key, "v").await.expect("PUT while the server is under attack");
    assert_eq!(c.get(key).await.unwrap().as_deref(), Some(&b"v"[..]));
    t0.elapsed()
}

/// One read batch on a raw engine connection; returns how long the reply took.
fn engine_served(addr: &str) -> Duration {
    let t0 = Instant::now();
    let (mut s, status) = dmkv_tests::engine_connect(addr, None);
    assert_eq!(status, dmkv_common::onesided::HANDSHAKE_OK);
    s.set_read_timeout(Some(SERVED_DEADLINE)).unwrap();
    let mut req = BytesMut::new();
    // The rkey is wrong on purpose: any reply shows the engine serves us.
    encode_request(77, &[ReadWr { rkey: 0, offset: 0, len: 8 }], &mut req);
    s.write_all(&req).unwrap();
    let mut len = [0u8; 4];
    s.read_exact(&mut len).expect("engine reply while the engine is flooded");
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut body).unwrap();
    assert_eq!(decode_reply(&body).unwrap().batch_id, 77);
    t0.elapsed()
}

/// Open TCP connections to `addr` that never send anything.
fn flood(addr: &str, n: usize) -> Vec<TcpStream> {
    (0..n).map(|_| TcpStream::connect(addr).expect("the kernel queues connections past the cap")).collect()
}

/// Sockets the process holds (listeners, connections, runtime internals).
fn sockets(pid: u32) -> usize {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return 0 };
    dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().starts_with("socket:"))
        .count()
}

/// [`sockets`] once it has stopped changing: the server has finished
/// starting and closed connections of earlier clients.
fn settled_sockets(pid: u32) -> usize {
    let mut last = sockets(pid);
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(200));
        let now = sockets(pid);
        if now == last {
            return now;
        }
        last = now;
    }
    panic!("the server's sockets never settled");
}

fn tmp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("dmkv-listeners-{}-{name}", std::process::id()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rpc_flood_past_the_cap_still_serves_a_good_client() {
    let cap = CAP.to_string();
    let srv = ServerProcess::start(&["--memory", "64MiB", "--max-connections", &cap, "--idle-timeout-secs", "1"]);
    served(&srv.rpc, "before-the-flood").await;
    let before = settled_sockets(srv.pid());
    let idle = flood(&srv.rpc, FLOOD);
    // The server takes a cap's worth and leaves the rest in the kernel's queue.
    assert!(wait_until(Duration::from_secs(10), || sockets(srv.pid()) > before));
    for _ in 0..5 {
        let held = sockets(srv.pid()) - before;
        assert!(held <= CAP, "server holds {held} connections, cap {CAP}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let waited = served(&srv.rpc, "flooded").await;
    eprintln!("rpc flood: {FLOOD} idle connections, cap {CAP}: a good client was served after {waited:?}");
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_flood_past_the_cap_still_serves_a_good_client() {
    let cap = CAP.to_string();
    let srv =
        ServerProcess::start(&["--memory", "64MiB", "--max-engine-connections", &cap, "--idle-timeout-secs", "1"]);
    let engine = srv.endpoint("engine").expect("engine on by default").to_string();
    served(&srv.rpc, "before-the-flood").await;
    let before = settled_sockets(srv.pid());
    let idle = flood(&engine, FLOOD);
    assert!(wait_until(Duration::from_secs(10), || sockets(srv.pid()) > before));
    for _ in 0..5 {
        let held = sockets(srv.pid()) - before;
        assert!(held <= CAP, "engine holds {held} connections, cap {CAP}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let waited = tokio::task::spawn_blocking(move || engine_served(&engine)).await.unwrap();
    eprintln!("engine flood: {FLOOD} idle connections, cap {CAP}: a good client was served after {waited:?}");
    // The RPC listener has a cap of its own, untouched by the engine's flood.
    served(&srv.rpc, "beside-the-flood").await;
    drop(idle);
}

/// Sends a frame header promising `promised` bytes, then one byte every
/// 100 ms; returns how long after the header the server closed it, or
/// `None` if it was still open after `give_up`.
fn slow_loris(addr: &str, engine: bool, promised: u32, give_up: Duration) -> Option<Duration> {
    // The engine's handshake comes first; a client stuck in it is closed
    // by the handshake deadline instead.
    let mut s = if engine { dmkv_tests::engine_connect(addr, None).0 } else { TcpStream::connect(addr).unwrap() };
    s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let mut header = BytesMut::new();
    header.put_u32_le(promised);
    let t0 = Instant::now();
    let mut next: &[u8] = &header;
    while t0.elapsed() < give_up {
        if s.write_all(next).is_err() {
            return Some(t0.elapsed());
        }
        next = &[0];
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(0) => return Some(t0.elapsed()),
            Ok(_) => panic!("the server answered an unfinished frame"),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return Some(t0.elapsed()),
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_loris_is_closed_at_the_frame_deadline() {
    const FRAME_TIMEOUT: Duration = Duration::from_millis(500);
    const GIVE_UP: Duration = Duration::from_secs(20);
    let ms = FRAME_TIMEOUT.as_millis().to_string();
    let srv = ServerProcess::start(&["--memory", "64MiB", "--frame-timeout-ms", &ms]);
    let engine = srv.endpoint("engine").expect("engine on by default").to_string();
    let mut lorises = Vec::new();
    for i in 0..4 {
        // Both under the listeners' largest frames, so only time ends them.
        let (addr, is_engine, promised) =
            if i % 2 == 0 { (srv.rpc.clone(), false, 1 << 20) } else { (engine.clone(), true, 10_000) };
        lorises.push(std::thread::spawn(move || slow_loris(&addr, is_engine, promised, GIVE_UP)));
    }
    // Served while the trickling goes on.
    let waited = served(&srv.rpc, "beside-the-loris").await;
    let closed: Vec<Option<Duration>> = lorises.into_iter().map(|t| t.join().unwrap()).collect();
    eprintln!("slow loris: closed after {closed:?} (frame timeout {FRAME_TIMEOUT:?}); good client took {waited:?}");
    for c in closed {
        let c = c.unwrap_or_else(|| panic!("a trickling client still held its connection after {GIVE_UP:?}"));
        // Bytes kept arriving the whole time: only the frame deadline can
        // have closed it, and not before it was due.
        assert!(c >= FRAME_TIMEOUT - Duration::from_millis(100), "closed after {c:?}, before its deadline");
    }
}

/// CPU time (user + system) of a process so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
    // utime and stime are fields 14 and 15 of stat(5); `rest` starts at field 3.
    let ticks = f[11] + f[12];
    Duration::from_secs_f64(ticks as f64 / clock_ticks() as f64)
}

fn clock_ticks() -> u64 {
    let out = Command::new("getconf").arg("CLK_TCK").output();
    out.ok().and_then(|o| String::from_utf8(o.stdout).ok()?.trim().parse().ok()).unwrap_or(100)
}

fn accept_error_lines(log: &std::path::Path) -> usize {
    std::fs::read_to_string(log).unwrap_or_default().lines().filter(|l| l.contains("accept")).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_descriptors_backs_off_and_recovers() {
    /// The server's descriptor limit: about twenty above what it uses idle.
    const NOFILE: usize = 40;
    /// How long the server is held out of descriptors.
    const HOLD: Duration = Duration::from_secs(2);
    /// Far above a backed-off accept loop (a few wakeups a second) and far
    /// below one retrying at once (a whole core): a liveness bound.
    const MAX_CPU_SHARE: f64 = 0.3;
    /// A backed-off loop logs about once; one per error would be hundreds.
    const MAX_ACCEPT_LINES: usize = 20;
    let prlimit = Command::new("prlimit").arg("--version").output();
    assert!(prlimit.is_ok_and(|o| o.status.success()), "prlimit (util-linux) is needed for this test");
    let log = tmp_path("emfile.log");
    let prefix: Vec<OsString> = vec!["prlimit".into(), format!("--nofile={NOFILE}:{NOFILE}").into()];
    let file = std::fs::File::create(&log).unwrap();
    let srv = ServerProcess::start_logged(&prefix, "127.0.0.1:0", &["--memory", "64MiB"], Some(file)).unwrap();
    let pid = srv.pid();
    // More than the server has descriptors for: the rest wait in the queue.
    let held = flood(&srv.rpc, 2 * NOFILE);
    assert!(
        wait_until(Duration::from_secs(20), || accept_error_lines(&log) > 0),
        "the server never ran out of descriptors: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let (cpu0, t0) = (cpu_time(pid), Instant::now());
    std::thread::sleep(HOLD);
    let (cpu, window) = (cpu_time(pid) - cpu0, t0.elapsed());
    let lines = accept_error_lines(&log);
    eprintln!("out of descriptors for {window:?}: server used {cpu:?} of CPU, logged {lines} accept lines");
    assert!(cpu.as_secs_f64() < MAX_CPU_SHARE * window.as_secs_f64(), "accept loop spun: {cpu:?} in {window:?}");
    assert!(lines < MAX_ACCEPT_LINES, "{lines} accept lines logged");
    drop(held);
    let waited = served(&srv.rpc, "after-emfile").await;
    eprintln!("after the flood closed, a good client was served after {waited:?}");
    drop(srv);
    let _ = std::fs::remove_file(&log);
}
