//! Which kernel this process runs under: the one piece of IO in this
//! crate, here so that client and server can never disagree on it.

/// The kernel's boot id, or an empty string where there is none (which
/// callers take to match nothing).
///
/// Why the boot id: processes that see the same one run under the same
/// kernel, so they can share memory and the shared-memory handoff is worth
/// trying. Host names repeat across machines and differ between containers
/// on one kernel.
pub fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}
