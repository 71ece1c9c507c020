//! Registering caller-owned memory (the server's region) with the protection domain.

use std::ffi::{c_int, c_void};
use std::mem::ManuallyDrop;
use std::ptr;
use std::sync::Arc;

use ibverbs_sys as sys;

use crate::context::Context;
use crate::error::{VerbsError, check, last_errno};

/// A registered memory region; deregistered on drop.
pub struct MemoryRegion {
    mr: *mut sys::ibv_mr,
    ctx: Arc<Context>,
}

// SAFETY: the MR handle is only read (keys, address) or deregistered once in Drop; libibverbs
// allows deregistration from any thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: all &self methods only read immutable fields of the ibv_mr.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    pub(crate) fn register(
        ctx: &Arc<Context>,
        ptr: *mut u8,
        len: usize,
        access: u32,
    ) -> Result<MemoryRegion, VerbsError> {
        if ptr.is_null() || len == 0 {
            return Err(VerbsError::InvalidRequest("cannot register an empty or null region".into()));
        }
        // SAFETY: the PD is alive (ctx is borrowed); the callers guarantee [ptr, ptr+len) is
        // mapped memory that outlives the returned MR.
        let mr = unsafe { sys::ibv_reg_mr(ctx.pd, ptr.cast::<c_void>(), len, access as c_int) };
        if mr.is_null() {
            return Err(VerbsError::Verb { verb: "ibv_reg_mr", errno: last_errno() });
        }
        Ok(MemoryRegion { mr, ctx: Arc::clone(ctx) })
    }

    /// Registers memory the caller owns (e.g. a `memmap2` mapping) for remote READs.
    ///
    /// Access is `IBV_ACCESS_REMOTE_READ` only: peers holding the rkey can read any byte of the
    /// region at any time, and nobody can write it through the NIC.
    ///
    /// # Safety
    /// `[ptr, ptr + len)` must be valid, mapped memory for as long as the returned region lives
    /// (drop the region before unmapping), and its contents are exposed to every peer with the
    /// rkey.
    pub unsafe fn register_remote_read(
        ctx: &Arc<Context>,
        ptr: *mut u8,
        len: usize,
    ) -> Result<MemoryRegion, VerbsError> {
        Self::register(ctx, ptr, len, sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0)
    }

    /// The key peers put into their READ work requests.
    pub fn rkey(&self) -> u32 {
        // SAFETY: mr is a live ibv_mr until Drop.
        unsafe { (*self.mr).rkey }
    }

    /// The key local work requests use in their scatter/gather entries.
    pub fn lkey(&self) -> u32 {
        // SAFETY: mr is a live ibv_mr until Drop.
        unsafe { (*self.mr).lkey }
    }

    /// Start address of the region (virtual address, what peers use as `remote_addr`).
    pub fn addr(&self) -> u64 {
        // SAFETY: mr is a live ibv_mr until Drop.
        unsafe { (*self.mr).addr as u64 }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        // SAFETY: mr is a live ibv_mr until Drop.
        unsafe { (*self.mr).length }
    }

    /// Always false: registering an empty region is rejected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device context this region belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// Deregisters now and reports a failure that `Drop` would have to ignore.
    pub fn deregister(self) -> Result<(), VerbsError> {
        let this = ManuallyDrop::new(self);
        // SAFETY: mr is live and, with Drop suppressed, deregistered exactly once.
        let rc = unsafe { sys::ibv_dereg_mr(this.mr) };
        // SAFETY: the Arc is moved out exactly once from a value whose Drop never runs.
        drop(unsafe { ptr::read(&this.ctx) });
        check("ibv_dereg_mr", rc)
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: mr is live and deregistered exactly once. A failure (EBUSY when a memory
        // window is still bound; dmkv binds none) cannot be reported from Drop.
        unsafe { sys::ibv_dereg_mr(self.mr) };
    }
}

impl std::fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("lkey", &self.lkey())
            .field("rkey", &self.rkey())
            .finish()
    }
}
