//! Single-dim strategies: for ONE mesh dim, the valid `[outputs.., inputs..]` placement rows of
//! an op, as pure functions of the input metas (the mesh and the current placements are not
//! seen). The all-Replicate row is added by the expander, not by the op.
//!
//! Mesh-size-dependent conditions are declared on the row and checked by the expander for the
//! full N-d combination: [`StrategyRow::requires_even`] (e.g. `mean -> P(avg)` is only exact when
//! every shard has the same size) and [`StrategyRow::requires_nonempty`] (e.g. `max -> P(max)`
//! needs every rank to hold at least one element of the reduced dim).

use std::fmt;

use serde::Serialize;
use smallvec::SmallVec;

use crate::cost::CollectiveKind;
use crate::error::Result;
use crate::op::Op;
use crate::placement::{format_placements, Placement};
use crate::spec::TensorMeta;

/// Refers to one of an op's tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum TensorRef {
    /// The i-th input.
    Input(usize),
    /// The i-th output.
    Output(usize),
}

/// A collective the op's LOCAL implementation performs itself on the row's mesh dim (e.g. the
/// three all_reduces of loss-parallel cross-entropy). Priced like redistributions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct InternalComm {
    /// The collective.
    pub kind: CollectiveKind,
    /// Its size (see [`crate::cost`]) computed from GLOBAL metas. In an
    /// [`OpSharding`](crate::OpSharding) it is already scaled to the local piece.
    pub bytes: u64,
    /// The tensor whose sharding on the OTHER mesh dims shrinks `bytes` (the expander multiplies by
    /// its local/global element ratio with this row's mesh dim treated as replicated).
    pub scale_by: TensorRef,
    /// The collective's buffer is one rank's piece along THIS row's mesh dim (an all_to_all
    /// of a tensor the row shards there): the expander also divides `bytes` by the dim's size.
    pub per_piece: bool,
}

/// One valid placement assignment for one mesh dim.
#[derive(Clone, Debug, PartialEq)]
pub struct StrategyRow {
    /// Output placements, one per output.
    pub outputs: SmallVec<[Placement; 2]>,
    /// Input placements, one per input.
    pub inputs: SmallVec<[Placement; 4]>,
    /// Collectives the local op runs itself on this mesh dim.
    pub internal: SmallVec<[InternalComm; 2]>,
    /// `(tensor, dim)` pairs that must be sharded EVENLY over all mesh dims that shard them in the
    /// chosen N-d combination.
    pub requires_even: SmallVec<[(TensorRef, usize); 2]>,
    /// `(tensor, dim)` pairs whose every shard must be non-empty.
    pub requires_nonempty: SmallVec<[(TensorRef, usize); 2]>,
    /// `(tensor, dim)` pairs that no OTHER mesh dim (of size > 1) may shard in the chosen N-d
    /// combination (e.g. the one-sided `rma_get` plan fetches rows from the owners along its own
    /// mesh dim only).
    pub requires_sole: SmallVec<[(TensorRef, usize); 1]>,
    /// `(tensor, dim)` pairs whose every local size (after the OTHER mesh dims' sharding) this
    /// row's mesh dim size must divide (the op re-shards that dim over this mesh dim itself,
    /// e.g. the heads of all-to-all context parallelism).
    pub requires_divides: SmallVec<[(TensorRef, usize); 1]>,
    /// `(tensor, dim, unit)`: every local size of `tensor`'s `dim` in the chosen N-d
    /// combination is a multiple of `unit` (e.g. a flat `[.., 3 H d]` projection sharded only
    /// between whole heads: `unit = 3 d`).
    pub requires_multiple: SmallVec<[(TensorRef, usize, usize); 1]>,
    /// Whether `Shard(d)` may be replaced by `StridedShard { dim: d, sf }` throughout the row
    /// (true when the op does not care about the order of indices along sharded dims).
    pub strided_ok: bool,
}

impl StrategyRow {
    /// A row without internal comms or requirements.
    pub fn new(outputs: &[Placement], inputs: &[Placement]) -> Self {
        StrategyRow {
            outputs: SmallVec::from_slice(outputs),
            inputs: SmallVec::from_slice(inputs),
            internal: SmallVec::new(),
            requires_even: SmallVec::new(),
            requires_nonempty: SmallVec::new(),
            requires_sole: SmallVec::new(),
            requires_divides: SmallVec::new(),
            requires_multiple: SmallVec::new(),
            strided_ok: true,
        }
    }

    /// The all-Replicate row for `n_out` outputs and `n_in` inputs.
    pub fn all_replicate(n_out: usize, n_in: usize) -> Self {
        let r = Placement::Replicate;
        StrategyRow::new(&vec![r; n_out], &vec![r; n_in])
    }

    /// Adds an even-sharding requirement.
    pub fn even(mut self, tensor: TensorRef, dim: usize) -> Self {
        self.requires_even.push((tensor, dim));
        self
    }

    /// Adds a non-empty-shards requirement.
    pub fn nonempty(mut self, tensor: TensorRef, dim: usize) -> Self {
        self.requires_nonempty.push((tensor, dim));
        self
    }

    /// Requires that no other mesh dim shards `dim` of `tensor`.
    pub fn sole(mut self, tensor: TensorRef, dim: usize) -> Self {
        self.requires_sole.push((tensor, dim));
        self
    }

    /// Requires this row's mesh dim size to divide every local size of `tensor`'s `dim` (see
    /// [`StrategyRow::requires_divides`]).
    pub fn divides(mut self, tensor: TensorRef, dim: usize) -> Self {
        self.requires_divides.push((tensor, dim));
        self
    }

    /// Requires every local size of `tensor`'s `dim` to be a multiple of `unit` (see
    /// [`StrategyRow::requires_multiple`]).
    pub fn multiple_of(mut self, tensor: TensorRef, dim: usize, unit: usize) -> Self {
        self.requires_multiple.push((tensor, dim, unit));
        self
    }

    /// Adds an internal collective.
    pub fn with_internal(mut self, kind: CollectiveKind, bytes: u64, scale_by: TensorRef) -> Self {
        self.internal.push(InternalComm {
            kind,
            bytes,
            scale_by,
            per_piece: false,
        });
        self
    }

    /// Adds an internal collective whose buffer is one rank's piece along this row's mesh dim
    /// (see [`InternalComm::per_piece`]).
    pub fn with_internal_piece(
        mut self,
        kind: CollectiveKind,
        bytes: u64,
        scale_by: TensorRef,
    ) -> Self {
        self.internal.push(InternalComm {
            kind,
            bytes,
            scale_by,
            per_piece: true,
        });
        self
    }

    /// Forbids the `StridedShard` variants of this row.
    pub fn no_strided(mut self) -> Self {
        self.strided_ok = false;
        self
    }

    /// True if every placement is `Replicate`.
    pub fn is_all_replicate(&self) -> bool {
        self.outputs
            .iter()
            .chain(&self.inputs)
            .all(|p| p.is_replicate())
    }
}

impl fmt::Display for StrategyRow {
    /// `S(0) <- S(0), R`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} <- ", format_placements(&self.outputs))?;
        let ins: Vec<String> = self.inputs.iter().map(|p| p.to_string()).collect();
        f.write_str(&ins.join(", "))?;
        for c in &self.internal {
            write!(f, " [+{} {} B]", c.kind, c.bytes)?;
        }
        Ok(())
    }
}

/// The single-dim strategy rows of `op` for these input metas (without the all-Replicate row).
///
/// ```
/// use candle_dtensor::strategies::*;
/// let x = TensorMeta::new(&[64, 32], DType::F32);
/// let w = TensorMeta::new(&[32, 16], DType::F32);
/// let rows: Vec<String> = single_dim_strategies(&Op::Matmul, &[&x, &w])
///     .unwrap().iter().map(|r| r.to_string()).collect();
/// assert!(rows.contains(&"P(sum) <- S(1), S(0)".to_string()));
/// ```
///
/// # Errors
/// The op's shape errors (see [`Op::output_metas`]).
pub fn single_dim_strategies(op: &Op, inputs: &[&TensorMeta]) -> Result<Vec<StrategyRow>> {
    let outs = op.output_metas(inputs)?;
    let rows = crate::ops::rows(op, inputs, &outs)?;
    let mut out: Vec<StrategyRow> = Vec::with_capacity(rows.len());
    for r in rows {
        if !r.is_all_replicate() && !out.contains(&r) {
            out.push(r);
        }
    }
    Ok(out)
}
