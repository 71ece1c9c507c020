//! What a test needs from the machine beyond Rust (root and nftables,
//! tmpfs mounts, faketime, the checkers the deploy and metrics tests run),
//! checked in one place. A test that lacks something prints one line
//! saying SKIPPED and why, and passes, so the README's `cargo test` passes
//! on a fresh machine; where the machine is meant to have it all
//! ([`required`]: CI, which installs it) a skip would hide a broken setup,
//! and the test fails.

use std::io::Write;
use std::path::Path;

use crate::netns::REQUIRE_ENV;

/// Set to `1` where every optional tool is installed (`.ci/run` sets it):
/// a test that cannot find one then fails instead of skipping.
pub const REQUIRE_TOOLS_ENV: &str = "DMKV_REQUIRE_TOOLS";

/// One thing a test needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Packet rules between loopback addresses ([`crate::partition`]).
    Nft,
    /// tmpfs mounts under the test's directory ([`crate::disk`]).
    Tmpfs,
    /// `faketime` and libfaketime ([`crate::skewed`]).
    Faketime,
    /// A program on `PATH`, and how to install it.
    Tool {
        /// Its name, as the test runs it.
        name: &'static str,
        /// The command that installs it (as `.ci/run` does).
        install: &'static str,
    },
}

impl Need {
    /// Whether it is here; if not, why not.
    pub fn available(self) -> Result<(), String> {
        match self {
            Need::Nft => crate::partition::Partition::available(),
            Need::Tmpfs => crate::disk::Tmpfs::available(),
            Need::Faketime => crate::skewed::faketime_available(),
            Need::Tool { name, install } => {
                if on_path(name) {
                    Ok(())
                } else {
                    Err(format!("{name} is not on PATH; install it: {install}"))
                }
            }
        }
    }

    fn name(self) -> &'static str {
        match self {
            Need::Nft => "nftables",
            Need::Tmpfs => "tmpfs mounts",
            Need::Faketime => "faketime",
            Need::Tool { name, .. } => name,
        }
    }
}

/// Whether this machine is meant to have every optional tool: a test that
/// lacks one fails here instead of skipping. True under `.ci/run`
/// ([`REQUIRE_TOOLS_ENV`] or [`REQUIRE_ENV`] is `1`) and wherever `CI` is
/// set.
pub fn required() -> bool {
    let one = |v: &str| std::env::var(v).as_deref() == Ok("1");
    one(REQUIRE_TOOLS_ENV) || one(REQUIRE_ENV) || std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// Whether an executable file `name` is in one of `PATH`'s directories.
fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let exec = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|dir| exec(&dir.join(name))))
}

/// Says that `test` is skipped and why, in one line on the process's real
/// standard error: the test harness captures what `eprintln!` prints and
/// shows it only for a failure, and a skip passes.
pub fn say_skipped(test: &str, why: &str) {
    let line = format!("{test}: SKIPPED ({}); set {REQUIRE_TOOLS_ENV}=1 to make this fail\n", why.replace('\n', " "));
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// Skips `test` for `why` ([`say_skipped`]) and returns `false`, or fails
/// it where skips are not allowed ([`required`]).
pub fn skip(test: &str, why: &str) -> bool {
    assert!(!required(), "{test}: {why} (this machine must have it: {REQUIRE_TOOLS_ENV}, {REQUIRE_ENV} or CI is set)");
    say_skipped(test, why);
    false
}

/// Whether `test` can run: `true` if every one of `needs` is available.
/// Otherwise it says why ([`skip`]) and returns `false`, or fails the test
/// where skips are not allowed.
pub fn available_or_skip(test: &str, needs: &[Need]) -> bool {
    let missing: Vec<String> =
        needs.iter().filter_map(|n| n.available().err().map(|e| format!("{}: {e}", n.name()))).collect();
    missing.is_empty() || skip(test, &missing.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_is_found_on_path_only_if_it_is_there() {
        assert!(on_path("sh"), "sh is on every PATH");
        assert!(!on_path("dmkv-no-such-tool"));
        let missing = Need::Tool { name: "dmkv-no-such-tool", install: "nothing installs it" };
        let why = missing.available().unwrap_err();
        assert!(why.contains("nothing installs it"), "{why}");
    }
}
