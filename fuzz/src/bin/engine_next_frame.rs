//! AFL target: `dmkv_common::fuzz::engine_next_frame`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::engine_next_frame(data));
}
