//! An unmodified third-party memcached client, Python's pymemcache, against
//! dmkvd's memcached port: tests/py/memcached_client.py covers set/get,
//! flags, multi-get, gets/cas, incr/decr, add/replace/append/prepend,
//! touch, expiry, delete and flush_all. The same script runs against a real
//! memcached first, which shows its expectations are memcached's.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dmkv_tests::ServerProcess;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("py/memcached_client.py")
}

/// A python that can import pymemcache. Debian's python3-pymemcache is
/// importable only by the system python, which a python version manager
/// may shadow on PATH: try both. Without one the test fails under CI
/// (.ci/run installs it) and is skipped loudly elsewhere.
fn python() -> Option<&'static str> {
    let found = ["python3", "/usr/bin/python3"].into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import pymemcache"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if found.is_none() {
        let msg = "no python3 with pymemcache: apt-get install python3-pymemcache (or pip install pymemcache)";
        if std::env::var_os("CI").is_some() {
            panic!("{msg}");
        }
        eprintln!("\n!!! SKIPPED: {msg}\n");
    }
    found
}

/// Runs the script against `port`; panics with its output if it fails.
fn run_script(py: &str, port: u16, against: &str) {
    let out = Command::new(py).arg(script()).arg(port.to_string()).output().expect("run python");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    println!("--- pymemcache against {against}:\n{text}");
    assert!(out.status.success(), "pymemcache script failed against {against} ({}):\n{text}", out.status);
    assert!(text.contains("ALL OK"), "script ended early against {against}:\n{text}");
}

/// A real memcached on a free port: the reference.
struct Memcached(std::process::Child, u16);

impl Memcached {
    /// None if memcached is not installed (then only dmkv is checked; CI
    /// installs it).
    fn start() -> Option<Memcached> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let child = Command::new("memcached")
            .args(["-l", "127.0.0.1", "-p", &port.to_string(), "-U", "0", "-u", "nobody"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let m = Memcached(child, port);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "memcached did not listen on {port} within 10 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(m)
    }
}

impl Drop for Memcached {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn pymemcache_works_against_dmkv_as_against_memcached() {
    let Some(py) = python() else { return };
    match Memcached::start() {
        Some(m) => run_script(py, m.1, "memcached"),
        None => {
            assert!(std::env::var_os("CI").is_none(), "memcached not installed (CI installs it)");
            eprintln!("memcached not installed: checking dmkv only");
        }
    }
    let srv = ServerProcess::start(&["--memory", "16MiB", "--memcached-listen", "127.0.0.1:0"]);
    let addr = srv.endpoint("memcached").expect("memcached= in the listening line");
    let port: u16 = addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port");
    run_script(py, port, "dmkv");
}
