//! The dmkv binary's command line (this test also makes `cargo test`
//! build `dmkv` for the end-to-end tests).

use std::process::Command;

#[test]
fn usage_errors_exit_2() {
    let bin = env!("CARGO_BIN_EXE_dmkv");
    let out = Command::new(bin).arg("--help").output().unwrap();
    assert!(out.status.success());
    let out = Command::new(bin).arg("frobnicate").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}
