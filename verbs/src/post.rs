//! Posting batches of READs, and the blocking post-and-wait helper built on it.

use std::ptr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use ibverbs_sys as sys;

use crate::batch::{BATCH_INDEX_BITS, InFlight, ReadRequest};
use crate::error::{VerbsError, last_errno};
use crate::limits::{MAX_READ_LEN, MAX_READS_PER_BATCH};
use crate::local_buffer::LocalBuffer;
use crate::queue_pair::{QpState, QueuePair};

/// Busy-poll iterations between `yield_now` calls in [`QueuePair::read_batch`], so a spinning
/// client does not starve the kernel threads that drive Soft-RoCE on a small machine.
const SPINS_PER_YIELD: u32 = 256;

impl QueuePair {
    /// Posts `reads` as one linked list of work requests in a single `ibv_post_send` call (one
    /// doorbell). Only the last one is signaled: RC completes work requests in order, so its
    /// completion covers the whole batch, and an error on any of them is always reported.
    ///
    /// `local` is borrowed mutably so no byte view of it can be alive while the NIC writes;
    /// until the batch completes, [`LocalBuffer::as_slice`] returns [`VerbsError::BufferBusy`].
    /// Returns the batch's id, also used by [`QueuePair::read_batch`].
    pub fn post_reads(&mut self, reads: &[ReadRequest], local: &mut LocalBuffer) -> Result<u64, VerbsError> {
        self.post(reads, local, false)
    }

    /// [`QueuePair::post_reads`], with the last read fenced (`IBV_SEND_FENCE`): the NIC starts
    /// it only once every earlier read of the batch has completed, so it reads the remote
    /// memory after they all did. RC alone does not promise that: a responder may carry out
    /// the reads of one queue pair concurrently. It costs the last read a round trip of its
    /// own. dmkv's readers of a cluster leader's region read its lease block last this way.
    pub fn post_reads_last_fenced(
        &mut self,
        reads: &[ReadRequest],
        local: &mut LocalBuffer,
    ) -> Result<u64, VerbsError> {
        self.post(reads, local, true)
    }

    fn post(&mut self, reads: &[ReadRequest], local: &mut LocalBuffer, fence_last: bool) -> Result<u64, VerbsError> {
        match self.state {
            QpState::Init => return Err(VerbsError::InvalidState("post_reads before connect")),
            QpState::Failed => return Err(VerbsError::QpFailed),
            QpState::Ready => {}
        }
        if reads.is_empty() || reads.len() > MAX_READS_PER_BATCH {
            return Err(VerbsError::InvalidRequest(format!(
                "batch of {} reads, allowed 1..={MAX_READS_PER_BATCH}",
                reads.len()
            )));
        }
        let max_len = MAX_READ_LEN.min(self.ctx.max_msg_sz.max(1));
        for r in reads {
            let in_bounds = r.local_offset.checked_add(r.len as usize).is_some_and(|end| end <= local.len());
            if r.len == 0 || r.len > max_len || !in_bounds {
                return Err(VerbsError::InvalidRequest(format!(
                    "read {}: {} bytes at local offset {} (buffer {} bytes, max read {max_len})",
                    r.wr_id,
                    r.len,
                    r.local_offset,
                    local.len()
                )));
            }
        }
        let n = reads.len() as u32;
        if self.outstanding_wrs + n > self.sq_capacity {
            return Err(VerbsError::QueueFull);
        }

        let seq = self.next_seq;
        let (lkey, base) = (local.lkey(), local.addr());
        self.sge_scratch.clear();
        self.sge_scratch.extend(reads.iter().map(|r| sys::ibv_sge {
            addr: base + r.local_offset as u64,
            length: r.len,
            lkey,
        }));
        self.wr_scratch.clear();
        for (i, r) in reads.iter().enumerate() {
            // SAFETY: ibv_send_wr is plain C data for which all-zero is a valid (empty) value.
            let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
            // The index lets an error completion (reported even for unsignaled WRs) name the read.
            wr.wr_id = (seq << BATCH_INDEX_BITS) | i as u64;
            wr.sg_list = &mut self.sge_scratch[i];
            wr.num_sge = 1;
            wr.opcode = sys::ibv_wr_opcode::IBV_WR_RDMA_READ;
            wr.send_flags = match (i + 1 == reads.len(), fence_last && i > 0) {
                (true, true) => sys::ibv_send_flags::IBV_SEND_SIGNALED.0 | sys::ibv_send_flags::IBV_SEND_FENCE.0,
                (true, false) => sys::ibv_send_flags::IBV_SEND_SIGNALED.0,
                (false, _) => 0,
            };
            wr.wr.rdma = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr: r.remote_addr, rkey: r.rkey };
            self.wr_scratch.push(wr);
        }
        // Link only after the Vec is complete: pushing could have moved the elements.
        let head = self.wr_scratch.as_mut_ptr();
        for i in 0..reads.len() - 1 {
            // SAFETY: i and i + 1 are in bounds of wr_scratch, which is not resized below.
            unsafe { (*head.add(i)).next = head.add(i + 1) };
        }

        // Count the batch before posting: the NIC may write into the buffer as soon as the
        // doorbell rings.
        local.inner.in_flight.fetch_add(1, Ordering::AcqRel);
        let batch = InFlight { seq, wr_ids: reads.iter().map(|r| r.wr_id).collect(), local: Arc::clone(&local.inner) };
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: qp is live and connected; the WR list and its SGEs live in scratch vectors
        // that are not touched until the call returns (providers copy WRs into the queue); every
        // SGE lies within the registered local buffer (checked above), which stays allocated
        // via the Arc in `batch` until the completion is seen or the QP is destroyed.
        let rc = unsafe { (self.post_send)(self.qp, head, &mut bad) };
        if rc != 0 {
            let errno = if rc > 0 { rc } else { last_errno() };
            if !bad.is_null() && bad != head {
                // Some WRs went out, but not the signaled last one: their completion could
                // never be matched, so this QP can no longer be accounted for.
                self.state = QpState::Failed;
                // Keep the buffer pinned until the QP is torn down.
                self.in_flight.push_back(batch);
                self.next_seq += 1;
                self.outstanding_wrs += n;
            }
            return Err(VerbsError::Verb { verb: "ibv_post_send", errno });
        }
        self.next_seq += 1;
        self.outstanding_wrs += n;
        self.in_flight.push_back(batch);
        Ok(seq)
    }

    /// Posts `reads` and busy-polls until that batch completes or `deadline` passes. Completions
    /// of other batches seen meanwhile are kept for the next [`QueuePair::poll`]. This blocks
    /// the calling thread: async code should use [`QueuePair::create_with_events`] and sleep on
    /// [`QueuePair::event_fd`] instead.
    ///
    /// On success the data is in `local`. A failed read returns its [`VerbsError::Completion`]
    /// (the batch's first failed read); on [`VerbsError::Timeout`] the batch stays outstanding.
    pub fn read_batch(
        &mut self,
        reads: &[ReadRequest],
        local: &mut LocalBuffer,
        deadline: Instant,
    ) -> Result<(), VerbsError> {
        let seq = self.post_reads(reads, local)?;
        let mut spins_left = SPINS_PER_YIELD;
        loop {
            if let Some(done) = self.try_finish(seq)? {
                return done;
            }
            if Instant::now() >= deadline {
                return Err(VerbsError::Timeout);
            }
            spins_left -= 1;
            if spins_left == 0 {
                spins_left = SPINS_PER_YIELD;
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}
