//! [`ShardingPropagator`]: op + input specs + mesh -> where every input must be, what comes out,
//! and what it costs. Cached; shared by rank threads.

use std::hash::{Hash, Hasher};
use std::sync::{Arc, OnceLock, RwLock};

use rustc_hash::{FxHashMap, FxHasher};
use serde::Serialize;
use smallvec::SmallVec;

use crate::error::Result;
use crate::expand::{ExpandMethod, Problem};
use crate::mesh::MeshTopology;
use crate::op::Op;
use crate::placement::{Placement, Placements};
use crate::plan::{build_plan, shortest_moves, RedistributePlan};
use crate::spec::{DTensorSpec, TensorMeta};
use crate::strategy::{InternalComm, TensorRef};

/// Cache entries kept before the cache is cleared (bounds memory when ops carry changing scalars).
pub const MAX_CACHE_ENTRIES: usize = 1 << 16;

/// The sharding decision for one op call.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OpSharding {
    /// The placements each input must have for the local op (global metas unchanged).
    pub input_specs: Vec<DTensorSpec>,
    /// Output placements and global metas.
    pub output_specs: Vec<DTensorSpec>,
    /// Per input: the plan from its current placements to `input_specs[i]`; `None` when already
    /// in place.
    pub redistributions: Vec<Option<RedistributePlan>>,
    /// Collectives the local op performs itself: `(mesh dim, comm)`, bytes scaled to local pieces.
    pub internal: Vec<(usize, InternalComm)>,
    /// Estimated redistribution + internal communication time (µs).
    pub cost_us: f64,
    /// Estimated all_reduce time to materialize `MaskPartial` outputs later (µs); part of the
    /// choice, not of `cost_us`.
    pub deferred_us: f64,
}

impl OpSharding {
    /// Whether any input must be redistributed before the local op.
    pub fn needs_redistribute(&self) -> bool {
        self.redistributions.iter().any(|p| p.is_some())
    }
}

struct Entry {
    mesh: u64,
    op: Op,
    inputs: Vec<DTensorSpec>,
    pins: Vec<Option<Placements>>,
    value: Arc<OpSharding>,
}

impl Entry {
    fn matches(
        &self,
        mesh: u64,
        op: &Op,
        inputs: &[&DTensorSpec],
        pins: &[Option<&[Placement]>],
    ) -> bool {
        self.mesh == mesh
            && self.op == *op
            && self.inputs.len() == inputs.len()
            && self.inputs.iter().zip(inputs).all(|(a, b)| a == *b)
            && self.pins.len() == pins.len()
            && self.pins.iter().zip(pins).all(|(a, b)| a.as_deref() == *b)
    }
}

/// Sharding propagation with a cache keyed by (mesh fingerprint, op, input specs).
///
/// `Sync`: one instance is shared by all rank threads ([`global_propagator`]). A cache hit hashes
/// the key with `FxHasher`, takes a read lock and compares the stored key; it allocates nothing.
#[derive(Default)]
pub struct ShardingPropagator {
    cache: RwLock<FxHashMap<u64, SmallVec<[Entry; 1]>>>,
}

fn key_hash(op: &Op, inputs: &[&DTensorSpec], mesh: u64, pins: &[Option<&[Placement]>]) -> u64 {
    let mut h = FxHasher::default();
    mesh.hash(&mut h);
    op.hash(&mut h);
    inputs.len().hash(&mut h);
    for s in inputs {
        s.hash(&mut h);
    }
    if !pins.is_empty() {
        pins.hash(&mut h);
    }
    h.finish()
}

impl ShardingPropagator {
    /// An empty propagator.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cached [`ShardingPropagator::propagate_uncached`].
    ///
    /// ```
    /// use candle_dtensor::strategies::*;
    /// let mesh = MeshTopology::parse("tp=4").unwrap();
    /// let x = DTensorSpec::new(&[8, 16], DType::F32, &[Placement::Replicate]);
    /// let w = DTensorSpec::new(&[16, 32], DType::F32, &[Placement::Shard(1)]);
    /// let s = global_propagator().propagate(&Op::Matmul, &[&x, &w], &mesh).unwrap();
    /// assert_eq!(s.output_specs[0].to_string(), "[8, 32] f32 S(1)");
    /// assert!(!s.needs_redistribute());
    /// ```
    ///
    /// # Errors
    /// As [`ShardingPropagator::propagate_uncached`].
    pub fn propagate(
        &self,
        op: &Op,
        inputs: &[&DTensorSpec],
        mesh: &MeshTopology,
    ) -> Result<Arc<OpSharding>> {
        self.propagate_pinned(op, inputs, mesh, &[])
    }

    /// Like [`ShardingPropagator::propagate`], with `pins[i]` (when given) the placements input
    /// `i` must have for the local op: the choice is made among strategies that keep those
    /// placements (a tensor-parallel style's input layout, or a parameter that must not move).
    /// Cached like `propagate`, with the pins in the key.
    ///
    /// ```
    /// use candle_dtensor::strategies::*;
    /// let mesh = MeshTopology::parse("tp=4").unwrap();
    /// let ids = DTensorSpec::new(&[4, 16], DType::U32, &[Placement::Replicate]);
    /// let w = DTensorSpec::new(&[512, 64], DType::F32, &[Placement::Shard(0)]);
    /// let keep = [Placement::Shard(0)];
    /// let s = global_propagator()
    ///     .propagate_pinned(&Op::Embedding, &[&ids, &w], &mesh, &[None, Some(&keep)])
    ///     .unwrap();
    /// assert_eq!(s.output_specs[0].placements[0].to_string(), "MP(0,512)");
    /// ```
    ///
    /// # Errors
    /// As `propagate`, and [`StrategyError::NoStrategy`](crate::StrategyError::NoStrategy) when
    /// no strategy keeps the pinned placements.
    pub fn propagate_pinned(
        &self,
        op: &Op,
        inputs: &[&DTensorSpec],
        mesh: &MeshTopology,
        pins: &[Option<&[Placement]>],
    ) -> Result<Arc<OpSharding>> {
        let fp = mesh.fingerprint();
        let h = key_hash(op, inputs, fp, pins);
        {
            let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
            if let Some(bucket) = cache.get(&h) {
                for e in bucket {
                    if e.matches(fp, op, inputs, pins) {
                        return Ok(Arc::clone(&e.value));
                    }
                }
            }
        }
        let value = Arc::new(propagate_pinned_with(
            op,
            inputs,
            mesh,
            ExpandMethod::Auto,
            pins,
        )?);
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        // Another thread may have inserted the same key meanwhile: keep one entry.
        if let Some(bucket) = cache.get(&h) {
            for e in bucket {
                if e.matches(fp, op, inputs, pins) {
                    return Ok(Arc::clone(&e.value));
                }
            }
        }
        if cache.len() >= MAX_CACHE_ENTRIES {
            cache.clear();
        }
        cache.entry(h).or_default().push(Entry {
            mesh: fp,
            op: op.clone(),
            inputs: inputs.iter().map(|s| (*s).clone()).collect(),
            pins: pins
                .iter()
                .map(|p| p.map(|p| p.iter().copied().collect()))
                .collect(),
            value: Arc::clone(&value),
        });
        Ok(value)
    }

    /// Propagation without the cache, with the default [`ExpandMethod::Auto`].
    ///
    /// # Errors
    /// Invalid input specs ([`StrategyError::PlacementCount`](crate::StrategyError::PlacementCount),
    /// [`StrategyError::ShardDimOutOfRange`](crate::StrategyError::ShardDimOutOfRange)), the op's
    /// shape errors, or [`StrategyError::NoStrategy`](crate::StrategyError::NoStrategy).
    pub fn propagate_uncached(
        &self,
        op: &Op,
        inputs: &[&DTensorSpec],
        mesh: &MeshTopology,
    ) -> Result<OpSharding> {
        propagate_with(op, inputs, mesh, ExpandMethod::Auto)
    }

    /// Number of cached entries.
    pub fn cache_len(&self) -> usize {
        self.cache
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|b| b.len())
            .sum()
    }

    /// Empties the cache.
    pub fn clear(&self) {
        self.cache
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

/// The process-wide propagator the runtime uses.
pub fn global_propagator() -> &'static ShardingPropagator {
    static GLOBAL: OnceLock<ShardingPropagator> = OnceLock::new();
    GLOBAL.get_or_init(ShardingPropagator::new)
}

/// Uncached propagation with an explicit search method (tests compare
/// [`ExpandMethod::Product`] and [`ExpandMethod::Dijkstra`]).
///
/// # Errors
/// As [`ShardingPropagator::propagate_uncached`].
pub fn propagate_with(
    op: &Op,
    inputs: &[&DTensorSpec],
    mesh: &MeshTopology,
    method: ExpandMethod,
) -> Result<OpSharding> {
    propagate_pinned_with(op, inputs, mesh, method, &[])
}

/// [`propagate_with`] with pinned input placements (see
/// [`ShardingPropagator::propagate_pinned`]).
///
/// # Errors
/// As [`ShardingPropagator::propagate_pinned`].
pub fn propagate_pinned_with(
    op: &Op,
    inputs: &[&DTensorSpec],
    mesh: &MeshTopology,
    method: ExpandMethod,
    pins: &[Option<&[Placement]>],
) -> Result<OpSharding> {
    let name = op.to_string();
    for s in inputs {
        s.validate(mesh.ndim(), &name)?;
    }
    for (i, pin) in pins.iter().enumerate() {
        if let (Some(p), Some(s)) = (pin, inputs.get(i)) {
            crate::spec::validate_placements(p, &s.meta.shape, mesh.ndim(), &name)?;
        }
    }
    let metas: SmallVec<[&TensorMeta; 4]> = inputs.iter().map(|s| &s.meta).collect();
    let out_metas = op.output_metas(&metas)?;
    let mut problem = Problem::new_pinned(op, inputs, &out_metas, mesh, pins)?;
    let sol = problem.solve(method, op)?;
    let mut input_specs = Vec::with_capacity(inputs.len());
    let mut redistributions = Vec::with_capacity(inputs.len());
    let mut cost = 0.0;
    for (i, spec) in inputs.iter().enumerate() {
        let target: Placements = problem.placements_of_pub(TensorRef::Input(i), &sol.rows);
        let plan = if target == spec.placements {
            None
        } else {
            let moves = shortest_moves(&problem.in_ctx[i], &spec.placements, &target, true)
                .ok_or_else(|| crate::StrategyError::NoStrategy {
                    op: name.clone(),
                    inputs: spec.to_string(),
                    reason: "internal error: chosen placements became unreachable".into(),
                })?;
            let plan = build_plan(&spec.placements, &target, moves.1);
            cost += plan.est_us;
            Some(plan)
        };
        input_specs.push(DTensorSpec {
            placements: target,
            meta: spec.meta.clone(),
        });
        redistributions.push(plan);
    }
    let output_specs = out_metas
        .iter()
        .enumerate()
        .map(|(o, m)| DTensorSpec {
            placements: problem.placements_of_pub(TensorRef::Output(o), &sol.rows),
            meta: m.clone(),
        })
        .collect();
    let internal: Vec<(usize, InternalComm)> = problem
        .internal(&sol.rows)
        .into_iter()
        .map(|(m, c, _)| (m, c))
        .collect();
    cost += problem.internal(&sol.rows).iter().map(|x| x.2).sum::<f64>();
    let deferred_us = problem.deferred(&sol.rows);
    debug_assert!(
        (cost + deferred_us - sol.total).abs() <= 1e-6 * sol.total.abs().max(1.0),
        "{op}: plan cost {cost} + deferred {deferred_us} != search cost {}",
        sol.total
    );
    Ok(OpSharding {
        input_specs,
        output_specs,
        redistributions,
        internal,
        cost_us: cost,
        deferred_us,
    })
}
