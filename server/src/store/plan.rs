//! What a write on the one write path (`Store::write_item`) is told and
//! decides: the key's current item, and what to store instead.

use std::borrow::Cow;

use dmkv_common::layout::ItemRef;

use super::item::ItemMeta;

/// The key's item as a write found it: verified, and live at the write's
/// clock (an expired item is passed as none).
pub(crate) struct Current<'a> {
    pub item: ItemRef<'a>,
}

impl Current<'_> {
    pub(super) fn meta(&self) -> ItemMeta {
        ItemMeta { version: self.item.version, flags: self.item.flags, expires_at: self.item.expires_at }
    }
}

/// What a write stores: the value, flags and expiry, and the version
/// (`None`: the next one).
pub(crate) struct Plan<'v> {
    pub value: Cow<'v, [u8]>,
    pub flags: u32,
    pub expires_at: u32,
    pub version: Option<u64>,
}
