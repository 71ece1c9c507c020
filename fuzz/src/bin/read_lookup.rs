//! AFL target: `dmkv_common::fuzz::read_lookup`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::read_lookup(data));
}
