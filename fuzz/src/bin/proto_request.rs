//! AFL target: `dmkv_common::fuzz::proto_request`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::proto_request(data));
}
