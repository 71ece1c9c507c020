//! What a fault test needs from the machine (root and nftables, tmpfs
//! mounts, faketime), checked in one place: a test that lacks something
//! prints one line saying SKIPPED and why, and passes, unless
//! [`REQUIRE_ENV`] is `1` (CI, which installs all of it): then a skip
//! would hide a broken setup, and the test fails.

use crate::netns::REQUIRE_ENV;

/// One thing a test needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Need {
    /// Packet rules between loopback addresses ([`crate::partition`]).
    Nft,
    /// tmpfs mounts under the test's directory ([`crate::disk`]).
    Tmpfs,
    /// `faketime` and libfaketime ([`crate::skewed`]).
    Faketime,
}

impl Need {
    /// Whether it is here; if not, why not.
    pub fn available(self) -> Result<(), String> {
        match self {
            Need::Nft => crate::partition::Partition::available(),
            Need::Tmpfs => crate::disk::Tmpfs::available(),
            Need::Faketime => crate::skewed::faketime_available(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Need::Nft => "nftables",
            Need::Tmpfs => "tmpfs mounts",
            Need::Faketime => "faketime",
        }
    }
}

/// Whether `test` can run: `true` if every one of `needs` is available.
/// Otherwise it prints one line (with SKIPPED and the reasons) and
/// returns `false`, or panics when [`REQUIRE_ENV`] is `1`.
pub fn available_or_skip(test: &str, needs: &[Need]) -> bool {
    let missing: Vec<String> =
        needs.iter().filter_map(|n| n.available().err().map(|e| format!("{}: {e}", n.name()))).collect();
    if missing.is_empty() {
        return true;
    }
    // One line, whatever the tools printed.
    let why = missing.join("; ").replace('\n', " ");
    if std::env::var(REQUIRE_ENV).as_deref() == Ok("1") {
        panic!("{test}: {REQUIRE_ENV}=1 but {why}");
    }
    eprintln!("{test}: SKIPPED ({why}); set {REQUIRE_ENV}=1 to make this fail");
    false
}
