//! `dmkv`: the command-line client.
//!
//! Exit codes: 0 success, 1 key not found, 2 any error (with a one-line
//! message on stderr).

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
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
    /// Force a one-sided backend: rdma, shm (same host only) or tcp (the
    /// server's engine) [default: the best available]. If the server does
    /// not offer it (or this build lacks it), dmkv fails with exit 2 and
    /// says why, rather than reading over RPC. Not with --path rpc.
    #[arg(long, value_name = "rdma|shm|engine")]
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
    /// Store VALUE under KEY; `-` (or no VALUE, with standard input not a
    /// terminal) stores standard input.
    #[command(visible_alias = "set")]
    Put { key: String, value: Option<String> },
    /// Delete KEY.
    #[command(visible_alias = "delete")]
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
    /// A live view of the node, or of every node of its cluster, refreshed
    /// every interval: per node requests/s by op, p50/p99 latency (µs) of
    /// GETs and PUTs, GET hit ratio, region bytes used and free, items,
    /// one-sided reads the server's engine served, and replication lag.
    Top {
        /// Time between refreshes (e.g. 1s, 500ms).
        #[arg(long, default_value = "1s", value_parser = dmkv_client::top::parse_interval)]
        interval: Duration,
        /// Stop after this many refreshes [default: run until interrupted].
        #[arg(long)]
        iterations: Option<u64>,
    },
    /// Cluster commands (`dmkv cluster status`).
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
    /// Run the YCSB driver (`dmkv-ycsb`) against the server: arguments
    /// after `bench` go to it (`dmkv bench --help` lists them), and so do
    /// --server, --path, --transport, --tls-ca and --token-file given
    /// before `bench`, unless repeated after it.
    #[command(disable_help_flag = true)]
    Bench {
        /// Arguments for dmkv-ycsb.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "DMKV_YCSB_ARGS")]
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
    /// Move a partition (0 to 4095) to another shard while clients read
    /// and write it: copied, caught up, then cut over with its writes
    /// paused for the last round (docs/elasticity.md). Asked of the node
    /// leading the metadata group, wherever this command is pointed.
    MovePartition {
        partition: u32,
        /// The shard it moves to.
        #[arg(long)]
        to: u32,
        /// Most MiB/s the copy before the cut-over sends (default: the
        /// node's, 48; 0: as fast as the shards take it).
        #[arg(long, value_name = "MIB")]
        rate_mib: Option<u32>,
    },
    /// Even out the cluster: partition moves from the fullest shards to
    /// the emptiest (to within 1.1 of the mean fill), run one at a time in
    /// the background by the node leading the metadata group (watch them
    /// with `cluster status`), and leader transfers so every node leads
    /// about as many shards.
    Rebalance {
        /// Print the plan and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Most MiB/s each move's copy sends (default: the node's, 48).
        #[arg(long, value_name = "MIB")]
        rate_mib: Option<u32>,
    },
    /// Pause the move of a partition under way (before its cut-over):
    /// its mover stops after the round it is copying; `move-partition`
    /// with the same target carries it on.
    PauseMove { partition: u32 },
    /// Cancel the move of a partition under way (before its cut-over):
    /// the target drops what it took and the partition stays where it was.
    CancelMove { partition: u32 },
    /// Move a shard's replica from one node to another: the new one joins,
    /// catches up and votes before the old one leaves (docs/elasticity.md).
    MoveReplica {
        #[arg(long)]
        shard: u32,
        /// The node the replica leaves.
        #[arg(long)]
        from: u64,
        /// The node it goes to.
        #[arg(long)]
        to: u64,
    },
    /// Give a node (a spare, or one emptied by remove-node) its share of
    /// replicas, moved one at a time from the nodes holding the most; then
    /// `rebalance` spreads leaders. NODE is its id or its client address.
    AddNode { node: String },
    /// Move every replica off a node, one at a time, each to the node
    /// holding the fewest that has none of that shard; the node stays in
    /// the cluster as a spare. NODE is its id or its client address.
    RemoveNode { node: String },
    /// Hand a shard's leadership to another node's replica (before
    /// stopping a node by hand, or to spread leaders): the leader gives its
    /// lease up and hands over once that replica has caught up.
    TransferLeader {
        #[arg(long)]
        shard: u32,
        /// The node whose replica leads next.
        #[arg(long)]
        to: u64,
    },
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let explicit = Explicit::of(&matches);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    match run(cli, explicit) {
        Ok(code) => code,
        // As Unix tools do (`dmkv stats | head`): the output was not wanted.
        Err(Failure::ReaderGone) => ExitCode::SUCCESS,
        Err(Failure::Msg(msg)) => {
            eprintln!("dmkv: {msg}");
            ExitCode::from(2)
        }
    }
}

/// Why a command failed.
#[derive(Debug)]
enum Failure {
    /// Standard output was closed by its reader (a broken pipe): the
    /// command ends quietly.
    ReaderGone,
    /// Anything else, said on standard error.
    Msg(String),
}

impl From<String> for Failure {
    fn from(msg: String) -> Failure {
        Failure::Msg(msg)
    }
}

/// A failed write to standard output.
fn written(e: std::io::Error) -> Failure {
    if e.kind() == std::io::ErrorKind::BrokenPipe { Failure::ReaderGone } else { Failure::Msg(e.to_string()) }
}

/// Which global options the user gave (on the command line or through the
/// environment) rather than left at their defaults: only those are passed
/// on to `dmkv-ycsb`, whose own defaults differ per backend.
#[derive(Debug, Clone, Copy, Default)]
struct Explicit {
    server: bool,
    path: bool,
}

impl Explicit {
    fn of(m: &clap::ArgMatches) -> Explicit {
        let given = |id| {
            matches!(
                m.value_source(id),
                Some(clap::parser::ValueSource::CommandLine | clap::parser::ValueSource::EnvVariable)
            )
        };
        Explicit { server: given("server"), path: given("path") }
    }
}

/// The `dmkv-ycsb` arguments for `dmkv [GLOBALS] bench ARGS`: the globals
/// it shares with dmkv, unless ARGS give them again, then ARGS untouched
/// (`--help` included: it gets dmkv-ycsb's help).
fn bench_args(cli: &Cli, explicit: Explicit, args: &[String]) -> Result<Vec<String>, String> {
    if cli.tls_server_name.is_some() || cli.tls_cert.is_some() {
        return Err("dmkv bench: dmkv-ycsb takes no --tls-server-name, --tls-cert or --tls-key".into());
    }
    let has = |flag: &str| args.iter().any(|a| a == flag || a.strip_prefix(flag).is_some_and(|r| r.starts_with('=')));
    let mut out = Vec::new();
    let mut pass = |flag: &str, value: Option<String>| {
        if let Some(v) = value
            && !has(flag)
        {
            out.push(flag.to_string());
            out.push(v);
        }
    };
    pass("--server", explicit.server.then(|| cli.server.clone()));
    pass("--path", explicit.path.then(|| cli.path.name().to_string()));
    pass("--transport", cli.transport.map(|t| t.name().to_string()));
    pass("--tls-ca", cli.tls_ca.as_ref().map(|p| p.display().to_string()));
    out.extend(args.iter().cloned());
    Ok(out)
}

/// Runs `dmkv-ycsb` from next to this binary (or from PATH).
fn bench(args: &[String], token: Option<String>) -> Result<ExitCode, String> {
    let sibling = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.join("dmkv-ycsb"))).filter(|p| p.exists());
    let exe = sibling.unwrap_or_else(|| "dmkv-ycsb".into());
    let mut cmd = std::process::Command::new(&exe);
    // dmkv-ycsb takes its secret from the environment only.
    if let Some(t) = token {
        cmd.env(dmkv_client::client::TOKEN_ENV, t.trim());
    }
    let status = cmd.args(args).status().map_err(|e| {
        format!("cannot run {}: {e} (build it with `cargo build --release --bin dmkv-ycsb`)", exe.display())
    })?;
    Ok(ExitCode::from(status.code().unwrap_or(2).clamp(0, 255) as u8))
}

/// Where `put` takes its value from.
#[derive(Debug, PartialEq, Eq)]
enum ValueFrom {
    Arg(String),
    Stdin,
}

/// `put KEY VALUE`, `put KEY -` (standard input), or `put KEY` with
/// standard input piped in; `put KEY` at a terminal would wait for input
/// the user may not know is wanted, so it is refused.
fn value_from(value: Option<String>, stdin_is_terminal: bool) -> Result<ValueFrom, String> {
    match value {
        Some(v) if v == "-" => Ok(ValueFrom::Stdin),
        Some(v) => Ok(ValueFrom::Arg(v)),
        None if stdin_is_terminal => {
            Err("put: give VALUE, or `-` to read the value from standard input (`dmkv put KEY -`)".into())
        }
        None => Ok(ValueFrom::Stdin),
    }
}

fn run(cli: Cli, explicit: Explicit) -> Result<ExitCode, Failure> {
    if let Cmd::Bench { args } = &cli.cmd {
        let args = bench_args(&cli, explicit, args)?;
        let token = match &cli.token_file {
            Some(path) => Some(
                std::fs::read_to_string(path).map_err(|e| format!("cannot read token file {}: {e}", path.display()))?,
            ),
            None => None,
        };
        return Ok(bench(&args, token)?);
    }
    if let (Some(t), ReadPath::Rpc) = (cli.transport, cli.path) {
        return Err(format!(
            "--transport {t} forces a one-sided backend, but --path rpc reads only over RPC: drop one"
        )
        .into());
    }
    // Before connecting: a refused `put` must not wait for a server first.
    let put_value = match &cli.cmd {
        Cmd::Put { value, .. } => Some(value_from(value.clone(), std::io::stdin().is_terminal())?),
        _ => None,
    };
    let token = match &cli.token_file {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| format!("cannot read token file {}: {e}", path.display()))?;
            Some(Arc::new(Token::new(&text).map_err(|e| format!("token file {}: {e}", path.display()))?))
        }
        None => ClientConfig::token_from_env().map_err(|e| e.to_string())?,
    };
    let tls = cli.tls_ca.map(|ca_file| TlsOptions {
        ca_file,
        server_name: cli.tls_server_name,
        client_cert: cli.tls_cert,
        client_key: cli.tls_key,
    });
    let cfg = ClientConfig::default()
        .pool_size(1)
        .request_timeout(Duration::from_millis(cli.timeout_ms))
        .read_path(cli.path)
        .transport(cli.transport)
        .token(token)
        .tls(tls);
    let client = Client::connect_with(cli.server, cfg.clone()).map_err(|e| e.to_string())?;
    let mut stdout = std::io::stdout().lock();
    match cli.cmd {
        Cmd::Get { key, raw } => match client.get(&key).map_err(|e| e.to_string())? {
            Some(v) => {
                stdout.write_all(&v).map_err(written)?;
                if !raw {
                    stdout.write_all(b"\n").map_err(written)?;
                }
                Ok(ExitCode::SUCCESS)
            }
            None => {
                eprintln!("dmkv: not found: {key}");
                Ok(ExitCode::from(1))
            }
        },
        Cmd::Put { key, .. } => {
            let value = match put_value {
                Some(ValueFrom::Arg(v)) => v.into_bytes(),
                Some(ValueFrom::Stdin) => {
                    let mut buf = Vec::new();
                    std::io::stdin().read_to_end(&mut buf).map_err(|e| format!("reading stdin: {e}"))?;
                    buf
                }
                None => unreachable!("decided above for every put"),
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
                writeln!(stdout, "{k} {v}").map_err(written)?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Paths { key, gets } => {
            let (mut found, start) = (0u32, std::time::Instant::now());
            for _ in 0..gets {
                found += u32::from(client.get(&key).map_err(|e| e.to_string())?.is_some());
            }
            let secs = start.elapsed().as_secs_f64();
            writeln!(stdout, "{gets} GETs of {key:?} ({found} found) in {secs:.3} s").map_err(written)?;
            write!(stdout, "{}", client.path_stats()).map_err(written)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Top { interval, iterations } => {
            top(&client, &cfg, interval, iterations, &mut stdout)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::Status } => {
            let status = cluster_status(&client, &cfg)?;
            write!(stdout, "{status}").map_err(written)?;
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
            .map_err(written)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::Rebalance { dry_run, rate_mib } } => {
            let r = at_meta_leader(&client, &cfg, |c| c.rebalance(dry_run, rate_mib))?;
            write!(stdout, "{}", dmkv_client::moves::render_plan(&r)).map_err(written)?;
            if !dry_run {
                for l in &r.leads {
                    let done = transfer_leader(&client, &cfg, l.shard, l.to)?;
                    writeln!(stdout, "shard {}: leadership moved from node {} to node {}", l.shard, done.from, done.to)
                        .map_err(written)?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::PauseMove { partition } } => {
            let r = at_meta_leader(&client, &cfg, |c| c.control_move(partition, false))?;
            writeln!(stdout, "partition {partition}'s move to map version {}: {}", r.version, r.outcome)
                .map_err(written)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::CancelMove { partition } } => {
            let r = at_meta_leader(&client, &cfg, |c| c.control_move(partition, true))?;
            writeln!(
                stdout,
                "partition {partition}'s move to map version {}: {}; it stays on shard {}",
                r.version, r.outcome, r.from
            )
            .map_err(written)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::MovePartition { partition, to, rate_mib } } => {
            let r = at_meta_leader(&client, &cfg, |c| c.move_partition(partition, to, rate_mib))?;
            writeln!(
                stdout,
                "partition {partition} moved from shard {} to shard {to} (map version {}): {} keys, {} bytes, {} \
                 catch-up rounds; writes paused {:.3} ms; {} ms in all",
                r.from,
                r.version,
                r.keys,
                r.bytes,
                r.rounds,
                r.pause_us as f64 / 1000.0,
                r.total_ms
            )
            .map_err(written)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::MoveReplica { shard, from, to } } => {
            let r = at_meta_leader(&client, &cfg, |c| c.move_replica(shard, from, to))?;
            writeln!(stdout, "{}", replica_moved(shard, from, to, &r)).map_err(written)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::AddNode { node } } => {
            let map = current_map(&client)?;
            let id = node_named(&map, &node)?;
            let (shards, nodes) = placement_of(&map);
            let moves = dmkv_common::cluster::replica_plan::plan_add(&shards, &nodes, id);
            run_replica_moves(&client, &cfg, &moves, &mut stdout)?;
            writeln!(stdout, "node {id} holds its share ({} replicas moved to it)", moves.len()).map_err(written)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::RemoveNode { node } } => {
            let map = current_map(&client)?;
            let id = node_named(&map, &node)?;
            let (shards, nodes) = placement_of(&map);
            let moves = dmkv_common::cluster::replica_plan::plan_remove(&shards, &nodes, id)?;
            run_replica_moves(&client, &cfg, &moves, &mut stdout)?;
            writeln!(stdout, "node {id} holds no replica ({} moved off it); it stays a spare", moves.len())
                .map_err(written)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Cluster { cmd: ClusterCmd::TransferLeader { shard, to } } => {
            let r = transfer_leader(&client, &cfg, shard, to)?;
            let line = match r.from == r.to {
                true => format!("shard {shard}: node {to} leads it already (term {})", r.term),
                false => format!("shard {shard}: leadership moved from node {} to node {to} (term {})", r.from, r.term),
            };
            writeln!(stdout, "{line}").map_err(written)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench { .. } => unreachable!("handled before connecting"),
    }
}

/// Most `dmkv cluster transfer-leader` waits for one node's answer (the
/// node waits up to 5 s for the transfer).
const TRANSFER_TIMEOUT: Duration = Duration::from_secs(15);
/// Most leaders `dmkv cluster transfer-leader` follows (NOT_LEADER
/// answers naming another node) before it gives up.
const MAX_LEADER_HOPS: usize = 5;

/// Asks the leader of `shard` (as the map names it, then as NOT_LEADER
/// answers do) to hand its leadership to node `to`.
fn transfer_leader(
    client: &Client,
    cfg: &ClientConfig,
    shard: u32,
    to: u64,
) -> Result<dmkv_common::proto::TransferLeaderReply, String> {
    let map = client.cluster_status().map_err(|e| format!("{e} (is this server a cluster node?)"))?;
    let info = map
        .shards
        .iter()
        .find(|s| s.id == shard)
        .ok_or_else(|| format!("shard {shard} does not exist: the cluster has {} shards", map.shards.len()))?;
    if !map.nodes.iter().any(|n| n.id == to) {
        return Err(format!("node {to} is not in the cluster"));
    }
    let addr_of = |id: u64| map.nodes.iter().find(|n| n.id == id).map(|n| n.rpc.clone());
    // No leader known: any replica answers with the one it knows.
    let mut next = (info.leader != 0).then_some(info.leader).or(info.replicas.first().copied());
    let mut last = format!("shard {shard} has no leader known");
    for _ in 0..MAX_LEADER_HOPS {
        let Some(id) = next.take() else { break };
        let addr = addr_of(id).ok_or_else(|| format!("node {id} is not in the map"))?;
        // The node waits for the replica to catch up, then for it to take over.
        let patient = cfg.clone().request_timeout(TRANSFER_TIMEOUT);
        match Client::connect_with(addr, patient).and_then(|c| c.transfer_leader(shard, to)) {
            Ok(r) => return Ok(r),
            Err(dmkv_client::ClientError::NotLeader { leader, .. }) => {
                last = format!("node {id} does not lead shard {shard}");
                next = leader;
            }
            Err(e) => return Err(format!("node {id}: {e}")),
        }
    }
    Err(last)
}

/// The node `name` names: its id, or its client address as the map has it.
fn node_named(map: &dmkv_common::proto::ClusterMapReply, name: &str) -> Result<u64, String> {
    let found = match name.parse::<u64>() {
        Ok(id) => map.nodes.iter().find(|n| n.id == id),
        Err(_) => map.nodes.iter().find(|n| n.rpc == name),
    };
    found.map(|n| n.id).ok_or_else(|| {
        let known: Vec<String> = map.nodes.iter().map(|n| format!("{} ({})", n.id, n.rpc)).collect();
        format!(
            "no node {name} in the cluster (nodes: {}); a new node is listed in the cluster file first",
            known.join(", ")
        )
    })
}

/// The map with the placement as the metadata group holds it now (the
/// node asked answers from its own, which can be a poll behind: a plan
/// made from that would miss the last move).
fn current_map(client: &Client) -> Result<dmkv_common::proto::ClusterMapReply, String> {
    let seen = client.cluster_status().map_err(|e| format!("{e} (is this server a cluster node?)"))?;
    client.cluster_status_past(seen.version).map_err(|e| format!("the metadata group's map: {e}"))
}

/// Each shard's nodes, and every node, as the map has them.
fn placement_of(map: &dmkv_common::proto::ClusterMapReply) -> (Vec<(u32, Vec<u64>)>, Vec<u64>) {
    let shards = map.shards.iter().map(|s| (s.id, s.replicas.clone())).collect();
    let mut nodes: Vec<u64> = map.nodes.iter().map(|n| n.id).collect();
    nodes.sort_unstable();
    (shards, nodes)
}

/// Carries `moves` out one at a time at the metadata group's leader,
/// printing each as it ends; stops at the first that fails.
fn run_replica_moves(
    client: &Client,
    cfg: &ClientConfig,
    moves: &[dmkv_common::cluster::replica_plan::ReplicaMove],
    out: &mut impl Write,
) -> Result<(), Failure> {
    for (i, m) in moves.iter().enumerate() {
        let r = at_meta_leader(client, cfg, |c| c.move_replica(m.shard, m.from, m.to)).map_err(|e| {
            format!("move {} of {} (shard {}: node {} -> {}): {e}", i + 1, moves.len(), m.shard, m.from, m.to)
        })?;
        writeln!(out, "[{}/{}] {}", i + 1, moves.len(), replica_moved(m.shard, m.from, m.to, &r)).map_err(written)?;
    }
    Ok(())
}

fn replica_moved(shard: u32, from: u64, to: u64, r: &dmkv_common::proto::MoveReplicaReply) -> String {
    match r.outcome.as_str() {
        "already" => format!("shard {shard}: its replica is on node {to}, not {from}, already"),
        _ => format!(
            "shard {shard}: replica moved from node {from} to node {to} (map version {}) in {:.1} s",
            r.version,
            r.total_ms as f64 / 1000.0
        ),
    }
}

/// Most `dmkv cluster move-partition` (and `move-replica`) waits for the
/// move's answer: past a new replica's 600 s to catch up.
const MOVE_TIMEOUT: Duration = Duration::from_secs(720);

/// Asks the metadata group's leader (to move a partition, or pause or
/// cancel a move): the nodes in turn (the group's are the first by id),
/// following NOT_LEADER.
fn at_meta_leader<T>(
    client: &Client,
    cfg: &ClientConfig,
    ask: impl Fn(&Client) -> Result<T, dmkv_client::ClientError>,
) -> Result<T, String> {
    let map = client.cluster_status().map_err(|e| format!("{e} (is this server a cluster node?)"))?;
    let mut nodes: Vec<(u64, String)> = map.nodes.iter().map(|n| (n.id, n.rpc.clone())).collect();
    nodes.sort();
    let mut last = String::from("the cluster has no nodes");
    let mut next = nodes.first().map(|n| n.0);
    let mut asked = std::collections::BTreeSet::new();
    while let Some(id) = next.take() {
        asked.insert(id);
        let addr = &nodes.iter().find(|n| n.0 == id).ok_or_else(|| format!("node {id} is not in the map"))?.1;
        // A big partition takes a while: the reply comes once the map flipped.
        let patient = cfg.clone().request_timeout(MOVE_TIMEOUT);
        let answer = Client::connect_with(addr.clone(), patient).and_then(|c| ask(&c));
        match answer {
            Ok(r) => return Ok(r),
            Err(dmkv_client::ClientError::NotLeader { leader, .. }) => {
                last = format!("node {id} does not lead the metadata group");
                next = leader.filter(|l| !asked.contains(l));
            }
            Err(e) => return Err(format!("node {id}: {e}")),
        }
        // No leader named: the next of the group's nodes not asked yet.
        if next.is_none() {
            next = nodes.iter().take(3).map(|n| n.0).find(|n| !asked.contains(n));
        }
    }
    Err(last)
}

/// A node `dmkv top` watches.
struct Watched {
    name: String,
    addr: String,
    client: Result<Client, String>,
    /// Whether it is a cluster node (then its lag is asked for too).
    cluster: bool,
}

impl Watched {
    /// Its STATS and, for a cluster node, the largest lag of the shards it
    /// leads; an error says why the node did not answer. A node that could
    /// not be reached is dialled again each time, so it can come back.
    fn poll(&mut self, cfg: &ClientConfig) -> Result<(dmkv_client::top::Snapshot, Option<u64>), String> {
        if self.client.is_err() {
            self.client = Client::connect_with(self.addr.clone(), cfg.clone()).map_err(|e| e.to_string());
        }
        let c = self.client.as_ref().map_err(Clone::clone)?;
        let stats = c.stats().map_err(|e| e.to_string())?;
        let lag = match self.cluster {
            true => {
                let st = c.cluster_status().map_err(|e| e.to_string())?;
                let leading = st.local.iter().filter(|r| r.role == "leader");
                Some(leading.flat_map(|r| r.lag.values().copied()).max().unwrap_or(0))
            }
            false => None,
        };
        Ok((stats, lag))
    }
}

/// `dmkv top`: polls every node's STATS each interval and draws the rows
/// of [`dmkv_client::top`]; in place on a terminal, as successive blocks
/// otherwise (for logs and pipes). Ctrl-C ends it: there is no terminal
/// state to restore (the screen is only cleared, never switched).
fn top(
    seed: &Client,
    cfg: &ClientConfig,
    interval: Duration,
    iterations: Option<u64>,
    out: &mut impl Write,
) -> Result<(), Failure> {
    use dmkv_client::top;
    let mut nodes: Vec<Watched> = match seed.cluster_status() {
        Ok(map) => map
            .nodes
            .iter()
            .map(|n| Watched {
                name: n.id.to_string(),
                addr: n.rpc.clone(),
                client: Client::connect_with(n.rpc.clone(), cfg.clone()).map_err(|e| e.to_string()),
                cluster: true,
            })
            .collect(),
        // Not a cluster node: the node alone.
        Err(_) => vec![Watched {
            name: seed.as_async().addr().to_string(),
            addr: seed.as_async().addr().to_string(),
            client: Client::connect_with(seed.as_async().addr().to_string(), cfg.clone()).map_err(|e| e.to_string()),
            cluster: false,
        }],
    };
    let terminal = std::io::stdout().is_terminal();
    let poll_all = |nodes: &mut Vec<Watched>| nodes.iter_mut().map(|n| n.poll(cfg)).collect::<Vec<_>>();
    let mut before = poll_all(&mut nodes);
    let mut taken = std::time::Instant::now();
    let mut shown = 0u64;
    while iterations.is_none_or(|n| shown < n) {
        std::thread::sleep(interval);
        let after = poll_all(&mut nodes);
        let elapsed = taken.elapsed();
        taken = std::time::Instant::now();
        let mut rows = Vec::new();
        let mut notes = String::new();
        for (node, (b, a)) in nodes.iter().zip(before.iter().zip(&after)) {
            match (b, a) {
                (Ok((b, _)), Ok((a, lag))) => rows.push(top::row(&node.name, b, a, elapsed, *lag)),
                // Answered now but not before: rates start next interval.
                (Err(_), Ok(_)) => notes.push_str(&format!("node {} ({}): back\n", node.name, node.addr)),
                (_, Err(e)) => notes.push_str(&format!("node {} ({}): unreachable: {e}\n", node.name, node.addr)),
            }
        }
        let frame = format!(
            "dmkv top: {} node(s), every {interval:?}; latencies in us; ENGINE/s counts one-sided reads over TCP \
             only (shared-memory and RDMA reads never reach the server)\n{}{notes}",
            nodes.len(),
            top::render(&rows)
        );
        // Home and clear, then the frame: the view stays in place.
        let clear = if terminal { "\x1b[H\x1b[2J" } else { "" };
        let gap = if terminal { "" } else { "\n" };
        write!(out, "{clear}{frame}{gap}").and_then(|()| out.flush()).map_err(written)?;
        before = after;
        shown += 1;
    }
    Ok(())
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
        "{} nodes, {} shards, {} partitions, map version {}",
        first.nodes.len(),
        first.shards.len(),
        first.partitions.len(),
        first.version
    );
    if let Some(m) = &first.moving {
        let phase = dmkv_common::cluster::map::MovePhase::of_code(m.phase).map_or("?", |p| p.name());
        let _ = writeln!(
            out,
            "moving: partition {} from shard {} to shard {} ({phase}; flips to map version {}; the node leading the \
             metadata group carries on a stopped move by itself, `dmkv cluster move-partition {} --to {}` a paused one)",
            m.partition, m.from, m.to, m.version, m.partition, m.to
        );
    }
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
    let _ = writeln!(
        out,
        "{:<7}{:<32}{:<8}{:<7}{:<12}{:<10}{:<10}{:<8}{:<24}LAG",
        "SHARD", "MEMBERS", "LEADER", "TERM", "PARTITIONS", "ITEMS", "BYTES", "COMMIT", "APPLIED"
    );
    // The metadata group first (it keeps the map), then the data shards.
    let meta = dmkv_common::proto::ShardEntry { id: dmkv_common::cluster::map::META_SHARD, ..Default::default() };
    for sh in std::iter::once(&meta).chain(&first.shards) {
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
        // The metadata group's nodes are those that hold a replica of it.
        let placed: Vec<u64> = match sh.id == meta.id {
            true => views.iter().filter(|v| v.local.iter().any(|r| r.shard == sh.id)).map(|v| v.node_id).collect(),
            false => sh.replicas.clone(),
        };
        let mut replicas: Vec<String> = placed.iter().map(u64::to_string).collect();
        if replicas.is_empty() {
            replicas.push("-".into());
        }
        if let Some((r, _)) = lead {
            // The members as the leader applied them: node.incarnation,
            // learners marked ~.
            replicas = r.voters.iter().map(|&v| replica_name(v)).collect();
            replicas.extend(r.learners.iter().map(|&l| format!("~{}", replica_name(l))));
        }
        let (items, bytes) = match lead {
            Some((r, _)) => (r.items.to_string(), dmkv_client::top::bytes(r.bytes)),
            None => ("-".to_string(), "-".to_string()),
        };
        let (leader, term, parts, commit, lag) = match lead {
            Some((r, node)) => {
                let mut lag: Vec<_> = r.lag.iter().map(|(n, l)| format!("{}:{l}", replica_name(*n))).collect();
                lag.sort();
                // What the shard owns as its leader applied it, and the
                // map version of its last change.
                let parts = match sh.id == meta.id {
                    true => "-".to_string(),
                    false => format!("{}@v{}", r.partitions, r.placement_version),
                };
                (node.to_string(), r.term.to_string(), parts, r.commit.to_string(), lag.join(" "))
            }
            None => ("none".into(), "-".into(), "-".into(), "-".into(), String::new()),
        };
        let id = if sh.id == meta.id { "meta".to_string() } else { sh.id.to_string() };
        let _ = writeln!(
            out,
            "{:<7}{:<32}{:<8}{:<7}{:<12}{:<10}{:<10}{:<8}{:<24}{}",
            id,
            replicas.join(","),
            leader,
            term,
            parts,
            items,
            bytes,
            commit,
            applied.join(" "),
            lag
        );
    }
    out.push_str(&dmkv_client::moves::render(&views));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_at_a_terminal_needs_a_value_or_dash() {
        let err = value_from(None, true).unwrap_err();
        assert_eq!(err, "put: give VALUE, or `-` to read the value from standard input (`dmkv put KEY -`)");
        assert_eq!(value_from(None, false), Ok(ValueFrom::Stdin));
        assert_eq!(value_from(Some("-".into()), true), Ok(ValueFrom::Stdin));
        assert_eq!(value_from(Some("v".into()), true), Ok(ValueFrom::Arg("v".into())));
    }

    fn bench_of(argv: &[&str]) -> Result<Vec<String>, String> {
        let m = Cli::command().try_get_matches_from(argv).unwrap();
        let cli = Cli::from_arg_matches(&m).unwrap();
        let Cmd::Bench { args } = &cli.cmd else { panic!("not bench") };
        bench_args(&cli, Explicit::of(&m), args)
    }

    #[test]
    fn bench_gets_explicit_globals_unless_repeated() {
        assert_eq!(bench_of(&["dmkv", "bench", "--help"]).unwrap(), ["--help"]);
        assert_eq!(
            bench_of(&["dmkv", "--server", "h:1", "--path", "rpc", "--transport", "tcp", "bench", "--records", "9"])
                .unwrap(),
            ["--server", "h:1", "--path", "rpc", "--transport", "engine", "--records", "9"]
        );
        assert_eq!(
            bench_of(&["dmkv", "--server", "h:1", "--path", "rpc", "bench", "--server=h:2", "--path", "auto"]).unwrap(),
            ["--server=h:2", "--path", "auto"]
        );
        // `--server-x` is not `--server`.
        assert_eq!(bench_of(&["dmkv", "-s", "h:1", "bench", "--server-x"]).unwrap(), ["--server", "h:1", "--server-x"]);
        assert!(bench_of(&["dmkv", "--tls-ca", "ca", "--tls-server-name", "n", "bench"]).is_err());
    }
}
