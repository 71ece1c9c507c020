//! AFL target: `dmkv_common::fuzz::proto_response`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::proto_response(data));
}
