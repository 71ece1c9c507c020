//! Helpers for end-to-end tests: start real `dmkvd` processes on ports
//! picked at run time, wait for conditions with deadlines, clean up.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub mod cluster;
pub mod disk;
pub mod faults;
pub mod history;
pub mod layers;
pub mod linearize;
pub mod memcached;
pub mod needs;
pub mod nemesis;
pub mod netns;
pub mod partition;
pub mod prom;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod schedule;
pub mod skewed;
pub mod skip;
pub mod workload;

/// How long a server gets to start and print its address.
pub const START_DEADLINE: Duration = Duration::from_secs(20);
/// How long a server gets to exit after SIGTERM before it is killed.
pub const STOP_DEADLINE: Duration = Duration::from_secs(10);

/// Path of a binary built from this workspace (`dmkvd`, `dmkv`).
///
/// `cargo test --workspace` builds them next to the test executables (one
/// directory up from `deps/`); a binary finds its siblings in its own
/// directory. `DMKV_BIN_DIR` overrides the directory.
pub fn bin_path(name: &str) -> PathBuf {
    find_bin(name).unwrap_or_else(|e| panic!("{e}"))
}

/// [`bin_path`] without the panic.
pub fn find_bin(name: &str) -> Result<PathBuf, String> {
    let dirs = match std::env::var_os("DMKV_BIN_DIR") {
        Some(d) => vec![PathBuf::from(d)],
        None => {
            let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
            exe.ancestors().skip(1).take(2).map(PathBuf::from).collect()
        }
    };
    dirs.iter().map(|d| d.join(name)).find(|p| p.exists()).ok_or_else(|| {
        let looked: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        format!("{name} not found in {}: build it (`cargo test --workspace` does)", looked.join(" or "))
    })
}

/// A directory for one test's files, removed when dropped. The process id
/// in its name keeps test binaries running at once apart.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// Makes (afresh) `dmkv-test-NAME-PID` in the system's temp directory.
    pub fn new(name: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("dmkv-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap_or_else(|e| panic!("make {}: {e}", d.display()));
        TempDir(d)
    }

    /// The path of `rel` inside it.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.0.join(rel)
    }

    /// Writes `text` to file `name` in it and returns the file's path.
    pub fn file(&self, name: &str, text: &str) -> String {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
        p.display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `dmkvd`, stopped (SIGTERM, then SIGKILL) when dropped.
pub struct ServerProcess {
    child: Option<Child>,
    /// RPC address, as printed by the server.
    pub rpc: String,
    /// Every `key=value` pair of the server's "listening" line.
    pub endpoints: Vec<(String, String)>,
}

impl ServerProcess {
    /// Starts `dmkvd --listen 127.0.0.1:0 ARGS...` and waits for its address.
    pub fn start(args: &[&str]) -> ServerProcess {
        ServerProcess::start_with(&[], "127.0.0.1:0", args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts `PREFIX... dmkvd --listen LISTEN --log warn ARGS...` and waits
    /// for its address. The prefix runs dmkvd elsewhere, e.g.
    /// [`netns::Netns::exec_prefix`]; it must exec dmkvd (not fork it), so
    /// that stopping the child stops the server.
    pub fn start_with(prefix: &[OsString], listen: &str, args: &[&str]) -> Result<ServerProcess, String> {
        ServerProcess::start_logged(prefix, listen, args, None)
    }

    /// [`ServerProcess::start_with`], with the server's stderr (its log)
    /// written to `stderr` instead of the test's own.
    pub fn start_logged(
        prefix: &[OsString],
        listen: &str,
        args: &[&str],
        stderr: Option<std::fs::File>,
    ) -> Result<ServerProcess, String> {
        let dmkvd = find_bin("dmkvd")?;
        let mut cmd = match prefix.split_first() {
            Some((prog, rest)) => {
                let mut c = Command::new(prog);
                c.args(rest).arg(&dmkvd);
                c
            }
            None => Command::new(&dmkvd),
        };
        // Warnings only, unless the test asks for a filter of its own.
        if !args.contains(&"--log") {
            cmd.args(["--log", "warn"]);
        }
        let mut child = cmd
            .args(["--listen", listen])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(stderr.map_or_else(Stdio::inherit, Stdio::from))
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", dmkvd.display()))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + START_DEADLINE;
        let line = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) if line.starts_with("dmkvd listening") => break line,
                Ok(_) => continue,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = child.wait().map_or("unknown status".to_string(), |s| s.to_string());
                    return Err(format!("dmkvd exited ({status}) before reporting its address; see its stderr"));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!("dmkvd did not report its address within {START_DEADLINE:?}"));
                }
            }
        };
        let endpoints: Vec<(String, String)> = line
            .split_whitespace()
            .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect();
        let mut server = ServerProcess { child: Some(child), rpc: String::new(), endpoints };
        server.rpc = server.endpoint("rpc").ok_or_else(|| format!("no rpc address in {line:?}"))?.to_string();
        Ok(server)
    }

    /// The address printed for `name` (e.g. "rpc").
    pub fn endpoint(&self, name: &str) -> Option<&str> {
        self.endpoints.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// OS process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// Sends SIGTERM and waits (bounded) for exit; returns the exit status.
    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        // The `kill` command keeps this crate free of unsafe FFI.
        let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        let deadline = Instant::now() + STOP_DEADLINE;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => {
                    let _ = child.kill();
                    return child.wait().ok();
                }
            }
        }
    }

    /// Kills the process at once (SIGKILL: no shutdown, like a crash).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends the process a signal by name (`STOP`, `CONT`, ...), as
    /// `kill -SIG` would; whether it was sent.
    pub fn signal(&self, sig: &str) -> bool {
        self.child.as_ref().is_some_and(|c| {
            Command::new("kill").args([format!("-{sig}"), c.id().to_string()]).status().is_ok_and(|s| s.success())
        })
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(None)))
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Polls `cond` until it holds or `timeout` passes; returns whether it held.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Opens a raw connection to a dmkvd engine at `addr` and runs its
/// handshake (see `dmkv_common::onesided`), proving `token` if the engine
/// asks; returns the connection and the handshake's status byte.
pub fn engine_connect(addr: &str, token: Option<&dmkv_common::auth::Token>) -> (std::net::TcpStream, u8) {
    use dmkv_common::onesided::{GREETING_LEN, HANDSHAKE_PROOF_LEN, decode_greeting};
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("set timeout");
    let mut greeting = [0u8; GREETING_LEN];
    s.read_exact(&mut greeting).expect("engine greeting");
    let (auth, nonce) = decode_greeting(&greeting).expect("a dmkv engine greeting");
    let proof = match (auth, token) {
        (true, Some(t)) => t.prove(dmkv_common::auth::Purpose::Engine, &nonce),
        _ => [0u8; HANDSHAKE_PROOF_LEN],
    };
    s.write_all(&proof).expect("send proof");
    let mut status = [0u8; 1];
    s.read_exact(&mut status).expect("handshake status");
    (s, status[0])
}

/// Grows a server's index while a test runs: a thread storing new small
/// keys (`grow-N`, never read by the tests' checks) over RPC, paced so
/// that it leaves the machine to the test, until stopped or the store is
/// full. Start the server with `--buckets 32` (one segment) and the index
/// splits all the while.
///
/// A burst's puts are sent at once (pipelined on one connection): sent one
/// by one, a loaded 2-vCPU VM stored 400 keys in 6 s, which one segment
/// holds without a split, and the test that relied on it failed.
pub struct Grower {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<u64>>,
}

impl Grower {
    /// Keys stored per burst, and the pause after each.
    const BURST: u64 = 50;
    const PAUSE: Duration = Duration::from_millis(50);

    /// Starts storing keys at the server whose RPC address is `rpc`.
    pub fn start(rpc: &str) -> Grower {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (rpc, flag) = (rpc.to_string(), std::sync::Arc::clone(&stop));
        let handle = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("grower runtime");
            rt.block_on(async move {
                let cfg = dmkv_client::ClientConfig::default().read_path(dmkv_client::ReadPath::Rpc);
                let c = dmkv_client::Client::connect_with(&rpc, cfg).await.expect("grower connects");
                let mut n = 0u64;
                while !flag.load(Ordering::Relaxed) {
                    let mut burst = tokio::task::JoinSet::new();
                    for i in n..n + Self::BURST {
                        let c = c.clone();
                        burst.spawn(async move { c.put(format!("grow-{i}"), "g").await.is_ok() });
                    }
                    let stored = burst.join_all().await;
                    n += stored.iter().filter(|&&ok| ok).count() as u64;
                    if stored.contains(&false) {
                        break;
                    }
                    tokio::time::sleep(Self::PAUSE).await;
                }
                n
            })
        });
        Grower { stop, handle: Some(handle) }
    }

    /// Stops and says how many keys it stored.
    pub fn stop(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle.take().map_or(0, |h| h.join().expect("grower thread"))
    }
}

impl Drop for Grower {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}
