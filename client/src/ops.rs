//! The SDK's memcached-style operations: writes with flags, a TTL, a
//! compare-and-swap version or a mode (add, replace, append, prepend),
//! counters and touch. The server runs each atomically and judges expiry
//! by its own clock (the one one-sided GETs read), so a TTL is relative to
//! the server's time, not this host's. In a cluster each goes to its
//! key's shard leader and through raft with a write id, like a PUT: the
//! leader's clock makes a TTL an absolute expiry, the entry's log index
//! is the new version, and a write sent again after a lost reply or a
//! failover applies once (a touch excepted: it is sent again, and timed
//! again by the leader it reaches).
//!
//! Refusals come back as [`ClientError::Server`] with the code:
//! `NOT_STORED` (a mode's condition failed), `EXISTS` (CAS: the item has
//! another version), `NOT_FOUND` (CAS, counter or touch of a missing or
//! expired item), `NOT_NUMERIC` (counter on a non-number). Nothing changed
//! then.

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
    /// A write to the node this client connected to, or in a cluster to
    /// the key's shard leader with a write id (`op` makes the request).
    async fn write_call(&self, key: &[u8], op: impl Fn(Option<proto::WriteId>) -> Op) -> Result<R, ClientError> {
        match self.router() {
            Some(r) => r.write_call(key, |id| op(Some(id))).await,
            None => self.call(op(None)).await,
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
        let (key, value) = (Bytes::copy_from_slice(key), Bytes::copy_from_slice(value));
        let op = |write_id| {
            Op::Put(proto::Put {
                key: key.clone(),
                value: value.clone(),
                write_id,
                flags: opts.flags,
                ttl_secs: ttl_secs(opts.ttl),
                cas: opts.cas,
                mode: opts.mode as i32,
                ..Default::default()
            })
        };
        match self.write_call(&key, op).await? {
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
        let k = Bytes::copy_from_slice(key);
        let op =
            |write_id| Op::Arith(proto::Arith { key: k.clone(), delta, decrement, write_id, ..Default::default() });
        match self.write_call(key, op).await? {
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
        let k = Bytes::copy_from_slice(key);
        let op = |write_id| {
            Op::Touch(proto::Touch { key: k.clone(), ttl_secs: ttl_secs(ttl), get, write_id, ..Default::default() })
        };
        match self.write_call(key, op).await? {
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
        let k = Bytes::copy_from_slice(key);
        match self
            .write_call(key, |write_id| Op::Delete(proto::Delete { key: k.clone(), write_id, cas: version }))
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
