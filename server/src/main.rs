//! `dmkvd`: runs a dmkv server. With no arguments it serves one node on
//! 127.0.0.1:7070 with a 256 MiB region.

use clap::Parser;
use dmkv_server::{Config, Server, config::Flags};
use tracing_subscriber::EnvFilter;

fn main() -> std::process::ExitCode {
    let flags = Flags::parse();
    let cfg = match Config::load(flags) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("dmkvd: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&cfg.log));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(cfg.threads).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dmkvd: cannot start runtime: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    rt.block_on(async move {
        let server = match Server::bind(&cfg).await {
            Ok(s) => s,
            Err(e) => {
                eprintln!("dmkvd: cannot start on {}: {e}", cfg.listen);
                return std::process::ExitCode::from(2);
            }
        };
        tracing::info!(rpc = %server.local_addr(), memory = cfg.memory, buckets = cfg.buckets, "dmkvd serving");
        // Tests and scripts read this line to learn the port picked at run time.
        println!("{}", server.endpoints_line());
        server.serve(shutdown_signal()).await;
        std::process::ExitCode::SUCCESS
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
    tracing::info!("signal received");
}
