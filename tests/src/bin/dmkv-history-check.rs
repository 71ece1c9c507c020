//! The full linearizability search of a recorded history, in a process
//! of its own so that its caller can stop it (`dmkv_tests::history::
//! full_search`): the history (`history::encode`'s text) on standard
//! input; prints `linearizable` and exits 0, or prints the first key's
//! history that is not and exits 1; exits 2 on input it cannot read.

use std::io::Read;

use dmkv_tests::history::decode;
use dmkv_tests::linearize::check_segmented;

/// The search recurses once per operation of a key.
const STACK: usize = 1 << 30;

fn main() {
    let mut text = String::new();
    if let Err(e) = std::io::stdin().read_to_string(&mut text) {
        eprintln!("dmkv-history-check: cannot read the history: {e}");
        std::process::exit(2);
    }
    let (keys, log) = match decode(&text) {
        Ok(h) => h,
        Err(e) => {
            eprintln!("dmkv-history-check: {e}");
            std::process::exit(2);
        }
    };
    let verdict = std::thread::Builder::new().stack_size(STACK).spawn(move || check_segmented(&keys, &log));
    match verdict.map(|h| h.join()) {
        Ok(Ok((true, _))) => println!("linearizable"),
        Ok(Ok((false, why))) => {
            println!("{why}");
            std::process::exit(1);
        }
        _ => {
            eprintln!("dmkv-history-check: the search failed");
            std::process::exit(2);
        }
    }
}
