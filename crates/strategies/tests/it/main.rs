//! One integration-test binary, one module per area (ripgrep's `tests/tests.rs` pattern).

mod common;

// Local shapes and offsets (torch.chunk, nesting, StridedShard).
mod layout;
// Redistribution plans: every single-dim transition, N-d ordering, flattened merges.
mod plans;
// Property test: random plans executed by the reference executor reproduce the target layout.
mod plan_props;
// Strategy tables per op family.
mod strategies;
// Property test: propagate() + local ops on per-rank data == single-device result.
mod op_props;
// Expansion: Dijkstra vs product, index-op plan competition, errors, cache.
mod expand;
// PyTorch DTensor conformance cases (reference/dtensor.md §8).
mod conformance;
// The explain report.
mod explain;
