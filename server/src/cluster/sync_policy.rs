//! When a node's raft log is forced to disk (`--sync`): the policy the
//! log writes by and the last-run record remembers.

/// When the log is forced to disk (`--sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncPolicy {
    /// Every ready batch is fsynced before raft goes on: an acknowledged
    /// write survives power loss of every replica. The default.
    #[default]
    Always,
    /// Written at once (a process crash loses nothing), fsynced every
    /// [`BATCH_SYNC_INTERVAL`]: a power loss of a majority of a shard's
    /// replicas within that time can lose acknowledged writes.
    Batch,
    /// Written at once, fsynced when the kernel decides.
    None,
}

/// How often `--sync batch` forces the log to disk.
pub const BATCH_SYNC_INTERVAL: std::time::Duration = std::time::Duration::from_millis(10);

impl std::str::FromStr for SyncPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "always" => Ok(SyncPolicy::Always),
            "batch" => Ok(SyncPolicy::Batch),
            "none" => Ok(SyncPolicy::None),
            _ => Err(format!("unknown sync policy {s:?} (always, batch or none)")),
        }
    }
}
