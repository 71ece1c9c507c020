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

/// The process's time namespace (the inode of `/proc/self/ns/time`; 1 on
/// a kernel without time namespaces, where every process has the one
/// clock), or 0 where it cannot be told (which callers take to match
/// nothing).
///
/// Why: processes under one kernel and in one time namespace read the same
/// `CLOCK_MONOTONIC`, so a reader can judge a shard leader's lease by its
/// own clock; another namespace may shift that clock by any offset.
pub fn time_namespace() -> u64 {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata("/proc/self/ns/time") {
        Ok(m) => m.ino(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && std::fs::metadata("/proc/self/ns").is_ok() => 1,
        Err(_) => 0,
    }
}
