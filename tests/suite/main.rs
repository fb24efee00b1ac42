//! The workspace's integration tests, one module per concern, in one test
//! binary: each file under `tests/` is a binary of its own, linked against
//! the whole runtime, and a dozen of them cost CI's test build more than the
//! tests take to run. Three stay binaries of their own:
//! `tests/metrics_endpoint.rs` (the metrics recorder is process-global),
//! `tests/teardown.rs` (it counts the process's threads) and
//! `tests/train_equivalence.rs` (the training example's modules, which name
//! each other from the crate root).
//!
//! One module: `cargo test --test suite scenarios`.

#[path = "../common/mod.rs"]
mod common;

mod arrival_batch;
mod bad_input;
mod bench_smoke;
mod docs;
mod elastic;
mod exactness_props;
mod faults;
mod gather;
mod scenarios;
mod soak;
mod step_semantics;
mod store;
mod timeline;
