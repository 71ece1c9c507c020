//! Registered memory cut into fixed-size message slots, for SENDs and RECVs.
//!
//! A slot is either the caller's (a [`Slot`] token in hand) or the NIC's
//! (posted: the token went into the post and comes back in the completion).
//! Bytes are copied in and out only through a token, so a slot the NIC may
//! be writing is never read: the types say when it is whose.

use std::alloc::{self, Layout};
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use ibverbs_sys as sys;

use crate::context::Context;
use crate::error::VerbsError;
use crate::limits::LOCAL_BUFFER_ALIGN;
use crate::memory_region::MemoryRegion;

/// Most slots one slab holds (the slot index fits a work request id's low
/// 32 bits with room to spare).
pub const MAX_SLOTS: u32 = 1 << 20;
/// Largest slot.
pub const MAX_SLOT_BYTES: u32 = 1 << 20;

/// One slot of a [`Slots`] slab, held by whoever may touch its bytes. Not
/// `Clone`: posting gives it to the NIC, its completion gives it back.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a slot dropped is lost to its slab until the slab is gone"]
pub struct Slot {
    pub(crate) slab: u32,
    pub(crate) index: u32,
}

impl Slot {
    /// Its index in the slab.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The work request id of a post of this slot: the slab and the index.
    pub(crate) fn wr_id(&self, kind: u64) -> u64 {
        (kind << 56) | (u64::from(self.slab) << 24) | u64::from(self.index)
    }

    /// The slot a completion's work request id names (the id was made by
    /// [`Slot::wr_id`] when this crate posted it).
    pub(crate) fn from_wr_id(wr_id: u64) -> (u64, Slot) {
        (wr_id >> 56, Slot { slab: ((wr_id >> 24) & 0xffff_ffff) as u32, index: (wr_id & 0xff_ffff) as u32 })
    }
}

static NEXT_SLAB: AtomicU32 = AtomicU32::new(1);

/// A registered slab of `count` slots of `slot_bytes` each (local write
/// access only: peers cannot read or write it, they send into it).
pub struct Slots {
    mr: ManuallyDrop<MemoryRegion>,
    ptr: *mut u8,
    layout: Layout,
    id: u32,
    count: u32,
    slot_bytes: u32,
}

// SAFETY: the raw pointer is an exclusively owned allocation; its bytes are
// touched only through `Slot` tokens (one holder each), by copies.
unsafe impl Send for Slots {}
// SAFETY: as above: `&self` methods copy the bytes of a slot whose token the
// caller holds, so no two threads touch one slot's bytes at once.
unsafe impl Sync for Slots {}

impl Slots {
    /// Allocates and registers the slab; returns it with every slot's token.
    pub fn new(ctx: &Arc<Context>, count: u32, slot_bytes: u32) -> Result<(Slots, Vec<Slot>), VerbsError> {
        if !(1..=MAX_SLOTS).contains(&count) || !(64..=MAX_SLOT_BYTES).contains(&slot_bytes) {
            return Err(VerbsError::InvalidRequest(format!(
                "{count} slots of {slot_bytes} bytes (1..={MAX_SLOTS} of 64..={MAX_SLOT_BYTES})"
            )));
        }
        let len = count as usize * slot_bytes as usize;
        let layout = Layout::from_size_align(len, LOCAL_BUFFER_ALIGN)
            .map_err(|e| VerbsError::InvalidRequest(format!("slab of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(VerbsError::Verb { verb: "alloc", errno: libc::ENOMEM });
        }
        let mr = match MemoryRegion::register(ctx, ptr, len, sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0) {
            Ok(mr) => mr,
            Err(e) => {
                // SAFETY: allocated above with this layout, never registered.
                unsafe { alloc::dealloc(ptr, layout) };
                return Err(e);
            }
        };
        let id = NEXT_SLAB.fetch_add(1, Ordering::Relaxed);
        let tokens = (0..count).map(|index| Slot { slab: id, index }).collect();
        Ok((Slots { mr: ManuallyDrop::new(mr), ptr, layout, id, count, slot_bytes }, tokens))
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    /// Slots in the slab.
    pub fn count(&self) -> u32 {
        self.count
    }

    pub(crate) fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    /// The address of `slot`, checked to be one of this slab's.
    pub(crate) fn addr(&self, slot: &Slot) -> Result<u64, VerbsError> {
        self.check(slot)?;
        Ok(self.ptr as u64 + u64::from(slot.index) * u64::from(self.slot_bytes))
    }

    fn check(&self, slot: &Slot) -> Result<(), VerbsError> {
        if slot.slab != self.id || slot.index >= self.count {
            return Err(VerbsError::InvalidRequest(format!(
                "slot {} of slab {} is not this slab's",
                slot.index, slot.slab
            )));
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes from `slot` at `offset` into `dst`.
    pub fn copy_out(&self, slot: &Slot, offset: usize, dst: &mut [u8]) -> Result<(), VerbsError> {
        self.check(slot)?;
        if offset.checked_add(dst.len()).is_none_or(|end| end > self.slot_bytes as usize) {
            return Err(VerbsError::InvalidRequest(format!(
                "{offset}+{} outside a {} byte slot",
                dst.len(),
                self.slot_bytes
            )));
        }
        // SAFETY: the range is inside the slot (checked), the slot inside the
        // live allocation; the caller holds its token, so the NIC is not
        // writing it (a posted slot's token is in the post) and nobody else
        // touches it.
        unsafe {
            let src = self.ptr.add(slot.index as usize * self.slot_bytes as usize + offset);
            std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// Copies `src` into `slot` from its start.
    pub fn copy_in(&self, slot: &Slot, src: &[u8]) -> Result<(), VerbsError> {
        self.check(slot)?;
        if src.len() > self.slot_bytes as usize {
            return Err(VerbsError::InvalidRequest(format!(
                "{} bytes into a {} byte slot",
                src.len(),
                self.slot_bytes
            )));
        }
        // SAFETY: as in `copy_out`, writing instead of reading.
        unsafe {
            let dst = self.ptr.add(slot.index as usize * self.slot_bytes as usize);
            std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
        }
        Ok(())
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        // SAFETY: deregistered before the memory is freed, exactly once. The
        // queues that post these slots hold the slab and are destroyed first.
        unsafe { ManuallyDrop::drop(&mut self.mr) };
        // SAFETY: allocated in `new` with this layout.
        unsafe { alloc::dealloc(self.ptr, self.layout) };
    }
}
