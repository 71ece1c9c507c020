//! The load phase's progress bar: drawn on a terminal, absent from output
//! that goes to a pipe or a CI log.

use std::process::Command;

use dmkv_tests::ServerProcess;

const YCSB: &str = env!("CARGO_BIN_EXE_dmkv-ycsb");

fn ycsb_args(server: &str) -> Vec<String> {
    ["--server", server, "--workload", "c", "--records", "20000", "--operations", "10", "--path", "rpc"]
        .map(String::from)
        .to_vec()
}

/// Carriage returns and escape sequences: how a bar redraws itself.
fn has_bar_controls(out: &str) -> bool {
    out.contains('\r') || out.contains('\x1b')
}

#[test]
fn no_progress_bar_when_stderr_is_not_a_terminal() {
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    let out = Command::new(YCSB).args(ycsb_args(&srv.rpc)).env_remove("CI").output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(!has_bar_controls(&stdout) && !has_bar_controls(&stderr), "{stdout:?}\n{stderr:?}");
}

/// Runs the driver under `script` (util-linux), which gives it a terminal;
/// what the terminal showed.
fn on_a_terminal(server: &str, ci: bool) -> String {
    let have_script = Command::new("script").arg("--version").output().is_ok();
    assert!(have_script, "`script` (util-linux) is needed to give dmkv-ycsb a terminal");
    let cmd = std::iter::once(YCSB.to_string()).chain(ycsb_args(server)).collect::<Vec<_>>().join(" ");
    let mut c = Command::new("timeout");
    c.args(["60", "script", "-qec", &cmd, "/dev/null"]);
    if ci {
        c.env("CI", "true");
    } else {
        c.env_remove("CI");
    }
    let out = c.output().expect("run script");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    text
}

#[test]
fn progress_bar_on_a_terminal_unless_ci() {
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    // The positive case first: otherwise a driver with no bar at all would
    // pass the test above.
    let shown = on_a_terminal(&srv.rpc, false);
    assert!(shown.contains("records") && shown.contains('\x1b'), "no bar drawn on a terminal:\n{shown:?}");
    let ci = on_a_terminal(&srv.rpc, true);
    assert!(!ci.contains('\x1b'), "a bar drawn under CI:\n{ci:?}");
}
