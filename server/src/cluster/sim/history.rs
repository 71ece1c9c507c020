//! What the simulation's clients saw, and its check.
//!
//! Every write is a PUT of a fresh value, and the store gives each applied
//! write a version higher than any before it, in log order: a key's
//! versions are its writes' linear order. A history of one register with
//! such writes is linearizable if no read returns a version older than one
//! whose write was acknowledged before the read began (a stale read), nor
//! older than one another read of the key returned before the read began
//! (a read back in time). Reads return only applied, hence committed,
//! versions, so those two rules are the whole check.

use std::collections::BTreeMap;

/// How a read went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// One-sided, on the leader host's own clock.
    Shared,
    /// One-sided through the engine, judged by its stamps.
    Stamped,
    /// One-sided, judged by bounds on the leader's clock from samples.
    Sampled,
    /// Over RPC, under the lease or after a quorum round.
    Rpc,
}

/// A read that returned: the version it saw (`None`: the key was absent).
#[derive(Debug, Clone, Copy)]
pub struct Read {
    pub key: usize,
    pub invoked: u64,
    pub returned: u64,
    pub got: Option<u64>,
    pub via: Via,
    /// The replica read.
    pub node: usize,
}

/// Acknowledged writes and returned reads, in true nanoseconds.
#[derive(Debug, Default)]
pub struct History {
    /// (acknowledged at, key, version).
    pub acks: Vec<(u64, usize, u64)>,
    pub reads: Vec<Read>,
}

impl History {
    /// The first anomaly, in words, naming the write or read it missed.
    pub fn check(&self) -> Option<String> {
        // Per key: acknowledgements by time, with the highest version
        // acknowledged so far; reads by return time, likewise.
        let mut acks: BTreeMap<usize, Vec<(u64, u64)>> = BTreeMap::new();
        for &(at, key, version) in &self.acks {
            acks.entry(key).or_default().push((at, version));
        }
        let mut seen: BTreeMap<usize, Vec<(u64, u64, usize)>> = BTreeMap::new();
        for (i, r) in self.reads.iter().enumerate() {
            seen.entry(r.key).or_default().push((r.returned, r.got.unwrap_or(0), i));
        }
        for list in acks.values_mut() {
            list.sort();
            running_max(list);
        }
        let mut seen_max: BTreeMap<usize, Vec<(u64, u64, usize)>> = BTreeMap::new();
        for (k, mut list) in seen {
            list.sort();
            let mut best: Option<(u64, usize)> = None;
            let mut out = Vec::with_capacity(list.len());
            for (at, v, i) in list {
                if best.is_none_or(|(b, _)| v > b) {
                    best = Some((v, i));
                }
                let (b, bi) = best.expect("set above");
                out.push((at, b, bi));
            }
            seen_max.insert(k, out);
        }
        for r in &self.reads {
            let got = r.got.unwrap_or(0);
            if let Some(list) = acks.get(&r.key) {
                let before = list.partition_point(|&(at, _)| at < r.invoked);
                if before > 0 && list[before - 1].1 > got {
                    let (at, v) = list[before - 1];
                    return Some(format!(
                        "stale read of key {} by {:?} on replica {} at {}..{} ms: got {}, but version {v} was acknowledged at {} ms",
                        r.key,
                        r.via,
                        r.node + 1,
                        r.invoked / MS_F,
                        r.returned / MS_F,
                        version(r.got),
                        at / MS_F
                    ));
                }
            }
            if let Some(list) = seen_max.get(&r.key) {
                let before = list.partition_point(|&(at, _, _)| at < r.invoked);
                if before > 0 && list[before - 1].1 > got {
                    let earlier = &self.reads[list[before - 1].2];
                    return Some(format!(
                        "read back in time of key {} by {:?} on replica {} at {}..{} ms: got {}, but a read by {:?} on replica {} returned {} at {} ms",
                        r.key,
                        r.via,
                        r.node + 1,
                        r.invoked / MS_F,
                        r.returned / MS_F,
                        version(r.got),
                        earlier.via,
                        earlier.node + 1,
                        version(earlier.got),
                        earlier.returned / MS_F
                    ));
                }
            }
        }
        None
    }
}

const MS_F: u64 = 1_000_000;

fn version(v: Option<u64>) -> String {
    v.map_or_else(|| "nothing".to_string(), |v| format!("version {v}"))
}

/// Replaces each (time, version) by (time, highest version up to it).
fn running_max(list: &mut [(u64, u64)]) {
    let mut best = 0;
    for e in list.iter_mut() {
        best = best.max(e.1);
        e.1 = best;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(key: usize, invoked: u64, returned: u64, got: Option<u64>) -> Read {
        Read { key, invoked, returned, got, via: Via::Shared, node: 0 }
    }

    #[test]
    fn stale_reads_and_reads_back_in_time_are_named() {
        let mut h = History { acks: vec![(10, 1, 5), (20, 1, 7)], reads: vec![read(1, 15, 16, Some(5))] };
        assert_eq!(h.check(), None, "version 7 came later");
        h.reads.push(read(1, 25, 26, Some(5)));
        let e = h.check().unwrap();
        assert!(e.contains("stale read of key 1") && e.contains("version 7 was acknowledged"), "{e}");
        let h = History { acks: vec![(10, 1, 5)], reads: vec![read(1, 11, 12, None)] };
        assert!(h.check().unwrap().contains("got nothing"));
        // An unacknowledged write seen, then unseen.
        let h = History { acks: vec![], reads: vec![read(2, 0, 5, Some(9)), read(2, 6, 7, Some(3))] };
        assert!(h.check().unwrap().contains("read back in time of key 2"));
        // Overlapping reads may see either.
        let h = History { acks: vec![], reads: vec![read(2, 0, 5, Some(9)), read(2, 4, 7, Some(3))] };
        assert_eq!(h.check(), None);
    }
}
