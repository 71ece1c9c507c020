//! The README is an interface: every command its code blocks show must
//! run as written, and its flag tables must agree with the binaries'
//! `--help`.
//!
//! Commands are run for real against a `dmkvd` this test starts (the
//! README's own `dmkvd` command, on a port picked at run time), in the
//! README's order, with `DMKV_SERVER` pointing at it. Substitutions, all
//! listed here: `dmkv-ycsb` gets `--server` and a shorter run
//! (`--records`, `--duration`, `--warmup`), and writes its files in a temp
//! directory; `dmkv top` stops after two refreshes (`--iterations 2`). A block that runs `deploy/local-cluster.sh start` runs
//! whole against that cluster, started by the script with the test's
//! binaries, ports picked at run time and a temp directory. Commands that
//! are not ours (`cargo test`, `cargo build`, `apt-get`) are not run.
//!
//! A flag table is one the README marks with `<!-- flags: BIN [SUB] -->`
//! (or `<!-- commands: BIN -->` for subcommands) on the line before it;
//! `complete` after the name means every flag `--help` lists must be in
//! the table too, not only the other way round.
//!
//! Beyond the README, every command any markdown file of the repository
//! shows (code blocks and inline code starting with one of our binaries)
//! may only use flags that binary or one of its subcommands accepts.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use dmkv_tests::{ServerProcess, find_bin};

fn readme() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The README's `sh` code blocks, each as its lines with `\` continuations
/// joined.
fn shell_blocks(md: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut block: Option<Vec<String>> = None;
    let mut pending = String::new();
    for line in md.lines() {
        if let Some(lang) = line.strip_prefix("```") {
            match block.take() {
                Some(b) => out.push(b),
                None if lang.trim() == "sh" => block = Some(Vec::new()),
                None => {}
            }
            continue;
        }
        let Some(b) = block.as_mut() else { continue };
        match line.trim_end().strip_suffix('\\') {
            Some(head) => pending.push_str(head),
            None => {
                pending.push_str(line);
                b.push(std::mem::take(&mut pending));
            }
        }
    }
    out
}

/// Drops a trailing `# comment` (a `#` after whitespace, outside quotes)
/// and returns the command and the comment.
fn split_comment(line: &str) -> (String, String) {
    let mut quote = None;
    let mut prev_space = true;
    for (i, c) in line.char_indices() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '#') if prev_space => return (line[..i].trim().to_string(), line[i + 1..].trim().to_string()),
            _ => {}
        }
        prev_space = c.is_whitespace();
    }
    (line.trim().to_string(), String::new())
}

/// One step of a README pipeline, as the test will run it.
#[derive(Debug, Clone, PartialEq)]
enum Step {
    /// `cargo run [--release] --bin NAME [-- ARGS]`, or NAME run directly.
    Bin { name: String, args: Vec<String> },
    /// `deploy/local-cluster.sh ARGS`, the arguments joined.
    Cluster(String),
    /// `echo [-n] TEXT`: the next step's standard input.
    Echo(String),
    /// Anything else (`cargo test`, `apt-get`, ...): not ours to run.
    Other(String),
}

fn parse_step(words: &[String]) -> Step {
    let w: Vec<&str> = words.iter().map(String::as_str).collect();
    match w.as_slice() {
        ["cargo", "run", rest @ ..] => {
            let bin = rest.iter().position(|x| *x == "--bin").and_then(|i| rest.get(i + 1));
            let args = match rest.iter().position(|x| *x == "--") {
                Some(i) => rest[i + 1..].iter().map(|s| s.to_string()).collect(),
                None => Vec::new(),
            };
            match bin {
                Some(name) => Step::Bin { name: name.to_string(), args },
                None => Step::Other(words.join(" ")),
            }
        }
        [name @ ("dmkv" | "dmkvd" | "dmkv-ycsb"), rest @ ..] => {
            Step::Bin { name: name.to_string(), args: rest.iter().map(|s| s.to_string()).collect() }
        }
        ["deploy/local-cluster.sh", rest @ ..] => Step::Cluster(rest.join(" ")),
        ["echo", "-n", text] => Step::Echo(text.to_string()),
        ["echo", text] => Step::Echo(format!("{text}\n")),
        _ => Step::Other(words.join(" ")),
    }
}

/// A README command line: its pipeline and what its comment promises.
#[derive(Debug)]
struct ReadmeCommand {
    line: String,
    steps: Vec<Step>,
    /// From a `# prints: X` comment.
    prints: Option<String>,
}

/// The commands of every `sh` block, block by block.
fn readme_commands(md: &str) -> Vec<Vec<ReadmeCommand>> {
    shell_blocks(md).into_iter().map(|b| b.iter().filter_map(|l| parse_command(l)).collect()).collect()
}

fn parse_command(line: &str) -> Option<ReadmeCommand> {
    let (cmd, comment) = split_comment(line);
    let cmd = cmd.trim_end_matches('&').trim();
    if cmd.is_empty() {
        return None;
    }
    let steps = cmd
        .split(" | ")
        .map(|part| {
            let words = shlex::split(part).unwrap_or_else(|| panic!("README: unbalanced quotes in `{line}`"));
            parse_step(&words)
        })
        .collect();
    let prints = comment.strip_prefix("prints:").map(|s| s.trim().to_string());
    Some(ReadmeCommand { line: line.to_string(), steps, prints })
}

fn run(bin: &Path, args: &[String], env: &[(&str, &str)], stdin: Option<&str>, dir: &Path) -> Output {
    let mut cmd = Command::new(bin);
    cmd.args(args).current_dir(dir).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
    if let Some(text) = stdin {
        let mut pipe = child.stdin.take().expect("stdin is piped");
        pipe.write_all(text.as_bytes()).expect("write stdin");
    }
    child.wait_with_output().expect("wait")
}

/// Replaces the value of `flag` in `args`, or appends it.
fn set_flag(args: &mut Vec<String>, flag: &str, value: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) if i + 1 < args.len() => args[i + 1] = value.to_string(),
        _ => args.extend([flag.to_string(), value.to_string()]),
    }
}

/// A free loopback port to start the local cluster's ports from (clients
/// on P..P+2, peers on P+100..P+102, memcached on P+200..P+202), below the
/// kernel's ephemeral range: a port picked from that range can be handed
/// to another test's outgoing connection between this check and the
/// node's bind (two CI runs failed so).
fn cluster_base_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let (from, to) = (10_000u16, low.saturating_sub(300).max(10_300));
    // A start that differs per process, so parallel runs spread out.
    let mut p = from + (std::process::id() % u32::from(to - from)) as u16;
    let free = |q: u16| std::net::TcpListener::bind(("127.0.0.1", q)).is_ok();
    for _ in 0..200 {
        if (0..4).all(|i| free(p + i) && free(p + 100 + i) && free(p + 200 + i)) {
            return p;
        }
        p = if p + 311 >= to { from + (p + 311 - to) } else { p + 311 };
    }
    panic!("no free ports for the local cluster below {low}");
}

/// Runs the README's cluster script with the test's binaries and ports.
fn cluster_script(sub: &str, env: &[(&str, String)]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local-cluster.sh");
    let mut cmd = Command::new("bash");
    cmd.arg(&script).args(sub.split_whitespace());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run deploy/local-cluster.sh");
    assert!(
        out.status.success(),
        "README command `deploy/local-cluster.sh {sub}` failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Stops the local cluster however the test ends.
struct ClusterGuard(Vec<(&'static str, String)>);

impl Drop for ClusterGuard {
    fn drop(&mut self) {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local-cluster.sh");
        let _ = Command::new("bash").arg(script).arg("stop").envs(self.0.iter().map(|(k, v)| (k, v))).output();
    }
}

#[test]
fn every_readme_command_runs_as_written() {
    let md = readme();
    let blocks = readme_commands(&md);
    let commands: Vec<&ReadmeCommand> = blocks.iter().flatten().collect();
    assert!(commands.len() >= 10, "README code blocks gave only {} commands", commands.len());
    let tmp = std::env::temp_dir().join(format!("dmkv-readme-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("temp dir");

    // The store first: the README's own command for it, on a free port.
    let dmkvd_args = commands
        .iter()
        .flat_map(|c| &c.steps)
        .find_map(|s| match s {
            Step::Bin { name, args } if name == "dmkvd" => Some(args.clone()),
            _ => None,
        })
        .expect("README shows how to run dmkvd");
    let args: Vec<&str> = dmkvd_args.iter().map(String::as_str).collect();
    let server = ServerProcess::start(&args);

    let mut ran = 0;
    let mut cluster_blocks = 0;
    for block in &blocks {
        // A block that starts the local cluster runs against it.
        let is_cluster = block.iter().flat_map(|c| &c.steps).any(|s| *s == Step::Cluster("start".into()));
        let mut guard = None;
        let target = if is_cluster {
            cluster_blocks += 1;
            let port = cluster_base_port();
            let bin = |n: &str| find_bin(n).unwrap_or_else(|e| panic!("{e}")).display().to_string();
            let env = vec![
                ("DMKVD", bin("dmkvd")),
                ("DMKV", bin("dmkv")),
                ("DMKV_CLUSTER_PORT", port.to_string()),
                ("DMKV_CLUSTER_DIR", tmp.join("cluster").display().to_string()),
            ];
            guard = Some(ClusterGuard(env));
            format!("127.0.0.1:{port}")
        } else {
            server.rpc.clone()
        };
        let env = [("DMKV_SERVER", target.as_str())];
        for c in block {
            let mut stdin: Option<String> = None;
            for step in &c.steps {
                match step {
                    Step::Echo(text) => stdin = Some(text.clone()),
                    Step::Bin { name, .. } if name == "dmkvd" => {}
                    Step::Bin { name, args } => {
                        let bin: PathBuf = find_bin(name).unwrap_or_else(|e| panic!("`{}`: {e}", c.line));
                        let mut args = args.clone();
                        // `top` runs until stopped: two refreshes show it works.
                        if name == "dmkv" && args.first().is_some_and(|a| a == "top") {
                            set_flag(&mut args, "--iterations", "2");
                        }
                        if name == "dmkv-ycsb" {
                            set_flag(&mut args, "--server", &target);
                            set_flag(&mut args, "--records", "1000");
                            set_flag(&mut args, "--duration", "0.5");
                            set_flag(&mut args, "--warmup", "0");
                        }
                        let out = run(&bin, &args, &env, stdin.take().as_deref(), &tmp);
                        let stdout = String::from_utf8_lossy(&out.stdout);
                        let stderr = String::from_utf8_lossy(&out.stderr);
                        assert!(
                            out.status.success(),
                            "README command `{}` failed ({}):\nstdout: {stdout}\nstderr: {stderr}",
                            c.line,
                            out.status
                        );
                        if let Some(want) = &c.prints {
                            assert_eq!(stdout.trim_end(), want, "README command `{}` prints", c.line);
                        }
                        ran += 1;
                    }
                    Step::Cluster(sub) => {
                        let env = &guard.as_ref().expect("the block starts the cluster first").0;
                        cluster_script(sub, env);
                        ran += 1;
                    }
                    Step::Other(_) => {}
                }
            }
        }
        drop(guard);
    }
    assert!(cluster_blocks >= 1, "README shows no local cluster");
    assert!(ran >= 12, "only {ran} README commands ran");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// The long flags a `--help` output lists (`--help` and `--version` aside).
fn help_flags(help: &str) -> Vec<String> {
    let mut flags = Vec::new();
    for line in help.lines() {
        let t = line.trim_start();
        if !t.starts_with('-') {
            continue;
        }
        for word in t.split_whitespace().take(2) {
            if let Some(f) = word.trim_end_matches(',').strip_prefix("--") {
                let f = f.split(['=', '<', '[']).next().unwrap_or_default();
                if f != "help" && f != "version" && !f.is_empty() {
                    flags.push(format!("--{f}"));
                }
            }
        }
    }
    flags
}

/// Subcommand names of a `--help` output's `Commands:` section.
fn help_commands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// Every `--flag` in a cell of a table row.
fn cell_flags(cell: &str) -> Vec<String> {
    cell.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(str::to_string)
        .collect()
}

/// Marked tables: (marker words, first cells of the table's body rows).
fn marked_tables(md: &str, kind: &str) -> Vec<(Vec<String>, Vec<String>)> {
    let lines: Vec<&str> = md.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some(rest) = l.trim().strip_prefix(&format!("<!-- {kind}:")) else { continue };
        let words: Vec<String> = rest.trim_end_matches("-->").split_whitespace().map(str::to_string).collect();
        let cells = lines[i + 1..]
            .iter()
            .take_while(|r| r.starts_with('|'))
            .skip(2)
            // `\|` is a pipe inside a cell (`--path auto\|rpc`), not a border.
            .map(|r| r.replace("\\|", "/").trim_start_matches('|').split('|').next().unwrap_or_default().to_string())
            .collect();
        out.push((words, cells));
    }
    out
}

fn help_of(words: &[String]) -> String {
    let bin = find_bin(&words[0]).unwrap_or_else(|e| panic!("{e}"));
    let out = Command::new(&bin).args(&words[1..]).arg("--help").output().expect("run --help");
    assert!(out.status.success(), "{} --help failed", words.join(" "));
    String::from_utf8(out.stdout).expect("help is UTF-8")
}

#[test]
fn readme_flag_tables_agree_with_help() {
    let md = readme();
    let tables = marked_tables(&md, "flags");
    assert!(tables.len() >= 3, "README marks only {} flag tables", tables.len());
    for (words, cells) in tables {
        let complete = words.last().is_some_and(|w| w == "complete");
        let target: Vec<String> = words.iter().filter(|w| *w != "complete").cloned().collect();
        let help = help_flags(&help_of(&target));
        let table: Vec<String> = cells.iter().flat_map(|c| cell_flags(c)).collect();
        assert!(!table.is_empty(), "README's flag table for `{}` lists no flags", target.join(" "));
        for f in &table {
            assert!(help.contains(f), "README lists `{f}` for `{}`, its --help does not", target.join(" "));
        }
        if complete {
            for f in &help {
                assert!(table.contains(f), "`{} --help` lists `{f}`, README's table does not", target.join(" "));
            }
        }
    }
}

#[test]
fn readme_command_tables_agree_with_help() {
    let md = readme();
    let tables = marked_tables(&md, "commands");
    assert!(!tables.is_empty(), "README marks no command table");
    for (words, cells) in tables {
        let target: Vec<String> = words.iter().filter(|w| *w != "complete").cloned().collect();
        let help = help_commands(&help_of(&target));
        let table: Vec<String> = cells
            .iter()
            .filter_map(|c| c.trim().trim_matches('`').split_whitespace().next().map(str::to_string))
            .collect();
        for c in &table {
            assert!(help.contains(c), "README lists `{} {c}`, its --help does not", target.join(" "));
        }
        for c in &help {
            assert!(table.contains(c), "`{} --help` lists `{c}`, README's table does not", target.join(" "));
        }
    }
}

#[test]
fn readme_parsing_reads_what_it_should() {
    let md = "x\n```sh\ncargo run --release --bin dmkv -- get k   # prints: v\n\
              echo -n \"a b\" | dmkv put k2\n\
              cargo run --bin dmkv-ycsb -- --workload a \\\n    --threads 2 &\n```\n";
    let c: Vec<ReadmeCommand> = readme_commands(md).into_iter().flatten().collect();
    assert_eq!(c.len(), 3);
    assert_eq!(c[0].steps, vec![Step::Bin { name: "dmkv".into(), args: vec!["get".into(), "k".into()] }]);
    assert_eq!(c[0].prints.as_deref(), Some("v"));
    assert_eq!(c[1].steps[0], Step::Echo("a b".into()));
    let Step::Bin { name, args } = &c[2].steps[0] else { panic!("{:?}", c[2]) };
    assert_eq!((name.as_str(), args.len()), ("dmkv-ycsb", 4));
    assert_eq!(help_flags("  -s, --server <ADDR>  x\n      --raw  y\n  -h, --help\n"), vec!["--server", "--raw"]);
    assert_eq!(cell_flags("`--engine-listen ADDR` / `--no-engine`"), vec!["--engine-listen", "--no-engine"]);
}

/// Our binaries, as documents name them.
const BINARIES: [&str; 9] = [
    "dmkvd",
    "dmkv",
    "dmkv-ycsb",
    "dmkv-ycsb-plot",
    "dmkv-getbench",
    "dmkv-pathbench",
    "dmkv-memutil",
    "dmkv-cluster-bench",
    "dmkv-hitratio",
];

/// Every long flag a binary or any of its (nested) subcommands accepts.
fn all_flags(words: &mut Vec<String>, depth: usize, out: &mut Vec<String>) {
    let help = help_of(words);
    out.extend(help_flags(&help));
    if depth == 0 {
        return;
    }
    for sub in help_commands(&help) {
        words.push(sub);
        all_flags(words, depth - 1, out);
        words.pop();
    }
}

/// Commands in a markdown text: lines of code blocks and inline code
/// spans that start with one of our binaries (or a path ending in one).
fn doc_commands(md: &str) -> Vec<(String, String)> {
    let mut spans = Vec::new();
    let mut in_block = false;
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if in_block {
            spans.push(line.to_string());
        } else {
            spans.extend(line.split('`').skip(1).step_by(2).map(str::to_string));
        }
    }
    let mut out = Vec::new();
    for span in spans {
        let (cmd, _) = split_comment(&span);
        for part in cmd.split(" | ") {
            let mut words = part.split_whitespace();
            // `cargo run ... --bin NAME -- ARGS` names the binary too.
            let Some(first) = words.next() else { continue };
            let (name, rest) = if first == "cargo" && part.contains("--bin ") && part.contains(" -- ") {
                let name = part.split("--bin ").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or_default();
                (name.to_string(), part.split(" -- ").nth(1).unwrap_or_default().to_string())
            } else {
                let name = first.rsplit('/').next().unwrap_or_default().to_string();
                (name, words.collect::<Vec<_>>().join(" "))
            };
            if BINARIES.contains(&name.as_str()) {
                out.push((name, rest));
            }
        }
    }
    out
}

#[test]
fn documented_commands_use_flags_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut docs = vec![root.join("README.md")];
    for dir in ["docs", "deploy", "tests/rdma-vm", "verbs", "fuzz", "benches"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir)) else { continue };
        docs.extend(entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "md")));
    }
    let mut known: std::collections::HashMap<String, Vec<String>> = Default::default();
    let mut checked = 0;
    for doc in &docs {
        let md = std::fs::read_to_string(doc).unwrap_or_else(|e| panic!("read {}: {e}", doc.display()));
        for (name, args) in doc_commands(&md) {
            let flags = known.entry(name.clone()).or_insert_with(|| {
                let mut out = vec!["--help".to_string(), "--version".to_string()];
                all_flags(&mut vec![name.clone()], 2, &mut out);
                out
            });
            for f in cell_flags(&args) {
                assert!(
                    flags.contains(&f),
                    "{} shows `{name} ... {f}`, which no `{name} --help` lists",
                    doc.strip_prefix(&root).unwrap_or(doc).display()
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 100, "only {checked} documented flags found");
}

#[test]
fn readme_lists_every_client_error() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/src/error.rs");
    let src = std::fs::read_to_string(&path).expect("read client/src/error.rs");
    let body = src.split("pub enum ClientError {").nth(1).expect("ClientError in error.rs");
    let body = &body[..body.find("\n}").expect("end of ClientError")];
    // Variants: lines at the enum's indentation that start with a capital.
    let variants: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("    ") && !l.starts_with("     "))
        .map(str::trim)
        .filter(|l| l.starts_with(|c: char| c.is_ascii_uppercase()))
        .filter_map(|l| l.split(|c: char| !c.is_ascii_alphanumeric()).next())
        .collect();
    assert!(variants.len() >= 10, "found only {variants:?} in ClientError");
    let md = readme();
    for v in variants {
        let named = md.contains(&format!("`{v}`")) || md.contains(&format!("`{v} {{"));
        assert!(named, "README's ClientError table lacks `{v}`");
    }
}
