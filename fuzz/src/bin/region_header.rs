//! AFL target: `dmkv_common::fuzz::region_header`.
fn main() {
    afl::fuzz!(|data: &[u8]| dmkv_common::fuzz::region_header(data));
}
