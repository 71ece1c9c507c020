//! One-sided GETs: read the server's region without running its key-value
//! code, verify every byte, and fall back to RPC when that fails.
//!
//! [`OneSided`] drives the pure protocol of [`dmkv_common::read`] over a
//! backend: [`shm`] (the region mapped in this process) or [`engine`] (the
//! server's software one-sided engine over TCP).

pub mod access;
mod clock;
mod directory;
pub mod engine;
mod hints;
mod local;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shm;

use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use dmkv_common::cluster::lease::ClockSample;
use dmkv_common::layout::{DirEntry, KeyHash, LAYOUT_VERSION, LEASE_LEN, LEASE_OFFSET, RegionHeader, key_hash};
use dmkv_common::proto::{RegionDescriptor, RegionInfoReply};
use dmkv_common::read::{
    AfterBuckets, Hint, Lookup, MAX_ATTEMPTS, MAX_BATCH_KEYS, Outcome, ReadSpec, Retry, clock_read, dir_read,
    judge_clock, judge_dir_entry, next_batch_keys,
};
use thiserror::Error;

use crate::client::{Transport, Versioned};
use access::AccessLog;
pub use clock::mono_ns;
use directory::DirCache;
use dmkv_common::cluster::lease_check::{self as lease, AttemptStart, LeaseClock};
use hints::{HintCache, HintId};
pub use local::{ItemMeta, LocalGet, Scratch, with_scratch};

/// Most keys whose item address is cached per server.
pub const DEFAULT_HINT_ENTRIES: usize = 64 * 1024;

/// Why a backend could not serve a batch. Every variant means the path is
/// unusable until attached again; nothing read is returned.
#[derive(Debug, Clone, Error)]
pub enum BackendError {
    #[error("cannot attach: {0}")]
    Attach(String),
    #[error("one-sided connection closed")]
    Closed,
    #[error("region registration is stale (new epoch or rkey)")]
    Stale,
    #[error("one-sided read timed out")]
    Timeout,
    #[error("one-sided protocol error: {0}")]
    Protocol(String),
    /// The exception: a cluster shard's region held no lease that covered
    /// the reads (a follower's, a deposed leader's, or a lease being
    /// renewed late). Nothing read is returned; ask the leader over RPC.
    /// The path stays attached.
    #[error("the region holds no lease covering the reads")]
    Unleased,
}

/// The results of one batch of reads: the bytes of each read, in order, or
/// `None` for a read the backend refused (out of bounds).
#[derive(Debug, Default)]
pub struct Reads {
    data: Vec<u8>,
    ranges: Vec<Option<Range<usize>>>,
    /// The server's monotonic clock before the batch's first read and
    /// after its last, where the backend stamps batches (the engine).
    stamps: Option<(u64, u64)>,
}

impl Reads {
    fn clear(&mut self) {
        self.data.clear();
        self.ranges.clear();
        self.stamps = None;
    }

    /// Appends room for a read of `len` bytes and returns it.
    fn push_slot(&mut self, len: usize) -> &mut [u8] {
        let start = self.data.len();
        self.data.resize(start + len, 0);
        self.ranges.push(Some(start..start + len));
        &mut self.data[start..]
    }

    fn push_failed(&mut self) {
        self.ranges.push(None);
    }

    /// The bytes of read `i`; `None` if it failed.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        self.ranges.get(i)?.clone().map(|r| &self.data[r])
    }
}

enum Backend {
    Shm(shm::ShmRegion),
    Engine(engine::EnginePool),
    #[cfg(feature = "rdma")]
    Rdma(Box<rdma::RdmaPath>),
}

impl Backend {
    async fn read(&self, specs: &[ReadSpec], out: &mut Reads) -> Result<(), BackendError> {
        match self {
            Backend::Shm(s) => s.read(specs, out),
            Backend::Engine(e) => e.read(specs, out).await,
            #[cfg(feature = "rdma")]
            Backend::Rdma(r) => r.read(specs, out).await,
        }
    }
}

/// Counters of one-sided reads, for tests, benchmarks and operators.
#[derive(Debug, Default)]
pub struct ReadCounters {
    /// GETs answered one-sided (hit or miss).
    pub gets: AtomicU64,
    /// Of those, answered from a cached address in one round trip.
    pub hint_hits: AtomicU64,
    /// Attempts abandoned because an item failed verification.
    pub torn: AtomicU64,
    /// Attempts abandoned because a matching slot held another key.
    pub other_key: AtomicU64,
    /// Attempts abandoned because they outlasted the grace period.
    pub slow: AtomicU64,
    /// Attempts abandoned because the cached directory entry was stale
    /// (the segment had split): the entry is read again.
    pub stale_directory: AtomicU64,
    /// Attempts that found an item that can expire but no server clock to
    /// judge it by (the server answers those).
    pub no_clock: AtomicU64,
    /// Directory entries read (first use, or after a stale one).
    pub directory_reads: AtomicU64,
    /// GETs that used up their attempts and went over RPC.
    pub fallbacks: AtomicU64,
    /// Batches of a cluster shard's region refused for want of a lease.
    pub unleased: AtomicU64,
    /// Clock samples of a remote server that did not agree with the one
    /// before (a clock jumped or broke the drift bound): one-sided reads of
    /// its leased regions are refused until two agree again.
    pub clock_disagreements: AtomicU64,
    /// Keys read over RPC (GETs, each key of a multi-get, fallbacks and
    /// probes): kept here beside the one-sided count so the client's
    /// metrics can split all its reads by path (the server sees only these).
    pub rpc_gets: AtomicU64,
}

/// A snapshot of [`ReadCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStats {
    pub gets: u64,
    pub hint_hits: u64,
    pub torn: u64,
    pub other_key: u64,
    pub slow: u64,
    pub stale_directory: u64,
    pub no_clock: u64,
    pub directory_reads: u64,
    pub fallbacks: u64,
    pub unleased: u64,
    pub clock_disagreements: u64,
    pub rpc_gets: u64,
}

impl ReadCounters {
    /// The current values.
    pub fn snapshot(&self) -> ReadStats {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ReadStats {
            gets: l(&self.gets),
            hint_hits: l(&self.hint_hits),
            torn: l(&self.torn),
            other_key: l(&self.other_key),
            slow: l(&self.slow),
            stale_directory: l(&self.stale_directory),
            no_clock: l(&self.no_clock),
            directory_reads: l(&self.directory_reads),
            fallbacks: l(&self.fallbacks),
            unleased: l(&self.unleased),
            clock_disagreements: l(&self.clock_disagreements),
            rpc_gets: l(&self.rpc_gets),
        }
    }

    fn retry(&self, r: Retry) {
        let c = match r {
            Retry::Torn => &self.torn,
            Retry::OtherKey => &self.other_key,
            Retry::Slow => &self.slow,
            Retry::StaleDirectory => &self.stale_directory,
            Retry::NoClock => &self.no_clock,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// The cost of a one-sided (multi-)GET, for path selection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Trace {
    /// Batches of reads posted, each one round trip.
    pub round_trips: u32,
    /// Of those, round trips of attempts that had to be retried.
    pub retries: u32,
}

/// Result of a one-sided GET.
pub enum OneSidedGet {
    Found(Versioned),
    Missing,
    /// Verification kept failing: ask the server over RPC.
    GiveUp,
}

/// An attached one-sided path to one server's region.
pub struct OneSided {
    header: RegionHeader,
    dir: DirCache,
    backend: Backend,
    transport: Transport,
    hints: Mutex<HintCache>,
    counters: std::sync::Arc<ReadCounters>,
    clock: clock::AttemptClock,
    enforce_grace: bool,
    /// Keys per batch of a multi-get, sized to this path's measured speed.
    batch_keys: AtomicUsize,
    /// A cluster shard's region: every batch reads the lease block last,
    /// and counts only if the attempt lay inside one run of the lease, on
    /// the leader's clock as this bounds it (`lease`). `None`: a single
    /// node's region, no lease.
    lease: Option<LeaseClock>,
    /// Reads to report to a server that evicts.
    pub(crate) accesses: AccessLog,
    /// Which region, for access reports.
    pub(crate) region_id: u32,
}

/// How to attach a one-sided path.
pub struct AttachOptions {
    /// Only this transport (default: the best one available).
    pub forced: Option<Transport>,
    /// Longest wait for connections and reads.
    pub timeout: Duration,
    /// Keys whose item address is cached.
    pub hint_entries: usize,
    /// Where reads are counted.
    pub counters: std::sync::Arc<ReadCounters>,
    /// Abandon attempts that outlast the grace period.
    pub enforce_grace: bool,
    /// Connections to the engine (TCP transport).
    pub engine_connections: usize,
    /// Settings of congestion detection for engine connections.
    pub path_config: dmkv_common::path::PathConfig,
    /// Where replacements of congested engine connections are counted.
    pub repaths: std::sync::Arc<AtomicU64>,
    /// The secret to prove to servers that require authentication.
    pub token: Option<std::sync::Arc<dmkv_common::auth::Token>>,
    /// Which region: `None`, a single node's (the first); `Some(s)`, the
    /// region of cluster shard `s`'s replica on this node.
    pub shard: Option<u32>,
    /// The server's clock as sampled just before attaching (the region
    /// info's `monotonic_ns`, between this client's clock before and after
    /// the call): how a cluster region's lease is judged. Needed for
    /// cluster regions only.
    pub clock: Option<ClockSample>,
    /// Check leases of cluster regions. Only tests that show the check
    /// matters turn it off.
    pub check_leases: bool,
}

/// A local GET's result with its value (found: the whole buffer).
fn local_result(got: LocalGet, value: Vec<u8>) -> OneSidedGet {
    match got {
        LocalGet::Found(m) => OneSidedGet::Found(Versioned {
            value: Bytes::from(value),
            version: m.version,
            flags: m.flags,
            expires_at: m.expires_at,
        }),
        LocalGet::Missing => OneSidedGet::Missing,
        LocalGet::GiveUp => OneSidedGet::GiveUp,
    }
}

/// Adds the server clock's read to a batch, last (after every item read
/// in it, so the clock was read no earlier than they were); where it is.
fn push_clock_read(specs: &mut Vec<ReadSpec>) -> usize {
    specs.push(clock_read());
    specs.len() - 1
}

/// Picks and attaches a backend for the server described by `info`.
///
/// `opts.forced` limits the choice to one transport; otherwise RDMA is
/// tried first (when the server offers it and this host has a device), then
/// shared memory (only when the server runs on this host), then the engine.
pub async fn attach(
    client: &crate::Client,
    info: &RegionInfoReply,
    opts: AttachOptions,
) -> Result<OneSided, BackendError> {
    let AttachOptions {
        forced,
        timeout,
        hint_entries,
        counters,
        enforce_grace,
        engine_connections,
        path_config,
        repaths,
        token,
        shard,
        clock,
        check_leases,
    } = opts;
    let desc = match shard {
        None => info.regions.first().ok_or_else(|| BackendError::Attach("server has no region".into()))?,
        Some(s) => info
            .regions
            .iter()
            .find(|d| d.leased && d.shard == s)
            .ok_or_else(|| BackendError::Attach(format!("node holds no replica of shard {s}")))?,
    };
    // A shard replica's region is read only under its lease: never as a
    // single node's.
    if desc.leased != shard.is_some() {
        return Err(BackendError::Attach("a cluster shard's region is read through the cluster router".into()));
    }
    let header = header_of(desc)?;
    let candidates: &[Transport] = match forced {
        Some(t) => &[t][..],
        None => &[Transport::Rdma, Transport::Shm, Transport::Tcp],
    };
    let mut errors = Vec::new();
    for &t in candidates {
        let attempt = match offered(info, t) {
            Err(why) => Err(BackendError::Attach(why)),
            Ok(()) => match t {
                Transport::Shm => {
                    shm::ShmRegion::attach(&info.shm_socket, desc.rkey, desc.epoch, token.as_deref(), timeout)
                        .await
                        .map(Backend::Shm)
                }
                Transport::Tcp => {
                    let health =
                        crate::path::ConnHealth::new(engine_connections, path_config, std::sync::Arc::clone(&repaths));
                    match engine_dialer(client, info) {
                        Ok(dialer) => engine::EnginePool::connect(
                            &info.engine_addr,
                            desc.rkey,
                            timeout,
                            engine_connections,
                            health,
                            dialer,
                        )
                        .await
                        .map(Backend::Engine),
                        Err(e) => Err(e),
                    }
                }
                Transport::Rdma => attach_rdma(client, desc.epoch, timeout).await,
            },
        };
        match attempt {
            Ok(backend) => {
                let lease = match (desc.leased && check_leases, clock) {
                    (false, _) => None,
                    (true, None) => return Err(BackendError::Attach("no clock sample to judge leases by".into())),
                    (true, Some(sample)) => {
                        let same_clock = !info.host_id.is_empty()
                            && info.host_id == local_host_id()
                            && info.time_namespace != 0
                            && info.time_namespace == dmkv_common::host::time_namespace();
                        let c = LeaseClock::choose(t == Transport::Tcp, same_clock, sample)
                            .map_err(|e| BackendError::Attach(format!("clock sample refused: {e}")))?;
                        if let LeaseClock::Sampled(s) = &c {
                            spawn_resync(
                                client.clone(),
                                std::sync::Arc::downgrade(s),
                                std::sync::Arc::clone(&counters),
                            );
                        }
                        Some(c)
                    }
                };
                let clock = clock::AttemptClock::new(header.grace_nanos);
                return Ok(OneSided {
                    header,
                    dir: DirCache::new(header.dir_depth),
                    backend,
                    transport: t,
                    hints: Mutex::new(HintCache::new(hint_entries)),
                    counters,
                    clock,
                    enforce_grace,
                    batch_keys: AtomicUsize::new(MAX_BATCH_KEYS),
                    lease,
                    accesses: AccessLog::new(desc.evicts),
                    region_id: desc.region_id,
                });
            }
            // A forced transport's own reason, for `TransportUnavailable`.
            Err(e) if forced.is_some() => return Err(e),
            Err(e) => errors.push(format!("{t}: {e}")),
        }
    }
    debug_assert_eq!(errors.len(), candidates.len(), "every candidate failed once");
    Err(BackendError::Attach(errors.join("; ")))
}

/// Whether the server described by `info` offers transport `t` to this
/// client at all; if not, why, in words for whoever forced `t`. Passing
/// does not promise that attaching works (connections may still fail).
pub fn offered(info: &RegionInfoReply, t: Transport) -> Result<(), String> {
    match t {
        Transport::Shm if info.shm_socket.is_empty() => {
            Err("the server does not offer shared memory (dmkvd --no-shm, or shm = false)".into())
        }
        Transport::Shm if info.host_id.is_empty() || info.host_id != local_host_id() => {
            Err("the server is on another host; shared memory works only on the server's host".into())
        }
        Transport::Tcp if info.engine_addr.is_empty() => {
            Err("the server does not offer its one-sided engine (dmkvd --no-engine, or engine = false)".into())
        }
        Transport::Rdma if info.rdma_device.is_empty() => Err(NO_SERVER_RDMA.into()),
        Transport::Rdma if !cfg!(feature = "rdma") => Err(NO_CLIENT_RDMA.into()),
        Transport::Shm | Transport::Tcp | Transport::Rdma => Ok(()),
    }
}

const NO_SERVER_RDMA: &str = "the server has no region registered for RDMA (it found no RDMA device, \
                              runs with --no-rdma, or was built without the `rdma` feature)";
const NO_CLIENT_RDMA: &str = "this client was built without RDMA support (cargo feature `rdma`)";

/// How to reach the engine: with TLS when it speaks it (and this client
/// is configured for TLS), proving the client's token.
fn engine_dialer(client: &crate::Client, info: &RegionInfoReply) -> Result<engine::Dialer, BackendError> {
    let tls = match (info.engine_tls, client.tls()) {
        (false, _) => None,
        (true, Some(c)) => Some(c.clone()),
        (true, None) => {
            return Err(BackendError::Attach("the engine speaks TLS; configure ClientConfig::tls to use it".into()));
        }
    };
    Ok(engine::Dialer { tls, token: client.token().cloned() })
}

#[cfg(feature = "rdma")]
async fn attach_rdma(client: &crate::Client, epoch: u64, timeout: Duration) -> Result<Backend, BackendError> {
    rdma::RdmaPath::attach(client, epoch, timeout).await.map(|p| Backend::Rdma(Box::new(p)))
}

#[cfg(not(feature = "rdma"))]
async fn attach_rdma(_: &crate::Client, _: u64, _: Duration) -> Result<Backend, BackendError> {
    // `offered` refuses RDMA in builds without it.
    Err(BackendError::Attach(NO_CLIENT_RDMA.into()))
}

/// Takes a sample of `client`'s server's clock: its region info, and
/// this client's clock before and after asking for it.
pub(crate) async fn clock_sample(client: &crate::Client) -> Result<(RegionInfoReply, ClockSample), crate::ClientError> {
    let sent = mono_ns();
    let info = client.region_info_full().await?;
    let sample = ClockSample { sent, server: info.monotonic_ns, received: mono_ns() };
    Ok((info, sample))
}

/// Samples the server's clock every [`lease::CLOCK_RESYNC_INTERVAL`] while
/// the path that needs it lives.
fn spawn_resync(
    client: crate::Client,
    clock: std::sync::Weak<lease::SampledClock>,
    counters: std::sync::Arc<ReadCounters>,
) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(lease::CLOCK_RESYNC_INTERVAL).await;
            let Some(c) = clock.upgrade() else { return };
            // A failed call leaves the last sample to age out.
            if let Ok((_, sample)) = clock_sample(&client).await
                && !c.resample(sample)
            {
                counters.clock_disagreements.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "the server's clock and this client's disagree beyond the drift bound; one-sided reads of its shards are refused until they agree again"
                );
            }
        }
    });
}

fn header_of(d: &RegionDescriptor) -> Result<RegionHeader, BackendError> {
    if d.layout_version != LAYOUT_VERSION {
        return Err(BackendError::Attach(format!(
            "server's layout version {} is not {LAYOUT_VERSION}",
            d.layout_version
        )));
    }
    let h = RegionHeader {
        epoch: d.epoch,
        dir_depth: d.directory_depth,
        hash_seed: d.hash_seed,
        index_offset: d.index_offset,
        data_offset: d.data_offset,
        data_len: d.data_length,
        region_len: d.length,
        grace_nanos: d.grace_nanos,
    };
    h.validate().map_err(|e| BackendError::Attach(format!("bad region descriptor: {e}")))?;
    Ok(h)
}

fn local_host_id() -> String {
    dmkv_common::host::host_id()
}

/// One key's progress through a (multi-)GET.
struct Pending<'k> {
    key: &'k [u8],
    kh: KeyHash,
    segment: DirEntry,
    /// The entry was read from the directory in this attempt.
    fresh: bool,
    look: Lookup,
    hint: Option<Hint>,
    first: Range<usize>,
    items: Range<usize>,
}

impl OneSided {
    /// Which backend this path uses.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Caches where the server said `key`'s slot is (an RPC GET's reply),
    /// so its next one-sided GET reads bucket and item in one round trip.
    /// Nonsense is ignored; a stale hint costs one round trip, never a
    /// wrong value (it is trusted only while the bucket holds its slot).
    pub fn learn_hint(&self, key: &[u8], which: u32, index: u32, slot: u64) {
        let (Ok(which), Ok(index)) = (u8::try_from(which), u8::try_from(index)) else { return };
        if which > 1 || usize::from(index) >= dmkv_common::limits::SLOTS_PER_BUCKET {
            return;
        }
        let Some(slot) = dmkv_common::layout::Slot::unpack(slot) else { return };
        let id = self.hint_id(key);
        self.hints.lock().expect("hints poisoned").put(id, Hint { which, index, slot });
    }

    /// Whether `key`'s item address is cached (its GET can take one round
    /// trip).
    pub fn has_hint(&self, key: &[u8]) -> bool {
        let id = self.hint_id(key);
        self.hints.lock().expect("hints poisoned").get(id).is_some()
    }

    fn hint_id(&self, key: &[u8]) -> HintId {
        HintId::of(&key_hash(key, self.header.hash_seed))
    }

    /// When an attempt starts (see `clock`: never late).
    fn attempt_start(&self) -> u64 {
        self.clock.start()
    }

    /// When an attempt is judged (see `clock`: never early).
    fn judge_time(&self) -> u64 {
        self.clock.judge()
    }

    fn lookup(&self, kh: KeyHash, segment: DirEntry) -> (Lookup, Option<Hint>) {
        let hint = self.hint(&kh);
        (self.lookup_hinted(kh, segment, hint), hint)
    }

    /// The cached address of the key hashed to `kh`.
    fn hint(&self, kh: &KeyHash) -> Option<Hint> {
        self.hints.lock().expect("hints poisoned").get(HintId::of(kh))
    }

    /// An attempt starting now in `segment`, reading the hinted item too.
    fn lookup_hinted(&self, kh: KeyHash, segment: DirEntry, hint: Option<Hint>) -> Lookup {
        let look = Lookup::with_hash(kh, &self.header, segment, hint, self.attempt_start());
        if self.enforce_grace { look } else { look.without_grace_check() }
    }

    /// The directory entry of each of `todo`'s keys (hashed in `hashes`),
    /// reading those not cached in one batch (`None` where that read did
    /// not give one); and which it read.
    async fn directory_entries(&self, hashes: &[KeyHash]) -> Result<(Vec<Option<DirEntry>>, Vec<usize>), BackendError> {
        let mut entries: Vec<Option<DirEntry>> = hashes.iter().map(|kh| self.dir.get(kh)).collect();
        let missing: Vec<usize> = (0..hashes.len()).filter(|&j| entries[j].is_none()).collect();
        if missing.is_empty() {
            return Ok((entries, missing));
        }
        let specs: Vec<ReadSpec> = missing.iter().map(|&j| dir_read(&hashes[j], &self.header)).collect();
        let mut reads = Reads::default();
        self.backend.read(&specs, &mut reads).await?;
        self.counters.directory_reads.fetch_add(specs.len() as u64, Ordering::Relaxed);
        for (n, &j) in missing.iter().enumerate() {
            entries[j] = reads.get(n).and_then(|b| judge_dir_entry(b, &self.header));
            if let Some(e) = entries[j] {
                self.dir.put(&hashes[j], e);
            }
        }
        Ok((entries, missing))
    }

    /// GETs `key` with one-sided reads, at most [`MAX_ATTEMPTS`] attempts.
    pub async fn get(&self, key: &[u8]) -> Result<OneSidedGet, BackendError> {
        Ok(self.get_traced(key).await?.0)
    }

    /// [`OneSided::get`], also saying how many round trips it took.
    pub async fn get_traced(&self, key: &[u8]) -> Result<(OneSidedGet, Trace), BackendError> {
        if self.is_local() {
            // An empty buffer grows to the value's exact size, which the
            // returned `Bytes` then owns: one allocation, one copy.
            let mut value = Vec::new();
            let (got, trace) = local::with_scratch(|s| self.get_local(key, s, &mut value))?;
            if local::yield_due(1) {
                tokio::task::yield_now().await;
            }
            return Ok((local_result(got, value), trace));
        }
        let (mut out, trace) = self.multi_get_traced(&[key]).await?;
        Ok((out.pop().expect("one result per key"), trace))
    }

    /// GETs many keys: all bucket reads in one batch, then all item reads in
    /// one batch, repeated for the keys that must retry. Batches carry at
    /// most as many keys as this path reads within a quarter of the grace
    /// period ([`next_batch_keys`]).
    pub async fn multi_get<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<OneSidedGet>, BackendError> {
        Ok(self.multi_get_traced(keys).await?.0)
    }

    /// [`OneSided::multi_get`], also saying how many round trips it took.
    pub async fn multi_get_traced<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<(Vec<OneSidedGet>, Trace), BackendError> {
        if let Some(r) = self.multi_get_local(keys) {
            if local::yield_due(keys.len()) {
                tokio::task::yield_now().await;
            }
            return r;
        }
        let mut results: Vec<Option<OneSidedGet>> = (0..keys.len()).map(|_| None).collect();
        let mut trace = Trace::default();
        let mut todo: Vec<usize> = (0..keys.len()).collect();
        for _ in 0..MAX_ATTEMPTS {
            if todo.is_empty() {
                break;
            }
            let mut retry_all = Vec::new();
            let mut rest = &todo[..];
            while !rest.is_empty() {
                let n = self.batch_keys.load(Ordering::Relaxed).clamp(1, rest.len());
                let (batch, tail) = rest.split_at(n);
                rest = tail;
                // Only multi-gets are sized: a single GET (the hot path) is
                // not timed twice more.
                let start = (keys.len() > 1).then(|| self.attempt_start());
                let (retry, rounds) = self.attempt(keys, batch, &mut results).await?;
                if let Some(start) = start {
                    let took = self.judge_time().saturating_sub(start);
                    // Without the grace check (tests that provoke tears) no batch is too slow.
                    let grace = if self.enforce_grace { self.header.grace_nanos } else { u64::MAX };
                    self.batch_keys.store(next_batch_keys(n, took, grace), Ordering::Relaxed);
                }
                trace.round_trips += rounds;
                if !retry.is_empty() {
                    trace.retries += rounds;
                }
                retry_all.extend(retry);
            }
            todo = retry_all;
        }
        for i in todo {
            self.counters.fallbacks.fetch_add(1, Ordering::Relaxed);
            results[i] = Some(OneSidedGet::GiveUp);
        }
        Ok((results.into_iter().map(|r| r.expect("every key resolved")).collect(), trace))
    }

    /// One attempt for keys `todo` of `keys`; returns those that must retry
    /// and the round trips (batches of reads) the attempt took.
    async fn attempt<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        todo: &[usize],
        results: &mut [Option<OneSidedGet>],
    ) -> Result<(Vec<usize>, u32), BackendError> {
        let mut retry = Vec::new();
        let mut lease_start = AttemptStart::at(self.attempt_start());
        // A key's first GET, or its first after a split, reads its
        // directory entry first: one more round trip.
        let hashes: Vec<KeyHash> = todo.iter().map(|&i| key_hash(keys[i].as_ref(), self.header.hash_seed)).collect();
        let (entries, read) = self.directory_entries(&hashes).await?;
        let dir_round = u32::from(!read.is_empty());
        let mut specs = Vec::with_capacity(todo.len() * 3);
        let mut pend: Vec<(usize, Pending)> = Vec::with_capacity(todo.len());
        for (j, ((&i, kh), entry)) in todo.iter().zip(hashes).zip(entries).enumerate() {
            let key = keys[i].as_ref();
            let Some(segment) = entry else {
                // A torn or refused entry read.
                self.counters.retry(Retry::Torn);
                retry.push(i);
                continue;
            };
            let (look, hint) = self.lookup(kh, segment);
            let start = specs.len();
            look.first_reads(&mut specs);
            let fresh = read.binary_search(&j).is_ok();
            pend.push((i, Pending { key, kh, segment, fresh, look, hint, first: start..specs.len(), items: 0..0 }));
        }
        if pend.is_empty() {
            return Ok((retry, dir_round));
        }
        let lease_at = self.push_lease_read(&mut specs);
        let clock_at = push_clock_read(&mut specs);
        let mut reads = Reads::default();
        self.backend.read(&specs, &mut reads).await?;
        self.check_lease(&reads, lease_at, &mut lease_start)?;
        let clock = judge_clock(reads.get(clock_at).unwrap_or(&[]));
        let mut item_specs = Vec::new();
        let mut second = Vec::new();
        for (i, mut p) in pend {
            let (b0, b1) = (reads.get(p.first.start), reads.get(p.first.start + 1));
            let (Some(b0), Some(b1)) = (b0, b1) else {
                self.counters.retry(Retry::Torn);
                retry.push(i);
                continue;
            };
            let hinted = p.hint.and_then(|_| reads.get(p.first.start + 2));
            let judged = p.look.after_buckets(p.key, [b0, b1], hinted, self.judge_time(), clock);
            // An entry just read from the directory: its segment's headers
            // say which other indexes it serves (once, not every GET).
            if p.fresh
                && let Some(h) = p.look.serving()
            {
                self.dir.learn(p.segment, h.depth, h.suffix);
            }
            match judged {
                AfterBuckets::Hit(h) => {
                    let item = hinted.expect("hit comes from the hinted item");
                    self.counters.hint_hits.fetch_add(1, Ordering::Relaxed);
                    results[i] = Some(self.found(&p.kh, item, &h));
                }
                AfterBuckets::Miss => results[i] = Some(self.missing(&p.kh)),
                AfterBuckets::Retry(r) => {
                    if r == Retry::StaleDirectory {
                        self.dir.forget(&p.kh, p.segment);
                    }
                    self.counters.retry(r);
                    retry.push(i);
                }
                AfterBuckets::ReadItems => {
                    let start = item_specs.len();
                    p.look.item_reads(&mut item_specs);
                    p.items = start..item_specs.len();
                    second.push((i, p));
                }
            }
        }
        if second.is_empty() {
            return Ok((retry, 1 + dir_round));
        }
        let lease_at = self.push_lease_read(&mut item_specs);
        let clock_at = push_clock_read(&mut item_specs);
        let mut items = Reads::default();
        self.backend.read(&item_specs, &mut items).await?;
        self.check_lease(&items, lease_at, &mut lease_start)?;
        let clock = judge_clock(items.get(clock_at).unwrap_or(&[]));
        for (i, p) in second {
            let bufs: Vec<&[u8]> = p.items.clone().map(|j| items.get(j).unwrap_or(&[])).collect();
            match p.look.after_items(p.key, &bufs, self.judge_time(), clock) {
                Outcome::Hit(h) => results[i] = Some(self.found(&p.kh, bufs[h.item], &h)),
                Outcome::Miss => results[i] = Some(self.missing(&p.kh)),
                Outcome::Retry(r) => {
                    self.counters.retry(r);
                    retry.push(i);
                }
            }
        }
        Ok((retry, 2 + dir_round))
    }

    /// The offsets of items read, for a report to an evicting server.
    pub fn take_accesses(&self) -> Option<Vec<u64>> {
        self.accesses.take_ready()
    }

    /// Adds the lease block's read to a batch of a cluster region's reads,
    /// after every data read (a reader must see the block as it was after
    /// them); where it is (before the clock's: see `push_clock_read`).
    fn push_lease_read(&self, specs: &mut Vec<ReadSpec>) -> Option<usize> {
        self.lease.as_ref()?;
        specs.push(ReadSpec { offset: LEASE_OFFSET, len: LEASE_LEN as u32 });
        Some(specs.len() - 1)
    }

    /// Whether a batch's reads may be believed: in a cluster region, only
    /// if the attempt so far (from `start` to the end of this batch) lay
    /// inside one run of the lease whose block the batch read last
    /// (`lease::check`). Bucket and item reads of one GET each pass this,
    /// so the GET took effect while the region's replica was the only
    /// leader and held every acknowledged write (docs/replication.md).
    fn check_lease(&self, reads: &Reads, at: Option<usize>, start: &mut AttemptStart) -> Result<(), BackendError> {
        let (Some(clock), Some(at)) = (&self.lease, at) else { return Ok(()) };
        let ended = self.judge_time();
        match lease::check(clock, self.header.hash_seed, reads.get(at), reads.stamps, start, ended) {
            Ok(()) => Ok(()),
            Err(_) => {
                self.counters.unleased.fetch_add(1, Ordering::Relaxed);
                Err(BackendError::Unleased)
            }
        }
    }

    fn found(&self, kh: &KeyHash, item: &[u8], h: &dmkv_common::read::Hit) -> OneSidedGet {
        let meta = self.note_found(kh, h);
        OneSidedGet::Found(Versioned {
            value: Bytes::copy_from_slice(&item[h.value.clone()]),
            version: meta.version,
            flags: meta.flags,
            expires_at: meta.expires_at,
        })
    }

    /// Counts a hit and remembers where it was.
    fn note_found(&self, kh: &KeyHash, h: &dmkv_common::read::Hit) -> ItemMeta {
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        self.hints.lock().expect("hints poisoned").put(HintId::of(kh), h.hint);
        self.accesses.note(h.hint.slot.offset_units);
        ItemMeta { version: h.version, flags: h.flags, expires_at: h.expires_at }
    }

    fn missing(&self, kh: &KeyHash) -> OneSidedGet {
        self.note_missing(kh);
        OneSidedGet::Missing
    }

    /// Counts a miss and forgets where the key was.
    fn note_missing(&self, kh: &KeyHash) {
        self.counters.gets.fetch_add(1, Ordering::Relaxed);
        self.hints.lock().expect("hints poisoned").remove(HintId::of(kh));
    }
}
