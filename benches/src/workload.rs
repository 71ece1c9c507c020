//! YCSB's core workloads, the operations they issue, and the values they
//! write (derived from the seed so reads can be checked).

use bytes::Bytes;
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

pub use crate::generator::Distribution;
use crate::generator::{Rng, derive, mix64};

/// A core workload of YCSB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Update heavy: 50% reads, 50% updates.
    A,
    /// Read mostly: 95% reads, 5% updates.
    B,
    /// Read only.
    C,
    /// Read latest: 95% reads, 5% inserts, reads prefer new keys.
    D,
    /// Short ranges: scans. Not supported by a hash store.
    E,
    /// Read-modify-write: 50% reads, 50% read-modify-writes.
    F,
}

/// What an update, and the write of a read-modify-write, writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpdateWrites {
    /// The whole record, every field (YCSB's `writeallfields=true`).
    #[default]
    Record,
    /// One field (YCSB's default, `writeallfields=false`). The stores as
    /// driven here have no partial writes, so the field replaces the stored
    /// value, as YCSB's memcached binding does; reads then find a record or
    /// a field.
    Field,
}

impl UpdateWrites {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            UpdateWrites::Record => "record",
            UpdateWrites::Field => "field",
        }
    }
}

/// YCSB's fields per record (`fieldcount`).
pub const YCSB_FIELDS: usize = 10;

/// Why workload E is refused.
pub const SCAN_UNSUPPORTED: &str = "workload E (short range scans) is not supported: dmkv is a hash store \
     without an ordered key space, so it has no SCAN operation to measure";

/// Proportions of the operations of a workload; they sum to 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mix {
    pub read: f64,
    pub update: f64,
    pub insert: f64,
    pub rmw: f64,
}

impl Workload {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Workload::A => "a",
            Workload::B => "b",
            Workload::C => "c",
            Workload::D => "d",
            Workload::E => "e",
            Workload::F => "f",
        }
    }

    /// The operation mix; an error for workloads dmkv cannot run.
    pub fn mix(self) -> Result<Mix, &'static str> {
        let m = |read, update, insert, rmw| Ok(Mix { read, update, insert, rmw });
        match self {
            Workload::A => m(0.5, 0.5, 0.0, 0.0),
            Workload::B => m(0.95, 0.05, 0.0, 0.0),
            Workload::C => m(1.0, 0.0, 0.0, 0.0),
            Workload::D => m(0.95, 0.0, 0.05, 0.0),
            Workload::E => Err(SCAN_UNSUPPORTED),
            Workload::F => m(0.5, 0.0, 0.0, 0.5),
        }
    }

    /// YCSB's request distribution for the workload.
    pub fn default_distribution(self) -> Distribution {
        match self {
            Workload::D => Distribution::Latest,
            _ => Distribution::Zipfian,
        }
    }
}

/// One operation of the run phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Update,
    Insert,
    ReadModifyWrite,
}

/// Every operation kind, in report order.
pub const OP_KINDS: [OpKind; 4] = [OpKind::Read, OpKind::Update, OpKind::Insert, OpKind::ReadModifyWrite];

impl OpKind {
    /// YCSB's name for the operation.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Read => "READ",
            OpKind::Update => "UPDATE",
            OpKind::Insert => "INSERT",
            OpKind::ReadModifyWrite => "READ-MODIFY-WRITE",
        }
    }

    /// Position in [`OP_KINDS`].
    pub fn index(self) -> usize {
        self as usize
    }
}

impl Mix {
    /// The operation for uniform `u` in [0, 1).
    pub fn choose(&self, u: f64) -> OpKind {
        let mut acc = self.read;
        if u < acc {
            return OpKind::Read;
        }
        acc += self.update;
        if u < acc {
            return OpKind::Update;
        }
        acc += self.insert;
        if u < acc {
            return OpKind::Insert;
        }
        if self.rmw > 0.0 {
            return OpKind::ReadModifyWrite;
        }
        // Rounding left a sliver above the sum: give it to the largest share.
        OpKind::Read
    }
}

/// Bytes at the start of a value that name the key it was written for.
pub const VALUE_TAG_LEN: usize = 8;

/// The tag that starts every value written for `keynum` in a run seeded
/// with `seed`.
pub fn value_tag(seed: u64, keynum: u64) -> u64 {
    derive(seed, u64::MAX, keynum)
}

/// A value of `size` bytes for `keynum`: its tag, then bytes drawn from
/// `nonce` (so updates change the value).
pub fn make_value(seed: u64, keynum: u64, nonce: u64, size: usize) -> Bytes {
    let mut v = Vec::with_capacity(size + 8);
    v.extend_from_slice(&value_tag(seed, keynum).to_le_bytes());
    let mut r = Rng::new(mix64(nonce));
    while v.len() < size {
        v.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    v.truncate(size);
    Bytes::from(v)
}

/// What is wrong with a value read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BadValue {
    /// The length is not the configured value size.
    Length { expected: usize, got: usize },
    /// The value was written for another key (or with another seed).
    Tag,
}

impl std::fmt::Display for BadValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BadValue::Length { expected, got } => write!(f, "value of {got} bytes, expected {expected}"),
            BadValue::Tag => write!(f, "value was written for another key or seed"),
        }
    }
}

/// Checks a value read for `keynum`: its length, and its tag when the
/// value is long enough to carry one.
pub fn check_value(seed: u64, keynum: u64, size: usize, v: &[u8]) -> Result<(), BadValue> {
    if v.len() != size {
        return Err(BadValue::Length { expected: size, got: v.len() });
    }
    if size >= VALUE_TAG_LEN && v[..VALUE_TAG_LEN] != value_tag(seed, keynum).to_le_bytes()[..] {
        return Err(BadValue::Tag);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixes_sum_to_one_and_choose_in_proportion() {
        for w in [Workload::A, Workload::B, Workload::C, Workload::D, Workload::F] {
            let m = w.mix().unwrap();
            assert!((m.read + m.update + m.insert + m.rmw - 1.0).abs() < 1e-9);
            let mut r = Rng::new(1);
            let mut counts = [0u64; 4];
            let n = 100_000;
            for _ in 0..n {
                counts[m.choose(r.next_f64()).index()] += 1;
            }
            let want = [m.read, m.update, m.insert, m.rmw];
            for i in 0..4 {
                let got = counts[i] as f64 / n as f64;
                assert!((got - want[i]).abs() < 0.01, "workload {w:?} op {i}: {got} vs {}", want[i]);
            }
        }
        assert_eq!(Workload::E.mix(), Err(SCAN_UNSUPPORTED));
        assert_eq!(Workload::D.default_distribution(), Distribution::Latest);
        assert_eq!(Workload::A.default_distribution(), Distribution::Zipfian);
    }

    #[test]
    fn values_carry_their_key_and_size() {
        let v = make_value(7, 42, 1, 1000);
        assert_eq!(v.len(), 1000);
        assert_eq!(check_value(7, 42, 1000, &v), Ok(()));
        assert_eq!(check_value(7, 43, 1000, &v), Err(BadValue::Tag));
        assert_eq!(check_value(8, 42, 1000, &v), Err(BadValue::Tag));
        assert_eq!(check_value(7, 42, 999, &v), Err(BadValue::Length { expected: 999, got: 1000 }));
        assert_ne!(make_value(7, 42, 1, 1000), make_value(7, 42, 2, 1000));
        assert_eq!(make_value(7, 42, 1, 1000), make_value(7, 42, 1, 1000));
        assert_eq!(make_value(7, 42, 1, 3).len(), 3);
        assert_eq!(check_value(7, 42, 3, &make_value(7, 42, 1, 3)), Ok(()));
        assert_eq!(make_value(7, 42, 1, 0).len(), 0);
    }
}
