//! `dmkvd`: runs a dmkv server. With no arguments it serves one node on
//! 127.0.0.1:7070 with a 256 MiB region.
//!
//! Every failure to start is one line on stderr, "dmkvd: ...", naming the
//! setting or path at fault, and exit code 2.

use std::process::ExitCode;

use clap::Parser;
use dmkv_server::config::{Flags, LogFormat};
use dmkv_server::{Config, Server};

/// Exit code of a failed start.
const EXIT_START: u8 = 2;

fn main() -> ExitCode {
    match run(Flags::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dmkvd: {e}");
            ExitCode::from(EXIT_START)
        }
    }
}

fn run(flags: Flags) -> Result<(), String> {
    let cfg = Config::load(flags)?;
    let env = std::env::var("RUST_LOG").ok();
    let filter = dmkv_server::config::log_filter(cfg.log.as_deref(), env.as_deref())?;
    use std::io::IsTerminal;
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match cfg.log_format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
        // Fields at the top level (not under "fields"), so that a filter
        // such as jq's .peer or .shard finds them.
        LogFormat::Json => logs.json().flatten_event(true).with_current_span(false).init(),
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.threads)
        .enable_all()
        .build()
        .map_err(|e| format!("--threads {}: cannot start the worker threads: {e}", cfg.threads))?;
    rt.block_on(async move {
        // Server::bind's errors name the listener, file or setting that failed.
        let server = Server::bind(&cfg).await.map_err(|e| e.to_string())?;
        let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| format!("cannot handle SIGTERM: {e}"))?;
        tracing::info!(rpc = %server.local_addr(), memory = cfg.memory, buckets = cfg.buckets, "dmkvd serving");
        // Tests and scripts read this line to learn the port picked at run time.
        println!("{}", server.endpoints_line());
        notify(sd_notify::NotifyState::Ready);
        server.serve(shutdown_signal(term)).await;
        Ok(())
    })
}

async fn shutdown_signal(mut term: tokio::signal::unix::Signal) {
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
    tracing::info!("signal received");
    notify(sd_notify::NotifyState::Stopping);
}

/// Tells systemd (a `Type=notify` unit) where dmkvd is; nothing happens
/// without NOTIFY_SOCKET. A failure is logged, not fatal: the service
/// serves either way.
fn notify(state: sd_notify::NotifyState) {
    if std::env::var_os("NOTIFY_SOCKET").is_none_or(|s| s.is_empty()) {
        return;
    }
    if let Err(e) = sd_notify::notify(&[state]) {
        tracing::warn!("sd_notify: {e}");
    }
}
