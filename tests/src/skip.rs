//! How a test that lacks something from the machine skips: it prints one
//! line saying SKIPPED and why, and passes; where the machine is meant to
//! have it all ([`required`]: CI, which installs it) a skip would hide a
//! broken setup, and the test fails instead. What a test needs, and
//! whether it is here, is [`crate::needs`]'s; this is only the policy, so
//! every module that probes for something can use it.

use std::io::Write;

/// Set to `1` where every optional tool is installed (`.ci/run` sets it):
/// a test that cannot find one then fails instead of skipping.
pub const REQUIRE_TOOLS_ENV: &str = "DMKV_REQUIRE_TOOLS";

/// Environment variable that, set to `1`, makes tests needing namespaces
/// (or packet rules, [`crate::partition`]) fail where they cannot be made
/// instead of skipping.
pub const REQUIRE_ENV: &str = "DMKV_NETNS_TESTS";

/// Whether this machine is meant to have every optional tool: a test that
/// lacks one fails here instead of skipping. True under `.ci/run`
/// ([`REQUIRE_TOOLS_ENV`] or [`REQUIRE_ENV`] is `1`) and wherever `CI` is
/// set.
pub fn required() -> bool {
    let one = |v: &str| std::env::var(v).as_deref() == Ok("1");
    one(REQUIRE_TOOLS_ENV) || one(REQUIRE_ENV) || std::env::var_os("CI").is_some_and(|v| !v.is_empty())
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
