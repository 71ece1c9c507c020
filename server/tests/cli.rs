//! The dmkvd binary's command line (this test also makes `cargo test`
//! build `dmkvd` for the end-to-end tests).

use std::process::Command;

#[test]
fn help_and_bad_config_exit_codes() {
    let bin = env!("CARGO_BIN_EXE_dmkvd");
    let out = Command::new(bin).arg("--help").output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("--memory"));
    let out = Command::new(bin).args(["--memory", "12XB"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("dmkvd: --memory: invalid size"));
    let out = Command::new(bin).args(["--config", "/nonexistent/dmkvd.toml"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("dmkvd: --config /nonexistent/dmkvd.toml: cannot read it"));
}
