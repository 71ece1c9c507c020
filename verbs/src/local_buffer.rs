//! Owned, registered buffers that RDMA READs land in, and the in-flight accounting that keeps
//! them alive and unreadable while the NIC may still write into them.

use std::alloc::{self, Layout};
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ibverbs_sys as sys;

use crate::context::Context;
use crate::error::VerbsError;
use crate::limits::LOCAL_BUFFER_ALIGN;
use crate::memory_region::MemoryRegion;

// This constructor lives here rather than in memory_region.rs so that module need not know
// LocalBuffer: LocalBuffer is built on MemoryRegion, and the two must not import each other.
impl MemoryRegion {
    /// Allocates and registers a zeroed, page-aligned local buffer of `len` bytes that the NIC
    /// writes READ results into (`IBV_ACCESS_LOCAL_WRITE` only).
    pub fn register_local(ctx: &Arc<Context>, len: usize) -> Result<LocalBuffer, VerbsError> {
        LocalBuffer::new(ctx, len)
    }
}

/// The allocation and registration behind a [`LocalBuffer`]; also held by in-flight batches so
/// the memory the NIC writes into outlives the batch even if the buffer handle is dropped.
pub(crate) struct LocalInner {
    mr: ManuallyDrop<MemoryRegion>,
    ptr: *mut u8,
    layout: Layout,
    /// Posted batches targeting this buffer that have not completed (or been torn down) yet.
    pub(crate) in_flight: AtomicUsize,
}

// SAFETY: the raw pointer is an exclusively owned heap allocation; access to its bytes is
// guarded by `in_flight` and the borrow rules of LocalBuffer (see LocalBuffer docs).
unsafe impl Send for LocalInner {}
// SAFETY: as above; shared access only creates shared views while no NIC write is in flight.
unsafe impl Sync for LocalInner {}

impl Drop for LocalInner {
    fn drop(&mut self) {
        // SAFETY: deregister before freeing so the NIC can no longer reach the memory; the MR is
        // taken exactly once, here.
        unsafe { ManuallyDrop::drop(&mut self.mr) };
        // SAFETY: ptr was allocated with exactly this layout in LocalBuffer::new.
        unsafe { alloc::dealloc(self.ptr, self.layout) };
    }
}

/// A registered, owned buffer that RDMA READs land in.
///
/// Soundness rule: the NIC writes into the buffer while a batch is in flight, so
/// [`QueuePair::post_reads`](crate::QueuePair::post_reads) takes `&mut LocalBuffer` (no byte view
/// can be alive while posting) and [`LocalBuffer::as_slice`] fails with
/// [`VerbsError::BufferBusy`] until every batch that targets the buffer has completed.
pub struct LocalBuffer {
    pub(crate) inner: Arc<LocalInner>,
}

impl LocalBuffer {
    /// Same as [`MemoryRegion::register_local`].
    pub fn new(ctx: &Arc<Context>, len: usize) -> Result<LocalBuffer, VerbsError> {
        let layout = Layout::from_size_align(len.max(1), LOCAL_BUFFER_ALIGN)
            .map_err(|e| VerbsError::InvalidRequest(format!("local buffer of {len} bytes: {e}")))?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(VerbsError::Verb { verb: "alloc", errno: libc::ENOMEM });
        }
        match MemoryRegion::register(ctx, ptr, layout.size(), sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0) {
            Ok(mr) => Ok(LocalBuffer {
                inner: Arc::new(LocalInner { mr: ManuallyDrop::new(mr), ptr, layout, in_flight: AtomicUsize::new(0) }),
            }),
            Err(e) => {
                // SAFETY: allocated above with this layout, never registered.
                unsafe { alloc::dealloc(ptr, layout) };
                Err(e)
            }
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.layout.size()
    }

    /// Always false (a buffer has at least one byte).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Local key of the registration.
    pub fn lkey(&self) -> u32 {
        self.inner.mr.lkey()
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.inner.ptr as u64
    }

    /// Whether reads into this buffer are still outstanding.
    pub fn is_busy(&self) -> bool {
        self.inner.in_flight.load(Ordering::Acquire) != 0
    }

    /// The whole buffer, once no read into it is outstanding.
    pub fn as_slice(&self) -> Result<&[u8], VerbsError> {
        if self.is_busy() {
            return Err(VerbsError::BufferBusy);
        }
        // SAFETY: the allocation is live (we hold the Arc) and initialized (zeroed, then
        // written only by completed DMA); no write is in flight (checked above) and none can
        // start while this shared borrow lives, because posting needs &mut self.
        Ok(unsafe { std::slice::from_raw_parts(self.inner.ptr, self.len()) })
    }

    /// `len` bytes at `offset`, once no read into the buffer is outstanding.
    pub fn slice(&self, offset: usize, len: usize) -> Result<&[u8], VerbsError> {
        let all = self.as_slice()?;
        offset.checked_add(len).and_then(|end| all.get(offset..end)).ok_or_else(|| {
            VerbsError::InvalidRequest(format!("{offset}+{len} is outside the {} byte buffer", all.len()))
        })
    }

    /// Mutable view (e.g. to clear it between reads), once no read into it is outstanding.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], VerbsError> {
        if self.is_busy() {
            return Err(VerbsError::BufferBusy);
        }
        // SAFETY: as in as_slice; &mut self additionally excludes every other view.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.inner.ptr, self.len()) })
    }
}

impl std::fmt::Debug for LocalBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBuffer")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .field("busy", &self.is_busy())
            .finish()
    }
}
