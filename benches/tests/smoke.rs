//! The driver against real servers: a few hundred operations of every
//! workload, so `dmkv-ycsb` cannot rot. memcached and Redis are measured
//! too when they are installed; without them those parts are skipped,
//! unless `DMKV_RIVALS_TESTS=1` (set by CI), where that fails.

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dmkv_benches::backend::{BackendKind, DmkvOptions};
use dmkv_benches::driver::{self, Settings, Warmup};
use dmkv_benches::report::Report;
use dmkv_benches::workload::{Distribution, Workload};
use dmkv_client::ReadPath;
use dmkv_tests::{ServerProcess, wait_until};

const RECORDS: u64 = 200;
const OPERATIONS: u64 = 300;
/// How long memcached or Redis gets to accept connections.
const START_DEADLINE: Duration = Duration::from_secs(10);

fn settings(backend: BackendKind, server: &str, workload: Workload) -> Settings {
    Settings {
        dmkv: DmkvOptions { read_path: ReadPath::Rpc, transport: None, tls_ca: None },
        records: RECORDS,
        operations: Some(OPERATIONS),
        threads: 2,
        in_flight: 4,
        seed: 7,
        ..Settings::new(backend, server, workload)
    }
}

fn check(r: &Report, ops: u64) {
    assert_eq!(r.failures(), 0, "failures: {:?}", r.run.first_error);
    assert_eq!(r.run.bad_values, 0);
    assert_eq!(r.run.operations, ops);
    if let Some(l) = &r.load {
        assert_eq!(l.operations, r.records);
    }
}

/// Loads once, then runs every supported workload on the loaded records.
fn every_workload(backend: BackendKind, server: &str) {
    for (i, w) in [Workload::A, Workload::B, Workload::C, Workload::D, Workload::F].into_iter().enumerate() {
        let s = Settings { skip_load: i > 0, ..settings(backend, server, w) };
        let r = driver::run(&s).unwrap_or_else(|e| panic!("{backend:?} workload {w:?}: {e}"));
        check(&r, OPERATIONS);
        let count = |op: &str| r.run.op(op).map_or(0, |o| o.count);
        match w {
            Workload::A => assert!(count("READ") > 0 && count("UPDATE") > 0),
            Workload::C => assert_eq!(count("READ"), OPERATIONS),
            Workload::D => assert!(count("INSERT") > 0 && count("READ") > 0),
            Workload::F => assert!(count("READ-MODIFY-WRITE") > 0),
            _ => {}
        }
    }
}

#[test]
fn every_workload_runs_against_dmkvd() {
    let server = ServerProcess::start(&["--memory", "64MiB"]);
    every_workload(BackendKind::Dmkv, &server.rpc);

    // Open loop, warm-up by count, uniform keys: still exactly the asked
    // number of measured operations.
    let s = Settings {
        skip_load: true,
        target_rate: Some(5000.0),
        warmup: Warmup::Ops(50),
        distribution: Distribution::Uniform,
        ..settings(BackendKind::Dmkv, &server.rpc, Workload::B)
    };
    check(&driver::run(&s).unwrap(), OPERATIONS);

    // Reads are checked: values loaded with another seed are reported.
    let s = Settings { skip_load: true, seed: 8, ..settings(BackendKind::Dmkv, &server.rpc, Workload::C) };
    let r = driver::run(&s).unwrap();
    assert_eq!(r.run.bad_values, OPERATIONS);
    assert!(r.failures() > 0);
}

#[test]
fn the_binary_writes_reports_and_refuses_scans() {
    let exe = env!("CARGO_BIN_EXE_dmkv-ycsb");
    let out = Command::new(exe).args(["--workload", "e"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not supported"));

    let server = ServerProcess::start(&["--memory", "64MiB"]);
    let dir = std::env::temp_dir().join(format!("dmkv-ycsb-smoke-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, csv) = (dir.join("r.json"), dir.join("r.csv"));
    let out = Command::new(exe)
        .args(["--server", &server.rpc, "--records", "100", "--operations", "200", "--in-flight", "8"])
        .args(["--path", "rpc", "--json", json.to_str().unwrap(), "--csv", csv.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("p99.9"));
    let r: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    check(&r, 200);
    assert_eq!(r.records, 100);
    assert!(std::fs::read_to_string(&csv).unwrap().lines().any(|l| l.contains(",run,READ,")));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A server process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn installed(name: &str) -> bool {
    Command::new("which").arg(name).stdout(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Starts `program` on a free loopback port; `None` if it is not installed,
/// unless `DMKV_RIVALS_TESTS=1` (as in CI, which installs both): then a
/// missing program fails the test instead of skipping it.
fn start(program: &str, args: impl Fn(u16) -> Vec<String>) -> Option<(Killed, String)> {
    if !installed(program) {
        assert!(
            std::env::var("DMKV_RIVALS_TESTS").as_deref() != Ok("1"),
            "DMKV_RIVALS_TESTS=1 but {program} is not installed"
        );
        println!("{program} is not installed: skipping its part of the smoke test (DMKV_RIVALS_TESTS=1 fails instead)");
        return None;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(program).args(args(port)).stdout(Stdio::null()).spawn().unwrap();
    let child = Killed(child);
    let addr = format!("127.0.0.1:{port}");
    assert!(wait_until(START_DEADLINE, || TcpStream::connect(&addr).is_ok()), "{program} did not start on {addr}");
    Some((child, addr))
}

#[test]
fn every_workload_runs_against_memcached_and_redis_if_installed() {
    let memcached = start("memcached", |p| {
        ["-u", "root", "-l", "127.0.0.1", "-p", &p.to_string(), "-U", "0", "-m", "64", "-t", "2"]
            .map(String::from)
            .to_vec()
    });
    if let Some((_child, addr)) = memcached {
        every_workload(BackendKind::Memcached, &addr);
    }
    let redis = start("redis-server", |p| {
        ["--port", &p.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"].map(String::from).to_vec()
    });
    if let Some((_child, addr)) = redis {
        every_workload(BackendKind::Redis, &addr);
    }
}
