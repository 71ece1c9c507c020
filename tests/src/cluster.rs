//! A cluster of real `dmkvd` processes on loopback for tests: a cluster
//! file with ports picked at run time, nodes that can be killed (SIGKILL)
//! and restarted.
//!
//! Clients reach every node on 127.0.0.1; each node's peer address (raft
//! traffic, which nodes also dial from) is on a loopback IP of its own,
//! `127.A.B.(i+1)`, in a block derived from the process id and a
//! process-wide counter, so that rules dropping one node's traffic to the
//! others (see [`crate::partition`]) touch neither client traffic nor
//! other clusters, in this process or others.

use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use dmkv_common::cluster::map::{META_REPLICAS, META_SHARD};

use crate::ServerProcess;

/// A running test cluster; its nodes stop when it is dropped.
pub struct TestCluster {
    dir: PathBuf,
    file: PathBuf,
    /// Node i+1's process (`None`: killed or stopped).
    nodes: Vec<Option<ServerProcess>>,
    rpc: Vec<String>,
    peer_ips: Vec<Ipv4Addr>,
    args: Vec<String>,
    durable: bool,
    /// Each node's data directory's own file system, when asked for
    /// ([`TestCluster::try_start_on_tmpfs`]); unmounted after the nodes stop.
    disks: Vec<crate::disk::Tmpfs>,
}

fn free_port() -> u16 {
    free_port_on(Ipv4Addr::LOCALHOST)
}

fn free_port_on(ip: Ipv4Addr) -> u16 {
    held_port_on(ip).1
}

/// A free port on `ip`, held bound until the listener is dropped: ports
/// picked one after another while the earlier ones are still held are
/// distinct (released at once, the kernel may hand the same port out
/// again). Released before dmkvd binds it: another process could take it
/// in between, which a test would report as a failed start.
fn held_port_on(ip: Ipv4Addr) -> (TcpListener, u16) {
    let l = TcpListener::bind((ip, 0)).expect("a free port");
    let port = l.local_addr().expect("a bound address").port();
    (l, port)
}

/// Clusters started by this process so far.
static CLUSTERS: AtomicU32 = AtomicU32::new(0);

/// Loopback IPs for the peer addresses of `nodes` nodes: `127.A.B.1` on,
/// with A in 1..=254 (never 127.0.x.x, where 127.0.0.1 is) and B from the
/// process id and the count of clusters started. Every 127/8 address is
/// local on Linux: nothing needs configuring.
fn peer_ips(nodes: usize) -> Vec<Ipv4Addr> {
    assert!(nodes <= 254, "at most 254 nodes per test cluster");
    const BLOCKS: u32 = 254 * 256;
    let n = CLUSTERS.fetch_add(1, Ordering::Relaxed);
    let block = std::process::id().wrapping_mul(2_654_435_761).wrapping_add(n.wrapping_mul(97)) % BLOCKS;
    let (a, b) = (1 + block / 256, block % 256);
    (1..=nodes).map(|h| Ipv4Addr::new(127, a as u8, b as u8, h as u8)).collect()
}

impl TestCluster {
    /// Starts `nodes` nodes holding `shards` shards of `replicas` replicas;
    /// with `durable`, each keeps its raft log in its own data directory.
    /// `args` go to every dmkvd, `{id}` in them replaced by the node's id.
    pub fn start(nodes: usize, shards: u32, replicas: usize, durable: bool, args: &[&str]) -> TestCluster {
        TestCluster::try_start(nodes, shards, replicas, durable, args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`TestCluster::start`] without the panic, for tools (benchmarks)
    /// that report a cluster that did not come up as an error.
    pub fn try_start(
        nodes: usize,
        shards: u32,
        replicas: usize,
        durable: bool,
        args: &[&str],
    ) -> Result<TestCluster, String> {
        TestCluster::try_start_with(nodes, 0, shards, replicas, durable.then_some(None), args)
    }

    /// [`TestCluster::start`] of `nodes` nodes holding the shards and
    /// `spares` more (the last ones, `spare = true` in the cluster file)
    /// holding none.
    pub fn start_with_spares(
        nodes: usize,
        spares: usize,
        shards: u32,
        replicas: usize,
        durable: bool,
        args: &[&str],
    ) -> TestCluster {
        TestCluster::try_start_with_spares(nodes, spares, shards, replicas, durable, args)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`TestCluster::start_with_spares`] without the panic.
    pub fn try_start_with_spares(
        nodes: usize,
        spares: usize,
        shards: u32,
        replicas: usize,
        durable: bool,
        args: &[&str],
    ) -> Result<TestCluster, String> {
        TestCluster::try_start_with(nodes, spares, shards, replicas, durable.then_some(None), args)
    }

    /// A durable [`TestCluster::try_start`] whose nodes each keep their
    /// data directory on a tmpfs of `bytes` of its own, which
    /// [`TestCluster::disk`] can fill.
    pub fn try_start_on_tmpfs(
        nodes: usize,
        shards: u32,
        replicas: usize,
        bytes: u64,
        args: &[&str],
    ) -> Result<TestCluster, String> {
        TestCluster::try_start_with(nodes, 0, shards, replicas, Some(Some(bytes)), args)
    }

    /// `durable`: `None`, no data directories; `Some(tmpfs)`, each node's,
    /// on a tmpfs of that size if given. The last `spares` nodes are spares.
    fn try_start_with(
        placed: usize,
        spares: usize,
        shards: u32,
        replicas: usize,
        durable: Option<Option<u64>>,
        args: &[&str],
    ) -> Result<TestCluster, String> {
        let dir = std::env::temp_dir().join(format!("dmkv-cluster-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let nodes = placed + spares;
        let mut text = format!("shards = {shards}\nreplicas = {replicas}\n");
        let mut rpc = Vec::new();
        let ips = peer_ips(nodes);
        let mut held = Vec::new();
        for (id, ip) in (1..=nodes).zip(&ips) {
            let (rl, rp) = held_port_on(Ipv4Addr::LOCALHOST);
            let (pl, pp) = held_port_on(*ip);
            held.extend([rl, pl]);
            let (r, p) = (format!("127.0.0.1:{rp}"), format!("{ip}:{pp}"));
            text += &format!("[[node]]\nid = {id}\nrpc = \"{r}\"\npeer = \"{p}\"\nspare = {}\n", id > placed);
            rpc.push(r);
        }
        drop(held);
        let file = dir.join("cluster.toml");
        std::fs::write(&file, text).map_err(|e| format!("cannot write {}: {e}", file.display()))?;
        let mut c = TestCluster {
            dir,
            file,
            nodes: (0..nodes).map(|_| None).collect(),
            rpc,
            peer_ips: ips,
            args: args.iter().map(|s| s.to_string()).collect(),
            durable: durable.is_some(),
            disks: Vec::new(),
        };
        if let Some(Some(bytes)) = durable {
            for i in 0..nodes {
                c.disks.push(crate::disk::Tmpfs::mount(&c.data_dir(i), bytes)?);
            }
        }
        for i in 0..nodes {
            c.try_restart(i)?;
        }
        // Clients of TLS or authenticating clusters bring their own
        // settings: their tests wait for what they need.
        if !c.args.iter().any(|a| a == "--tls-cert" || a == "--auth-file") {
            c.wait_settled(placed, shards, replicas)?;
        }
        Ok(c)
    }

    /// Waits (up to 20 s) until every shard, and the metadata group, has a
    /// leader whose members are `replicas` voters on distinct nodes (the
    /// metadata group: the first three that are not spares) and no
    /// learner: nodes that start apart can have one join as a new member
    /// first.
    fn wait_settled(&self, placed: usize, shards: u32, replicas: usize) -> Result<(), String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("cannot start a runtime: {e}"))?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let settled = rt.block_on(async {
                let mut ok = std::collections::BTreeSet::new();
                for i in 0..self.rpc.len() {
                    let Ok(c) = dmkv_client::Client::connect(self.rpc(i)).await else { continue };
                    let Ok(s) = c.cluster_status().await else { continue };
                    for r in s.local.iter().filter(|r| r.role == "leader") {
                        // The metadata group has its own size: the first
                        // three nodes.
                        let want = match r.shard {
                            META_SHARD => placed.min(META_REPLICAS),
                            _ => replicas,
                        };
                        let nodes: std::collections::BTreeSet<u64> = r.voters.iter().map(|v| v >> 32).collect();
                        if r.learners.is_empty() && r.voters.len() == want && nodes.len() == want {
                            ok.insert(r.shard);
                        }
                    }
                }
                ok.len() == shards as usize + 1
            });
            if settled {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                let lines: Vec<String> =
                    (0..self.rpc.len()).map(|i| format!("node {}: {}", i + 1, self.last_log_line(i))).collect();
                return Err(format!(
                    "the cluster's members did not settle within 20 s; each node's last log line:\n{}",
                    lines.join("\n")
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Starts node index `i` (id `i + 1`) again, or for the first time.
    pub fn restart(&mut self, i: usize) {
        self.try_restart(i).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`TestCluster::restart`] without the panic.
    pub fn try_restart(&mut self, i: usize) -> Result<(), String> {
        self.try_restart_with(i, &[])
    }

    /// [`TestCluster::restart`] under `prefix` (a program and its
    /// arguments that run dmkvd, e.g. `env VAR=value`).
    pub fn restart_with(&mut self, i: usize, prefix: &[&str]) {
        let prefix: Vec<std::ffi::OsString> = prefix.iter().map(Into::into).collect();
        self.try_restart_with(i, &prefix).unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_restart_with(&mut self, i: usize, prefix: &[std::ffi::OsString]) -> Result<(), String> {
        let id = (i + 1).to_string();
        let data = self.data_dir(i);
        let file = self.file.to_string_lossy().to_string();
        let data = data.to_string_lossy().to_string();
        let mut args: Vec<&str> = vec!["--cluster", &file, "--node-id", &id];
        if !self.args.iter().any(|a| a == "--memory") {
            args.extend(["--memory", "32MiB"]);
        }
        if self.durable {
            args.extend(["--data-dir", &data]);
        }
        // `{id}` in an argument is the node's id: each node its own file.
        let own: Vec<String> = self.args.iter().map(|a| a.replace("{id}", &id)).collect();
        args.extend(own.iter().map(String::as_str));
        // Appended to: a node's log from before a restart (why it crashed)
        // is what a failure report needs most.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("node{id}.log")))
            .and_then(|mut f| {
                use std::io::Write;
                writeln!(f, "== the test starts node {id}").map(|_| f)
            })
            .ok();
        let p = ServerProcess::start_logged(prefix, &self.rpc[i], &args, log)
            .map_err(|e| format!("node {id}: {e}: {}", self.last_log_line(i)))?;
        self.nodes[i] = Some(p);
        Ok(())
    }

    /// Kills every node with SIGKILL, then starts them all again (from
    /// their data directories, when durable).
    pub fn restart_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
        for i in 0..self.nodes.len() {
            self.restart(i);
        }
    }

    /// Stops node index `i` as an operator does (SIGTERM, then waits for
    /// it to exit, bounded); its exit status.
    pub fn stop(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        self.nodes[i].take().and_then(|mut p| p.stop())
    }

    /// Kills node index `i` with SIGKILL.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].take() {
            p.kill();
        }
    }

    /// Sends node index `i` a signal by name (`STOP`, `CONT`); whether it
    /// runs and the signal was sent.
    pub fn signal(&self, i: usize, sig: &str) -> bool {
        self.nodes[i].as_ref().is_some_and(|p| p.signal(sig))
    }

    /// Node index `i`'s process id, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.nodes[i].as_ref().map(ServerProcess::pid)
    }

    /// Whether node index `i` was started and has not exited (a crash
    /// shows here; a node killed by the test is not running either).
    pub fn running(&mut self, i: usize) -> bool {
        self.nodes[i].as_mut().is_some_and(ServerProcess::is_running)
    }

    /// Whether node index `i` was started and not killed by the test
    /// (it may have exited by itself since: see [`TestCluster::running`]).
    pub fn started(&self, i: usize) -> bool {
        self.nodes[i].is_some()
    }

    /// Forgets node index `i`'s process, which exited by itself, so that
    /// it can be restarted; its exit status.
    pub fn reap(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        self.nodes[i].take().and_then(|mut p| p.stop())
    }

    /// Node index `i`'s data directory (used only when durable).
    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.join(format!("node{}", i + 1))
    }

    /// The file system under node index `i`'s data directory, if the
    /// cluster was started on tmpfs.
    pub fn disk(&mut self, i: usize) -> Option<&mut crate::disk::Tmpfs> {
        self.disks.get_mut(i)
    }

    /// How many nodes the cluster has.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Freezes node index `i` (SIGSTOP): its threads stop, its memory
    /// stays mapped by same-host readers, as a node stalled by its host.
    pub fn pause(&self, i: usize) {
        let p = self.nodes[i].as_ref().expect("a running node");
        assert!(p.signal("STOP"), "kill -STOP node {}", i + 1);
    }

    /// Lets a paused node run on (SIGCONT).
    pub fn resume(&self, i: usize) {
        let p = self.nodes[i].as_ref().expect("a running node");
        assert!(p.signal("CONT"), "kill -CONT node {}", i + 1);
    }

    /// Waits (up to 20 s) until node `i` knows a leader for every shard;
    /// returns its map.
    pub async fn leaders_known(&self, i: usize) -> dmkv_common::cluster::map::ClusterMap {
        match self.try_leaders_known(i).await {
            Ok(m) => m,
            Err(e) => panic!("{e}; node log:\n{}", self.log(i)),
        }
    }

    /// [`TestCluster::leaders_known`] without the panic.
    pub async fn try_leaders_known(&self, i: usize) -> Result<dmkv_common::cluster::map::ClusterMap, String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            if let Ok(client) = dmkv_client::Client::connect(self.rpc(i)).await
                && let Ok(m) = client.cluster_map().await
                && m.shards().iter().all(|s| s.leader.is_some())
            {
                return Ok(m);
            }
            if std::time::Instant::now() >= deadline {
                return Err(format!("node {}: no leader for every shard within 20 s", i + 1));
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Node index `i`'s RPC address.
    pub fn rpc(&self, i: usize) -> &str {
        &self.rpc[i]
    }

    /// Bytes each of the first `shards` data shards' leader holds, as the
    /// nodes report them (0 for a shard whose leader did not answer).
    pub async fn shard_bytes(&self, shards: u32) -> Vec<u64> {
        let mut bytes = vec![0u64; shards as usize];
        for i in 0..self.len() {
            let Ok(client) = dmkv_client::Client::connect(self.rpc(i)).await else { continue };
            let Ok(s) = client.cluster_status().await else { continue };
            for r in s.local.iter().filter(|r| r.role == "leader" && r.shard < shards) {
                bytes[r.shard as usize] = r.bytes;
            }
        }
        bytes
    }

    /// Runs the `dmkv` CLI against node index `i` with `args`; whether it
    /// succeeded, and its stdout (on success) or stderr.
    pub fn cli(&self, i: usize, args: &[&str]) -> (bool, String) {
        cli_at(self.rpc(i), args)
    }

    /// The address node index `i` printed for `name` ("rpc", "engine",
    /// "shm", "peer"), while it runs.
    pub fn endpoint(&self, i: usize, name: &str) -> Option<&str> {
        self.nodes[i].as_ref()?.endpoint(name)
    }

    /// The IP of node index `i`'s peer address, which its raft traffic
    /// comes from and goes to.
    pub fn peer_ip(&self, i: usize) -> Ipv4Addr {
        self.peer_ips[i]
    }

    /// The cluster file.
    pub fn file(&self) -> &std::path::Path {
        &self.file
    }

    /// The last line node `i` logged, for one-line errors.
    pub fn last_log_line(&self, i: usize) -> String {
        self.log(i).lines().last().unwrap_or("(nothing logged)").to_string()
    }

    /// Node `i`'s log so far (for failure messages).
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.dir.join(format!("node{}.log", i + 1))).unwrap_or_default()
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut p) = n.take() {
                // A paused node would not act on the stop signal.
                p.signal("CONT");
                p.stop();
            }
        }
        // Unmounted first: what is left is the directories alone.
        self.disks.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs the `dmkv` CLI against the node at `rpc` with `args`; whether it
/// succeeded, and its stdout (on success) or stderr.
pub fn cli_at(rpc: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(crate::bin_path("dmkv"))
        .args(["--server", rpc])
        .args(args)
        .output()
        .expect("run dmkv");
    let text = if out.status.success() { &out.stdout } else { &out.stderr };
    (out.status.success(), String::from_utf8_lossy(text).into_owned())
}
