//! AFL target: `dmkv_common::fuzz::item`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::item(data));
}
