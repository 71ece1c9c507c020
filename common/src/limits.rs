//! Every size and count that bounds dmkv, named in one place.

/// Largest key, in bytes. Keys must also be non-empty.
pub const MAX_KEY_LEN: usize = 1024;
/// Largest value, in bytes.
pub const MAX_VALUE_LEN: usize = 1024 * 1024;
/// Default largest frame on the wire: one maximum PUT plus headroom.
pub const DEFAULT_MAX_FRAME_LEN: usize = 2 * 1024 * 1024;
/// Smallest frame limit a server or client accepts in its configuration:
/// one maximum-size PUT must always fit.
pub const MIN_MAX_FRAME_LEN: usize = MAX_KEY_LEN + MAX_VALUE_LEN + 256;
/// A client's default ceiling on its connections' frame limit: each
/// connection uses the smaller of this and the limit the server names in
/// its HELLO reply, so a server may raise its `--max-frame` this far
/// without its clients being told.
pub const MAX_CLIENT_FRAME_LEN: usize = 64 * 1024 * 1024;
/// Length of the frame prefix (u32 little-endian).
pub const FRAME_HEADER_LEN: usize = 4;
/// Most keys in one MULTI_GET request.
pub const MAX_MULTI_GET_KEYS: usize = 1024;
/// Size of one index bucket: two cache lines, read as one. 15 slots (not
/// 7, as in one line) let a segment fill to about 73 % before it splits,
/// where 7 gave 48 %: the index of 16-byte values took 15 % of memory
/// instead of 23 % (docs/index.md).
pub const BUCKET_LEN: usize = 128;
/// 8-byte words in a bucket: a header word, then the slots.
pub const WORDS_PER_BUCKET: usize = BUCKET_LEN / 8;
/// Slots in a bucket (every word but the header).
pub const SLOTS_PER_BUCKET: usize = WORDS_PER_BUCKET - 1;
/// Buckets in an index segment, the unit the index grows by.
pub const SEGMENT_BUCKETS: usize = 32;
/// Bytes of an index segment (4 KiB).
pub const SEGMENT_LEN: usize = SEGMENT_BUCKETS * BUCKET_LEN;
/// Deepest the index directory can be: 2^32 entries.
pub const MAX_DIRECTORY_DEPTH: u32 = 32;
/// Allocation unit of the data area; items are aligned to it.
pub const UNIT: usize = 64;
/// Smallest region (`--memory`) dmkvd accepts: room for the header, a
/// small index and a few maximum-size items.
pub const MIN_REGION_LEN: usize = 4 * 1024 * 1024;
/// Largest region a slot's offset field can address (2^33 units).
pub const MAX_REGION_LEN: u64 = (1u64 << 33) * UNIT as u64;
/// Longest a cluster client sends one write again once a try of it may
/// have reached a node (its retry window, which the write id carries). A
/// shard remembers each identified write for twice its window, so this
/// bounds how long a write id is remembered; a client whose request
/// timeout is longer still resends a write only within this, and reports
/// it uncertain after (reads use the whole timeout).
pub const MAX_WRITE_RETRY_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);
/// Shortest retry window a shard remembers a write by, whatever the client
/// says: the second window is the margin for a try's time in transit and
/// queues and for leaders' clocks that disagree, which do not shrink with
/// a client's short timeout.
pub const MIN_WRITE_RETRY_WINDOW: std::time::Duration = std::time::Duration::from_secs(1);
