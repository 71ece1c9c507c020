//! The crate's error type and the helpers that turn verb return codes and work-completion
//! statuses into it. Every other module builds on this one, so it imports none of them.

use std::ffi::{CStr, c_int};

use ibverbs_sys as sys;

/// `ibv_wc_status` of a remote protection error (wrong rkey, out-of-bounds, no remote-read access).
pub const WC_STATUS_REM_ACCESS_ERR: u32 = sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR;
/// `ibv_wc_status` of a work request flushed because its QP went to the error state.
pub const WC_STATUS_WR_FLUSH_ERR: u32 = sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
/// `ibv_wc_status` of a transport retry timeout (peer gone or unreachable).
pub const WC_STATUS_RETRY_EXC_ERR: u32 = sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR;

/// Errors of this crate. Verb failures name the verb and errno; completion failures carry the
/// work-completion status and its `ibv_wc_status_str` text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    /// No RDMA support: libibverbs reports ENOSYS (no kernel support) or an empty device list.
    #[error("no RDMA device available")]
    NoDevice,
    /// Devices exist, but none has this name.
    #[error("RDMA device {0:?} not found")]
    DeviceNotFound(String),
    /// The chosen device (or every device) has no port in the ACTIVE state.
    #[error("no ACTIVE port on the RDMA device(s)")]
    NoActivePort,
    /// A verb failed.
    #[error("{verb} failed: {} (errno {errno})", std::io::Error::from_raw_os_error(*errno))]
    Verb {
        /// The libibverbs function that failed.
        verb: &'static str,
        /// Its errno.
        errno: i32,
    },
    /// A work request completed with an error status. The QP is now in the error state: every
    /// other outstanding request is flushed and the QP must be recreated and reconnected.
    #[error("work request {wr_id} failed: {status_str} (ibv_wc_status {status})")]
    Completion {
        /// Caller's `wr_id` of the failed read.
        wr_id: u64,
        /// `ibv_wc_status` value (see the `WC_STATUS_*` constants).
        status: u32,
        /// `ibv_wc_status_str(status)`.
        status_str: String,
    },
    /// The send queue has no room for the batch; poll completions first.
    #[error("send queue full")]
    QueueFull,
    /// The queue pair is in the error state after a failed completion (or a partial post);
    /// create and connect a new one.
    #[error("queue pair is in the error state; recreate it")]
    QpFailed,
    /// The call does not fit the queue pair's state (e.g. posting before `connect`).
    #[error("invalid queue pair state: {0}")]
    InvalidState(&'static str),
    /// A request violates a documented limit (batch size, read length, buffer bounds).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// An encoded [`Endpoint`](crate::Endpoint) is malformed.
    #[error("bad endpoint encoding: {0}")]
    BadEndpoint(String),
    /// The deadline passed before the batch completed. The batch is still outstanding: its
    /// buffer stays busy until a later [`QueuePair::poll`](crate::QueuePair::poll) sees it complete.
    #[error("deadline passed before the batch completed")]
    Timeout,
    /// The [`LocalBuffer`](crate::LocalBuffer) is the target of reads that have not completed yet.
    #[error("local buffer still has reads in flight")]
    BufferBusy,
}

/// The errno of the last failed libc/libibverbs call.
pub(crate) fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO)
}

/// Maps a verb's int return to a result. libibverbs verbs return 0 on success and, depending on
/// the verb and version, either a positive errno or -1 with `errno` set.
pub(crate) fn check(verb: &'static str, rc: c_int) -> Result<(), VerbsError> {
    match rc {
        0 => Ok(()),
        rc if rc > 0 => Err(VerbsError::Verb { verb, errno: rc }),
        _ => Err(VerbsError::Verb { verb, errno: last_errno() }),
    }
}

pub(crate) fn wc_status_str(status: u32) -> String {
    // SAFETY: ibv_wc_status_str accepts any value and returns a pointer to a static string.
    let p = unsafe { sys::ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("unknown status {status}");
    }
    // SAFETY: non-null, NUL-terminated, static lifetime (a string literal table in libibverbs).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_verb_and_status() {
        let e = VerbsError::Verb { verb: "ibv_reg_mr", errno: libc::ENOMEM };
        assert!(e.to_string().starts_with("ibv_reg_mr failed"), "{e}");
        assert_eq!(wc_status_str(WC_STATUS_REM_ACCESS_ERR), "remote access error");
    }
}
