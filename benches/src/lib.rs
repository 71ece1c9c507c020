//! Benchmarks of dmkv: the YCSB driver `dmkv-ycsb` (its logic lives here so
//! it can be tested), the plotter `dmkv-ycsb-plot`, and criterion
//! micro-benchmarks under `benches/`.
//!
//! A run: [`cli::Args`] become [`driver::Settings`]; [`driver::run`] loads
//! the records and runs the workload over a [`backend::KvConn`] per thread,
//! choosing keys with [`generator`]'s YCSB generators; [`report`] turns the
//! histograms into tables, JSON and CSV, and [`plot`] into SVG charts.
//!
//! [`scenario`] holds the read-path selection scenarios (network namespace,
//! shaped engine port, load generators, probe windows) shared by
//! `dmkv-pathbench` and the end-to-end test `tests/pathsel.rs`.
//!
//! [`hitratio`] replays a cache-aside zipfian trace for `dmkv-hitratio`:
//! the hit ratio of memcached and of dmkv's eviction at equal memory.

pub mod backend;
pub mod cli;
pub mod driver;
pub mod generator;
pub mod hitratio;
pub mod memcached;
pub mod pipe;
pub mod plot;
pub mod redis;
pub mod report;
pub mod scenario;
pub mod workload;
