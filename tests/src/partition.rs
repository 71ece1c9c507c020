//! Network partitions between processes on loopback, for tests: nftables
//! rules that drop every packet between one address and others, in both
//! directions ([`Partition::isolate`]) or in one only
//! ([`Partition::one_way`]), while everything else (clients on 127.0.0.1)
//! flows.
//!
//! Each [`Partition`] is one nftables table of its own, named after the
//! process id and a process-wide counter (`dmkv_part_PID_N`), holding one
//! chain on the output hook (loopback packets pass it once per direction).
//! Tests in this process and in others add and remove their own tables
//! without touching anyone else's rules. Dropping a [`Partition`] deletes
//! its table (the partition heals), also while a test panics; tables left
//! by processes that no longer exist (killed with SIGKILL) are deleted by
//! the next [`Partition::isolate`].
//!
//! Clients can be put on the isolated node's side too, as readers on the
//! isolated node's host would be: threads that [`join_side`] make their
//! sockets with a group id of the test's, and
//! [`Partition::isolate_with_clients`] drops those sockets' packets to the
//! other nodes' client endpoints (`meta skgid`), while the test's other
//! threads reach every node.
//!
//! Needs root and `nft` (Debian package `nftables`). Like
//! [`crate::netns`], tests skip where it is unavailable, unless skips are
//! not allowed ([`crate::skip::required`], as in CI): then they fail.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// Table names start so.
const PREFIX: &str = "dmkv_part_";

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Packets dropped by a [`Partition`]'s rules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Between the isolated node and the others, both ways.
    pub nodes: u64,
    /// From the isolated side's clients to the other nodes.
    pub clients: u64,
}

/// Packets between one address and others dropped, until dropped.
#[derive(Debug)]
pub struct Partition {
    table: String,
}

impl Partition {
    /// Whether partitions can be made here: root, `nft` installed, a table
    /// can be added and deleted. Computed once per process.
    pub fn available() -> Result<(), String> {
        static ANSWER: OnceLock<Result<(), String>> = OnceLock::new();
        ANSWER.get_or_init(probe).clone()
    }

    /// Whether `test`, which needs partitions, can run: `true` if they are
    /// [available](Partition::available). If not, it says why and returns
    /// `false` so the test skips, unless skips are not allowed
    /// ([`crate::skip::required`]; CI installs nftables): then a skip
    /// would hide a broken setup, so it panics.
    pub fn available_or_skip(test: &str) -> bool {
        match Partition::available() {
            Ok(()) => true,
            Err(e) => crate::skip::skip(test, &format!("packet filtering (nftables) unavailable here: {e}")),
        }
    }

    /// Drops every IPv4 packet from `node` to any of `others` and back.
    pub fn isolate(node: Ipv4Addr, others: &[Ipv4Addr]) -> Result<Partition, String> {
        Partition::isolate_with_clients(node, others, None, &[])
    }

    /// [`Partition::isolate`], and with `side` (a group id given to
    /// [`join_side`]) the packets of sockets made by threads of that group
    /// to any of `endpoints` (the other nodes' client ports) are dropped
    /// too: those clients are on `node`'s side of the partition.
    pub fn isolate_with_clients(
        node: Ipv4Addr,
        others: &[Ipv4Addr],
        side: Option<u32>,
        endpoints: &[SocketAddrV4],
    ) -> Result<Partition, String> {
        if others.is_empty() {
            return Err("no address to isolate from".into());
        }
        let set = others.iter().map(Ipv4Addr::to_string).collect::<Vec<_>>().join(", ");
        let mut rules = vec![
            format!("ip saddr {node} ip daddr {{ {set} }} counter drop"),
            format!("ip saddr {{ {set} }} ip daddr {node} counter drop"),
        ];
        if let Some(gid) = side
            && !endpoints.is_empty()
        {
            let eps = endpoints.iter().map(|e| format!("{} . {}", e.ip(), e.port())).collect::<Vec<_>>().join(", ");
            rules.push(format!("meta skgid {gid} ip daddr . tcp dport {{ {eps} }} counter drop"));
        }
        Partition::install(&rules)
    }

    /// Drops the IPv4 packets from each pair's first address to its
    /// second, and nothing the other way: an asymmetric partition, as a
    /// bad NIC queue, a one-way firewall rule or a route that lost its
    /// return path makes. A TCP connection across it still delivers in
    /// the open direction (only its ACKs back are lost); new connections
    /// dialled from the cut side do not complete.
    pub fn one_way(cuts: &[(Ipv4Addr, Ipv4Addr)]) -> Result<Partition, String> {
        if cuts.is_empty() {
            return Err("no direction to cut".into());
        }
        if let Some((a, _)) = cuts.iter().find(|(a, b)| a == b) {
            return Err(format!("cannot cut {a} from itself"));
        }
        let rules: Vec<String> = cuts.iter().map(|(a, b)| format!("ip saddr {a} ip daddr {b} counter drop")).collect();
        Partition::install(&rules)
    }

    /// Adds a table of this process's holding `rules` on the output hook.
    fn install(rules: &[String]) -> Result<Partition, String> {
        remove_stale();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let table = format!("{PREFIX}{}_{n}", std::process::id());
        // One script: the table appears with all its rules at once.
        let rules: String = rules.iter().map(|r| format!("\t\t{r}\n")).collect();
        let script = format!(
            "table inet {table} {{\n\tchain out {{\n\t\ttype filter hook output priority 0; policy accept;\n{rules}\t}}\n}}\n"
        );
        nft_script(&script)?;
        Ok(Partition { table })
    }

    /// Packets the rules dropped so far: proof that traffic was cut, not
    /// merely that rules exist.
    pub fn dropped(&self) -> Result<Dropped, String> {
        let out = nft(&["list", "table", "inet", &self.table])?;
        Ok(parse_dropped(&out))
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Ends the partition (as dropping it does), saying whether the table
    /// could be deleted.
    pub fn heal(mut self) -> Result<(), String> {
        let table = std::mem::take(&mut self.table);
        nft(&["delete", "table", "inet", &table]).map(|_| ())
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        if self.table.is_empty() {
            return;
        }
        if let Err(e) = nft(&["delete", "table", "inet", &self.table]) {
            eprintln!("partition: could not delete nftables table {}: {e}", self.table);
        }
    }
}

/// Puts the calling thread in group `gid` (real, effective, saved and
/// file-system ids; this thread only, unlike `setgid(2)` from libc): the
/// sockets it makes from now on carry that group, which
/// [`Partition::isolate_with_clients`] matches. For a runtime's threads,
/// call it from `on_thread_start`. Needs root (it stays root: the user id
/// and capabilities are unchanged).
pub fn join_side(gid: u32) -> Result<(), String> {
    let g = rustix::process::Gid::from_raw(gid);
    rustix::thread::set_thread_gid(g).map_err(|e| format!("cannot set this thread's group to {gid}: {e}"))?;
    match rustix::process::getgid().as_raw() {
        got if got == gid => Ok(()),
        got => Err(format!("this thread's group is {got}, not {gid}")),
    }
}

fn probe() -> Result<(), String> {
    if !is_root() {
        return Err("not running as root".into());
    }
    match Command::new("nft").arg("--version").output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => return Err(format!("`nft --version` failed: {}", String::from_utf8_lossy(&o.stderr).trim())),
        Err(e) => return Err(format!("`nft` not usable ({e}); install nftables")),
    }
    // Addresses no test uses: the probe's rules touch nothing.
    let p = Partition::isolate(Ipv4Addr::new(127, 255, 254, 1), &[Ipv4Addr::new(127, 255, 254, 2)])?;
    p.dropped()?;
    p.heal()
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(2) == Some("0")))
        .unwrap_or(false)
}

/// Runs `nft args`; its stdout, or an error naming the command and its stderr.
fn nft(args: &[&str]) -> Result<String, String> {
    let cmd = format!("nft {}", args.join(" "));
    let out = Command::new("nft").args(args).output().map_err(|e| format!("`{cmd}`: cannot run nft: {e}"))?;
    if !out.status.success() {
        return Err(format!("`{cmd}` failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `nft -f -` with `script` on its standard input.
fn nft_script(script: &str) -> Result<(), String> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run nft: {e}"))?;
    let written = child.stdin.take().map(|mut i| i.write_all(script.as_bytes()));
    let out = child.wait_with_output().map_err(|e| format!("nft -f -: {e}"))?;
    if let Some(Err(e)) = written {
        return Err(format!("nft -f -: writing the script: {e}"));
    }
    if !out.status.success() {
        return Err(format!(
            "nft -f - failed ({}): {}\n{script}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Deletes tables named by this module for processes that are gone.
fn remove_stale() {
    let Ok(list) = nft(&["list", "tables", "inet"]) else { return };
    for line in list.lines() {
        let Some(name) = line.split_whitespace().nth(2) else { continue };
        let Some(pid) =
            name.strip_prefix(PREFIX).and_then(|r| r.split_once('_')).and_then(|(p, _)| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = nft(&["delete", "table", "inet", name]);
        }
    }
}

/// The `counter packets N` of `nft list table` output, summed per kind of
/// rule (one rule a line; client rules match `skgid`).
fn parse_dropped(out: &str) -> Dropped {
    let mut d = Dropped::default();
    for line in out.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(n) =
            words.windows(3).find(|w| w[0] == "counter" && w[1] == "packets").and_then(|w| w[2].parse::<u64>().ok())
        else {
            continue;
        };
        if words.contains(&"skgid") {
            d.clients += n;
        } else {
            d.nodes += n;
        }
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_dropped_packets() {
        let out = "table inet dmkv_part_1_0 {\n\tchain out {\n\t\ttype filter hook output priority filter; policy accept;\n\
                   \t\tip saddr 127.1.2.1 ip daddr { 127.1.2.2, 127.1.2.3 } counter packets 12 bytes 720 drop\n\
                   \t\tip saddr { 127.1.2.2, 127.1.2.3 } ip daddr 127.1.2.1 counter packets 3 bytes 180 drop\n\
                   \t\tmeta skgid 4000001234 ip daddr . tcp dport { 127.0.0.1 . 7070 } counter packets 4 bytes 240 drop\n\t}\n}\n";
        assert_eq!(parse_dropped(out), Dropped { nodes: 15, clients: 4 });
        assert_eq!(parse_dropped(""), Dropped::default());
    }

    #[test]
    fn drops_traffic_between_the_addresses_only() {
        if !Partition::available_or_skip("drops_traffic_between_the_addresses_only") {
            return;
        }
        use std::net::{TcpListener, TcpStream};
        use std::time::Duration;
        let (a, b) = (Ipv4Addr::new(127, 255, 253, 1), Ipv4Addr::new(127, 255, 253, 2));
        let l = TcpListener::bind((b, 0)).expect("listen");
        let to = l.local_addr().unwrap();
        let p = Partition::isolate(a, &[b]).expect("partition");
        let from_a = connect_from(a, to);
        let from_localhost = TcpStream::connect_timeout(&to, Duration::from_millis(500));
        assert!(from_a.is_err(), "{a} reached {to} across the partition");
        assert!(from_localhost.is_ok(), "127.0.0.1 cut off: {from_localhost:?}");
        assert!(p.dropped().unwrap().nodes > 0);
        let table = p.table().to_string();
        drop(p);
        assert!(!nft(&["list", "tables"]).unwrap().contains(&table), "{table} left behind");
        assert!(connect_from(a, to).is_ok(), "still cut after the partition healed");
    }

    #[test]
    fn a_one_way_cut_drops_one_direction_only() {
        if !Partition::available_or_skip("a_one_way_cut_drops_one_direction_only") {
            return;
        }
        use std::net::UdpSocket;
        let (a, b) = (Ipv4Addr::new(127, 255, 253, 9), Ipv4Addr::new(127, 255, 253, 10));
        let (sa, sb) = (UdpSocket::bind((a, 0)).expect("bind"), UdpSocket::bind((b, 0)).expect("bind"));
        for s in [&sa, &sb] {
            s.set_read_timeout(Some(std::time::Duration::from_millis(300))).unwrap();
        }
        // Datagrams, not connections: a TCP handshake needs both ways. A
        // datagram dropped on the output hook fails its send (EPERM).
        let arrives = |from: &UdpSocket, to: &UdpSocket| {
            from.send_to(b"x", to.local_addr().unwrap()).is_ok() && to.recv(&mut [0u8; 8]).is_ok()
        };
        let p = Partition::one_way(&[(a, b)]).expect("partition");
        assert!(!arrives(&sa, &sb), "{a} reached {b} across the cut");
        assert!(arrives(&sb, &sa), "{b} to {a} was cut too");
        assert_eq!(p.dropped().unwrap().nodes, 1);
        assert!(Partition::one_way(&[(a, a)]).is_err());
        drop(p);
        assert!(arrives(&sa, &sb), "still cut after the partition healed");
    }

    #[test]
    fn cuts_a_sides_clients_from_the_endpoints_only() {
        if !Partition::available_or_skip("cuts_a_sides_clients_from_the_endpoints_only") {
            return;
        }
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let other = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let std::net::SocketAddr::V4(to) = l.local_addr().unwrap() else { unreachable!() };
        let other = other.local_addr().unwrap();
        let (a, b) = (Ipv4Addr::new(127, 255, 253, 5), Ipv4Addr::new(127, 255, 253, 6));
        let gid = 4_000_000_000 + std::process::id() % 1_000_000;
        let p = Partition::isolate_with_clients(a, &[b], Some(gid), &[to]).expect("partition");
        let on_side = std::thread::spawn(move || {
            join_side(gid).expect("join the side");
            (connect_from(Ipv4Addr::LOCALHOST, to.into()), connect_from(Ipv4Addr::LOCALHOST, other))
        })
        .join()
        .unwrap();
        assert!(on_side.0.is_err(), "a client on the isolated side reached {to}");
        assert!(on_side.1.is_ok(), "a client on the isolated side was cut from {other} too: {:?}", on_side.1);
        assert!(connect_from(Ipv4Addr::LOCALHOST, to.into()).is_ok(), "the test's own thread was cut off");
        assert!(p.dropped().unwrap().clients > 0);
    }

    /// A connection from `from` to `to`, given up after 500 ms.
    fn connect_from(from: Ipv4Addr, to: std::net::SocketAddr) -> Result<(), String> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        rt.block_on(async {
            let s = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
            s.bind((from, 0).into()).map_err(|e| e.to_string())?;
            match tokio::time::timeout(std::time::Duration::from_millis(500), s.connect(to)).await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("timed out".into()),
            }
        })
    }
}
