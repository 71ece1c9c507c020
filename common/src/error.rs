//! Typed errors shared by client and server.

use thiserror::Error;

/// Why bytes read from a region do not form a valid item or header.
///
/// One-sided readers see these when they race a writer; they are
/// expected, counted and retried, never returned as data.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    #[error("buffer of {have} bytes is shorter than the {need} bytes needed")]
    Truncated { need: usize, have: usize },
    #[error("checksum mismatch")]
    Checksum,
    #[error("bad magic number")]
    BadMagic,
    #[error("unsupported layout version {0}")]
    UnsupportedVersion(u32),
    #[error("field {field} out of range: {value}")]
    OutOfRange { field: &'static str, value: u64 },
}

/// Errors of requests that reach the store.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Error {
    #[error("key is empty")]
    EmptyKey,
    #[error("key of {0} bytes exceeds the limit of {max} bytes", max = crate::limits::MAX_KEY_LEN)]
    KeyTooLarge(usize),
    #[error("value of {0} bytes exceeds the limit of {max} bytes", max = crate::limits::MAX_VALUE_LEN)]
    ValueTooLarge(usize),
    #[error("store is out of memory")]
    OutOfMemory,
    #[error("index is full for this key (both candidate buckets are full)")]
    IndexFull,
    /// A conditional write's condition did not hold (add of a present key,
    /// replace or append of a missing one): nothing was changed.
    #[error("not stored: the write's condition did not hold")]
    NotStored,
    /// A compare-and-swap named another version than the item's: nothing
    /// was changed.
    #[error("the item has changed since the version given (CAS mismatch)")]
    Exists,
    /// The item a CAS, counter or touch names does not exist (or expired).
    #[error("no such item")]
    NotFound,
    /// A counter operation on a value that is not a decimal number of at
    /// most 20 digits.
    #[error("cannot increment or decrement a non-numeric value")]
    NotNumeric,
}

/// Checks a key against the limits.
pub fn check_key(key: &[u8]) -> Result<(), Error> {
    if key.is_empty() {
        Err(Error::EmptyKey)
    } else if key.len() > crate::limits::MAX_KEY_LEN {
        Err(Error::KeyTooLarge(key.len()))
    } else {
        Ok(())
    }
}

/// Checks a value against the limits.
pub fn check_value(value: &[u8]) -> Result<(), Error> {
    if value.len() > crate::limits::MAX_VALUE_LEN { Err(Error::ValueTooLarge(value.len())) } else { Ok(()) }
}
