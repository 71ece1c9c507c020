//! `dmkv`: the command-line client.
//!
//! Exit codes: 0 success, 1 key not found, 2 any error (with a one-line
//! message on stderr).

use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use dmkv_client::{ClientConfig, ReadPath, Transport, blocking::Client};

#[derive(Parser)]
#[command(name = "dmkv", version, about = "dmkv command-line client")]
struct Cli {
    /// Server RPC address.
    #[arg(long, short, default_value = "127.0.0.1:7070", env = "DMKV_SERVER")]
    server: String,
    /// Request timeout in milliseconds.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    /// How GETs go: auto (one-sided where possible), one-sided, or rpc.
    #[arg(long, default_value = "auto")]
    path: ReadPath,
    /// Force a one-sided backend: shm or tcp (default: the best available).
    #[arg(long)]
    transport: Option<Transport>,
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

fn run(cli: Cli) -> Result<ExitCode, String> {
    let cfg = ClientConfig {
        pool_size: 1,
        request_timeout: Duration::from_millis(cli.timeout_ms),
        read_path: cli.path,
        transport: cli.transport,
        ..Default::default()
    };
    let client = Client::connect_with(cli.server, cfg).map_err(|e| e.to_string())?;
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
    }
}
