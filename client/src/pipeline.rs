//! Typed pipelining: send many requests to one node before awaiting any
//! reply, each reply parsed into what the matching call would return.
//!
//! ```no_run
//! # async fn demo() -> Result<(), dmkv_client::ClientError> {
//! let client = dmkv_client::Client::connect("127.0.0.1:7070").await?;
//! let mut sent = Vec::new();
//! for i in 0..16 {
//!     sent.push(client.send_put(format!("k{i}"), "v").await?);
//! }
//! for p in sent {
//!     let _version: u64 = p.wait().await?;
//! }
//! let v = client.send_get("k1").await?.wait().await?;
//! assert_eq!(v.map(|v| v.value).as_deref(), Some(&b"v"[..]));
//! # Ok(()) }
//! ```

use std::time::Duration;

use bytes::Bytes;
use dmkv_common::error::{check_key, check_value};
use dmkv_common::proto::{self, request::Op, response::Result as R};

use crate::client::Client;
use crate::conn::InFlight;
use crate::error::{ClientError, unexpected, unwrap};
use crate::value::Versioned;

/// A request sent whose reply has not been awaited yet; [`Pending::wait`]
/// gives what the matching call (`get_versioned`, `put`, `delete`) returns.
#[must_use = "a pending request's reply says whether it succeeded"]
pub struct Pending<T> {
    sent: InFlight,
    timeout: Duration,
    parse: fn(R) -> Result<T, ClientError>,
}

impl<T> Pending<T> {
    /// Waits for the reply, at most the client's request timeout from now.
    pub async fn wait(self) -> Result<T, ClientError> {
        (self.parse)(unwrap(self.sent.wait(self.timeout).await?)?)
    }
}

fn get_reply(r: R) -> Result<Option<Versioned>, ClientError> {
    match r {
        R::Get(g) if g.found => {
            Ok(Some(Versioned { value: g.value, version: g.version, flags: g.flags, expires_at: g.expires_at }))
        }
        R::Get(_) => Ok(None),
        other => Err(unexpected(&other)),
    }
}

fn put_reply(r: R) -> Result<u64, ClientError> {
    match r {
        R::Put(p) => Ok(p.version),
        other => Err(unexpected(&other)),
    }
}

fn delete_reply(r: R) -> Result<bool, ClientError> {
    match r {
        R::Delete(d) => Ok(d.existed),
        other => Err(unexpected(&other)),
    }
}

impl Client {
    /// Sends a GET over RPC without waiting for its reply.
    pub async fn send_get(&self, key: impl AsRef<[u8]>) -> Result<Pending<Option<Versioned>>, ClientError> {
        let key = key.as_ref();
        check_key(key)?;
        self.pipelined(Op::Get(proto::Get { key: Bytes::copy_from_slice(key) }), get_reply).await
    }

    /// Sends a PUT without waiting for its reply (its version).
    pub async fn send_put(&self, key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> Result<Pending<u64>, ClientError> {
        let (key, value) = (key.as_ref(), value.as_ref());
        check_key(key)?;
        check_value(value)?;
        let op = Op::Put(proto::Put {
            key: Bytes::copy_from_slice(key),
            value: Bytes::copy_from_slice(value),
            ..Default::default()
        });
        self.pipelined(op, put_reply).await
    }

    /// Sends a DELETE without waiting for its reply (whether the key was
    /// there).
    pub async fn send_delete(&self, key: impl AsRef<[u8]>) -> Result<Pending<bool>, ClientError> {
        let key = key.as_ref();
        check_key(key)?;
        self.pipelined(
            Op::Delete(proto::Delete { key: Bytes::copy_from_slice(key), write_id: None, cas: 0 }),
            delete_reply,
        )
        .await
    }

    /// Pipelined requests go to one node: a cluster's writes need the
    /// router's retries and write ids, which a reply awaited later cannot
    /// have.
    async fn pipelined<T>(&self, op: Op, parse: fn(R) -> Result<T, ClientError>) -> Result<Pending<T>, ClientError> {
        if self.router().is_some() {
            return Err(ClientError::Config(
                "pipelining sends to one node: against a cluster use get, put and delete (they route and retry)".into(),
            ));
        }
        let timeout = self.config().request_timeout;
        Ok(Pending { sent: self.send(op).await?, timeout, parse })
    }
}
