//! The full linearizability search made to scale with long histories:
//! stateright's tester (as [`crate::history::check`] uses it) run on each
//! key's history cut into segments, joined by the register's possible
//! values at each cut.
//!
//! stateright's search copies the remaining history at every step, so a
//! key's history of a few thousand operations takes minutes even when it
//! is linearizable. But at a point where no operation of the key is in
//! flight, every operation before it precedes every one after it in real
//! time: a linearization is one of the part before, then one of the part
//! after, starting from the value the first left. So each segment is
//! checked from each value the previous one may have left (checked by a
//! read of that value appended after the segment), which is exact.
//!
//! An operation that failed stays in flight for ever, and there would be
//! no such points after it. So, before cutting, failed operations are
//! replaced by equivalent ones: a failed read constrains nothing and is
//! dropped; a failed PUT of value v (values are unique per key) took
//! effect before the first read of v returned, and is given that return
//! (no read of v: it can be left out, or taken to precede the next
//! write, without changing any read). A failed DELETE writes the value
//! every DELETE writes, so its effect cannot be told apart: it is kept
//! in flight in every segment after its invocation, which lets it take
//! effect in each of them (more lenient than once; never a false alarm).

use std::collections::{BTreeMap, BTreeSet};

use stateright::semantics::register::{Register, RegisterOp, RegisterRet};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester};

use crate::history::{ABSENT, Event};

/// Lines of a failing segment quoted in the counterexample.
const SHOWN: usize = 80;

/// One operation of a key: its thread, what it did, and the log positions
/// of its invocation and return (none: it failed).
#[derive(Debug, Clone)]
struct Op {
    thread: usize,
    op: RegisterOp<u64>,
    inv: usize,
    ret: Option<(usize, RegisterRet<u64>)>,
}

/// Whether every key's history is linearizable (each key a register
/// starting at 0); if not, the first key's failing segment.
pub fn check_segmented(keys: &[String], log: &[Event]) -> (bool, String) {
    let mut per_key: BTreeMap<&str, Vec<Op>> = keys.iter().map(|k| (k.as_str(), Vec::new())).collect();
    let mut open: BTreeMap<(usize, &str), usize> = BTreeMap::new();
    for (at, e) in log.iter().enumerate() {
        match e {
            Event::Invoke(t, k, op) => {
                let ops = per_key.entry(k).or_default();
                open.insert((*t, k), ops.len());
                ops.push(Op { thread: *t, op: op.clone(), inv: at, ret: None });
            }
            Event::Return(t, k, r) => {
                if let Some(i) = open.remove(&(*t, k.as_str())) {
                    per_key.get_mut(k.as_str()).expect("invoked")[i].ret = Some((at, r.clone()));
                }
            }
        }
    }
    for (k, ops) in per_key {
        if let Err(why) = check_key(ops) {
            return (false, format!("key {k}: {why}"));
        }
    }
    (true, String::new())
}

/// One key's history, as the module's doc says.
fn check_key(ops: Vec<Op>) -> Result<(), String> {
    let (ops, floating) = close_failed(ops);
    let mut states: BTreeSet<u64> = BTreeSet::from([0]);
    for seg in segments(&ops) {
        let end = seg.last().and_then(|o| o.ret.as_ref()).map_or(0, |r| r.0);
        let start = seg.first().map_or(0, |o| o.inv);
        let deletes: Vec<&Op> = floating.iter().filter(|d| d.inv < end).collect();
        let mut next = BTreeSet::new();
        for &s in &states {
            for f in finals(seg, s, !deletes.is_empty()) {
                if !next.contains(&f) && linearizable(seg, &deletes, start, s, f) {
                    next.insert(f);
                }
            }
        }
        if next.is_empty() {
            let mut lines: Vec<String> = seg.iter().take(SHOWN).map(|o| format!("{o:?}")).collect();
            if seg.len() > SHOWN {
                lines.push(format!("... {} more", seg.len() - SHOWN));
            }
            return Err(format!(
                "no linearization of the {} operations from event {start} on, from any of the values {states:?}:\n{}",
                seg.len(),
                lines.join("\n")
            ));
        }
        states = next;
    }
    Ok(())
}

/// Replaces failed operations by equivalent ones (see the module's doc);
/// returns the operations, all complete, in the order of their
/// invocations, and the failed DELETEs.
fn close_failed(ops: Vec<Op>) -> (Vec<Op>, Vec<Op>) {
    // Per value, the earliest return of a read of it.
    let mut first_read: BTreeMap<u64, usize> = BTreeMap::new();
    for o in &ops {
        if let Some((at, RegisterRet::ReadOk(v))) = &o.ret {
            let e = first_read.entry(*v).or_insert(*at);
            *e = (*e).min(*at);
        }
    }
    let (mut done, mut floating) = (Vec::new(), Vec::new());
    for mut o in ops {
        match (&o.op, &o.ret) {
            (_, Some(_)) => done.push(o),
            (RegisterOp::Read, None) => {}
            (RegisterOp::Write(ABSENT), None) => floating.push(o),
            (RegisterOp::Write(v), None) => {
                // A read of v before the write began stays unexplained.
                if let Some(&at) = first_read.get(v).filter(|&&at| at > o.inv) {
                    o.ret = Some((at, RegisterRet::WriteOk));
                    done.push(o);
                }
            }
        }
    }
    done.sort_by_key(|o| o.inv);
    (done, floating)
}

/// Cuts `ops` (complete, by invocation) where none is in flight.
fn segments(ops: &[Op]) -> Vec<&[Op]> {
    let mut out = Vec::new();
    let (mut from, mut last_ret) = (0, 0);
    for (i, o) in ops.iter().enumerate() {
        if i > from && o.inv > last_ret {
            out.push(&ops[from..i]);
            from = i;
        }
        last_ret = last_ret.max(o.ret.as_ref().map_or(usize::MAX, |r| r.0));
    }
    if from < ops.len() {
        out.push(&ops[from..]);
    }
    out
}

/// The values a segment may leave when it starts from `s`: those of its
/// writes that no other write of it follows in real time; `s` if it has no
/// write; absent too if a failed DELETE may take effect in it.
fn finals(seg: &[Op], s: u64, deletes: bool) -> BTreeSet<u64> {
    let writes: Vec<(u64, usize, usize)> = seg
        .iter()
        .filter_map(|o| match (&o.op, &o.ret) {
            (RegisterOp::Write(v), Some((r, _))) => Some((*v, o.inv, *r)),
            _ => None,
        })
        .collect();
    let mut out: BTreeSet<u64> = writes.iter().filter(|w| !writes.iter().any(|w2| w2.1 > w.2)).map(|w| w.0).collect();
    if writes.is_empty() {
        out.insert(s);
    }
    if deletes {
        out.insert(ABSENT);
    }
    out
}

/// An event as fed to the tester: log position, 0 invoke / 1 return (an
/// invocation first at a tie), thread, and the operation or its result.
type Fed = (usize, u8, usize, Option<RegisterOp<u64>>, Option<RegisterRet<u64>>);

/// Whether `seg`, with the failed `deletes` in flight, has a linearization
/// from `s` that leaves `f` (stateright's search, with a read of `f`
/// after everything).
fn linearizable(seg: &[Op], deletes: &[&Op], start: usize, s: u64, f: u64) -> bool {
    let mut events: Vec<Fed> = Vec::new();
    for d in deletes {
        events.push((d.inv.max(start), 0, d.thread, Some(d.op.clone()), None));
    }
    for o in seg {
        events.push((o.inv, 0, o.thread, Some(o.op.clone()), None));
        if let Some((at, r)) = &o.ret {
            events.push((*at, 1, o.thread, None, Some(r.clone())));
        }
    }
    events.sort_by_key(|e| (e.0, e.1));
    let mut t = LinearizabilityTester::new(Register(s));
    let last = seg.iter().chain(deletes.iter().copied()).map(|o| o.thread).max().unwrap_or(0) + 1;
    for (_, _, thread, op, ret) in events {
        let fed = match (op, ret) {
            (Some(op), _) => t.on_invoke(thread, op).map(|_| ()),
            (None, Some(r)) => t.on_return(thread, r).map(|_| ()),
            _ => Ok(()),
        };
        if fed.is_err() {
            return false;
        }
    }
    t.on_invoke(last, RegisterOp::Read).and_then(|t| t.on_return(last, RegisterRet::ReadOk(f))).is_ok()
        && t.is_consistent()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inv(t: usize, op: RegisterOp<u64>) -> Event {
        Event::Invoke(t, "k".into(), op)
    }
    fn ret(t: usize, r: RegisterRet<u64>) -> Event {
        Event::Return(t, "k".into(), r)
    }
    fn check(log: &[Event]) -> bool {
        let keys = ["k".to_string()];
        let (segmented, _) = check_segmented(&keys, log);
        let (whole, _) = crate::history::check(&keys, log);
        assert_eq!(segmented, whole, "the segmented search disagrees with the whole one on {log:?}");
        segmented
    }
    use RegisterOp::{Read, Write};
    use RegisterRet::{ReadOk, WriteOk};

    #[test]
    fn agrees_with_the_whole_search() {
        // Sequential: write 1, read 1, write 2, read 2.
        let seq =
            [inv(0, Write(1)), ret(0, WriteOk), inv(1, Read), ret(1, ReadOk(1)), inv(0, Write(2)), ret(0, WriteOk)];
        assert!(check(&seq));
        // A segment's value carries into the next: read 0 after write 1 is stale.
        let stale = [inv(0, Write(1)), ret(0, WriteOk), inv(1, Read), ret(1, ReadOk(0))];
        assert!(!check(&stale));
        // Two concurrent writes, then reads: either may be last, but not
        // both in turn.
        let both = [inv(0, Write(1)), inv(1, Write(2)), ret(0, WriteOk), ret(1, WriteOk)];
        let reads = |a: u64, b: u64| [inv(2, Read), ret(2, ReadOk(a)), inv(2, Read), ret(2, ReadOk(b))];
        assert!(check(&[&both[..], &reads(2, 2)].concat()));
        assert!(check(&[&both[..], &reads(1, 1)].concat()));
        assert!(!check(&[&both[..], &reads(1, 2)].concat()));
        // A read of a value whose write failed: the write took effect.
        let failed = [inv(0, Write(1)), inv(1, Read), ret(1, ReadOk(1)), inv(3, Write(2)), ret(3, WriteOk)];
        assert!(check(&failed));
        // ... and the read after it of the old value is stale.
        let failed_then_old = [inv(0, Write(1)), inv(1, Read), ret(1, ReadOk(1)), inv(1, Read), ret(1, ReadOk(0))];
        assert!(!check(&failed_then_old));
    }

    #[test]
    fn agrees_with_the_whole_search_on_random_histories() {
        use rand::rngs::StdRng;
        use rand::{Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(30);
        let (mut yes, mut no) = (0, 0);
        for _ in 0..400 {
            // Three threads; each step one thread invokes or returns; a
            // write of a fresh value, or a read of a written value; some
            // writes fail (never return).
            let mut log = Vec::new();
            let mut open: [Option<RegisterOp<u64>>; 3] = [None, None, None];
            let mut thread = [0usize, 1, 2];
            let mut next = 1u64;
            for _ in 0..14 {
                let i = rng.random_range(0..3);
                match open[i].take() {
                    None => {
                        let op = if rng.random_bool(0.4) {
                            next += 1;
                            Write(next - 1)
                        } else {
                            Read
                        };
                        log.push(inv(thread[i], op.clone()));
                        open[i] = Some(op);
                    }
                    Some(Write(_)) if rng.random_bool(0.2) => thread[i] += 3,
                    Some(Write(_)) => log.push(ret(thread[i], WriteOk)),
                    Some(Read) => log.push(ret(thread[i], ReadOk(rng.random_range(0..next)))),
                }
            }
            if check(&log) { yes += 1 } else { no += 1 }
        }
        assert!(yes > 20 && no > 20, "too one-sided a sample: {yes} linearizable, {no} not");
    }

    #[test]
    fn a_failed_delete_may_take_effect_later() {
        let keys = ["k".to_string()];
        let log = [
            inv(0, Write(1)),
            ret(0, WriteOk),
            inv(1, Write(ABSENT)),
            inv(2, Read),
            ret(2, ReadOk(1)),
            inv(2, Read),
            ret(2, ReadOk(ABSENT)),
        ];
        assert!(check_segmented(&keys, &log).0);
        // Not before its invocation.
        let early = [inv(0, Write(1)), ret(0, WriteOk), inv(2, Read), ret(2, ReadOk(ABSENT)), inv(1, Write(ABSENT))];
        assert!(!check_segmented(&keys, &early).0);
    }

    #[test]
    fn cuts_where_nothing_is_in_flight() {
        let op = |inv, ret| Op { thread: 0, op: Read, inv, ret: Some((ret, ReadOk(0))) };
        let ops = [op(0, 3), op(1, 2), op(4, 6), op(5, 7), op(8, 9)];
        let lens: Vec<usize> = segments(&ops).iter().map(|s| s.len()).collect();
        assert_eq!(lens, [2, 2, 1]);
    }
}
