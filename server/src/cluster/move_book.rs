//! What a node knows of the moves it takes part in, for `dmkv cluster
//! status`: the move its mover drives (phase and what was copied), the
//! copy it sends as a source's leader (live, chunk by chunk), and the
//! moves its mover ended. Bounded: one of each running, and the last
//! [`MAX_MOVE_HISTORY`] ended.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Instant;

use dmkv_common::proto::MoveReport;

use crate::lock::lock;

/// Ended moves a node remembers.
pub const MAX_MOVE_HISTORY: usize = 16;

#[derive(Default)]
pub struct MoveBook {
    inner: Mutex<Book>,
}

#[derive(Default)]
struct Book {
    driving: Option<(MoveReport, Instant)>,
    sending: Option<(MoveReport, Instant)>,
    ended: VecDeque<MoveReport>,
}

impl MoveBook {
    /// This node's mover begins a move.
    pub fn begin(&self, partition: u32, from: u32, to: u32, version: u64, rate_bytes: u64) {
        let r = MoveReport { partition, from, to, version, rate_bytes, phase: "copy".into(), ..Default::default() };
        lock(&self.inner).driving = Some((r, Instant::now()));
    }

    /// The mover's move enters `phase`.
    pub fn phase(&self, phase: &str) {
        if let Some((r, _)) = lock(&self.inner).driving.as_mut() {
            r.phase = phase.into();
        }
    }

    /// The mover's move copied this much more.
    pub fn copied(&self, keys: u64, bytes: u64) {
        if let Some((r, _)) = lock(&self.inner).driving.as_mut() {
            r.keys += keys;
            r.bytes += bytes;
        }
    }

    /// The mover's move ended (`outcome`: "done", or why not).
    pub fn end(&self, outcome: String, pause_us: u64) {
        let mut b = lock(&self.inner);
        if let Some((mut r, at)) = b.driving.take() {
            r.phase = outcome;
            r.pause_us = pause_us;
            r.elapsed_ms = at.elapsed().as_millis() as u64;
            if b.ended.len() >= MAX_MOVE_HISTORY {
                b.ended.pop_front();
            }
            b.ended.push_back(r);
        }
    }

    /// The mover's move ended with `e`: abandoned (undone before its
    /// cut-over) if it said so, else failed (asked again, it goes on).
    pub fn end_err(&self, e: &impl std::fmt::Debug) {
        let abandoned = lock(&self.inner).driving.as_ref().is_some_and(|(r, _)| r.phase == "abandoned");
        let how = if abandoned { "abandoned" } else { "failed" };
        self.end(format!("{how}: {e:?}"), 0);
    }

    /// This node, leading a source shard, begins sending a copy.
    pub fn send_begin(&self, partition: u32, from: u32, to: u32, version: u64, rate_bytes: u64) {
        let r = MoveReport { partition, from, to, version, rate_bytes, phase: "sending".into(), ..Default::default() };
        lock(&self.inner).sending = Some((r, Instant::now()));
    }

    /// The copy being sent took `keys` and `bytes` in all so far.
    pub fn sent(&self, keys: u64, bytes: u64) {
        if let Some((r, _)) = lock(&self.inner).sending.as_mut() {
            (r.keys, r.bytes) = (keys, bytes);
        }
    }

    /// The copy being sent ended.
    pub fn send_end(&self) {
        lock(&self.inner).sending = None;
    }

    /// Records a copy sent from now until the guard is dropped (however
    /// the copy ends).
    pub fn sending(&self, partition: u32, from: u32, to: u32, version: u64, rate_bytes: u64) -> Sending<'_> {
        self.send_begin(partition, from, to, version, rate_bytes);
        Sending(self)
    }

    /// Everything known, running ones first, with their time so far.
    pub fn reports(&self) -> Vec<MoveReport> {
        let b = lock(&self.inner);
        let running = [&b.driving, &b.sending]
            .into_iter()
            .flatten()
            .map(|(r, at)| MoveReport { elapsed_ms: at.elapsed().as_millis() as u64, ..r.clone() });
        running.chain(b.ended.iter().cloned()).collect()
    }
}

/// See [`MoveBook::sending`].
pub struct Sending<'a>(&'a MoveBook);

impl Drop for Sending<'_> {
    fn drop(&mut self) {
        self.0.send_end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_is_reported_while_it_runs_then_kept_bounded() {
        let book = MoveBook::default();
        book.begin(7, 0, 1, 3, 1 << 20);
        book.copied(10, 1000);
        book.phase("catch-up");
        book.send_begin(7, 0, 1, 3, 1 << 20);
        book.sent(4, 400);
        let r = book.reports();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].phase.as_str(), r[0].keys, r[0].bytes), ("catch-up", 10, 1000));
        assert_eq!((r[1].phase.as_str(), r[1].keys, r[1].bytes), ("sending", 4, 400));
        book.send_end();
        book.end("done".into(), 1500);
        let r = book.reports();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].phase.as_str(), r[0].pause_us), ("done", 1500));
        for p in 0..40 {
            book.begin(p, 0, 1, 3, 0);
            book.end("done".into(), 0);
        }
        let r = book.reports();
        assert_eq!(r.len(), MAX_MOVE_HISTORY);
        assert_eq!(r.last().map(|r| r.partition), Some(39));
        // Nothing running: phase and progress calls change nothing.
        book.phase("flip");
        book.copied(1, 1);
        book.sent(1, 1);
        assert_eq!(book.reports().len(), MAX_MOVE_HISTORY);
    }
}
