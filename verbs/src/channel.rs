//! Completion channels: the file descriptor an event-driven caller sleeps on instead of
//! busy-polling a completion queue.

use ibverbs_sys as sys;

use crate::context::Context;
use crate::error::{VerbsError, last_errno};

/// A non-blocking completion channel of `ctx`.
pub(crate) fn create_channel(ctx: &Context) -> Result<*mut sys::ibv_comp_channel, VerbsError> {
    // SAFETY: the context is open.
    let ch = unsafe { sys::ibv_create_comp_channel(ctx.ctx) };
    if ch.is_null() {
        return Err(VerbsError::Verb { verb: "ibv_create_comp_channel", errno: last_errno() });
    }
    // SAFETY: `fd` of a live channel is an open descriptor owned by the channel.
    let fd = unsafe { (*ch).fd };
    // SAFETY: fcntl on an open descriptor with valid commands.
    let ok = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) == 0
    };
    if !ok {
        let errno = last_errno();
        destroy_channel(ch);
        return Err(VerbsError::Verb { verb: "fcntl(O_NONBLOCK)", errno });
    }
    Ok(ch)
}

/// Destroys a channel (no-op for null). Its CQ must be gone first.
pub(crate) fn destroy_channel(ch: *mut sys::ibv_comp_channel) {
    if !ch.is_null() {
        // SAFETY: the channel is live, no CQ uses it any more, and it is destroyed once.
        unsafe { sys::ibv_destroy_comp_channel(ch) };
    }
}
