//! Network namespaces for tests and benchmarks that need a real network
//! path between client and server: one namespace joined to the root
//! namespace by a veth pair, with optional HTB rate limiting of what the
//! namespace sends from one TCP port.
//!
//! ```text
//! root namespace (clients)            namespace NAME (dmkvd)
//!   HOST_IF  10.a.b.c+1/30  <──veth──>  NS_IF  10.a.b.c+2/30
//!                                        egress: htb root 1:
//!                                          1:10 fast (default)
//!                                          1:20 slow, u32 match ip sport PORT
//! ```
//!
//! Everything is made with `ip` and `tc` (iproute2) and needs root. Names
//! and addresses derive from the process id and a process-wide counter, so
//! tests in one process and in other processes do not collide; an address
//! block already in use in the root namespace is skipped. Dropping a
//! [`Netns`] deletes the veth pair and the namespace, also while a test
//! panics. Namespaces left behind by processes that no longer exist
//! (killed with SIGKILL) are deleted, with any process still inside, by
//! the next [`Netns::new`].

use std::ffi::{OsStr, OsString};
use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// Set to `1`, tests needing namespaces (or packet rules) fail where they
/// cannot be made instead of skipping; defined with the skip policy.
pub use crate::skip::REQUIRE_ENV;

/// Candidate /30 blocks: 10.200.0.0 to 10.255.255.252.
const BLOCKS: u32 = 56 * 256 * 64;
/// How many names and address blocks `new` tries before giving up.
const ATTEMPTS: u32 = 64;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// A network namespace with a veth pair to the root namespace.
#[derive(Debug)]
pub struct Netns {
    name: String,
    host_if: String,
    ns_if: String,
    host_addr: Ipv4Addr,
    ns_addr: Ipv4Addr,
}

/// Counters of the slow HTB class (see [`Netns::shape_sport`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassStats {
    /// Bytes sent through the class.
    pub sent_bytes: u64,
    /// Packets dropped by its queue.
    pub dropped: u64,
    /// Bytes queued now.
    pub backlog_bytes: u64,
}

impl Netns {
    /// Whether namespaces can be made here: root, `ip` and `tc` installed,
    /// a namespace with a veth pair and an HTB qdisc can be created. The
    /// answer is computed once per process.
    pub fn available() -> Result<(), String> {
        static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();
        ANSWER.get_or_init(probe).clone()
    }

    /// Whether `test`, which needs namespaces, can run: `true` if they are
    /// [available](Netns::available). If not, it says why and returns
    /// `false` so the test skips, unless [`REQUIRE_ENV`] is `1` (as in CI,
    /// where namespaces work): then a skip would hide a broken setup, so it
    /// panics.
    pub fn available_or_skip(test: &str) -> bool {
        match Netns::available() {
            Ok(()) => true,
            Err(e) => crate::skip::skip(test, &format!("network namespaces unavailable here: {e}")),
        }
    }

    /// Creates a namespace, a veth pair into it, a /30 on the pair, and
    /// brings both ends and the namespace's `lo` up.
    pub fn new() -> Result<Netns, String> {
        if !is_root() {
            return Err("network namespaces need root".into());
        }
        remove_stale();
        let pid = std::process::id();
        let mut last_err = String::new();
        for _ in 0..ATTEMPTS {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            // "dk" + up to 7 digits of pid + "x" + counter + one letter: at
            // most 15 characters (IFNAMSIZ - 1) for counters below 10000.
            let base = format!("dk{pid}x{}", n % 10_000);
            let Some((host_addr, ns_addr)) = free_block(pid, n)? else {
                last_err = "no free 10.200.0.0/13 address block".into();
                continue;
            };
            if let Err(e) = run("ip", &["netns", "add", &base]) {
                // A leftover of a dead process whose pid we now have, or a
                // race with another process: try the next name.
                last_err = e;
                continue;
            }
            let ns = Netns {
                name: base.clone(),
                host_if: format!("{base}h"),
                ns_if: format!("{base}n"),
                host_addr,
                ns_addr,
            };
            // From here on, Drop cleans up whatever was made.
            ns.setup()?;
            return Ok(ns);
        }
        Err(format!("could not create a network namespace after {ATTEMPTS} tries: {last_err}"))
    }

    fn setup(&self) -> Result<(), String> {
        let (h, n, name) = (self.host_if.as_str(), self.ns_if.as_str(), self.name.as_str());
        run("ip", &["link", "add", h, "type", "veth", "peer", "name", n])?;
        run("ip", &["link", "set", n, "netns", name])?;
        run("ip", &["addr", "add", &format!("{}/30", self.host_addr), "dev", h])?;
        run("ip", &["link", "set", h, "up"])?;
        run("ip", &["-n", name, "addr", "add", &format!("{}/30", self.ns_addr), "dev", n])?;
        run("ip", &["-n", name, "link", "set", n, "up"])?;
        run("ip", &["-n", name, "link", "set", "lo", "up"])?;
        Ok(())
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Address of the root namespace's end of the veth pair.
    pub fn host_addr(&self) -> Ipv4Addr {
        self.host_addr
    }

    /// Address of the namespace's end: servers inside listen here.
    pub fn ns_addr(&self) -> Ipv4Addr {
        self.ns_addr
    }

    /// The veth end in the root namespace.
    pub fn host_if(&self) -> &str {
        &self.host_if
    }

    /// The veth end inside the namespace.
    pub fn ns_if(&self) -> &str {
        &self.ns_if
    }

    /// The words that run a program inside: `ip netns exec NAME`.
    pub fn exec_prefix(&self) -> Vec<OsString> {
        ["ip", "netns", "exec", &self.name].into_iter().map(OsString::from).collect()
    }

    /// `ip netns exec NAME prog`, to add arguments to and spawn. (`ip netns
    /// exec` execs the program, so the child's pid is the program's.)
    pub fn command(&self, prog: impl AsRef<OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(prog);
        c
    }

    /// Rate-limits what the namespace sends from TCP/UDP port `sport`
    /// (server to client, where read replies flow): an HTB root on the
    /// namespace's veth end with a fast default class 1:10 and a slow class
    /// 1:20 of `rate` (tc syntax: "40mbit"), selected by a u32 filter on the
    /// source port. `queue_limit_bytes` caps the slow class's FIFO (a bfifo,
    /// bytes because veth hands the qdisc GSO packets of up to 64 KiB), so
    /// its queueing delay stays near `limit / rate`. Replaces earlier shaping.
    pub fn shape_sport(&self, sport: u16, rate: &str, queue_limit_bytes: Option<u32>) -> Result<(), String> {
        let (name, dev) = (self.name.as_str(), self.ns_if.as_str());
        let _ = run("tc", &["-n", name, "qdisc", "del", "dev", dev, "root"]);
        run("tc", &["-n", name, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])?;
        // Explicit quanta: HTB's derived ones are out of range at these rates.
        let fast = ["-n", name, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb"];
        run("tc", &[&fast[..], &["rate", "10gbit", "quantum", "60000"]].concat())?;
        let slow = ["-n", name, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb"];
        run("tc", &[&slow[..], &["rate", rate, "ceil", rate, "quantum", "60000"]].concat())?;
        if let Some(limit) = queue_limit_bytes {
            let limit = limit.to_string();
            let q = ["-n", name, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "bfifo", "limit"];
            run("tc", &[&q[..], &[limit.as_str()]].concat())?;
        }
        let port = sport.to_string();
        let f = ["-n", name, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32"];
        run("tc", &[&f[..], &["match", "ip", "sport", &port, "0xffff", "flowid", "1:20"]].concat())?;
        Ok(())
    }

    /// Removes the shaping of [`Netns::shape_sport`].
    pub fn unshape(&self) -> Result<(), String> {
        run("tc", &["-n", &self.name, "qdisc", "del", "dev", &self.ns_if, "root"]).map(|_| ())
    }

    /// Counters of the slow class 1:20 (after [`Netns::shape_sport`]).
    pub fn slow_class_stats(&self) -> Result<ClassStats, String> {
        let out = run("tc", &["-s", "-n", &self.name, "class", "show", "dev", &self.ns_if, "classid", "1:20"])?;
        parse_class_stats(&out).ok_or_else(|| format!("no counters for class 1:20 in `tc -s class show`: {out:?}"))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting one end deletes the pair, synchronously; deleting the
        // namespace alone would leave the pair until the kernel's deferred
        // cleanup of the namespace.
        let _ = run("ip", &["link", "del", &self.host_if]);
        if let Err(e) = run("ip", &["netns", "del", &self.name]) {
            eprintln!("netns: could not delete namespace {}: {e}", self.name);
        }
    }
}

fn probe() -> Result<(), String> {
    if !is_root() {
        return Err("not running as root".into());
    }
    for tool in ["ip", "tc"] {
        match Command::new(tool).arg("-V").output() {
            Ok(o) if o.status.success() => {}
            Ok(o) => return Err(format!("`{tool} -V` failed: {}", String::from_utf8_lossy(&o.stderr).trim())),
            Err(e) => return Err(format!("`{tool}` not usable ({e}); install iproute2")),
        }
    }
    let ns = Netns::new()?;
    ns.shape_sport(9, "10mbit", Some(100_000)).map_err(|e| format!("HTB shaping unavailable: {e}"))?;
    ns.slow_class_stats()?;
    Ok(())
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(2) == Some("0")))
        .unwrap_or(false)
}

/// Runs `tool args`; its stdout, or an error naming the command and its stderr.
fn run(tool: &str, args: &[&str]) -> Result<String, String> {
    let cmd = format!("{tool} {}", args.join(" "));
    let out = Command::new(tool).args(args).output().map_err(|e| format!("`{cmd}`: cannot run {tool}: {e}"))?;
    if !out.status.success() {
        return Err(format!("`{cmd}` failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A /30 derived from (pid, n) that no root-namespace address falls in.
fn free_block(pid: u32, n: u32) -> Result<Option<(Ipv4Addr, Ipv4Addr)>, String> {
    let used: Vec<Ipv4Addr> = run("ip", &["-o", "-4", "addr", "show"])?
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            w.find(|&x| x == "inet")?;
            w.next()?.split('/').next()?.parse().ok()
        })
        .collect();
    // Spread pids over the blocks; the counter picks consecutive ones.
    let start = pid.wrapping_mul(2_654_435_761).wrapping_add(n.wrapping_mul(97)) % BLOCKS;
    for i in 0..ATTEMPTS {
        let b = (start + i) % BLOCKS;
        let base = u32::from(Ipv4Addr::new(10, 200, 0, 0)) + b * 4;
        if used.iter().all(|a| u32::from(*a) & !3 != base) {
            return Ok(Some((Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))));
        }
    }
    Ok(None)
}

/// Deletes namespaces named by this module for processes that are gone.
fn remove_stale() {
    let Ok(list) = run("ip", &["netns", "list"]) else { return };
    for line in list.lines() {
        let Some(name) = line.split_whitespace().next() else { continue };
        let Some(pid) = name.strip_prefix("dk").and_then(|r| r.split_once('x')).and_then(|(p, n)| {
            (n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty()).then_some(p)?.parse::<u32>().ok()
        }) else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            // A server its owner started there outlives a SIGKILLed owner.
            for p in run("ip", &["netns", "pids", name]).unwrap_or_default().split_whitespace() {
                let _ = Command::new("kill").args(["-KILL", p]).status();
            }
            let _ = run("ip", &["link", "del", &format!("{name}h")]);
            let _ = run("ip", &["netns", "del", name]);
        }
    }
}

fn parse_class_stats(out: &str) -> Option<ClassStats> {
    let words: Vec<&str> = out.split_whitespace().collect();
    let after = |w: &str| words.iter().position(|x| *x == w).and_then(|i| words.get(i + 1));
    let sent_bytes = after("Sent")?.parse().ok()?;
    let dropped = after("(dropped")?.trim_end_matches(',').parse().ok()?;
    let backlog_bytes = after("backlog")?.trim_end_matches('b').parse().unwrap_or(0);
    Some(ClassStats { sent_bytes, dropped, backlog_bytes })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tc_class_counters() {
        let out = "class htb 1:20 root leaf 20: prio 0 rate 40Mbit ceil 40Mbit burst 1600b cburst 1600b \n \
                   Sent 123456 bytes 89 pkt (dropped 7, overlimits 3 requeues 0) \n \
                   backlog 3028b 2p requeues 0\n lended: 1 borrowed: 0 giants: 0\n";
        assert_eq!(parse_class_stats(out), Some(ClassStats { sent_bytes: 123456, dropped: 7, backlog_bytes: 3028 }));
        assert_eq!(parse_class_stats(""), None);
    }

    #[test]
    fn creates_and_removes_everything() {
        if !Netns::available_or_skip("creates_and_removes_everything") {
            return;
        }
        let ns = Netns::new().expect("namespace");
        let (name, host_if) = (ns.name().to_string(), ns.host_if().to_string());
        assert!(run("ip", &["netns", "list"]).unwrap().lines().any(|l| l.split_whitespace().next() == Some(&name)));
        assert!(run("ip", &["link", "show", &host_if]).is_ok());
        let out =
            ns.command("ip").args(["-o", "-4", "addr", "show", "dev", ns.ns_if()]).output().expect("ip netns exec");
        assert!(String::from_utf8_lossy(&out.stdout).contains(&ns.ns_addr().to_string()), "{out:?}");
        ns.shape_sport(7070, "10mbit", Some(200_000)).expect("shaping");
        assert_eq!(ns.slow_class_stats().expect("class counters").sent_bytes, 0);
        ns.unshape().expect("unshape");
        drop(ns);
        assert!(!run("ip", &["netns", "list"]).unwrap().lines().any(|l| l.split_whitespace().next() == Some(&name)));
        assert!(run("ip", &["link", "show", &host_if]).is_err(), "{host_if} left behind");
    }

    #[test]
    fn names_fit_interface_names() {
        let longest = format!("dk{}x{}n", 4_194_304, 9_999);
        assert!(longest.len() <= 15, "{longest}");
    }
}
