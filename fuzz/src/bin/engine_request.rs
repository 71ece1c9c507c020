//! AFL target: `dmkv_common::fuzz::engine_request`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::engine_request(data));
}
