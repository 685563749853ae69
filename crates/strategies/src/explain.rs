//! `explain`: what the compiler decided for one op (or one redistribution), as a serializable
//! report and a readable table. The CLI example (`examples/explain.rs`) only maps flags onto
//! [`ExplainRequest`]; all parsing lives here so the runtime's own `explain --run` can reuse it.

use std::fmt;

use serde::Serialize;

use crate::cost::{collective_cost_us, CollectiveKind};
use crate::error::{Result, StrategyError};
use crate::expand::ExpandMethod;
use crate::mesh::MeshTopology;
use crate::op::{InputKind, Op, OpArgs};
use crate::placement::{format_placements, parse_placements_with_ndim, Placement};
use crate::plan::{plan_redistribute, RedistributePlan};
use crate::propagate::propagate_with;
use crate::spec::{DTensorSpec, DType, Shape};

/// Everything `explain` needs, as text (the CLI flags).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExplainRequest {
    /// Mesh, `dp=2,tp=2`.
    pub mesh: String,
    /// Mesh dims with a flattened communicator, e.g. `["dp,tp"]`.
    pub flatten: Vec<String>,
    /// DTensor method name, or `redistribute`.
    pub op: String,
    /// Input shapes `64x32,32x64`; an optional `:dtype` suffix per shape (`4x16:u32`); `scalar`
    /// for a 0-d tensor.
    pub shapes: String,
    /// Input placements, inputs separated by `;` (`S(0),R;R,S(1)`); empty = all replicated.
    pub placements: String,
    /// Dim arguments (`0` or `0,1`; negative allowed).
    pub dims: Option<String>,
    /// keepdim for reductions.
    pub keepdim: bool,
    /// Target shape of reshape / broadcast_as (`16x6`), or the piece sizes of split.
    pub to_shape: Option<String>,
    /// Default dtype of float inputs (`f32`).
    pub dtype: Option<String>,
    /// Target placements for `--op redistribute`.
    pub to: Option<String>,
    /// Target dtype of to_dtype.
    pub to_dtype: Option<String>,
    /// Scalar argument (scalar ops, affine multiplier, masked_fill/pad value, dropout p, norm
    /// p, topk k, var/std correction, baddbmm alpha).
    pub scalar: Option<f64>,
    /// Causal flag of sdpa.
    pub causal: bool,
    /// Search method (default auto).
    pub method: ExpandMethod,
}

/// One collective in a report.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CollectiveReport {
    /// What runs.
    pub kind: CollectiveKind,
    /// Mesh dim name, or `dp+tp` for a merged step.
    pub mesh_dim: String,
    /// Size per rank (see [`crate::cost`]).
    pub bytes: u64,
    /// Estimated time (µs).
    pub est_us: f64,
    /// The input it redistributes (`None`: the op's internal communication).
    pub input: Option<usize>,
    /// Placement before (on that mesh dim).
    pub from: String,
    /// Placement after.
    pub to: String,
}

/// What the compiler decided.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExplainReport {
    /// The op (method name) or `redistribute`.
    pub op: String,
    /// The mesh, `dp=2,tp=2`.
    pub mesh: String,
    /// Input shapes with dtypes (`[64, 32] f32`).
    pub shapes: Vec<String>,
    /// Given input placements.
    pub inputs: Vec<String>,
    /// Placements the inputs are redistributed to.
    pub chosen_inputs: Vec<String>,
    /// Output placements (several outputs separated by `;`).
    pub output: String,
    /// Output shapes with dtypes.
    pub output_shapes: Vec<String>,
    /// Per input, the redistribution chain (`S(0),R -> R,R`), or `-`.
    pub plans: Vec<String>,
    /// All communication: redistribution collectives and internal comms.
    pub collectives: Vec<CollectiveReport>,
    /// Total estimated communication time (µs).
    pub est_us_total: f64,
    /// Estimated later all_reduce of `MaskPartial` outputs (µs), not in the total.
    pub deferred_us: f64,
}

/// Parses `64x32` (or `scalar` / `[]` for 0-d).
///
/// # Errors
/// [`StrategyError::Parse`] quoting the text.
pub fn parse_shape(s: &str) -> Result<Shape> {
    let t = s.trim();
    if t.is_empty() || t == "scalar" || t == "[]" {
        return Ok(Shape::new());
    }
    t.split('x')
        .map(|d| {
            d.trim()
                .parse::<usize>()
                .map_err(|_| StrategyError::parse("shape", s, format!("{d:?} is not a size")))
        })
        .collect()
}

/// Parses `64x32,32x64:u32` into shapes and optional per-input dtypes.
///
/// # Errors
/// [`StrategyError::Parse`] quoting the text.
pub fn parse_shapes(s: &str) -> Result<Vec<(Shape, Option<DType>)>> {
    if s.trim().is_empty() {
        return Err(StrategyError::parse(
            "shapes",
            s,
            "no shapes given (e.g. 64x32,32x64)",
        ));
    }
    s.split(',')
        .map(|part| {
            let (shape, dt) = match part.split_once(':') {
                Some((a, b)) => (a, Some(b.parse::<DType>()?)),
                None => (part, None),
            };
            Ok((parse_shape(shape)?, dt))
        })
        .collect()
}

/// Parses `0,1` / `-1` into signed dims.
///
/// # Errors
/// [`StrategyError::Parse`] quoting the text.
pub fn parse_dims(s: &str) -> Result<Vec<isize>> {
    if s.trim().is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|d| {
            d.trim()
                .parse::<isize>()
                .map_err(|_| StrategyError::parse("dims", s, format!("{d:?} is not a dim")))
        })
        .collect()
}

/// Default dtype of an input of this kind: indices `i64`, masks `u8`, floats `base`.
fn default_dtype(kind: InputKind, base: DType) -> DType {
    match kind {
        InputKind::Index { .. } => DType::I64,
        InputKind::Mask => DType::U8,
        InputKind::Float | InputKind::Positive => base,
    }
}

impl ExplainRequest {
    /// The op arguments of this request (everything but mesh, op name and placements).
    ///
    /// # Errors
    /// [`StrategyError::Parse`] for malformed dims, target shape or dtype.
    pub fn op_args(&self, shapes: &[Shape]) -> Result<OpArgs> {
        Ok(OpArgs {
            shapes: shapes.to_vec(),
            dims: match &self.dims {
                Some(d) => parse_dims(d)?,
                None => Vec::new(),
            },
            keepdim: self.keepdim,
            to_shape: self.to_shape.as_deref().map(parse_shape).transpose()?,
            to_dtype: self.to_dtype.as_deref().map(str::parse).transpose()?,
            scalar: self.scalar,
            causal: self.causal,
        })
    }

    /// Fills the op arguments from an op table example (`--shapes 4x6,6x8 --dims 1 ...`, see
    /// [`crate::OpDecl::example`]).
    ///
    /// # Errors
    /// [`StrategyError::Parse`] for an unknown flag or a flag without its value.
    pub fn with_example(mut self, example: &str) -> Result<Self> {
        let mut words = example.split_whitespace();
        while let Some(flag) = words.next() {
            let mut value = || {
                words.next().map(str::to_string).ok_or_else(|| {
                    StrategyError::parse("example", example, format!("{flag} needs a value"))
                })
            };
            match flag {
                "--shapes" => self.shapes = value()?,
                "--dims" => self.dims = Some(value()?),
                "--to-shape" => self.to_shape = Some(value()?),
                "--to-dtype" => self.to_dtype = Some(value()?),
                "--scalar" => {
                    let v = value()?;
                    self.scalar = Some(v.parse().map_err(|_| {
                        StrategyError::parse("example", example, format!("{v:?} is not a number"))
                    })?);
                }
                "--keepdim" => self.keepdim = true,
                "--causal" => self.causal = true,
                other => {
                    return Err(StrategyError::parse(
                        "example",
                        example,
                        format!("unknown flag {other}"),
                    ))
                }
            }
        }
        Ok(self)
    }
}

/// Builds the [`Op`] named `name` from the request's arguments and the input shapes (as the op
/// table declares: [`Op::parse`]).
///
/// # Errors
/// [`StrategyError::UnknownOp`] or [`StrategyError::InvalidArgument`] for missing/bad arguments.
pub fn build_op(req: &ExplainRequest, shapes: &[Shape]) -> Result<Op> {
    Op::parse(&req.op, &req.op_args(shapes)?)
}

fn plan_collectives(
    plan: &RedistributePlan,
    input: usize,
    mesh: &MeshTopology,
    out: &mut Vec<CollectiveReport>,
) {
    for s in plan.communication_steps() {
        out.push(CollectiveReport {
            kind: s.kind,
            mesh_dim: mesh.group_name(&s.mesh_dims),
            bytes: s.bytes,
            est_us: s.est_us,
            input: Some(input),
            from: s.from.to_string(),
            to: s.to.to_string(),
        });
    }
}

/// What an [`ExplainRequest`] resolves to: the mesh (with its flattened groups), the input
/// specs (dtypes defaulted per op, e.g. `u32` ids for `embedding`), and the op (`None` for
/// `redistribute`). The runtime's `explain --run` uses it to build the same inputs.
pub struct ResolvedRequest {
    /// The mesh.
    pub mesh: MeshTopology,
    /// One spec per input.
    pub specs: Vec<DTensorSpec>,
    /// The op, or `None` for `redistribute`.
    pub op: Option<Op>,
}

/// Parses and resolves a request; see [`ResolvedRequest`].
///
/// # Errors
/// Malformed mesh, shapes, placements or op arguments.
pub fn resolve(req: &ExplainRequest) -> Result<ResolvedRequest> {
    let mut mesh = MeshTopology::parse(&req.mesh)?;
    for group in &req.flatten {
        let names: Vec<&str> = group.split([',', '+']).map(str::trim).collect();
        mesh = mesh.with_flattened_names(&names)?;
    }
    let base: DType = match &req.dtype {
        Some(d) => d.parse()?,
        None => DType::F32,
    };
    let parsed = parse_shapes(&req.shapes)?;
    let op_name = req.op.trim();
    let shapes: Vec<Shape> = parsed.iter().map(|p| p.0.clone()).collect();
    let op = if op_name == "redistribute" {
        None
    } else {
        Some(build_op(req, &shapes)?)
    };
    let per_input: Vec<&str> = if req.placements.trim().is_empty() {
        Vec::new()
    } else {
        req.placements.split(';').collect()
    };
    if !per_input.is_empty() && per_input.len() != parsed.len() {
        return Err(StrategyError::parse(
            "placements",
            &req.placements,
            format!(
                "{} placement lists for {} shapes",
                per_input.len(),
                parsed.len()
            ),
        ));
    }
    let specs: Vec<DTensorSpec> = parsed
        .iter()
        .enumerate()
        .map(|(i, (shape, dt))| {
            let kind = op
                .as_ref()
                .map_or(InputKind::Float, |o| o.input_kind(i, &shapes));
            let dtype = dt.unwrap_or_else(|| default_dtype(kind, base));
            let placements = match per_input.get(i) {
                Some(p) => parse_placements_with_ndim(p, Some(shape.len()))?,
                None => smallvec::smallvec![Placement::Replicate; mesh.ndim()],
            };
            Ok(DTensorSpec::new(shape, dtype, &placements))
        })
        .collect::<Result<_>>()?;
    Ok(ResolvedRequest { mesh, specs, op })
}

/// Runs the request.
///
/// ```
/// use candle_dtensor::strategies::*;
/// let req = ExplainRequest {
///     mesh: "dp=2,tp=2".into(), op: "matmul".into(), shapes: "64x32,32x64".into(),
///     placements: "S(0),R;R,S(1)".into(), ..Default::default()
/// };
/// let report = explain(&req).unwrap();
/// assert_eq!(report.output, "S(0),S(1)");
/// assert!(report.collectives.is_empty());
/// ```
///
/// # Errors
/// Parse errors, unknown ops, shapes the op cannot take, invalid placements.
pub fn explain(req: &ExplainRequest) -> Result<ExplainReport> {
    let ResolvedRequest { mesh, specs, op } = resolve(req)?;
    let op_name = req.op.trim();
    let mesh_str = mesh.to_string();
    if op_name == "redistribute" {
        let [src] = specs.as_slice() else {
            return Err(StrategyError::arg(
                "redistribute",
                "needs exactly one shape",
            ));
        };
        let to = req
            .to
            .as_deref()
            .ok_or_else(|| StrategyError::arg("redistribute", "needs --to PLACEMENTS"))?;
        let dst = parse_placements_with_ndim(to, Some(src.meta.ndim()))?;
        let plan = plan_redistribute(src, &dst, &mesh)?;
        let mut collectives = Vec::new();
        plan_collectives(&plan, 0, &mesh, &mut collectives);
        return Ok(ExplainReport {
            op: "redistribute".into(),
            mesh: mesh_str,
            shapes: vec![src.meta.to_string()],
            inputs: vec![format_placements(&src.placements)],
            chosen_inputs: vec![format_placements(&dst)],
            output: format_placements(&dst),
            output_shapes: vec![src.meta.to_string()],
            plans: vec![plan.to_string()],
            collectives,
            est_us_total: plan.est_us,
            deferred_us: 0.0,
        });
    }
    let op = op.ok_or_else(|| StrategyError::arg(op_name, "unknown op"))?;
    let refs: Vec<&DTensorSpec> = specs.iter().collect();
    let s = propagate_with(&op, &refs, &mesh, req.method)?;
    let mut collectives = Vec::new();
    let mut plans = Vec::new();
    for (i, p) in s.redistributions.iter().enumerate() {
        match p {
            Some(plan) => {
                plan_collectives(plan, i, &mesh, &mut collectives);
                plans.push(plan.to_string());
            }
            None => plans.push("-".into()),
        }
    }
    for (m, c) in &s.internal {
        collectives.push(CollectiveReport {
            kind: c.kind,
            mesh_dim: mesh.group_name(&[*m]),
            bytes: c.bytes,
            est_us: collective_cost_us(c.kind, c.bytes, &mesh.dims[*m]),
            input: None,
            from: "-".into(),
            to: "-".into(),
        });
    }
    Ok(ExplainReport {
        op: op.to_string(),
        mesh: mesh_str,
        shapes: specs.iter().map(|s| s.meta.to_string()).collect(),
        inputs: specs
            .iter()
            .map(|s| format_placements(&s.placements))
            .collect(),
        chosen_inputs: s
            .input_specs
            .iter()
            .map(|s| format_placements(&s.placements))
            .collect(),
        output: s
            .output_specs
            .iter()
            .map(|s| format_placements(&s.placements))
            .collect::<Vec<_>>()
            .join(";"),
        output_shapes: s.output_specs.iter().map(|s| s.meta.to_string()).collect(),
        plans,
        collectives,
        est_us_total: s.cost_us,
        deferred_us: s.deferred_us,
    })
}

impl fmt::Display for ExplainReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "op {} on mesh {}", self.op, self.mesh)?;
        writeln!(
            f,
            "{:<6} {:<22} {:<16} {:<16} plan",
            "input", "shape", "given", "chosen"
        )?;
        for i in 0..self.inputs.len() {
            writeln!(
                f,
                "{:<6} {:<22} {:<16} {:<16} {}",
                i,
                self.shapes.get(i).map(String::as_str).unwrap_or("?"),
                self.inputs[i],
                self.chosen_inputs.get(i).map(String::as_str).unwrap_or("?"),
                self.plans.get(i).map(String::as_str).unwrap_or("-")
            )?;
        }
        writeln!(
            f,
            "output {} {}",
            self.output_shapes.join("; "),
            self.output
        )?;
        if self.collectives.is_empty() {
            writeln!(f, "no communication")?;
        } else {
            writeln!(
                f,
                "{:<16} {:<10} {:<8} {:>12} {:>10}",
                "collective", "mesh dim", "input", "bytes", "est us"
            )?;
            for c in &self.collectives {
                let who = c
                    .input
                    .map(|i| i.to_string())
                    .unwrap_or_else(|| "internal".into());
                writeln!(
                    f,
                    "{:<16} {:<10} {:<8} {:>12} {:>10.2}",
                    c.kind.name(),
                    c.mesh_dim,
                    who,
                    c.bytes,
                    c.est_us
                )?;
            }
        }
        write!(f, "estimated communication: {:.2} us", self.est_us_total)?;
        if self.deferred_us > 0.0 {
            write!(
                f,
                " (+{:.2} us later to reduce MaskPartial outputs)",
                self.deferred_us
            )?;
        }
        Ok(())
    }
}
