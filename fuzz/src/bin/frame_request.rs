//! AFL target: `dmkv_common::fuzz::frame_request`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::frame_request(data));
}
