//! Every benchmark binary meets bad flags, an unreachable server, missing
//! files and unavailable transports with exit code 2 and one line naming
//! what failed, never a panic and its backtrace.

use std::process::{Command, Stdio};

use dmkv_tests::ServerProcess;

/// A port nothing listens on: bound, then released.
fn dead_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// Runs `exe args` and checks it failed with exit code 2 and one line,
/// "`name`: ...", containing each of `parts`.
fn fails(name: &str, exe: &str, args: &[&str], parts: &[&str]) -> String {
    let out = Command::new(exe)
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {exe}: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!stderr.contains("panicked"), "{name} {args:?} panicked: {stderr}");
    assert_eq!(out.status.code(), Some(2), "{name} {args:?}: exit code; stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{name} {args:?}: one line on stderr, got {stderr:?}");
    let prefix = format!("{name}: ");
    assert!(lines[0].starts_with(&prefix), "{}", lines[0]);
    for part in parts {
        assert!(lines[0].contains(part), "{name} {args:?}: {:?} lacks {part:?}", lines[0]);
    }
    lines[0].to_string()
}

const GETBENCH: &str = env!("CARGO_BIN_EXE_dmkv-getbench");
const MEMUTIL: &str = env!("CARGO_BIN_EXE_dmkv-memutil");
const CLUSTER_BENCH: &str = env!("CARGO_BIN_EXE_dmkv-cluster-bench");
const YCSB: &str = env!("CARGO_BIN_EXE_dmkv-ycsb");
const YCSB_PLOT: &str = env!("CARGO_BIN_EXE_dmkv-ycsb-plot");
const PATHBENCH: &str = env!("CARGO_BIN_EXE_dmkv-pathbench");

#[test]
fn getbench_bad_flags_and_unreachable_server() {
    let g = |args: &[&str], parts: &[&str]| fails("dmkv-getbench", GETBENCH, args, parts);
    g(&["--transport", "carrier-pigeon"], &["--transport", "carrier-pigeon"]);
    g(&["--keys", "0"], &["--keys must be at least 1"]);
    g(&["--secs", "inf"], &["--secs inf"]);
    g(&["--distribution", "normal"], &["--distribution \"normal\""]);
    let dead = dead_addr();
    g(&["--server", &dead, "--transport", "rpc"], &[&format!("cannot connect to {dead}")]);
}

#[test]
fn getbench_unavailable_transport_is_an_error() {
    let srv = ServerProcess::start(&["--memory", "16MiB", "--no-rdma"]);
    let line = fails(
        "dmkv-getbench",
        GETBENCH,
        &["--server", &srv.rpc, "--transport", "rdma", "--load", "--keys", "10", "--secs", "0.2"],
        &[],
    );
    assert!(line.to_lowercase().contains("rdma"), "{line}");
}

#[test]
fn memutil_missing_or_failing_dmkvd() {
    fails("dmkv-memutil", MEMUTIL, &["--dmkvd", "/nonexistent/dmkvd"], &["--dmkvd /nonexistent/dmkvd: cannot run it"]);
    let dmkvd = dmkv_tests::bin_path("dmkvd");
    let dmkvd = dmkvd.to_str().unwrap();
    fails(
        "dmkv-memutil",
        MEMUTIL,
        &["--dmkvd", dmkvd, "--memory", "1MiB"],
        &["did not start", "exit status: 2", "dmkvd: --memory: 1 MiB is below the smallest region"],
    );
    fails("dmkv-memutil", MEMUTIL, &["--dmkvd", dmkvd, "--levels", "150"], &["--levels: 150"]);
}

#[test]
fn cluster_bench_bad_flags_and_a_cluster_that_does_not_start() {
    let c = |args: &[&str], parts: &[&str]| fails("dmkv-cluster-bench", CLUSTER_BENCH, args, parts);
    c(&["failover", "--kills", "0"], &["--kills must be at least 1"]);
    c(&["put-latency", "--sync", "sometimes"], &["--sync \"sometimes\""]);
    c(&["put-latency", "--concurrency", "0"], &["--concurrency must be at least 1"]);
    c(&["catch-up", "--value-size", "0"], &["--value-size 0"]);
    // A region far larger than the machine: dmkvd refuses, and says why.
    c(&["catch-up", "--mib", "100000000"], &["the cluster did not start: node 1", "dmkvd: --memory"]);
}

/// A cluster started from inside the bench's runtime (which once panicked:
/// a runtime started within a runtime).
#[test]
fn cluster_bench_put_latency_runs() {
    let out = Command::new(CLUSTER_BENCH)
        .args(["put-latency", "--nodes", "1", "--puts", "50", "--concurrency", "2", "--value-size", "100"])
        .args(["--sync", "none"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("PUTs/s"));
}

#[test]
fn ycsb_and_plot_errors() {
    let dead = dead_addr();
    fails("dmkv-ycsb", YCSB, &["--server", &dead, "--records", "10", "--operations", "10"], &[&dead]);
    fails("dmkv-ycsb", YCSB, &["--duration", "1e30"], &["--duration"]);
    fails("dmkv-ycsb-plot", YCSB_PLOT, &["/nonexistent/report.json"], &["cannot read /nonexistent/report.json"]);
}

#[test]
fn pathbench_bad_flags() {
    let p = |args: &[&str], parts: &[&str]| fails("dmkv-pathbench", PATHBENCH, args, parts);
    p(&["--duration", "inf"], &["--duration inf"]);
    p(&["--scenario", "sunny"], &["unknown scenario \"sunny\""]);
    p(&["--rounds", "0"], &["at least one path, one round"]);
}
