//! A one-sided GET over shared memory allocates nothing on the heap once
//! the caller's buffer has grown: counted by a global allocator that
//! counts this thread's allocations, around a loop of GETs against a real
//! dmkvd. Its own test binary, so no other test's allocator is replaced.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use dmkv_client::blocking::Client;
use dmkv_client::{ClientConfig, ReadPath, Transport};
use dmkv_tests::ServerProcess;

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is passed to the system allocator unchanged; the
// counter is a const-initialised thread local (no allocation to reach it).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

const KEYS: usize = 2000;
const GETS: usize = 100_000;

#[test]
fn shm_gets_allocate_nothing() {
    let srv = ServerProcess::start(&["--memory", "64MiB"]);
    for path in [ReadPath::OneSided, ReadPath::Auto] {
        let cfg = ClientConfig::default().read_path(path).transport(Some(Transport::Shm));
        let c = Client::connect_with(&srv.rpc, cfg).unwrap();
        let keys: Vec<String> = (0..KEYS).map(|i| format!("key-{i}")).collect();
        for (i, k) in keys.iter().enumerate() {
            c.put(k, vec![b'v'; 100 + i % 900]).unwrap();
        }
        let mut out = Vec::new();
        // Warm-up: attach, fill the caches, grow the buffers.
        for _ in 0..3 {
            for k in &keys {
                c.get_into(k, &mut out).unwrap();
            }
        }
        let before = allocs();
        let mut found = 0;
        for i in 0..GETS {
            let k = &keys[(i * 7919) % KEYS];
            if c.get_into(k, &mut out).unwrap().is_some() {
                found += 1;
                assert!(out.iter().all(|&b| b == b'v'));
            }
        }
        let missing = c.get_into("no-such-key", &mut out).unwrap();
        let n = allocs() - before;
        assert_eq!(found, GETS, "{path:?}");
        assert_eq!(missing, None);
        let rs = c.read_stats();
        assert_eq!(rs.fallbacks, 0, "{path:?}: {rs:?}");
        assert!(rs.gets >= GETS as u64, "{path:?}: the GETs were not one-sided: {rs:?}");
        assert_eq!(n, 0, "{path:?}: {n} heap allocations in {GETS} GETs");
    }
}
