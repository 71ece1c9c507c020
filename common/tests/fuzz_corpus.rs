//! Replays the committed fuzz corpus (`fuzz/corpus/<target>/`) through the
//! fuzz targets, so every input the coverage-guided fuzzer kept is checked
//! by `cargo test`, with nothing but cargo installed.

use std::path::PathBuf;

use dmkv_common::fuzz::TARGETS;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus")
}

#[test]
fn every_target_has_a_corpus_and_replays_it_without_panicking() {
    let root = corpus_dir();
    let mut total = 0;
    for (name, target) in TARGETS {
        let dir = root.join(name);
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()));
        let mut n = 0;
        for entry in entries {
            let path = entry.expect("corpus entry").path();
            if !path.is_file() {
                continue;
            }
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            if std::panic::catch_unwind(|| target(&data)).is_err() {
                panic!("fuzz target {name} panicked on {}", path.display());
            }
            n += 1;
        }
        assert!(n > 0, "corpus {} is empty", dir.display());
        total += n;
    }
    println!("replayed {total} corpus inputs over {} targets", TARGETS.len());
}
