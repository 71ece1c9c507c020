//! No module cycles in any crate of the workspace (issue 31): a module
//! may use those below it and never one that uses it back. The check is
//! `dmkv_tests::layers`, a reader of `use` edges; its own unit tests show
//! that it finds a cycle.

use std::path::Path;

use dmkv_tests::layers::{Graph, crate_roots};

/// Every crate of the workspace, fuzz included.
const CRATES: &[&str] = &["common", "server", "client", "verbs", "tests", "benches", "fuzz"];

#[test]
fn no_crate_has_a_module_cycle() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    let mut roots = 0;
    for name in CRATES {
        let dir = workspace.join(name);
        for root in crate_roots(&dir) {
            roots += 1;
            let graph = Graph::load(&root).unwrap_or_else(|e| panic!("{}: {e}", root.display()));
            for cycle in graph.cycles(&dir) {
                found.push(format!("{name}: {}", cycle.join(" ")));
            }
        }
    }
    assert!(roots >= 8, "found only {roots} crate roots: is the workspace where it was?");
    assert!(found.is_empty(), "module cycles:\n{}", found.join("\n"));
}

/// Prints the edges inside each cycle (`-- --ignored --nocapture`).
#[test]
#[ignore]
fn print_cycle_edges() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for name in CRATES {
        let dir = workspace.join(name);
        for root in crate_roots(&dir) {
            let graph = Graph::load(&root).unwrap();
            let edges = graph.edge_list(&dir);
            for cycle in graph.cycles(&dir) {
                println!("== {name}");
                for from in &cycle {
                    let to: Vec<&String> =
                        edges.get(from).map(|s| s.iter().filter(|t| cycle.contains(t)).collect()).unwrap_or_default();
                    println!("  {from} -> {to:?}");
                }
            }
        }
    }
}
