//! Helpers for end-to-end tests: start real `dmkvd` processes on ports
//! picked at run time, wait for conditions with deadlines, clean up.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub mod netns;

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
        ServerProcess::spawn(prefix, listen, args, Stdio::inherit())
    }

    /// Like [`ServerProcess::start`], with the server's stderr written to
    /// `stderr` (a test that must see whether the server panicked reads it:
    /// a panic in a connection's task kills that task, not the process).
    pub fn start_logged(args: &[&str], stderr: std::fs::File) -> ServerProcess {
        ServerProcess::spawn(&[], "127.0.0.1:0", args, Stdio::from(stderr)).unwrap_or_else(|e| panic!("{e}"))
    }

    fn spawn(prefix: &[OsString], listen: &str, args: &[&str], stderr: Stdio) -> Result<ServerProcess, String> {
        let dmkvd = find_bin("dmkvd")?;
        let mut cmd = match prefix.split_first() {
            Some((prog, rest)) => {
                let mut c = Command::new(prog);
                c.args(rest).arg(&dmkvd);
                c
            }
            None => Command::new(&dmkvd),
        };
        let mut child = cmd
            .args(["--listen", listen, "--log", "warn"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(stderr)
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
