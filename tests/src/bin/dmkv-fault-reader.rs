//! A reader for the fault suite that runs in a process of its own (under
//! `faketime`, see `dmkv_tests::skewed`): it connects to a cluster, reads
//! every key once, says `ready`, then GETs keys in turn, asking its parent
//! before each GET and reporting after it, one line each way:
//!
//! ```text
//! -> get KEY          <- go | stop
//! -> ok KEY VALUE|-   (or: err KEY MESSAGE)
//! ```
//!
//! On `stop` (or the end of its input) it says `stats ONE_SIDED UNLEASED`
//! and exits. Usage: `dmkv-fault-reader --server ADDR --path PATH
//! [--transport T] --keys K1,K2,...`.

use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use dmkv_client::{Client, ReadPath, Transport};
use dmkv_tests::history::client_config;

/// How long connecting and the first read of every key may take.
const ATTACH_DEADLINE: Duration = Duration::from_secs(15);
/// Pause before each GET, as the in-process readers take.
const PACE: Duration = Duration::from_millis(2);

fn main() {
    if let Err(e) = run() {
        eprintln!("dmkv-fault-reader: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let (mut server, mut path, mut transport, mut keys) = (None, ReadPath::Auto, None, Vec::new());
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--server" => server = Some(value()?),
            "--path" => path = value()?.parse()?,
            "--transport" => transport = Some(value()?.parse::<Transport>()?),
            "--keys" => keys = value()?.split(',').map(String::from).collect(),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let server = server.ok_or("--server is required")?;
    if keys.is_empty() {
        return Err("--keys is required".into());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("no runtime: {e}"))?;
    rt.block_on(async {
        let client = attach(&server, path, transport, &keys).await?;
        let stdin = std::io::stdin();
        let mut answers = stdin.lock().lines();
        let mut out = std::io::stdout().lock();
        let say = |out: &mut std::io::StdoutLock, line: String| {
            writeln!(out, "{line}").and_then(|_| out.flush()).map_err(|e| format!("parent gone: {e}"))
        };
        say(&mut out, "ready".into())?;
        for key in keys.iter().cycle() {
            tokio::time::sleep(PACE).await;
            say(&mut out, format!("get {key}"))?;
            match answers.next() {
                Some(Ok(a)) if a == "go" => {}
                _ => break,
            }
            let line = match client.get(key).await {
                // The number only: a writer's padding follows a space.
                Ok(Some(v)) => format!("ok {key} {}", String::from_utf8_lossy(&v).split(' ').next().unwrap_or("")),
                Ok(None) => format!("ok {key} -"),
                Err(e) => format!("err {key} {e}"),
            };
            say(&mut out, line)?;
        }
        let s = client.read_stats();
        say(&mut out, format!("stats {} {}", s.gets, s.unleased))
    })
}

async fn attach(server: &str, path: ReadPath, transport: Option<Transport>, keys: &[String]) -> Result<Client, String> {
    let deadline = Instant::now() + ATTACH_DEADLINE;
    let client = loop {
        match Client::connect_with(server, client_config(path, transport, true)).await {
            Ok(c) => break c,
            Err(e) if Instant::now() >= deadline => return Err(format!("cannot connect to {server}: {e}")),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    for k in keys {
        while let Err(e) = client.get(k).await {
            if Instant::now() >= deadline {
                return Err(format!("cannot GET {k}: {e}"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(client)
}
