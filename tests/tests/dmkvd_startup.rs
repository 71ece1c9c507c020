//! dmkvd's start-up errors, as a newcomer meets them: each misuse must end
//! with exit code 2 and one line on stderr, "dmkvd: ...", that names the
//! setting (flag or config key) or the path at fault. The texts are part
//! of the interface, so the tests check their key parts.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dmkv_tests::bin_path;

/// A failed start takes well under this; a server that starts instead is
/// killed then, and the test fails.
const EXIT_DEADLINE: Duration = Duration::from_secs(20);

/// Runs dmkvd with `args` (and `env`) and returns its exit code and stderr.
fn run(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    let mut cmd = Command::new(bin_path("dmkvd"));
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).env_remove("RUST_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn dmkvd");
    let deadline = Instant::now() + EXIT_DEADLINE;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for dmkvd") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("dmkvd {args:?} did not exit within {EXIT_DEADLINE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    child.stderr.take().expect("piped").read_to_string(&mut stderr).expect("read stderr");
    (status.code(), stderr)
}

/// Asserts that dmkvd `args` fails to start with one line that contains
/// every one of `parts`; returns the line.
fn refused(args: &[&str], env: &[(&str, &str)], parts: &[&str]) -> String {
    let (code, stderr) = run(args, env);
    assert_eq!(code, Some(2), "dmkvd {args:?}: exit code; stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "dmkvd {args:?}: one line on stderr, got {stderr:?}");
    let line = lines[0];
    assert!(line.starts_with("dmkvd: "), "{line}");
    for part in parts {
        assert!(line.contains(part), "dmkvd {args:?}: {line:?} lacks {part:?}");
    }
    line.to_string()
}

fn mem_total() -> u64 {
    let text = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
    let line = text.lines().find(|l| l.starts_with("MemTotal:")).expect("MemTotal");
    let kib: u64 = line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).expect("MemTotal in kB");
    kib * 1024
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dmkv-startup-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("test dir");
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 temp path")
}

#[test]
fn region_larger_than_the_machine_is_refused_with_both_numbers() {
    let total = mem_total();
    let line = refused(&["--memory", "1TiB"], &[], &["--memory: 1 TiB (1099511627776 bytes) is"]);
    if total < 1 << 40 {
        assert!(line.contains(&format!("more than this machine's physical memory, {}", total_text(total))), "{line}");
    }
    // Within what the layout addresses, but still more than the machine.
    let gib = total.div_ceil(1 << 30) + 1;
    if gib < 512 {
        let size = format!("{gib}GiB");
        refused(&["--memory", &size], &[], &["--memory: ", "physical memory", &format!("({total} bytes)")]);
    }
}

/// MemTotal as the error writes it, "N.N GiB".
fn total_text(total: u64) -> String {
    let gib = total as f64 / (1u64 << 30) as f64;
    if gib.fract() == 0.0 { format!("{gib:.0} GiB") } else { format!("{gib:.1} GiB") }
}

#[test]
fn region_below_the_minimum_is_refused() {
    refused(&["--memory", "1MiB"], &[], &["--memory: 1 MiB is below the smallest region dmkvd accepts, 4 MiB"]);
    refused(&["--memory", "lots"], &[], &["--memory: invalid size \"lots\""]);
}

#[test]
fn buckets_that_leave_no_room_for_data_are_refused() {
    refused(
        &["--memory", "4MiB", "--buckets", "1048576"],
        &[],
        &["--buckets: 1048576 buckets need a 128 MiB index", "4 MiB region (--memory)", "at most 16384 buckets fit"],
    );
    refused(&["--buckets", "1000"], &[], &["--buckets: 1000 is not a power of two"]);
}

#[test]
fn shm_socket_in_a_missing_directory_is_named() {
    let dir = temp_dir("shm");
    let sock = dir.join("missing").join("dmkvd.sock");
    let missing = dir.join("missing");
    let expect = format!("--shm-socket {}: directory {}: No such file or directory", s(&sock), s(&missing));
    refused(&["--listen", "127.0.0.1:0", "--shm-socket", s(&sock)], &[], &[&expect]);
    // The same from a config file names the key and the file.
    let conf = dir.join("dmkvd.toml");
    std::fs::write(&conf, format!("listen = \"127.0.0.1:0\"\nshm_socket = \"{}\"\n", s(&sock))).unwrap();
    refused(&["--config", s(&conf)], &[], &[&format!("{}: shm_socket {}: directory", s(&conf), s(&sock))]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn zero_threads_are_refused() {
    refused(&["--threads", "0"], &[], &["dmkvd: --threads: must be at least 1, got 0"]);
}

#[test]
fn bad_log_filters_are_refused() {
    refused(&["--log", "dmkv_server=loud"], &[], &["--log \"dmkv_server=loud\": invalid log filter"]);
    refused(&["--listen", "127.0.0.1:0"], &[("RUST_LOG", "dmkv_server=loud")], &["RUST_LOG \"dmkv_server=loud\""]);
}

#[test]
fn missing_and_invalid_files_are_named() {
    let dir = temp_dir("files");
    let missing = dir.join("nope.toml");
    refused(&["--config", s(&missing)], &[], &[&format!("--config {}: cannot read it: No such file", s(&missing))]);
    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "listen = \"127.0.0.1:0\"\nmemroy = \"64MiB\"\n").unwrap();
    refused(&["--config", s(&bad)], &[], &[&format!("--config {}: line 2: unknown field `memroy`", s(&bad))]);
    let auth = dir.join("auth");
    refused(&["--auth-file", s(&auth)], &[], &[&format!("--auth-file {}: cannot read it", s(&auth))]);
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    refused(&["--tls-cert", s(&cert), "--tls-key", s(&key)], &[], &[&format!("--tls-cert {}: cannot read", s(&cert))]);
    let cluster = dir.join("cluster.toml");
    refused(&["--cluster", s(&cluster), "--node-id", "1"], &[], &[&format!("--cluster {}: cannot read", s(&cluster))]);
    let port = || TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (rpc, peer) = (port(), port());
    std::fs::write(
        &cluster,
        format!("shards = 1\nreplicas = 1\n[[node]]\nid = 1\nrpc = \"127.0.0.1:{rpc}\"\npeer = \"127.0.0.1:{peer}\"\n"),
    )
    .unwrap();
    // A data directory is made with its parents, but not under a file.
    let file = dir.join("file");
    std::fs::write(&file, b"x").unwrap();
    let data = file.join("data");
    refused(
        &["--cluster", s(&cluster), "--node-id", "1", "--data-dir", s(&data)],
        &[],
        &[&format!("--data-dir {}: {} is not a directory", s(&data), s(&file))],
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_busy_port_names_the_listener_and_its_address() {
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    refused(
        &["--listen", &addr, "--memory", "16MiB", "--no-shm"],
        &[],
        &[&format!("dmkvd: cannot bind the rpc listener to {addr}: Address already in use")],
    );
    refused(
        &["--listen", "127.0.0.1:0", "--engine-listen", &addr, "--memory", "16MiB", "--no-shm"],
        &[],
        &[&format!("cannot bind the engine listener to {addr}")],
    );
}

/// Starts dmkvd, waits for its "listening" line, stops it, and returns
/// its stderr (its log).
fn log_of(args: &[&str], rust_log: &str) -> String {
    let mut child = Command::new(bin_path("dmkvd"))
        .args(["--listen", "127.0.0.1:0", "--memory", "16MiB", "--no-shm"])
        .args(args)
        .env("RUST_LOG", rust_log)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dmkvd");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line).expect("dmkvd's stdout");
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.starts_with("dmkvd listening"), "dmkvd {args:?} did not start: {line:?}");
    let mut log = String::new();
    child.stderr.take().expect("piped").read_to_string(&mut log).expect("dmkvd's stderr");
    log
}

#[test]
fn log_flag_wins_over_rust_log() {
    assert!(log_of(&["--log", "info"], "off").contains("dmkvd serving"), "--log info loses to RUST_LOG=off");
    let quiet = log_of(&["--log", "error"], "debug");
    assert!(!quiet.contains("dmkvd serving") && !quiet.contains("DEBUG"), "--log error loses to RUST_LOG: {quiet}");
    // Without --log, RUST_LOG applies.
    assert!(!log_of(&[], "off").contains("dmkvd serving"));
    assert!(log_of(&[], "info").contains("dmkvd serving"));
}
