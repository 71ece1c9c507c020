//! `dmkv`: the command-line client.
//!
//! Exit codes: 0 success, 1 key not found, 2 any error (with a one-line
//! message on stderr).

use std::io::{Read, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use dmkv_client::{ClientConfig, ReadPath, TlsOptions, Token, Transport, blocking::Client};

#[derive(Parser)]
#[command(name = "dmkv", version, about = "dmkv command-line client")]
struct Cli {
    /// Server RPC address.
    #[arg(long, short, default_value = "127.0.0.1:7070", env = "DMKV_SERVER")]
    server: String,
    /// Request timeout in milliseconds.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// How GETs go: auto (per GET, the cheaper of one-sided and RPC right
    /// now), one-sided, or rpc.
    #[arg(long, default_value = "auto")]
    path: ReadPath,
    /// Force a one-sided backend: shm or tcp (default: the best available).
    #[arg(long)]
    transport: Option<Transport>,
    /// File holding the secret to prove to a server that requires
    /// authentication (default: the DMKV_TOKEN environment variable).
    #[arg(long, value_name = "FILE")]
    token_file: Option<std::path::PathBuf>,
    /// Speak TLS, trusting the server certificates this CA (PEM) signs.
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<std::path::PathBuf>,
    /// Name the server's certificate must carry (default: the host of --server).
    #[arg(long, value_name = "NAME", requires = "tls_ca")]
    tls_server_name: Option<String>,
    /// Client certificate (PEM) for servers that require one; needs --tls-key.
    #[arg(long, value_name = "FILE", requires_all = ["tls_ca", "tls_key"])]
    tls_cert: Option<std::path::PathBuf>,
    /// Client certificate's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print the value of KEY.
    Get {
        key: String,
        /// Print the value exactly, without a trailing newline.
        #[arg(long)]
        raw: bool,
    },
    /// Store VALUE (or standard input, if VALUE is omitted) under KEY.
    Put { key: String, value: Option<String> },
    /// Delete KEY.
    #[command(alias = "delete")]
    Del { key: String },
    /// Print the server's counters.
    Stats,
    /// GET KEY repeatedly, then print how this client routed the GETs: per
    /// path the requests, probes, failures, retries, window, delays and
    /// repaths, and the switches between paths.
    Paths {
        key: String,
        /// GETs to issue.
        #[arg(long, default_value_t = 1000)]
        gets: u32,
    },
    /// Cluster commands (`dmkv cluster status`).
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
    /// Run the YCSB driver (`dmkv-ycsb`) against the server; arguments
    /// after `bench` go to it (try `dmkv bench --help`).
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Ask every node of the cluster for its state and print shards,
    /// leaders, terms, commit and applied indexes, and followers' lag.
    Status,
    /// Replace a node's replica of a shard by a new one with no state: it
    /// joins as a learner, catches up by snapshot, is promoted, and the old
    /// one is removed (for a replica whose state is lost or damaged).
    ReplaceReplica {
        #[arg(long)]
        shard: u32,
        /// The node whose replica is replaced.
        #[arg(long)]
        node: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(msg) => {
            eprintln!("dmkv: {msg}");
            ExitCode::from(2)
        }
    }
}

/// Runs `dmkv-ycsb` from next to this binary (or from PATH).
fn bench(server: &str, args: &[String]) -> Result<ExitCode, String> {
    let sibling = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.join("dmkv-ycsb"))).filter(|p| p.exists());
    let exe = sibling.unwrap_or_else(|| "dmkv-ycsb".into());
    let mut cmd = std::process::Command::new(&exe);
    let wants_help = args.iter().any(|a| a == "--help" || a == "-h");
    if !wants_help && !args.iter().any(|a| a == "--server" || a.starts_with("--server=")) {
        cmd.args(["--server", server]);
    }
    let status = cmd.args(args).status().map_err(|e| {
        format!("cannot run {}: {e} (build it with `cargo build --release --bin dmkv-ycsb`)", exe.display())
    })?;
    Ok(ExitCode::from(status.code().unwrap_or(2).clamp(0, 255) as u8))
}

fn run(cli: Cli) -> Result<ExitCode, String> {
    if let Cmd::Bench { args } = &cli.cmd {
        return bench(&cli.server, args);
    }
    let token = match &cli.token_file {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("cannot read token file {}: {e}", path.display()))?;
            Some(Arc::new(Token::new(&text).map_err(|e| format!("token file {}: {e}", path.display()))?))
        }
        None => None,
    };
    let tls = cli.tls_ca.map(|ca_file| TlsOptions {
        ca_file,
        server_name: cli.tls_server_name,
        client_cert: cli.tls_cert,
        client_key: cli.tls_key,
    });
    let cfg = ClientConfig {
        pool_size: 1,
        request_timeout: Duration::from_millis(cli.timeout_ms),
        read_path: cli.path,
        transport: cli.transport,
        token,
        tls,
        ..Default::default()
    };
    let client = Client::connect_with(cli.server, cfg.clone()).map_err(|e| e.to_string())?;
    let mut stdout = std::io::stdout().lock();
    match cli.cmd {
        Cmd::Get { key, raw } => match client.get(&key).map_err(|e| e.to_string())? {
            Some(v) => {
                stdout.write_all(&v).map_err(|e| e.to_string())?;
                if !raw {
                    stdout.write_all(b"\n").map_err(|e| e.to_string())?;
                }
                Ok(ExitCode::SUCCESS)
            }
            None => {
                eprintln!("dmkv: not found: {key}");
                Ok(ExitCode::from(1))
            }
        },
        Cmd::Put { key, value } => {
            let value = match value {
                Some(v) => v.into_bytes(),
                None => {
                    let mut buf = Vec::new();
                    std::io::stdin().read_to_end(&mut buf).map_err(|e| format!("reading stdin: {e}"))?;
                    buf
                }
            };
            client.put(&key, &value).map_err(|e| e.to_string())?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Del { key } => {
            if client.delete(&key).map_err(|e| e.to_string())? {
                Ok(ExitCode::SUCCESS)
            } else {
                eprintln!("dmkv: not found: {key}");
                Ok(ExitCode::from(1))
            }
        }
        Cmd::Stats => {
            let mut stats: Vec<_> = client.stats().map_err(|e| e.to_string())?.into_iter().collect();
            stats.sort();
            for (k, v) in stats {
                writeln!(stdout, "{k} {v}").map_err(|e| e.to_string())?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Paths { key, gets } => {
            let (mut found, start) = (0u32, std::time::Instant::now());
            for _ in 0..gets {
                found += u32::from(client.get(&key).map_err(|e| e.to_string())?.is_some());
            }
            let secs = start.elapsed().as_secs_f64();
            writeln!(stdout, "{gets} GETs of {key:?} ({found} found) in {secs:.3} s").map_err(|e| e.to_string())?;
            write!(stdout, "{}", client.path_stats()).map_err(|e| e.to_string())?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::Status } => {
            let status = cluster_status(&client, &cfg)?;
            write!(stdout, "{status}").map_err(|e| e.to_string())?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::ReplaceReplica { shard, node } } => {
            let map = client.cluster_status().map_err(|e| format!("{e} (is this server a cluster node?)"))?;
            let addr = map
                .nodes
                .iter()
                .find(|n| n.id == node)
                .ok_or_else(|| format!("node {node} is not in the cluster"))?
                .rpc
                .clone();
            let target = Client::connect_with(addr, cfg.clone()).map_err(|e| e.to_string())?;
            let id = target.replace_replica(shard).map_err(|e| e.to_string())?;
            writeln!(
                stdout,
                "node {node}'s replica of shard {shard} is now {} (incarnation {}): it joins and catches up; \
                 `dmkv cluster status` shows it among the members once it has",
                replica_name(id),
                id & u64::from(u32::MAX)
            )
            .map_err(|e| e.to_string())?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { .. } => unreachable!("handled before connecting"),
    }
}

/// A replica's raft id as node.incarnation.
fn replica_name(id: u64) -> String {
    format!("{}.{}", dmkv_common::cluster::map::node_of(id), id & u64::from(u32::MAX))
}

/// Every node's view, merged into one report.
fn cluster_status(seed: &Client, cfg: &ClientConfig) -> Result<String, String> {
    use std::fmt::Write as _;
    let first = seed.cluster_status().map_err(|e| format!("{e} (is this server a cluster node?)"))?;
    let mut views = Vec::new();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} nodes, {} shards, {} partitions",
        first.nodes.len(),
        first.shards.len(),
        first.partitions.len()
    );
    let _ = writeln!(out, "{:<6}{:<24}STATE", "NODE", "RPC");
    for n in &first.nodes {
        let state = match Client::connect_with(n.rpc.clone(), cfg.clone()).and_then(|c| c.cluster_status()) {
            Ok(v) => {
                views.push(v);
                "up".to_string()
            }
            Err(e) => format!("unreachable: {e}"),
        };
        let _ = writeln!(out, "{:<6}{:<24}{state}", n.id, n.rpc);
    }
    let _ =
        writeln!(out, "{:<7}{:<32}{:<8}{:<7}{:<8}{:<24}LAG", "SHARD", "MEMBERS", "LEADER", "TERM", "COMMIT", "APPLIED");
    for sh in &first.shards {
        // The replica that leads in the highest term has the freshest view.
        let mut lead: Option<(&dmkv_common::proto::ReplicaState, u64)> = None;
        let mut applied = Vec::new();
        for v in &views {
            for r in v.local.iter().filter(|r| r.shard == sh.id) {
                applied.push(format!("{}:{}", v.node_id, r.applied));
                if r.role == "leader" && lead.is_none_or(|(l, _)| r.term > l.term) {
                    lead = Some((r, v.node_id));
                }
            }
        }
        let mut replicas: Vec<String> = sh.replicas.iter().map(u64::to_string).collect();
        if let Some((r, _)) = lead {
            // The members as the leader applied them: node.incarnation,
            // learners marked ~.
            replicas = r.voters.iter().map(|&v| replica_name(v)).collect();
            replicas.extend(r.learners.iter().map(|&l| format!("~{}", replica_name(l))));
        }
        let (leader, term, commit, lag) = match lead {
            Some((r, node)) => {
                let mut lag: Vec<_> = r.lag.iter().map(|(n, l)| format!("{}:{l}", replica_name(*n))).collect();
                lag.sort();
                (node.to_string(), r.term.to_string(), r.commit.to_string(), lag.join(" "))
            }
            None => ("none".into(), "-".into(), "-".into(), String::new()),
        };
        let _ = writeln!(
            out,
            "{:<7}{:<32}{:<8}{:<7}{:<8}{:<24}{}",
            sh.id,
            replicas.join(","),
            leader,
            term,
            commit,
            applied.join(" "),
            lag
        );
    }
    Ok(out)
}
