//! What a test needs from the machine beyond Rust (root and nftables,
//! tmpfs mounts, faketime, the checkers the deploy and metrics tests run),
//! checked in one place. A test that lacks something prints one line
//! saying SKIPPED and why, and passes, so the README's `cargo test` passes
//! on a fresh machine; where the machine is meant to have it all
//! ([`required`]: CI, which installs it) a skip would hide a broken setup,
//! and the test fails. That policy is [`crate::skip`]'s, re-exported here.

use std::path::Path;

pub use crate::skip::{REQUIRE_TOOLS_ENV, required, say_skipped, skip};

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

/// Whether an executable file `name` is in one of `PATH`'s directories.
fn on_path(name: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let exec = |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|dir| exec(&dir.join(name))))
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
