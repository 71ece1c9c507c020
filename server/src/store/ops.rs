//! The store's operations beyond plain put/get/delete, all on the one
//! write path (`Store::write_item`): conditional writes (add, replace,
//! append, prepend, CAS), counters, touch, reads that honour expiry, and
//! flush. Time comes in as `now_ms` (the server's published clock), so
//! every replica of a shard judges expiry alike and tests step it freely.

use std::borrow::Cow;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use crossbeam_epoch as epoch;
use dmkv_common::error::{Error, check_key};
use dmkv_common::expiry::expired;
use dmkv_common::layout::{self, Slot, decode_item, key_hash};

use super::item::{Arith, Expiry, Item, ItemMeta, Mode, Write};
use super::plan::{Current, Plan};
use super::{Location, Store};
use crate::lock::lock;

/// Most decimal digits of a counter (u64::MAX has 20).
pub const MAX_COUNTER_DIGITS: usize = 20;

/// The value of a counter item, or `NotNumeric`: decimal digits, at most
/// [`MAX_COUNTER_DIGITS`], optionally followed by spaces (memcached pads a
/// shrunk counter with them).
pub fn parse_counter(v: &[u8]) -> Result<u64, Error> {
    let digits = v.iter().position(|&b| b == b' ').map_or(v, |n| &v[..n]);
    if digits.is_empty()
        || digits.len() > MAX_COUNTER_DIGITS
        || !digits.iter().all(u8::is_ascii_digit)
        || !v[digits.len()..].iter().all(|&b| b == b' ')
    {
        return Err(Error::NotNumeric);
    }
    std::str::from_utf8(digits).ok().and_then(|s| s.parse().ok()).ok_or(Error::NotNumeric)
}

/// Checks a CAS condition against the current item.
fn check_cas(cas: u64, current: Option<&Current<'_>>) -> Result<(), Error> {
    match (cas, current) {
        (0, _) => Ok(()),
        (_, None) => Err(Error::NotFound),
        (cas, Some(c)) if c.item.version != cas => Err(Error::Exists),
        _ => Ok(()),
    }
}

impl Store {
    /// The live item of `key` at server time `now_ms` and where its slot
    /// is. An expired item is none (and counted).
    pub fn get_item(&self, key: &[u8], now_ms: u64) -> Result<Option<(Item, Location)>, Error> {
        check_key(key)?;
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        let kh = key_hash(key, self.header.hash_seed);
        let _guard = epoch::pin();
        let mut buf = Vec::new();
        let (_, seg) = self.index.segment(&kh);
        let Some((b, index, slot)) = self.find(seg, &kh, key, &mut buf) else { return Ok(None) };
        let item = decode_item(&buf).map_err(|_| Error::NotFound)?;
        if expired(item.expires_at, now_ms) {
            self.counters.get_expired.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
        self.counters.get_hits.fetch_add(1, Ordering::Relaxed);
        self.note_access(slot.offset_units);
        let meta = ItemMeta { version: item.version, flags: item.flags, expires_at: item.expires_at };
        let (start, len) = (layout::ITEM_HEADER_LEN + item.key.len(), item.value.len());
        let which = if b == usize::from(kh.buckets[0]) { 0 } else { 1 };
        let at = Location { which, index: index as u8, slot: slot.pack() };
        Ok(Some((Item { value: Bytes::from(buf).slice(start..start + len), meta }, at)))
    }

    /// Runs one write (see [`Write`]) at server time `now_ms`.
    pub fn write(&self, key: &[u8], w: &Write<'_>, now_ms: u64) -> Result<ItemMeta, Error> {
        self.write_versioned(key, w, now_ms, None)
    }

    /// [`Store::write`] with the version given (`Some`: a replicated
    /// write, whose version is its log index, so every replica gives the
    /// item the same CAS version; `None`: the store's next).
    pub fn write_versioned(
        &self,
        key: &[u8],
        w: &Write<'_>,
        now_ms: u64,
        version: Option<u64>,
    ) -> Result<ItemMeta, Error> {
        let needs_current = w.cas != 0 || w.mode != Mode::Set || w.expiry == Expiry::Keep;
        self.write_item(key, needs_current, |cur| {
            let cur = cur.filter(|c| !expired(c.item.expires_at, now_ms));
            check_cas(w.cas, cur.as_ref())?;
            let joined = |old: &[u8], first: bool| {
                let mut v = Vec::with_capacity(old.len() + w.value.len());
                if first {
                    v.extend_from_slice(w.value);
                    v.extend_from_slice(old);
                } else {
                    v.extend_from_slice(old);
                    v.extend_from_slice(w.value);
                }
                Cow::Owned(v)
            };
            let keep = |c: &Current<'_>| match w.expiry {
                Expiry::At(at) => at,
                Expiry::Keep => c.item.expires_at,
            };
            let fresh = |value| Plan {
                value,
                flags: w.flags,
                expires_at: match w.expiry {
                    Expiry::At(at) => at,
                    Expiry::Keep => 0,
                },
                version,
            };
            match (w.mode, &cur) {
                (Mode::Set, Some(c)) => Ok(Plan { expires_at: keep(c), ..fresh(Cow::Borrowed(w.value)) }),
                (Mode::Set | Mode::Add, None) => Ok(fresh(Cow::Borrowed(w.value))),
                (Mode::Add, Some(_)) => Err(Error::NotStored),
                (Mode::Replace, Some(c)) => Ok(Plan { expires_at: keep(c), ..fresh(Cow::Borrowed(w.value)) }),
                (Mode::Append | Mode::Prepend, Some(c)) => Ok(Plan {
                    value: joined(c.item.value, w.mode == Mode::Prepend),
                    flags: c.item.flags,
                    expires_at: c.item.expires_at,
                    version,
                }),
                (Mode::Append | Mode::Prepend, None) if w.vivify => Ok(fresh(Cow::Borrowed(w.value))),
                (Mode::Replace | Mode::Append | Mode::Prepend, None) => Err(Error::NotStored),
            }
        })
    }

    /// A counter operation at server time `now_ms`: the new value and the
    /// item's meta.
    pub fn arith(&self, key: &[u8], a: &Arith, now_ms: u64) -> Result<(u64, ItemMeta), Error> {
        self.arith_versioned(key, a, now_ms, None)
    }

    /// [`Store::arith`] with the version given (see [`Store::write_versioned`]).
    pub fn arith_versioned(
        &self,
        key: &[u8],
        a: &Arith,
        now_ms: u64,
        version: Option<u64>,
    ) -> Result<(u64, ItemMeta), Error> {
        let mut result = 0;
        let meta = self.write_item(key, true, |cur| {
            let cur = cur.filter(|c| !expired(c.item.expires_at, now_ms));
            check_cas(a.cas, cur.as_ref())?;
            let (value, flags, old_expiry) = match &cur {
                Some(c) => {
                    let n = parse_counter(c.item.value)?;
                    let n = if a.incr { n.wrapping_add(a.delta) } else { n.saturating_sub(a.delta) };
                    (n, c.item.flags, c.item.expires_at)
                }
                None => match a.vivify {
                    Some((initial, expires_at)) => (initial, 0, expires_at),
                    None => return Err(Error::NotFound),
                },
            };
            result = value;
            let expires_at = match (a.expiry, &cur) {
                (Expiry::At(at), Some(_)) => at,
                _ => old_expiry,
            };
            Ok(Plan { value: Cow::Owned(value.to_string().into_bytes()), flags, expires_at, version })
        })?;
        Ok((result, meta))
    }

    /// Gives `key`'s live item expiry `expires_at` (0: never), keeping its
    /// value, flags and version; returns the item (memcached's touch/gat).
    pub fn touch(&self, key: &[u8], expires_at: u32, now_ms: u64) -> Result<Option<Item>, Error> {
        let mut found = None;
        let r = self.write_item(key, true, |cur| {
            let Some(c) = cur.filter(|c| !expired(c.item.expires_at, now_ms)) else { return Err(Error::NotFound) };
            let value = c.item.value.to_vec();
            found = Some((Bytes::from(value.clone()), c.meta()));
            Ok(Plan { value: Cow::Owned(value), flags: c.item.flags, expires_at, version: Some(c.item.version) })
        });
        match r {
            Ok(meta) => Ok(found.map(|(value, _)| Item { value, meta })),
            Err(Error::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Removes `key` at server time `now_ms` if it is live and (`cas` not
    /// 0) has version `cas`. Ok(false): no live item (an expired one is
    /// removed all the same).
    pub fn delete_if(&self, key: &[u8], cas: u64, now_ms: u64) -> Result<bool, Error> {
        self.delete_where(key, |old, buf| {
            let item = if self.read_verified(old, buf) { decode_item(buf).ok() } else { None };
            match item.filter(|it| !expired(it.expires_at, now_ms)) {
                Some(it) if cas != 0 && it.version != cas => Err(Error::Exists),
                Some(_) => Ok(true),
                None if cas != 0 => Err(Error::NotFound),
                None => Ok(false),
            }
        })
    }

    /// Removes every item (memcached's flush_all); returns how many.
    pub fn clear_all(&self) -> u64 {
        self.clear_where(None::<fn(&[u8]) -> bool>)
    }

    /// Removes every item but those whose key `keep` names; returns how
    /// many went. An item that does not verify goes.
    pub fn clear_unless(&self, keep: impl Fn(&[u8]) -> bool) -> u64 {
        self.clear_where(Some(keep))
    }

    /// Without `keep`, no item is read: a flush costs a pass over slots.
    fn clear_where(&self, keep: Option<impl Fn(&[u8]) -> bool>) -> u64 {
        let guard = epoch::pin();
        let _w = lock(&self.writer);
        let mut n = 0;
        let slots: Vec<_> = self.live_slots().collect();
        let mut buf = Vec::new();
        for (id, pos, _, slot) in slots {
            if let Some(keep) = &keep
                && self.read_verified(slot, &mut buf)
                && decode_item(&buf).is_ok_and(|it| keep(it.key))
            {
                continue;
            }
            let seg = self.index.seg(id);
            let (b, w) = (pos / dmkv_common::limits::WORDS_PER_BUCKET, pos % dmkv_common::limits::WORDS_PER_BUCKET);
            self.set_slot(seg, b, w - 1, Slot::EMPTY);
            self.counters.items.fetch_sub(1, Ordering::Relaxed);
            self.retire(slot, &guard);
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use std::sync::Arc;
    use std::time::Duration;

    const NOW: u64 = 1_800_000_000_000;

    fn store() -> Store {
        Store::format(Arc::new(Region::create("ops", 4 << 20).unwrap()), 1024, 7, 1, Duration::ZERO).unwrap()
    }

    fn set<'a>(value: &'a [u8], mode: Mode) -> Write<'a> {
        Write { mode, ..Write::set(value) }
    }

    fn value(s: &Store, k: &[u8], now: u64) -> Option<Vec<u8>> {
        s.get_item(k, now).unwrap().map(|(i, _)| i.value.to_vec())
    }

    #[test]
    fn modes_follow_memcached() {
        let s = store();
        assert_eq!(s.write(b"k", &set(b"a", Mode::Replace), NOW), Err(Error::NotStored));
        assert_eq!(s.write(b"k", &set(b"a", Mode::Append), NOW), Err(Error::NotStored));
        assert_eq!(value(&s, b"k", NOW), None, "refused writes change nothing");
        s.write(b"k", &set(b"a", Mode::Add), NOW).unwrap();
        assert_eq!(s.write(b"k", &set(b"b", Mode::Add), NOW), Err(Error::NotStored));
        s.write(b"k", &Write { flags: 9, ..set(b"b", Mode::Replace) }, NOW).unwrap();
        s.write(b"k", &Write { flags: 1, ..set(b"c", Mode::Append) }, NOW).unwrap();
        s.write(b"k", &set(b"<", Mode::Prepend), NOW).unwrap();
        let (item, _) = s.get_item(b"k", NOW).unwrap().unwrap();
        assert_eq!((&item.value[..], item.meta.flags), (&b"<bc"[..], 9), "append keeps flags");
        s.write(b"v", &Write { vivify: true, ..set(b"x", Mode::Append) }, NOW).unwrap();
        assert_eq!(value(&s, b"v", NOW).unwrap(), b"x");
    }

    #[test]
    fn cas_succeeds_only_on_the_version_read() {
        let s = store();
        assert_eq!(s.write(b"k", &Write { cas: 5, ..Write::set(b"a") }, NOW), Err(Error::NotFound));
        let m = s.write(b"k", &Write::set(b"a"), NOW).unwrap();
        let m2 = s.write(b"k", &Write { cas: m.version, ..Write::set(b"b") }, NOW).unwrap();
        assert!(m2.version > m.version);
        assert_eq!(s.write(b"k", &Write { cas: m.version, ..Write::set(b"c") }, NOW), Err(Error::Exists));
        assert_eq!(value(&s, b"k", NOW).unwrap(), b"b");
        assert_eq!(s.delete_if(b"k", m.version, NOW), Err(Error::Exists));
        assert_eq!(s.delete_if(b"k", m2.version, NOW), Ok(true));
        assert_eq!(s.delete_if(b"k", 0, NOW), Ok(false));
    }

    #[test]
    fn expired_items_are_gone_for_reads_and_conditions() {
        let s = store();
        let at = (NOW / 1000 + 10) as u32;
        s.write(b"k", &Write { expiry: Expiry::At(at), flags: 3, ..Write::set(b"a") }, NOW).unwrap();
        assert_eq!(value(&s, b"k", NOW + 9_999).unwrap(), b"a");
        assert_eq!(value(&s, b"k", NOW + 10_000), None);
        let later = NOW + 10_000;
        assert_eq!(s.write(b"k", &set(b"b", Mode::Replace), later), Err(Error::NotStored));
        assert_eq!(s.touch(b"k", 0, later), Ok(None));
        s.write(b"k", &set(b"c", Mode::Add), later).unwrap();
        let (item, _) = s.get_item(b"k", later).unwrap().unwrap();
        assert_eq!((item.meta.flags, item.meta.expires_at), (0, 0), "the new item is a new item");
        // Touch keeps the version and moves the expiry.
        let t = s.touch(b"k", at + 100, later).unwrap().unwrap();
        assert_eq!(t.meta.version, item.meta.version);
        assert_eq!(value(&s, b"k", u64::from(at + 100) * 1000), None);
        assert_eq!(s.counters.items.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn counters_follow_memcached() {
        let s = store();
        let incr = |delta, incr| Arith { delta, incr, cas: 0, vivify: None, expiry: Expiry::Keep };
        assert_eq!(s.arith(b"n", &incr(1, true), NOW), Err(Error::NotFound));
        s.write(b"n", &Write { flags: 4, ..Write::set(b"10") }, NOW).unwrap();
        assert_eq!(s.arith(b"n", &incr(5, true), NOW).unwrap().0, 15);
        assert_eq!(s.arith(b"n", &incr(100, false), NOW).unwrap().0, 0, "decrements stop at 0");
        s.write(b"n", &Write::set(b"18446744073709551615"), NOW).unwrap();
        assert_eq!(s.arith(b"n", &incr(2, true), NOW).unwrap().0, 1, "increments wrap");
        s.write(b"n", &Write::set(b"abc"), NOW).unwrap();
        assert_eq!(s.arith(b"n", &incr(1, true), NOW), Err(Error::NotNumeric));
        assert_eq!(value(&s, b"n", NOW).unwrap(), b"abc");
        let viv = Arith { vivify: Some((7, 0)), ..incr(1, true) };
        assert_eq!(s.arith(b"m", &viv, NOW).unwrap().0, 7);
        assert_eq!(parse_counter(b"12  "), Ok(12));
        for bad in [&b""[..], b" 1", b"1a", b"123456789012345678901", b"99999999999999999999"] {
            assert_eq!(parse_counter(bad), Err(Error::NotNumeric), "{bad:?}");
        }
    }

    #[test]
    fn clear_all_empties_the_store() {
        let s = store();
        for i in 0..500u32 {
            s.write(format!("k{i}").as_bytes(), &Write::set(b"v"), NOW).unwrap();
        }
        assert_eq!(s.clear_all(), 500);
        assert_eq!(s.counters.items.load(Ordering::Relaxed), 0);
        assert_eq!(value(&s, b"k1", NOW), None);
        s.write(b"k1", &Write::set(b"w"), NOW).unwrap();
        assert_eq!(value(&s, b"k1", NOW).unwrap(), b"w");
    }
}
