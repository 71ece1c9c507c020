//! The compactor: when free space is broken into pieces too small for the
//! items that want it, empty one window of the data area by moving its live
//! items elsewhere, so that it comes back as one free block.
//!
//! The policy is pure functions of the allocator's figures ([`background_work`],
//! [`plan`]); the thread around them is a thin driver. It runs in
//! the background when the largest free block falls under half its
//! reserve ([`reserve_units`]; fragmentation is then at least 75 %),
//! paced to [`DUTY_PERCENT`] of one core so foreground requests keep their
//! latency, and at full speed on demand when a PUT would fail for
//! fragmentation alone ([`Compactor::after_out_of_memory`]).
//!
//! The moves themselves are the store's (`Store::relocate`), under the
//! writer lock like every write, so each replica of a shard compacts its
//! own region on its own.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use dmkv_common::error::Error;
use dmkv_common::layout::{SEGMENT_UNITS, item_units};
use tracing::debug;

use crate::alloc::Space;
use crate::lock::lock;
use crate::store::{Candidate, Relocation, Store};

/// The reserve the background compactor keeps in one free block: twice the
/// largest item, so any item fits without waiting for compaction ...
pub const WINDOW_UNITS: u64 = 32_768;
/// ... but in small regions at most this fraction of the data area ...
pub const MIN_WINDOWS: u64 = 8;
/// ... and at most this share (percent) of the free space.
pub const RESERVE_OF_FREE_PERCENT: u64 = 50;
/// The background compactor starts when the largest free block is under
/// this share (percent) of the reserve (so fragmentation, 1 − largest
/// block ÷ free space, is at least 75 %), and stops once it is back.
pub const RESERVE_LOW_PERCENT: u64 = 50;
/// Share of one core the background compactor may use.
pub const DUTY_PERCENT: u32 = 20;
/// Work between pauses in the background: short, so a foreground write
/// waits at most for one item's copy.
const SLICE: Duration = Duration::from_millis(1);
/// How often the idle compactor looks at the figures.
const IDLE_CHECK: Duration = Duration::from_millis(100);
/// A window whose last blocks are not free this long after the moves (and
/// the grace period) is given up on: something still holds it.
const WINDOW_DEADLINE: Duration = Duration::from_secs(2);
/// A PUT refused for space waits at most this long for grace periods and
/// compaction before the client hears OUT_OF_MEMORY.
pub const OUT_OF_MEMORY_WAIT: Duration = Duration::from_secs(2);
/// The guarantee: a PUT succeeds (within [`OUT_OF_MEMORY_WAIT`]) while the
/// live items, the retired ones in their grace period and the new item
/// together take at most this share of the data area (percent).
pub const GUARANTEED_PERCENT: u64 = 85;

/// When the compactor runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Never in the background; still on demand for a PUT that needs it.
    Off,
    /// In the background to keep the reserve, and on demand.
    #[default]
    Auto,
    /// Always, window after window (for tests: items keep moving).
    Continuous,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Mode::Off),
            "auto" => Ok(Mode::Auto),
            "continuous" => Ok(Mode::Continuous),
            _ => Err(format!("unknown compactor mode {s:?} (off, auto or continuous)")),
        }
    }
}

/// The window size for a data area of `area` units.
pub fn window_units(area: u64) -> u64 {
    (area / MIN_WINDOWS).clamp(1, WINDOW_UNITS)
}

/// How large a free block the background compactor keeps: a window, but
/// at most half the free space.
pub fn reserve_units(space: Space, window: u64) -> u64 {
    window.min((space.free + space.parked) * RESERVE_OF_FREE_PERCENT / 100)
}

/// What the background compactor should do, from the allocator's figures:
/// rebuild the reserve when it is low (but for `Off`), else in continuous
/// mode keep moving items.
pub fn background_work(mode: Mode, space: Space, window: u64) -> Option<Why> {
    if mode == Mode::Off || space.parked > 0 {
        return None;
    }
    if space.largest_free * 100 < reserve_units(space, window) * RESERVE_LOW_PERCENT {
        return Some(Why::Background);
    }
    (mode == Mode::Continuous).then_some(Why::Continuous)
}

/// A range to empty, and the used units in it that must move.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub range: Range<u64>,
    pub used: u64,
}

/// Which range [`plan`] prefers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// The one with the fewest used units (least to move).
    Emptiest,
    /// The first used stretch (from a free block to the end of the next)
    /// at or after this unit, wrapping around (to keep items moving, for
    /// tests). The length is not used.
    After(u64),
}

/// Plans which `len` units (or a little more) to empty, from the free
/// blocks (start, length; address order) of the data area `area`. A range
/// starts at a free block and ends with one; one that overlaps `avoid`
/// (where its items are to go) or an index segment (starts in `fixed`,
/// sorted: segments never move), or whose start is in `skip` (recently
/// given up on), is left out.
pub fn plan(
    blocks: &[(u64, u64)],
    area: Range<u64>,
    len: u64,
    pick: Pick,
    avoid: Range<u64>,
    skip: &[u64],
    fixed: &[u64],
) -> Option<Plan> {
    let n = blocks.len();
    let end_of = |k: usize| blocks[k].0 + blocks[k].1;
    // free[k]: free units in blocks[..k].
    let mut free = Vec::with_capacity(n + 1);
    free.push(0u64);
    for k in 0..n {
        free.push(free[k] + blocks[k].1);
    }
    // A range runs from a free block's start to a free block's end, so no
    // item straddles its ends: what it holds moves whole. `j` is the first
    // block that ends at or past `target`.
    let candidate = |i: usize, j: usize| -> Option<Plan> {
        let start = blocks[i].0;
        if j == n {
            return None;
        }
        let end = end_of(j);
        if end > area.end || (start < avoid.end && avoid.start < end) || skip.contains(&start) {
            return None;
        }
        let first_fixed = fixed.partition_point(|&s| s + SEGMENT_UNITS as u64 <= start);
        if fixed.get(first_fixed).is_some_and(|&s| s < end) {
            return None;
        }
        Some(Plan { range: start..end, used: (end - start) - (free[j + 1] - free[i]) })
    };
    match pick {
        Pick::Emptiest => {
            // Targets grow with `i`, so `j` only moves forward: linear.
            let mut best: Option<Plan> = None;
            let mut j = 0;
            for (i, &(start, _)) in blocks.iter().enumerate() {
                let Some(target) = start.checked_add(len) else { break };
                j = j.max(i);
                while j < n && end_of(j) < target {
                    j += 1;
                }
                if let Some(p) = candidate(i, j)
                    && best.as_ref().is_none_or(|b| p.used < b.used)
                {
                    best = Some(p);
                }
            }
            best
        }
        Pick::After(from) => {
            // Up to the end of the next free block.
            let next = |i: usize| i + 1 + blocks[i + 1..].partition_point(|&(at, l)| at + l < end_of(i) + 1);
            let first = blocks.partition_point(|b| b.0 < from);
            (first..n).chain(0..first).filter_map(|i| candidate(i, next(i))).find(|p| p.used > 0)
        }
    }
}

/// The free blocks with empty blocks added where a range may also begin
/// or end: where the area starts, where `dest` does, and at both ends of
/// every index segment (no item straddles those either), so a range may
/// also begin at the start of the area or just after a segment, and end
/// just before the destination or a segment.
fn bounds(blocks: &[(u64, u64)], area: &Range<u64>, fixed: &[u64], dest: Option<u64>) -> Vec<(u64, u64)> {
    let mut edges: Vec<u64> = fixed.iter().flat_map(|&s| [s, s + SEGMENT_UNITS as u64]).collect();
    edges.extend(dest);
    if blocks.first().is_none_or(|b| b.0 != area.start) {
        edges.push(area.start);
    }
    edges.sort_unstable();
    let mut bounds = Vec::with_capacity(blocks.len() + edges.len());
    let mut e = edges.iter().copied().peekable();
    for &b in blocks {
        while let Some(at) = e.next_if(|&at| at <= b.0) {
            bounds.push((at, 0));
        }
        bounds.push(b);
    }
    bounds.extend(e.map(|at| (at, 0)));
    bounds
}

/// Plans a range of `want` units (or a little more) whose items are to be
/// evicted where they are, for a PUT that waits (`--evict lru`): the one
/// with the fewest used units, so the fewest items go. Moving items is no
/// use in a full cache: they need a block as large as what they leave.
pub fn plan_eviction(blocks: &[(u64, u64)], area: Range<u64>, want: u64, skip: &[u64], fixed: &[u64]) -> Option<Plan> {
    let bounds = bounds(blocks, &area, fixed, None);
    plan(&bounds, area, want, Pick::Emptiest, 0..0, skip, fixed)
}

/// Plans a step towards a free block of `want` units: the longest range
/// (up to `want`) whose used units fit in the largest free block, so that
/// once it is empty the largest free block has grown. Each step needs only
/// room for what it moves, in one block, so it works however broken up
/// the rest of free space is. `Pick::After` plans the used stretches in
/// turn (continuous mode), growing nothing on purpose.
pub fn plan_step(
    blocks: &[(u64, u64)],
    area: Range<u64>,
    want: u64,
    pick: Pick,
    skip: &[u64],
    fixed: &[u64],
) -> Option<Plan> {
    let &(dest, dest_len) = blocks.iter().max_by_key(|&&(at, len)| (len, std::cmp::Reverse(at)))?;
    let avoid = dest..dest + dest_len;
    let bounds = bounds(blocks, &area, fixed, Some(dest));
    let fits =
        |len: u64| plan(&bounds, area.clone(), len, pick, avoid.clone(), skip, fixed).filter(|p| p.used <= dest_len);
    if let Pick::After(_) = pick {
        // Whatever is used from the next boundary on, up to the next free
        // block: items keep moving, a stretch at a time.
        return fits(1);
    }
    if want <= dest_len {
        return None;
    }
    if let Some(p) = fits(want) {
        return Some(p);
    }
    // The fewest used units over ranges of a length grows with the length:
    // find the longest that fits. Longer than `dest_len` or it gains nothing.
    let (mut lo, mut hi) = (dest_len, want);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid).is_some() { lo = mid } else { hi = mid }
    }
    if lo == dest_len { None } else { fits(lo) }
}

/// Why a range is being emptied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The reserve is low.
    Background,
    /// Continuous mode: keep items moving.
    Continuous,
    /// A PUT needs this many units in one block.
    Demand(u64),
}

/// Figures of the compactor's own, for STATS.
#[derive(Debug, Default)]
pub struct CompactorStats {
    /// CPU time the compactor thread used, in nanoseconds.
    pub cpu_nanos: AtomicU64,
    /// PUTs that asked for compaction.
    pub demands: AtomicU64,
    /// 1 while a window is being emptied.
    pub active: AtomicU64,
}

struct Shared {
    store: Arc<Store>,
    mode: Mode,
    /// Units a waiting PUT needs in one block (0: none).
    demand: AtomicU64,
    wake: Condvar,
    woken: Mutex<bool>,
    stop: AtomicBool,
    stats: CompactorStats,
}

/// The compactor of one store: a background thread, stopped on drop.
pub struct Compactor {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Compactor {
    /// Starts the compactor thread for `store`.
    pub fn spawn(store: Arc<Store>, mode: Mode) -> std::io::Result<Compactor> {
        let shared = Arc::new(Shared {
            store,
            mode,
            demand: AtomicU64::new(0),
            wake: Condvar::new(),
            woken: Mutex::new(false),
            stop: AtomicBool::new(false),
            stats: CompactorStats::default(),
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new().name("dmkv-compactor".into()).spawn(move || run(&s))?;
        Ok(Compactor { shared, thread: Some(thread) })
    }

    /// The compactor's figures.
    pub fn stats(&self) -> &CompactorStats {
        &self.shared.stats
    }

    /// After a PUT of `units` units was refused for space: how long to
    /// wait before trying again, or `None` if live data really fills the
    /// region. Asks for compaction when free space would do but is in
    /// pieces.
    pub fn after_out_of_memory(&self, units: u64) -> Option<Duration> {
        let store = &self.shared.store;
        // Space in its grace period comes back by itself (and asking
        // drives the epoch on)...
        let reclaim = store.reclaim_wait().map(|wait| wait.max(Duration::from_millis(1)));
        let space = store.space();
        // ... so wait for it, unless the store evicts: then some space
        // always waits out its grace period, and a write that needs a
        // block larger than any would never reach the compactor.
        if space.free + space.parked < units || (reclaim.is_some() && !store.evicts_here()) {
            return reclaim;
        }
        self.shared.stats.demands.fetch_add(1, Ordering::Relaxed);
        self.shared.demand.fetch_max(units, Ordering::Relaxed);
        self.notify();
        Some(Duration::from_millis(2))
    }

    /// `store.put`, waiting out grace periods and compaction as the server
    /// does for a client (for tools and tests that use a store directly).
    pub fn put_blocking(&self, key: &[u8], value: &[u8]) -> Result<u64, Error> {
        let deadline = Instant::now() + OUT_OF_MEMORY_WAIT;
        loop {
            match self.shared.store.put(key, value) {
                Err(Error::OutOfMemory) if Instant::now() < deadline => {
                    // Room for the item, or for a new index segment.
                    let units = item_units(key.len(), value.len()).max(SEGMENT_UNITS);
                    match self.after_out_of_memory(units as u64) {
                        Some(wait) => std::thread::sleep(wait),
                        None => return Err(Error::OutOfMemory),
                    }
                }
                r => return r,
            }
        }
    }

    fn notify(&self) {
        *lock(&self.shared.woken) = true;
        self.shared.wake.notify_one();
    }
}

impl Drop for Compactor {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.notify();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// No background steps this long after a PUT asked for room.
const DEMAND_QUIET: Duration = Duration::from_millis(200);

/// Ranges given up on recently, left out of plans until one succeeds.
const MAX_SKIPPED: usize = 256;

fn run(s: &Shared) {
    let mut cursor = 0;
    let mut skip: Vec<u64> = Vec::new();
    let mut cpu_seen = thread_cpu();
    let mut last_demand: Option<Instant> = None;
    while !s.stop.load(Ordering::Relaxed) {
        let area = s.store.data_units();
        let window = window_units(area.end - area.start);
        let need = s.demand.swap(0, Ordering::Relaxed);
        if need > 0 {
            last_demand = Some(Instant::now());
        }
        // Background steps pack items into the largest free block: not
        // while a PUT may be about to take it.
        let quiet = last_demand.is_some_and(|t| t.elapsed() < DEMAND_QUIET);
        let (why, want, pick) = if need > 0 {
            // A block made for an earlier demand may be waiting for the
            // PUT that asked: moving items into it (the largest) would
            // break it up again.
            if s.store.space().largest_free >= need {
                (None, 0, Pick::Emptiest)
            } else {
                (Some(Why::Demand(need)), need, Pick::Emptiest)
            }
        } else {
            let space = s.store.space();
            match background_work(s.mode, space, window).filter(|_| !quiet) {
                Some(Why::Continuous) => (Some(Why::Continuous), window, Pick::After(cursor)),
                Some(why) => (Some(why), reserve_units(space, window), Pick::Emptiest),
                None => (None, 0, Pick::Emptiest),
            }
        };
        let planning = Instant::now();
        let planned = why.and_then(|why| {
            let fixed = s.store.segment_starts();
            let blocks = s.store.free_blocks();
            let step = match why {
                Why::Demand(_) if s.store.evicts_here() => plan_eviction(&blocks, area, want, &skip, &fixed),
                _ => plan_step(&blocks, area, want, pick, &skip, &fixed),
            };
            Some((why, step?))
        });
        // Planning is work too: paced like moves unless a PUT waits.
        if why.is_some_and(|w| !matches!(w, Why::Demand(_))) {
            std::thread::sleep(planning.elapsed() * (100 - DUTY_PERCENT) / DUTY_PERCENT);
        }
        match planned {
            Some((why, step)) => {
                cursor = step.range.end;
                let start = step.range.start;
                if empty_range(s, &step, why) {
                    skip.clear();
                } else {
                    if skip.len() == MAX_SKIPPED {
                        skip.remove(0);
                    }
                    skip.push(start);
                }
            }
            None => {
                skip.clear();
                let mut woken = lock(&s.woken);
                if !*woken {
                    woken = s.wake.wait_timeout(woken, IDLE_CHECK).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
                }
                *woken = false;
            }
        }
        let cpu = thread_cpu();
        s.stats.cpu_nanos.fetch_add((cpu - cpu_seen).as_nanos() as u64, Ordering::Relaxed);
        cpu_seen = cpu;
    }
}

/// Carries out a step: park the range, reserve room for its items at the
/// destination, move them there, wait for the range to come back free.
/// Whether it did. With eviction on, a range for a PUT that waits has its
/// items evicted where they are instead ([`plan_eviction`]): memcached
/// too evicts a slab page's items to give a large item a page.
fn empty_range(s: &Shared, plan: &Plan, why: Why) -> bool {
    let range = plan.range.clone();
    let Some(items) = s.store.begin_evacuation(range.clone()) else { return false };
    let evict = matches!(why, Why::Demand(_)) && s.store.evicts_here();
    // Items straddling the range's ends count whole.
    let total: u64 = if evict { 0 } else { items.iter().map(Candidate::units).sum() };
    // Into the largest free block as it is now (writes may have taken the
    // front of the planned one meanwhile).
    let dest = match total {
        0 => 0,
        _ => match s.store.reserve(total) {
            Some(at) => at,
            None => {
                s.store.abandon_evacuation();
                return false;
            }
        },
    };
    s.stats.active.store(1, Ordering::Relaxed);
    debug!(?range, items = items.len(), total, dest, ?why, "compactor: emptying a range");
    let paced = !matches!(why, Why::Demand(_));
    let mut slice_start = Instant::now();
    let mut to = dest;
    let mut outcome = Ok(());
    for c in &items {
        if s.stop.load(Ordering::Relaxed) {
            outcome = Err("stopping");
            break;
        }
        if evict {
            s.store.evict_listed(c);
        } else if s.store.relocate(c, to) == Relocation::Moved {
            to += c.units();
        }
        // A demand that arrives meanwhile speeds the rest up.
        if paced && s.demand.load(Ordering::Relaxed) == 0 && slice_start.elapsed() >= SLICE {
            let worked = slice_start.elapsed();
            std::thread::sleep(worked * (100 - DUTY_PERCENT) / DUTY_PERCENT);
            slice_start = Instant::now();
        }
    }
    // What items that went meanwhile did not use.
    s.store.unreserve(to, dest + total - to);
    if outcome.is_ok() {
        // The old copies come back after their grace period; then the
        // range is one free block again and unparks by itself.
        let deadline = Instant::now() + s.store.grace() + WINDOW_DEADLINE;
        while s.store.evacuating().is_some() && Instant::now() < deadline && !s.stop.load(Ordering::Relaxed) {
            std::thread::sleep((s.store.grace() / 4).clamp(Duration::from_micros(200), Duration::from_millis(20)));
            s.store.reclaim_now();
        }
        if s.store.evacuating().is_some() {
            outcome = Err("its last blocks were not freed in time");
        }
    }
    s.stats.active.store(0, Ordering::Relaxed);
    match outcome {
        Ok(()) => {
            s.store.counters.compactor_ranges_done.fetch_add(1, Ordering::Relaxed);
            debug!(?range, moved = to - dest, "compactor: range emptied");
            true
        }
        Err(why_not) => {
            s.store.abandon_evacuation();
            debug!(?range, "compactor: gave up on a range: {why_not}");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_fit_the_area() {
        assert_eq!(window_units(1 << 20), WINDOW_UNITS);
        assert_eq!(window_units(8000), 1000);
        assert_eq!(window_units(0), 1);
    }

    #[test]
    fn background_work_keeps_a_reserve() {
        let w = 100;
        let space = |free, largest_free, parked| Space { used: 1000, free, largest_free, parked };
        assert_eq!(reserve_units(space(400, 50, 0), w), 100);
        assert_eq!(reserve_units(space(60, 10, 0), w), 30, "at most half the free space");
        let work = |mode, sp| background_work(mode, sp, w);
        assert_eq!(work(Mode::Auto, space(400, 49, 0)), Some(Why::Background));
        assert_eq!(work(Mode::Auto, space(400, 50, 0)), None, "half the reserve is enough to wait");
        assert_eq!(work(Mode::Auto, space(60, 14, 0)), Some(Why::Background));
        assert_eq!(work(Mode::Auto, space(60, 15, 0)), None);
        assert_eq!(work(Mode::Auto, space(400, 10, 10)), None, "one range at a time");
        assert_eq!(work(Mode::Off, space(400, 10, 0)), None);
        assert_eq!(work(Mode::Continuous, space(400, 400, 0)), Some(Why::Continuous));
        assert_eq!(work(Mode::Continuous, space(400, 10, 0)), Some(Why::Background), "the reserve first");
    }

    #[test]
    fn the_emptiest_range_is_planned() {
        // Free: 0..10, 12..20, 30..40, 41..50, 90..100 (area 0..100).
        let blocks = [(0, 10), (12, 8), (30, 10), (41, 9), (90, 10)];
        let p = |len, pick, skip: &[u64]| plan(&blocks, 0..100, len, pick, 0..0, skip, &[]);
        assert_eq!(p(20, Pick::Emptiest, &[]), Some(Plan { range: 30..50, used: 1 }));
        assert_eq!(p(20, Pick::Emptiest, &[30]), Some(Plan { range: 0..20, used: 2 }));
        assert_eq!(plan(&blocks, 0..100, 20, Pick::Emptiest, 45..46, &[], &[]), Some(Plan { range: 0..20, used: 2 }));
        // Index segments never move: no range holds one (here 40..104).
        assert_eq!(plan(&blocks, 0..100, 20, Pick::Emptiest, 0..0, &[], &[40]), Some(Plan { range: 0..20, used: 2 }));
        assert_eq!(plan(&blocks, 0..100, 20, Pick::Emptiest, 0..0, &[], &[0, 40]), None);
        // A range may not run past the area.
        assert_eq!(p(11, Pick::Emptiest, &[0, 12, 30, 41]), None);
        // Continuous: the next range holding anything, wrapping around.
        assert_eq!(p(10, Pick::After(31), &[]), Some(Plan { range: 41..100, used: 40 }));
        assert_eq!(p(10, Pick::After(95), &[]), Some(Plan { range: 0..20, used: 2 }));
        assert_eq!(plan(&[(0, 100)], 0..100, 10, Pick::After(0), 0..0, &[], &[]), None, "nothing to move");
    }

    #[test]
    fn steps_grow_the_largest_block() {
        // Free: 0..10 (the largest), 12..18, 20..26, 28..34 (area 0..40).
        let blocks = [(0, 10), (12, 6), (20, 6), (28, 6)];
        let step = |want| plan_step(&blocks, 0..40, want, Pick::Emptiest, &[], &[]);
        assert_eq!(step(10), None, "fits already");
        // 12..34 holds 4 used units: they go to 0..10, and 12..34 (22
        // units) comes back free.
        assert_eq!(step(22), Some(Plan { range: 12..34, used: 4 }));
        // 40 units is more than the area has outside 0..10: the longest
        // range there is 12..34.
        assert_eq!(step(40), Some(Plan { range: 12..34, used: 4 }));
        // Continuous: the used stretches in turn, from the start of the
        // area too, but never into the destination.
        let c = |from| plan_step(&blocks, 0..40, 8, Pick::After(from), &[], &[]);
        assert_eq!(c(13), Some(Plan { range: 20..34, used: 2 }));
        assert_eq!(c(35), Some(Plan { range: 12..26, used: 2 }), "wraps around");
        let packed = [(20, 20)];
        let c = plan_step(&packed, 0..40, 8, Pick::After(0), &[], &[]);
        assert_eq!(c, Some(Plan { range: 0..20, used: 20 }), "items before the only free block");
        // An index segment at 0..64, items at 64..120: ranges start after
        // the segment (they may begin and end at its edges).
        let c = plan_step(&[(120, 80)], 0..200, 8, Pick::After(0), &[], &[0]);
        assert_eq!(c, Some(Plan { range: 64..120, used: 56 }));
        let c = plan_step(&[(120, 80)], 0..200, 8, Pick::After(0), &[], &[30]);
        assert_eq!(c, Some(Plan { range: 0..30, used: 30 }), "and end where one starts");
    }
}
