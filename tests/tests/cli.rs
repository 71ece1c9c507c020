//! The `dmkv` command-line client misused as a newcomer would: a forced
//! transport the server does not offer, the wrong port, a peer that is no
//! dmkv server, `put` without a value, `bench` with the CLI's options. The
//! messages are part of the interface: each is checked for the words that
//! tell the user what went wrong. Run `cargo build --workspace --bins`
//! first: these tests run the built binaries.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Output, Stdio};

use dmkv_tests::{ServerProcess, bin_path};

/// Runs `dmkv ARGS` with `stdin` piped in; returns its output.
fn dmkv_with_input(args: &[&str], stdin: &[u8]) -> Output {
    let mut child = Command::new(bin_path("dmkv"))
        .args(args)
        .env_remove("DMKV_SERVER")
        .env_remove("DMKV_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dmkv");
    child.stdin.take().expect("piped").write_all(stdin).expect("write dmkv's stdin");
    child.wait_with_output().expect("dmkv's output")
}

fn dmkv(args: &[&str]) -> Output {
    dmkv_with_input(args, b"")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts that `o` failed with exit 2 and a message holding every part.
#[track_caller]
fn fails_saying(o: &Output, parts: &[&str]) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    for p in parts {
        assert!(err.contains(p), "{p:?} not in: {err}");
    }
}

#[test]
fn forced_transport_the_server_lacks_fails_naming_it() {
    let srv = ServerProcess::start(&["--memory", "16MiB", "--no-shm", "--no-engine", "--no-rdma"]);
    let s = srv.rpc.as_str();
    assert!(dmkv(&["--server", s, "put", "k", "v"]).status.success());
    for path in [None, Some("auto"), Some("one-sided")] {
        let mut args = vec!["--server", s];
        if let Some(p) = path {
            args.extend(["--path", p]);
        }
        let o = dmkv(&[&args[..], &["--transport", "rdma", "get", "k"]].concat());
        fails_saying(&o, &["dmkv: transport rdma unavailable: ", "RDMA"]);
        let o = dmkv(&[&args[..], &["--transport", "tcp", "get", "k"]].concat());
        fails_saying(&o, &["dmkv: transport engine unavailable: ", "one-sided engine", "--no-engine"]);
        let o = dmkv(&[&args[..], &["--transport", "shm", "get", "k"]].concat());
        fails_saying(&o, &["dmkv: transport shm unavailable: ", "shared memory", "--no-shm"]);
        assert!(stdout(&o).is_empty(), "nothing read: {}", stdout(&o));
    }
    let o = dmkv(&["--server", s, "--path", "rpc", "--transport", "rdma", "get", "k"]);
    fails_saying(&o, &["dmkv: --transport rdma forces a one-sided backend, but --path rpc"]);
    // Unforced, the same server serves the GET over RPC.
    let o = dmkv(&["--server", s, "get", "k"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), "v\n");
}

#[test]
fn help_lists_every_transport() {
    let o = dmkv(&["--help"]);
    assert!(o.status.success());
    let help = stdout(&o);
    assert!(help.contains("rdma, shm (same host only) or tcp"), "{help}");
    assert!(help.contains("dmkv fails with exit 2"), "{help}");
}

#[test]
fn engine_port_is_named_as_such() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let engine = srv.endpoint("engine").expect("the engine is on by default");
    let o = dmkv(&["--server", engine, "--timeout-ms", "2000", "get", "k"]);
    fails_saying(
        &o,
        &[&format!("dmkv: {engine} does not speak dmkv's RPC protocol: "), "that is the engine port", "rpc=ADDR"],
    );
}

/// A listener on a free port whose every connection gets `serve`.
fn fake_server(serve: fn(TcpStream)) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            std::thread::spawn(move || serve(s));
        }
    });
    addr
}

/// Reads what the client sends until it hangs up.
fn drain(mut s: TcpStream) {
    let mut buf = [0u8; 256];
    while s.read(&mut buf).is_ok_and(|n| n > 0) {}
}

#[test]
fn silent_peer_does_not_speak_dmkv() {
    let addr = fake_server(drain);
    let o = dmkv(&["--server", &addr, "--timeout-ms", "400", "get", "k"]);
    fails_saying(
        &o,
        &[&format!("dmkv: {addr} does not speak dmkv's RPC protocol: no answer to HELLO within "), "RPC address"],
    );
}

#[test]
fn chatty_peer_does_not_speak_dmkv() {
    let addr = fake_server(|mut s| {
        let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\n");
        drain(s);
    });
    let o = dmkv(&["--server", &addr, "--timeout-ms", "2000", "get", "k"]);
    fails_saying(
        &o,
        &[
            &format!(
                "dmkv: {addr} does not speak dmkv's RPC protocol: it answered HELLO with bytes that are no dmkv reply"
            ),
            "\"SSH-2.0-\"",
        ],
    );
}

#[test]
fn peer_that_hangs_up_does_not_speak_dmkv() {
    let addr = fake_server(|mut s| {
        let mut buf = [0u8; 4];
        let _ = s.read(&mut buf);
    });
    let o = dmkv(&["--server", &addr, "--timeout-ms", "2000", "get", "k"]);
    fails_saying(&o, &[&format!("dmkv: {addr} does not speak dmkv's RPC protocol: it closed the connection on HELLO")]);
}

#[test]
fn put_reads_stdin_for_dash_and_set_is_put() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let s = srv.rpc.as_str();
    let o = dmkv_with_input(&["--server", s, "put", "k1", "-"], b"from stdin");
    assert!(o.status.success(), "{}", stderr(&o));
    // Piped in with no VALUE: still stdin, as the README shows.
    let o = dmkv_with_input(&["--server", s, "put", "k2"], b"piped");
    assert!(o.status.success(), "{}", stderr(&o));
    let o = dmkv(&["--server", s, "set", "k3", "v3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    for (k, v) in [("k1", "from stdin"), ("k2", "piped"), ("k3", "v3")] {
        let o = dmkv(&["--server", s, "get", "--raw", k]);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(stdout(&o), v);
    }
}

#[test]
fn put_at_a_terminal_without_value_fails_at_once() {
    // `script` (util-linux, on every Debian) runs dmkv with a terminal for
    // its stdin. No skip where it is missing: a skipped test is no test.
    let have_script = Command::new("script").arg("--version").output().is_ok();
    assert!(have_script, "`script` (util-linux) is needed to give dmkv a terminal");
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let cmd = format!("{} --server {} put k", bin_path("dmkv").display(), srv.rpc);
    // `timeout`: should dmkv wait for the terminal after all, fail, not hang.
    let o = Command::new("timeout")
        .args(["20", "script", "-qec", &cmd, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .expect("run script");
    let out = stdout(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(out.contains("dmkv: put: give VALUE, or `-` to read the value from standard input"), "{out}");
    let o = dmkv(&["--server", &srv.rpc, "get", "k"]);
    assert_eq!(o.status.code(), Some(1), "nothing stored: {}", stdout(&o));
}

#[test]
fn bench_help_is_the_drivers() {
    let o = dmkv(&["bench", "--help"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let help = stdout(&o);
    assert!(help.contains("--workload"), "{help}");
    assert!(help.contains("--in-flight"), "{help}");
    assert!(!help.contains("DMKV_YCSB_ARGS"), "the wrapper's help: {help}");
}

#[test]
fn bench_gets_the_clis_server_and_path() {
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    let s = srv.rpc.as_str();
    let run = |globals: &[&str], after: &[&str]| {
        let fixed = ["--records", "100", "--duration", "0.5", "--value-size", "10"];
        let args = [globals, &["bench"], after, &fixed[..]].concat();
        let o = Command::new(bin_path("dmkv")).args(&args).env_remove("DMKV_SERVER").output().unwrap();
        assert!(o.status.success(), "dmkv {args:?}: {}", stderr(&o));
        stdout(&o)
    };
    let out = run(&["--server", s, "--path", "rpc"], &[]);
    assert!(out.contains(&format!("at {s}, path rpc:")), "{out}");
    // Given again after `bench`, the driver's own win.
    let out = run(&["--server", "127.0.0.1:1", "--path", "rpc"], &["--server", s, "--path=auto"]);
    assert!(out.contains(&format!("at {s}, path auto:")), "{out}");
}

/// `dmkv stats | head`: a reader that closes the pipe early ends the CLI
/// quietly, as it does a Unix tool (it said "dmkv: Broken pipe (os error
/// 32)" and exited 2).
#[test]
fn a_closed_pipe_ends_the_cli_quietly() {
    let srv = ServerProcess::start(&["--memory", "16MiB"]);
    let mut child = Command::new(bin_path("dmkv"))
        .args(["--server", srv.rpc.as_str(), "stats"])
        .env_remove("DMKV_SERVER")
        .env_remove("DMKV_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dmkv");
    // Closed before dmkv writes a line: its first write finds no reader.
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("dmkv's output");
    assert!(out.status.success() && stderr(&out).is_empty(), "{:?}: {}", out.status, stderr(&out));
}
