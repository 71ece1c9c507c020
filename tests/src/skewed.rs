//! A reader whose clocks are off: a child process (`dmkv-fault-reader`)
//! run under `faketime` with an offset, wall clock and monotonic clock
//! both shifted (`FAKETIME_DONT_FAKE_MONOTONIC` unset), as a client on a
//! host whose clock is wrong. Its GETs enter the parent's history in an
//! order that respects real time although the child's clock does not:
//!
//! ```text
//! child                         parent (Recorder)
//!   "get KEY"  ───────────────>   logs the read's invocation
//!              <───────────────   "go"
//!   GET KEY (SDK)
//!   "ok KEY VALUE" ───────────>   logs its return
//! ```
//!
//! so the logged invocation precedes the real one and the logged return
//! follows it: the logged interval contains the real one, which can only
//! make the check more lenient, never report what did not happen.
//!
//! libfaketime works by LD_PRELOAD: it fakes the clock calls that go
//! through libc (Rust's `SystemTime` and `Instant`, tokio's timers). Code
//! that reads the clock through the vDSO directly (rustix's
//! `clock_gettime` on its linux_raw backend, as the SDK's coarse
//! one-sided timer does) sees the true time: the offset reaches the lease
//! check (`SystemTime`) but not every clock.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use dmkv_client::{ReadPath, Transport};
use stateright::semantics::register::{RegisterOp, RegisterRet};

use crate::history::Recorder;
use crate::workload::{Totals, parse_value};

/// The child program, built from `src/bin/dmkv-fault-reader.rs`.
pub const READER_BIN: &str = "dmkv-fault-reader";
/// How long the child gets to connect and read every key once.
const READY_DEADLINE: Duration = Duration::from_secs(20);
/// After the stop, how long the child gets to finish its GET in flight
/// (its request timeout bounds it) before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Whether `faketime` is installed and shifts a child's wall clock.
pub fn faketime_available() -> Result<(), String> {
    static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();
    ANSWER.get_or_init(probe).clone()
}

fn probe() -> Result<(), String> {
    let out = Command::new("faketime")
        .args(["-f", "+100d", "date", "+%s"])
        .env_remove("FAKETIME_DONT_FAKE_MONOTONIC")
        .output()
        .map_err(|e| format!("`faketime` not usable ({e}); install faketime"))?;
    let faked: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .map_err(|_| format!("`faketime -f +100d date +%s` printed {:?}", String::from_utf8_lossy(&out.stdout)))?;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    match faked.checked_sub(now) {
        Some(d) if d > 99 * 86_400 => Ok(()),
        _ => Err(format!("faketime did not shift the clock (child {faked}, here {now})")),
    }
}

/// A reader in a child process under faketime.
pub struct SkewedReader {
    child: Child,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Totals>>,
}

/// The child's clock offset and read path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Skew {
    /// Milliseconds added to the child's clocks (negative: behind).
    pub offset_ms: i64,
    pub path: ReadPath,
    pub transport: Option<Transport>,
}

impl Skew {
    /// A label for reports, e.g. `faketime -5000ms get one-sided shm via 1`.
    pub fn label(&self, via: usize) -> String {
        let path = match (self.path, self.transport) {
            (ReadPath::Rpc, _) => "rpc".to_string(),
            (p, Some(t)) => format!("{} {}", p.name(), t.name()),
            (p, None) => p.name().to_string(),
        };
        format!("faketime {:+}ms get {path} via {}", self.offset_ms, via + 1)
    }
}

impl SkewedReader {
    /// Starts the child against `server` on `keys`; returns once it has
    /// read every key once. Its operations go into `recorder` under `label`.
    pub fn spawn(
        skew: Skew,
        server: &str,
        keys: &[String],
        recorder: &Recorder,
        label: &str,
    ) -> Result<SkewedReader, String> {
        let bin = crate::find_bin(READER_BIN)?;
        let offset = format!("{:+}", skew.offset_ms as f64 / 1000.0) + "s";
        let mut cmd = Command::new("faketime");
        cmd.args(["-m", "-f", &offset]).arg(&bin).args(["--server", server, "--path", skew.path.name()]);
        if let Some(t) = skew.transport {
            cmd.args(["--transport", t.name()]);
        }
        let mut child = cmd
            .args(["--keys", &keys.join(",")])
            .env_remove("FAKETIME_DONT_FAKE_MONOTONIC")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot run faketime {}: {e}", bin.display()))?;
        let mut to_child = child.stdin.take().expect("piped stdin");
        let from_child = child.stdout.take().expect("piped stdout");
        // Lines from the child through a channel: reads with a deadline.
        let (tx, lines) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            for line in BufReader::new(from_child).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        match lines.recv_timeout(READY_DEADLINE) {
            Ok(l) if l == "ready" => {}
            Ok(l) => {
                let _ = child.kill();
                return Err(format!("{label}: the child said {l:?} instead of ready"));
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{label}: the child was not ready within {READY_DEADLINE:?}"));
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, recorder, label) = (Arc::clone(&stop), recorder.clone(), label.to_string());
        let thread = std::thread::spawn(move || {
            let mut totals = Totals { label: label.clone(), ..Default::default() };
            let mut t = recorder.thread(&label);
            // Each round: the child asks, the parent logs and lets it go.
            while let Ok(ask) = lines.recv() {
                if let Some(stats) = ask.strip_prefix("stats ") {
                    let mut w = stats.split_whitespace().map(|n| n.parse().unwrap_or(0));
                    (totals.one_sided, totals.unleased) = (w.next().unwrap_or(0), w.next().unwrap_or(0));
                    continue;
                }
                let Some(key) = ask.strip_prefix("get ") else { break };
                if flag.load(Ordering::Relaxed) {
                    let _ = writeln!(to_child, "stop");
                    continue;
                }
                let began = recorder.elapsed();
                let start = Instant::now();
                recorder.invoke(t, &[key], RegisterOp::Read);
                if writeln!(to_child, "go").and_then(|_| to_child.flush()).is_err() {
                    break;
                }
                let Ok(answer) = lines.recv() else { break };
                let result = match answer.split_once(' ') {
                    Some(("ok", rest)) => {
                        let v = rest.split_once(' ').map(|(_, v)| v).unwrap_or("-");
                        let v = if v == "-" { None } else { Some(v.as_bytes()) };
                        parse_value(v).map(|v| recorder.ret(t, &[(key, RegisterRet::ReadOk(v))]))
                    }
                    _ => Err(answer.clone()),
                };
                if result.is_err() {
                    t = recorder.thread(&label);
                }
                totals.op(began, start.elapsed(), result);
            }
            totals
        });
        Ok(SkewedReader { child, stop, thread: Some(thread) })
    }

    /// Stops the child (killing it if it does not end within
    /// [`STOP_GRACE`]) and says what it did.
    pub fn stop(mut self) -> Totals {
        self.stop.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.thread.take().and_then(|h| h.join().ok()).unwrap_or_default()
    }
}

impl Drop for SkewedReader {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
