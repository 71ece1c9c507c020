//! AFL target: `dmkv_common::fuzz::shm_handoff`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::shm_handoff(data));
}
