//! The SDK's memcached-style operations on a single node: writes with
//! flags, a TTL, a compare-and-swap version or a mode (add, replace,
//! append, prepend), counters and touch. The server runs each atomically
//! and judges expiry by its own clock (the one one-sided GETs read), so a
//! TTL is relative to the server's time, not this host's.
//!
//! Refusals come back as [`ClientError::Server`] with the code:
//! `NOT_STORED` (a mode's condition failed), `EXISTS` (CAS: the item has
//! another version), `NOT_FOUND` (CAS, counter or touch of a missing or
//! expired item), `NOT_NUMERIC` (counter on a non-number). Nothing changed
//! then. Cluster nodes do not replicate these yet: they refuse them with
//! `BAD_REQUEST`.

use std::time::Duration;

use bytes::Bytes;
use dmkv_common::error::{check_key, check_value};
use dmkv_common::proto::{self, ErrorCode, request::Op, response::Result as R};

pub use dmkv_common::proto::PutMode;

use crate::client::Client;
use crate::error::{ClientError, unexpected};
use crate::value::Versioned;

/// How [`Client::put_with`] writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// How long the item lives, in whole seconds from the server's now
    /// (rounded up; `None`: for ever).
    pub ttl: Option<Duration>,
    /// Opaque client flags stored with the item.
    pub flags: u32,
    /// 0: unconditional; otherwise the item must have this version.
    pub cas: u64,
    pub mode: PutMode,
}

/// Whole seconds of a TTL, rounded up (a TTL of 1 ms still expires).
fn ttl_secs(ttl: Option<Duration>) -> u64 {
    ttl.map_or(0, |d| d.as_secs() + u64::from(d.subsec_nanos() > 0)).max(u64::from(ttl.is_some()))
}

impl Client {
    fn single_node(&self) -> Result<(), ClientError> {
        match self.router() {
            Some(_) => Err(ClientError::Server {
                code: ErrorCode::BadRequest,
                message: "flags, TTLs, CAS, write modes, counters and touch are not replicated yet: use a single node"
                    .into(),
            }),
            None => Ok(()),
        }
    }

    /// Stores `value` under `key` as `opts` says; returns the write's
    /// version (the item's CAS version).
    pub async fn put_with(
        &self,
        key: impl AsRef<[u8]>,
        value: impl AsRef<[u8]>,
        opts: PutOptions,
    ) -> Result<u64, ClientError> {
        let (key, value) = (key.as_ref(), value.as_ref());
        check_key(key)?;
        check_value(value)?;
        self.single_node()?;
        let op = Op::Put(proto::Put {
            key: Bytes::copy_from_slice(key),
            value: Bytes::copy_from_slice(value),
            flags: opts.flags,
            ttl_secs: ttl_secs(opts.ttl),
            cas: opts.cas,
            mode: opts.mode as i32,
            ..Default::default()
        });
        match self.call(op).await? {
            R::Put(p) => Ok(p.version),
            other => Err(unexpected(&other)),
        }
    }

    /// Replaces `key`'s value only if its item still has `version` (from
    /// [`Client::get_versioned`]); returns the new version, or fails with
    /// `EXISTS` (another write came first) or `NOT_FOUND`.
    pub async fn cas(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>, version: u64) -> Result<u64, ClientError> {
        if version == 0 {
            return Err(ClientError::Server { code: ErrorCode::BadRequest, message: "CAS version 0".into() });
        }
        self.put_with(key, value, PutOptions { cas: version, ..Default::default() }).await
    }

    async fn arith(&self, key: &[u8], delta: u64, decrement: bool) -> Result<u64, ClientError> {
        check_key(key)?;
        self.single_node()?;
        let op = Op::Arith(proto::Arith { key: Bytes::copy_from_slice(key), delta, decrement, ..Default::default() });
        match self.call(op).await? {
            R::Arith(a) => Ok(a.value),
            other => Err(unexpected(&other)),
        }
    }

    /// Adds `delta` to the decimal counter at `key` (wrapping at 2^64);
    /// returns the new value.
    pub async fn incr(&self, key: impl AsRef<[u8]>, delta: u64) -> Result<u64, ClientError> {
        self.arith(key.as_ref(), delta, false).await
    }

    /// Subtracts `delta` from the counter at `key`, stopping at 0.
    pub async fn decr(&self, key: impl AsRef<[u8]>, delta: u64) -> Result<u64, ClientError> {
        self.arith(key.as_ref(), delta, true).await
    }

    /// Gives `key`'s item a new TTL (`None`: for ever), keeping its value,
    /// flags and version; returns whether there was a live item.
    pub async fn touch(&self, key: impl AsRef<[u8]>, ttl: Option<Duration>) -> Result<bool, ClientError> {
        Ok(self.touch_get(key.as_ref(), ttl, false).await?.is_some())
    }

    /// [`Client::touch`] that also returns the item (memcached's gat).
    pub async fn get_and_touch(
        &self,
        key: impl AsRef<[u8]>,
        ttl: Option<Duration>,
    ) -> Result<Option<Versioned>, ClientError> {
        self.touch_get(key.as_ref(), ttl, true).await
    }

    async fn touch_get(&self, key: &[u8], ttl: Option<Duration>, get: bool) -> Result<Option<Versioned>, ClientError> {
        check_key(key)?;
        self.single_node()?;
        let op = Op::Touch(proto::Touch {
            key: Bytes::copy_from_slice(key),
            ttl_secs: ttl_secs(ttl),
            get,
            ..Default::default()
        });
        match self.call(op).await? {
            R::Touch(g) if g.found => {
                Ok(Some(Versioned { value: g.value, version: g.version, flags: g.flags, expires_at: g.expires_at }))
            }
            R::Touch(_) => Ok(None),
            other => Err(unexpected(&other)),
        }
    }

    /// Removes `key` only if its item has `version`: Ok(false) if there is
    /// none, `EXISTS` if it has another.
    pub async fn delete_cas(&self, key: impl AsRef<[u8]>, version: u64) -> Result<bool, ClientError> {
        let key = key.as_ref();
        check_key(key)?;
        self.single_node()?;
        match self
            .call(Op::Delete(proto::Delete { key: Bytes::copy_from_slice(key), write_id: None, cas: version }))
            .await?
        {
            R::Delete(d) => Ok(d.existed),
            other => Err(unexpected(&other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        assert_eq!(ttl_secs(None), 0);
        assert_eq!(ttl_secs(Some(Duration::from_millis(1))), 1);
        assert_eq!(ttl_secs(Some(Duration::ZERO)), 1, "a zero TTL expires, it is not 'for ever'");
        assert_eq!(ttl_secs(Some(Duration::from_millis(1500))), 2);
        assert_eq!(ttl_secs(Some(Duration::from_secs(30))), 30);
    }
}
