//! Reaping the completion queue: mapping each batch's single signaled completion back to its
//! reads, and the completion-channel events that let a caller sleep until one arrives.

use std::ffi::c_int;
use std::ptr;

use ibverbs_sys as sys;

use crate::batch::{BATCH_INDEX_BITS, Completion, Finished};
use crate::error::{VerbsError, last_errno, wc_status_str};
use crate::limits::POLL_BATCH;
use crate::queue_pair::{QpState, QueuePair};

impl QueuePair {
    /// Moves completions from the CQ into `self.finished`. Bounded: at most one CQ's worth.
    fn drain_cq(&mut self) -> Result<(), VerbsError> {
        let mut budget = self.sq_capacity as usize + POLL_BATCH;
        while budget > 0 {
            // SAFETY: cq is live; wc_scratch has room for POLL_BATCH entries.
            let got = unsafe { (self.poll_cq)(self.cq, POLL_BATCH as c_int, self.wc_scratch.as_mut_ptr()) };
            if got < 0 {
                // Providers return -1 with errno set, or a negative errno.
                let errno = if got == -1 { last_errno() } else { -got };
                return Err(VerbsError::Verb { verb: "ibv_poll_cq", errno });
            }
            for i in 0..got as usize {
                let wc = self.wc_scratch[i];
                self.complete(wc.wr_id(), wc.error().map(|(status, _vendor)| status));
            }
            if (got as usize) < POLL_BATCH {
                break;
            }
            budget = budget.saturating_sub(got as usize);
        }
        Ok(())
    }

    fn complete(&mut self, nic_wr_id: u64, error: Option<u32>) {
        let (seq, index) = (nic_wr_id >> BATCH_INDEX_BITS, (nic_wr_id & ((1 << BATCH_INDEX_BITS) - 1)) as usize);
        // A failed batch reports several completions (the error, then flushes of its unsignaled
        // WRs); only the first one finds the batch.
        let Some(pos) = self.in_flight.iter().position(|b| b.seq == seq) else { return };
        let Some(mut batch) = self.in_flight.remove(pos) else { return };
        self.outstanding_wrs -= batch.wr_ids.len() as u32;
        let error = error.map(|status| {
            self.state = QpState::Failed;
            (index.min(batch.wr_ids.len() - 1), status, wc_status_str(status))
        });
        let wr_ids = std::mem::take(&mut batch.wr_ids);
        // Dropping `batch` releases the buffer: the NIC is done with it.
        drop(batch);
        self.finished.push_back(Finished { seq, wr_ids, error });
    }

    fn expand(f: Finished, out: &mut Vec<Completion>) -> usize {
        let n = f.wr_ids.len();
        out.extend(f.wr_ids.into_iter().map(|wr_id| Completion {
            wr_id,
            result: match &f.error {
                None => Ok(()),
                Some((_, status, status_str)) => {
                    Err(VerbsError::Completion { wr_id, status: *status, status_str: status_str.clone() })
                }
            },
        }));
        n
    }

    /// Polls the CQ without blocking and appends one [`Completion`] per read of every finished
    /// batch (a batch's single signaled completion is mapped back to all of its reads). A
    /// failed batch reports [`VerbsError::Completion`] for each of its reads, all carrying the
    /// status of its first failed read (reads before it may have landed, but the batch is
    /// treated as one unit), and leaves the QP failed: recreate it. Returns the number of
    /// completions appended.
    pub fn poll(&mut self, out: &mut Vec<Completion>) -> Result<usize, VerbsError> {
        self.drain_cq()?;
        let mut n = 0;
        while let Some(f) = self.finished.pop_front() {
            n += Self::expand(f, out);
        }
        Ok(n)
    }

    /// Says, without blocking, whether batch `seq` (from [`QueuePair::post_reads`]) has
    /// finished: `None` while it is in flight, `Some(Ok(()))` when its data is in the local
    /// buffer, `Some(Err(Completion))` for its first failed read. Completions of other batches
    /// seen meanwhile are kept for the next [`QueuePair::poll`].
    pub fn try_finish(&mut self, seq: u64) -> Result<Option<Result<(), VerbsError>>, VerbsError> {
        self.drain_cq()?;
        let Some(pos) = self.finished.iter().position(|f| f.seq == seq) else { return Ok(None) };
        let f = self.finished.remove(pos).expect("position is in bounds");
        Ok(Some(match f.error {
            None => Ok(()),
            Some((idx, status, status_str)) => Err(VerbsError::Completion { wr_id: f.wr_ids[idx], status, status_str }),
        }))
    }

    /// The completion channel's descriptor, non-blocking; `None` without a channel. It is
    /// readable once an armed CQ has a new completion. Valid as long as this QP.
    pub fn event_fd(&self) -> Option<std::os::fd::RawFd> {
        // SAFETY: a non-null channel is live until Drop; `fd` is immutable after creation.
        (!self.channel.is_null()).then(|| unsafe { (*self.channel).fd })
    }

    /// Asks for one event on [`QueuePair::event_fd`] at the CQ's next completion
    /// (`ibv_req_notify_cq`). Poll once more after arming: earlier completions raise none.
    pub fn arm_events(&mut self) -> Result<(), VerbsError> {
        let Some(notify) = self.req_notify_cq.filter(|_| !self.channel.is_null()) else {
            return Err(VerbsError::InvalidState("arm_events needs a QP made by create_with_events"));
        };
        // SAFETY: cq is live and bound to our channel; `notify` is the provider's own op.
        let rc = unsafe { notify(self.cq, 0) };
        if rc != 0 {
            return Err(VerbsError::Verb { verb: "ibv_req_notify_cq", errno: if rc > 0 { rc } else { last_errno() } });
        }
        Ok(())
    }

    /// Takes every pending event off the channel without blocking and acknowledges them
    /// (events must all be acknowledged before the CQ is destroyed). Returns how many.
    pub fn take_events(&mut self) -> Result<usize, VerbsError> {
        if self.channel.is_null() {
            return Err(VerbsError::InvalidState("take_events needs a QP made by create_with_events"));
        }
        let mut n = 0u32;
        // One armed CQ raises at most one event per arming; the bound only guards the loop.
        for _ in 0..POLL_BATCH {
            let (mut cq, mut cq_ctx) = (ptr::null_mut(), ptr::null_mut());
            // SAFETY: the channel is live and non-blocking; both out-pointers are valid.
            if unsafe { sys::ibv_get_cq_event(self.channel, &mut cq, &mut cq_ctx) } != 0 {
                let errno = last_errno();
                if errno == libc::EAGAIN || errno == libc::EWOULDBLOCK {
                    break;
                }
                self.ack(n);
                return Err(VerbsError::Verb { verb: "ibv_get_cq_event", errno });
            }
            n += 1;
        }
        self.ack(n);
        Ok(n as usize)
    }

    fn ack(&mut self, n: u32) {
        if n > 0 {
            // SAFETY: cq is live and these n events came from it (it is the channel's only CQ).
            unsafe { sys::ibv_ack_cq_events(self.cq, n) };
        }
    }
}
