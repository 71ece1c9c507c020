//! AFL target: `dmkv_common::fuzz::engine_reply`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::engine_reply(data));
}
