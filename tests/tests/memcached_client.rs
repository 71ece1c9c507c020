//! An unmodified third-party memcached client, Python's pymemcache, against
//! dmkvd's memcached port: tests/py/memcached_client.py covers set/get,
//! flags, multi-get, gets/cas, incr/decr, add/replace/append/prepend,
//! touch, expiry, delete and flush_all. The same script runs against a real
//! memcached first, which shows its expectations are memcached's.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use dmkv_tests::ServerProcess;
use dmkv_tests::memcached::{Memcached, port_of};

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("py/memcached_client.py")
}

/// A python that can import pymemcache. Debian's python3-pymemcache is
/// importable only by the system python, which a python version manager
/// may shadow on PATH: try both. Without one the test fails under CI
/// (.ci/run installs it) and is skipped with one SKIPPED line elsewhere.
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
        let why = "no python3 with pymemcache: apt-get install python3-pymemcache (or pip install pymemcache)";
        dmkv_tests::needs::skip("pymemcache_works_against_dmkv_as_against_memcached", why);
    }
    found
}

/// Runs the script against `port`; panics with its output if it fails.
fn run_script(py: &str, port: u16, against: &str) {
    run_script_on(py, &[port], against)
}

/// Runs the script against `ports` (several: through pymemcache's
/// HashClient); panics with its output if it fails.
fn run_script_on(py: &str, ports: &[u16], against: &str) {
    let out = Command::new(py).arg(script()).args(ports.iter().map(u16::to_string)).output().expect("run python");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    println!("--- pymemcache against {against}:\n{text}");
    assert!(out.status.success(), "pymemcache script failed against {against} ({}):\n{text}", out.status);
    assert!(text.contains("ALL OK"), "script ended early against {against}:\n{text}");
}

#[test]
fn pymemcache_works_against_dmkv_as_against_memcached() {
    let Some(py) = python() else { return };
    match Memcached::start() {
        Some(m) => run_script(py, m.port, "memcached"),
        None => {
            assert!(!dmkv_tests::needs::required(), "memcached not installed (.ci/run installs it)");
            eprintln!("memcached not installed: checking dmkv only");
        }
    }
    let srv = ServerProcess::start(&["--memory", "16MiB", "--memcached-listen", "127.0.0.1:0"]);
    run_script(py, port_of(&srv), "dmkv");
}

/// A dmkv cluster serves memcached clients on every node: the same script
/// through each node's port (keys whose shard another node leads go to
/// it), then through pymemcache's HashClient over all three ports, as an
/// application with its own consistent hashing over memcached servers.
#[test]
fn pymemcache_works_against_every_node_of_a_cluster() {
    let Some(py) = python() else { return };
    let c = dmkv_tests::cluster::TestCluster::start(3, 3, 3, false, &["--memcached-listen", "127.0.0.1:0"]);
    let ports: Vec<u16> = (0..3)
        .map(|i| {
            let addr = c.endpoint(i, "memcached").expect("memcached= in the listening line");
            addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port")
        })
        .collect();
    for (i, &port) in ports.iter().enumerate() {
        run_script(py, port, &format!("cluster node {}", i + 1));
    }
    run_script_on(py, &ports, "the cluster through HashClient");
}
