//! What a one-sided reader tells an evicting server: the items it read,
//! which the server cannot see. Offsets are gathered here and sent in one
//! ACCESS_REPORT per [`REPORT_BATCH`] reads (or once the oldest waited
//! [`REPORT_MAX_AGE`]), so a GET costs one push, not a message.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Reads gathered before a report is sent.
pub const REPORT_BATCH: usize = 256;
/// Longest a read waits to be reported (checked at the next read).
pub const REPORT_MAX_AGE: Duration = Duration::from_millis(200);

/// Item offsets (in units) read since the last report.
pub struct AccessLog {
    /// Off when the server does not evict: then nothing is gathered.
    on: bool,
    pending: Mutex<(Vec<u64>, Option<Instant>)>,
}

impl AccessLog {
    /// Whether reads are gathered (the server evicts).
    pub fn is_on(&self) -> bool {
        self.on
    }

    pub fn new(on: bool) -> AccessLog {
        AccessLog { on, pending: Mutex::new((Vec::new(), None)) }
    }

    /// Whether reads are reported.
    pub fn on(&self) -> bool {
        self.on
    }

    /// Notes a read of the item at `unit`.
    pub fn note(&self, unit: u64) {
        if !self.on {
            return;
        }
        // A poisoned lock holds only offsets: take it as it is.
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if p.0.len() < REPORT_BATCH {
            p.0.push(unit);
        }
        p.1.get_or_insert_with(Instant::now);
    }

    /// The offsets to report now, if a batch is full or old enough.
    pub fn take_ready(&self) -> Option<Vec<u64>> {
        if !self.on {
            return None;
        }
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let ready = p.0.len() >= REPORT_BATCH || p.1.is_some_and(|t| t.elapsed() >= REPORT_MAX_AGE);
        if !ready || p.0.is_empty() {
            return None;
        }
        p.1 = None;
        Some(std::mem::take(&mut p.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_bounded_and_off_means_nothing() {
        let off = AccessLog::new(false);
        off.note(5);
        assert_eq!(off.take_ready(), None);
        let log = AccessLog::new(true);
        for u in 0..REPORT_BATCH as u64 - 1 {
            log.note(u);
        }
        assert_eq!(log.take_ready(), None, "neither full nor old");
        log.note(1);
        log.note(2);
        let batch = log.take_ready().unwrap();
        assert_eq!(batch.len(), REPORT_BATCH, "bounded");
        assert_eq!(log.take_ready(), None);
    }
}
