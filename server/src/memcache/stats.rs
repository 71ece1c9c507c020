//! The `stats` reply, with memcached's field names: the port's own
//! counters ([`Counters`]) and the store's.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use bytes::BytesMut;

pub use super::counters::Counters;
use super::service::{Service, VERSION};

/// The general `stats` reply: `STAT name value` lines and END.
pub fn general(svc: &Service, out: &mut BytesMut) {
    let c = &svc.counters;
    let stores = svc.stores();
    let sum = |f: fn(&crate::store::Store) -> &AtomicU64| stores.iter().map(|s| f(s).load(Relaxed)).sum::<u64>();
    let listener = &svc.shared.metrics.memcached;
    let now_ms = svc.kv().now_ms();
    let n = |a: &AtomicU64| a.load(Relaxed).to_string();
    let mut fields: Vec<(&str, String)> = vec![
        ("pid", std::process::id().to_string()),
        ("uptime", svc.started.elapsed().as_secs().to_string()),
        ("time", (now_ms / 1000).to_string()),
        ("version", VERSION.to_string()),
        ("pointer_size", (usize::BITS).to_string()),
        ("curr_connections", n(&listener.open)),
        ("total_connections", n(&listener.accepted)),
        ("max_connections", svc.max_connections.to_string()),
        ("cmd_get", n(&c.cmd_get)),
        ("cmd_set", n(&c.cmd_set)),
        ("cmd_flush", n(&c.cmd_flush)),
        ("cmd_touch", n(&c.cmd_touch)),
        ("get_hits", n(&c.get_hits)),
        ("get_misses", n(&c.get_misses)),
        // The store's count: every port's reads (one-sided ones excepted).
        ("get_expired", sum(|s| &s.counters.get_expired).to_string()),
        ("get_flushed", "0".into()),
        ("delete_misses", n(&c.delete_misses)),
        ("delete_hits", n(&c.delete_hits)),
        ("incr_misses", n(&c.incr_misses)),
        ("incr_hits", n(&c.incr_hits)),
        ("decr_misses", n(&c.decr_misses)),
        ("decr_hits", n(&c.decr_hits)),
        ("cas_misses", n(&c.cas_misses)),
        ("cas_hits", n(&c.cas_hits)),
        ("cas_badval", n(&c.cas_badval)),
        ("touch_hits", n(&c.touch_hits)),
        ("touch_misses", n(&c.touch_misses)),
        ("store_too_large", n(&c.store_too_large)),
        ("store_no_memory", n(&c.store_no_memory)),
        ("auth_cmds", n(&c.auth_cmds)),
        ("auth_errors", n(&c.auth_errors)),
        ("bytes_read", n(&listener.received)),
        ("bytes_written", n(&listener.sent)),
        ("limit_maxbytes", svc.region_bytes().to_string()),
        ("threads", svc.threads.to_string()),
        ("curr_items", sum(|s| &s.counters.items).to_string()),
        ("total_items", n(&c.total_items)),
        ("bytes", sum(|s| &s.counters.used_bytes).to_string()),
        // Non-zero only with `--evict lru`; otherwise a full store refuses writes.
        ("evictions", sum(|s| &s.counters.evictions).to_string()),
        ("reclaimed", "0".into()),
    ];
    if let super::backend::Backend::Cluster(c) = &svc.backend {
        // dmkv's own: requests passed on to the node leading their shard.
        fields.push(("forwarded", c.forward.sent.load(Relaxed).to_string()));
    }
    for (k, v) in fields {
        out.extend_from_slice(format!("STAT {k} {v}\r\n").as_bytes());
    }
    out.extend_from_slice(b"END\r\n");
}

/// `stats items`: dmkv keeps no size classes, so all its items are class
/// 1's (what tools that walk the classes to dump keys look for).
pub fn items(svc: &Service, out: &mut BytesMut) {
    let n: u64 = svc.stores().iter().map(|s| s.counters.items.load(Relaxed)).sum();
    if n > 0 {
        out.extend_from_slice(format!("STAT items:1:number {n}\r\n").as_bytes());
    }
    out.extend_from_slice(b"END\r\n");
}

/// Most bytes of one cachedump reply (memcached's bound, which `limit 0`
/// fills).
pub const MAX_CACHEDUMP_BYTES: usize = 2 << 20;
/// Most bytes of items one cachedump reads to find its keys.
pub const MAX_CACHEDUMP_READ: u64 = 16 << 20;
/// Cachedumps run one at a time (each walks the index).
static CACHEDUMPS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// `stats cachedump <class> <limit>`: `ITEM key [bytes b; expiry s]` for
/// up to `limit` live items of class 1 (the only one), memcached's lines;
/// the expiry is a unix time, 0 for none. Walked off the async workers.
pub async fn cachedump(svc: &Service, class: u32, limit: u32, out: &mut BytesMut) {
    if class == 1
        && let Ok(_one) = CACHEDUMPS.acquire().await
    {
        let stores = svc.stores();
        let now_ms = svc.kv().now_ms();
        // Each line takes at least 16 bytes besides its key.
        let most = MAX_CACHEDUMP_BYTES / 16;
        let max = if limit == 0 { most } else { (limit as usize).min(most) };
        // Keys the native API stored that the text protocol cannot name
        // (spaces, control bytes) would break the reply's lines.
        let keep = |k: &[u8]| super::token::key_ok(k) && !k.contains(&b' ');
        // A cluster node lists the shards it leads, one after another.
        let listed = tokio::task::spawn_blocking(move || {
            let mut listed = Vec::new();
            for store in stores {
                let left = max.saturating_sub(listed.len());
                if left == 0 {
                    break;
                }
                listed.extend(store.list(left, MAX_CACHEDUMP_READ, now_ms, keep));
            }
            listed
        })
        .await
        .unwrap_or_default();
        let start = out.len();
        for (key, len, expires_at) in listed {
            let line = format!(" [{len} b; {expires_at} s]\r\n");
            if out.len() - start + 5 + key.len() + line.len() > MAX_CACHEDUMP_BYTES {
                break;
            }
            out.extend_from_slice(b"ITEM ");
            out.extend_from_slice(&key);
            out.extend_from_slice(line.as_bytes());
        }
    }
    out.extend_from_slice(b"END\r\n");
}
