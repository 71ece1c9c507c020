//! A cluster of real `dmkvd` processes on loopback for tests: a cluster
//! file with ports picked at run time, nodes that can be killed (SIGKILL)
//! and restarted.

use std::net::TcpListener;
use std::path::PathBuf;

use crate::ServerProcess;

/// A running test cluster; its nodes stop when it is dropped.
pub struct TestCluster {
    dir: PathBuf,
    file: PathBuf,
    /// Node i+1's process (`None`: killed or stopped).
    nodes: Vec<Option<ServerProcess>>,
    rpc: Vec<String>,
    args: Vec<String>,
    durable: bool,
}

fn free_port() -> u16 {
    // Bound then released: another process could take it in between, which
    // a test would report as a failed start.
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl TestCluster {
    /// Starts `nodes` nodes holding `shards` shards of `replicas` replicas;
    /// with `durable`, each keeps its raft log in its own data directory.
    /// `args` go to every dmkvd.
    pub fn start(nodes: usize, shards: u32, replicas: usize, durable: bool, args: &[&str]) -> TestCluster {
        let dir = std::env::temp_dir().join(format!("dmkv-cluster-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).expect("cluster test dir");
        let mut text = format!("shards = {shards}\nreplicas = {replicas}\n");
        let mut rpc = Vec::new();
        for id in 1..=nodes {
            let (r, p) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
            text += &format!("[[node]]\nid = {id}\nrpc = \"{r}\"\npeer = \"{p}\"\n");
            rpc.push(r);
        }
        let file = dir.join("cluster.toml");
        std::fs::write(&file, text).expect("write cluster file");
        let mut c = TestCluster {
            dir,
            file,
            nodes: (0..nodes).map(|_| None).collect(),
            rpc,
            args: args.iter().map(|s| s.to_string()).collect(),
            durable,
        };
        for i in 0..nodes {
            c.restart(i);
        }
        c
    }

    /// Starts node index `i` (id `i + 1`) again, or for the first time.
    pub fn restart(&mut self, i: usize) {
        let id = (i + 1).to_string();
        let data = self.dir.join(format!("node{id}"));
        let file = self.file.to_string_lossy().to_string();
        let data = data.to_string_lossy().to_string();
        let mut args: Vec<&str> = vec!["--cluster", &file, "--node-id", &id, "--memory", "32MiB"];
        if self.durable {
            args.extend(["--data-dir", &data]);
        }
        args.extend(self.args.iter().map(String::as_str));
        let log = std::fs::File::create(self.dir.join(format!("node{id}.log"))).ok();
        let p = ServerProcess::start_logged(&[], &self.rpc[i], &args, log).unwrap_or_else(|e| panic!("node {id}: {e}"));
        self.nodes[i] = Some(p);
    }

    /// Kills node index `i` with SIGKILL.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].take() {
            p.kill();
        }
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
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            if let Ok(client) = dmkv_client::Client::connect(self.rpc(i)).await
                && let Ok(m) = client.cluster_map().await
                && m.shards().iter().all(|s| s.leader.is_some())
            {
                return m;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no leader for every shard within 20 s; node log:\n{}",
                self.log(i)
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Node index `i`'s RPC address.
    pub fn rpc(&self, i: usize) -> &str {
        &self.rpc[i]
    }

    /// The cluster file.
    pub fn file(&self) -> &std::path::Path {
        &self.file
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
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
