//! AFL target: `dmkv_common::fuzz::frame_response`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::frame_response(data));
}
