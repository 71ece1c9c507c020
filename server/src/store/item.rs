//! What a write may ask beyond "store this value", as memcached and the
//! SDK define it: a mode (set, add, replace, append, prepend), client
//! flags, an expiry, a compare-and-swap version; counters; touch.

use bytes::Bytes;

/// What the store keeps about an item besides key and value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ItemMeta {
    /// The write's version: strictly increasing per store, and the CAS
    /// unique of memcached.
    pub version: u64,
    /// Opaque 32-bit client flags.
    pub flags: u32,
    /// Unix second the item expires at; 0: never.
    pub expires_at: u32,
}

/// A live item as a read returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub value: Bytes,
    pub meta: ItemMeta,
}

/// How a write treats the key's current item. An expired item counts as
/// no item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Store whatever is there.
    #[default]
    Set,
    /// Only if there is no item (else [`Error::NotStored`]).
    Add,
    /// Only if there is an item (else [`Error::NotStored`]).
    Replace,
    /// Add the value after the item's (else [`Error::NotStored`]); the
    /// item keeps its flags and expiry.
    Append,
    /// Add the value before the item's, likewise.
    Prepend,
}

/// The expiry a write gives its item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    /// The unix second it expires at; 0: never.
    At(u32),
    /// The current item's (append, prepend, counters; none for a new one).
    Keep,
}

/// One write. `cas` 0: unconditional; otherwise the item must exist
/// ([`Error::NotFound`]) with this version ([`Error::Exists`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Write<'a> {
    pub value: &'a [u8],
    pub mode: Mode,
    pub flags: u32,
    pub expiry: Expiry,
    pub cas: u64,
    /// Append or prepend to a missing item creates it with this value
    /// (memcached meta's autovivify), with `flags` and `expiry`.
    pub vivify: bool,
}

impl<'a> Write<'a> {
    /// A plain set of `value`: no flags, no expiry, no condition.
    pub fn set(value: &'a [u8]) -> Self {
        Write { value, mode: Mode::Set, flags: 0, expiry: Expiry::At(0), cas: 0, vivify: false }
    }
}

/// A counter operation (memcached incr/decr): the value must be a decimal
/// number of at most 20 digits. Increments wrap at 2^64; decrements stop
/// at 0. The result is stored as decimal digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arith {
    pub delta: u64,
    pub incr: bool,
    /// 0: unconditional; otherwise as [`Write::cas`].
    pub cas: u64,
    /// On a missing item: create it with this value and expiry (no
    /// flags) instead of failing with [`Error::NotFound`].
    pub vivify: Option<(u64, u32)>,
    /// The expiry the item gets.
    pub expiry: Expiry,
}

#[allow(unused_imports)]
use dmkv_common::error::Error;
