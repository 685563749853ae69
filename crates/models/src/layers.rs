//! DTensor-native layers: `Linear`, `Embedding`, `LayerNorm`, `RmsNorm`, causal multi-head
//! `Attention`, `Mlp` (GELU or SwiGLU), and a pre-norm transformer `Block` whose feed-forward is
//! an `Mlp` or a mixture of experts ([`crate::moe_layer::MoeLayer`]).
//!
//! Each layer is written as for one device; its parameters' placements and its boundary
//! layouts come from the [`TpPlan`](candle_dtensor_parallel::TpPlan) style of its name. Shapes in the docs are global.

use candle_dtensor_core::cp;
use candle_dtensor_core::{DTensor, Placement};

use candle_dtensor_parallel::init::Init;
use candle_dtensor_parallel::tp_plan::{MeshRoles, ParallelStyle};

pub use crate::builder::Builder;
use crate::error::{ModelError, Result};
use crate::moe_layer::MoeLayer;
use crate::precision;

/// `y = x W^T + b` with `W: [out, in]`, `b: [out]`, `x: [.., in]`.
#[derive(Clone)]
pub struct Linear {
    /// `[out, in]`.
    pub weight: DTensor,
    /// `[out]`.
    pub bias: Option<DTensor>,
    style: ParallelStyle,
    roles: MeshRoles,
    sp: bool,
}

impl Linear {
    /// Creates `name.weight` (normal, `std`) and `name.bias` (zeros).
    pub fn new(
        b: &mut Builder,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        std: f64,
    ) -> Result<Self> {
        let style = b.plan.style(name);
        let (w_tp, b_tp) = match style {
            ParallelStyle::Colwise => {
                b.check_divisible(&format!("{name}: out features"), out_dim)?;
                (Placement::Shard(0), Placement::Shard(0))
            }
            ParallelStyle::Rowwise => {
                b.check_divisible(&format!("{name}: in features"), in_dim)?;
                (Placement::Shard(1), Placement::Replicate)
            }
            _ => (Placement::Replicate, Placement::Replicate),
        };
        let wp = b.param_placements(w_tp);
        let weight = b.store.param(
            &format!("{name}.weight"),
            &[out_dim, in_dim],
            Init::Normal(std),
            &wp,
        )?;
        let bias = if bias {
            let bp = b.param_placements(b_tp);
            Some(
                b.store
                    .param(&format!("{name}.bias"), &[out_dim], Init::Zeros, &bp)?,
            )
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            style,
            roles: b.roles.clone(),
            sp: b.plan.sequence_parallel,
        })
    }

    /// Applies the layer (its GEMM in the current [`precision`] policy's dtype), the output in
    /// `x`'s dtype.
    pub fn forward(&self, x: &DTensor) -> Result<DTensor> {
        self.apply(x, None, false)
    }

    /// [`Linear::forward`] with the output in `out`, from an `x` in any float dtype (bf16
    /// activations under a mixed-precision policy: [`precision::linear_to`]).
    pub fn forward_to(&self, x: &DTensor, out: candle_core::DType) -> Result<DTensor> {
        self.apply(x, Some(out), false)
    }

    /// GELU of [`Linear::forward`] (`out` `None`) or [`Linear::forward_to`], with the GELU in
    /// the linear's graph node where the output is whole on every rank
    /// ([`precision::linear_gelu`]: no edge between them for candle's backward to pay); after
    /// the reduction for a row-parallel linear.
    pub fn forward_gelu(&self, x: &DTensor, out: Option<candle_core::DType>) -> Result<DTensor> {
        self.apply(x, out, true)
    }

    fn apply(&self, x: &DTensor, out: Option<candle_core::DType>, gelu: bool) -> Result<DTensor> {
        let linear = |b: Option<&DTensor>, layout: Option<&[Placement]>| match (out, gelu) {
            (_, true) => precision::linear_gelu(x, &self.weight, b, layout, out),
            (Some(dt), false) => precision::linear_to(x, &self.weight, b, layout, dt),
            (None, false) => precision::linear(x, &self.weight, b, layout),
        };
        let plain = |b: Option<&DTensor>, layout: Option<&[Placement]>| match out {
            Some(dt) => precision::linear_to(x, &self.weight, b, layout, dt),
            None => precision::linear(x, &self.weight, b, layout),
        };
        match (self.style, self.roles.tp) {
            (ParallelStyle::Colwise, Some(_)) => {
                let layout = self.roles.with_tp(x.placements(), Placement::Replicate);
                linear(self.bias.as_ref(), Some(&layout))
            }
            (ParallelStyle::Rowwise, Some(tp)) => {
                let last = x.rank().saturating_sub(1);
                let layout = self.roles.with_tp(x.placements(), Placement::Shard(last));
                // The bias is added once, after the reduction of the partial products; on a
                // `tp` dim of one rank the product is already whole, so the linear adds it (one
                // node, as for an unsharded linear, instead of a broadcast add over the output).
                let whole = x.mesh().shape().get(tp) == Some(&1);
                let y = plain(self.bias.as_ref().filter(|_| whole), Some(&layout))?;
                let out = if self.sp && y.rank() == 3 {
                    Placement::Shard(1)
                } else {
                    Placement::Replicate
                };
                let y = y.redistribute(&self.roles.with_tp(y.placements(), out))?;
                let y = match &self.bias {
                    Some(b) if !whole => y.add(&precision::cast(b, y.dtype())?)?,
                    _ => y,
                };
                if gelu {
                    Ok(y.gelu()?)
                } else {
                    Ok(y)
                }
            }
            _ => linear(self.bias.as_ref(), None),
        }
    }
}

/// Token embedding `[V, D]`: integer ids `[..]` to `[.., D]`.
pub struct Embedding {
    /// `[V, D]`.
    pub weight: DTensor,
    style: ParallelStyle,
    roles: MeshRoles,
    sp: bool,
}

impl Embedding {
    /// Creates `name.weight` (normal, `std`).
    pub fn new(b: &mut Builder, name: &str, vocab: usize, dim: usize, std: f64) -> Result<Self> {
        let style = b.plan.style(name);
        let on_tp = match style {
            ParallelStyle::VocabParallel => {
                b.check_divisible(&format!("{name}: vocab"), vocab)?;
                Placement::Shard(0)
            }
            ParallelStyle::Colwise => {
                b.check_divisible(&format!("{name}: embedding dim"), dim)?;
                Placement::Shard(1)
            }
            _ => Placement::Replicate,
        };
        let wp = b.param_placements(on_tp);
        let weight = b.store.param(
            &format!("{name}.weight"),
            &[vocab, dim],
            Init::Normal(std),
            &wp,
        )?;
        Ok(Embedding {
            weight,
            style,
            roles: b.roles.clone(),
            sp: b.plan.sequence_parallel,
        })
    }

    /// Looks `ids` up; a vocab-parallel table's masked partial output is reduced (to the
    /// sequence dim under sequence parallelism). The rows come out in the current
    /// [`precision`] scope's master dtype (FSDP's gathered bf16 table cast up).
    pub fn forward(&self, ids: &DTensor) -> Result<DTensor> {
        let y = ids.embedding_with_layout(&self.weight, Some(self.weight.placements()))?;
        let y = precision::to_master(&y)?;
        if self.style == ParallelStyle::VocabParallel && self.roles.tp.is_some() {
            let out = if self.sp && y.rank() == 3 {
                Placement::Shard(1)
            } else {
                Placement::Replicate
            };
            return Ok(y.redistribute(&self.roles.with_tp(y.placements(), out))?);
        }
        Ok(y)
    }
}

/// Layer norm over the last dim, with weight and optional bias (built from primitives, so it
/// has a gradient).
#[derive(Clone)]
pub struct LayerNorm {
    /// `[D]`.
    pub weight: DTensor,
    /// `[D]`.
    pub bias: Option<DTensor>,
    eps: f64,
}

impl LayerNorm {
    /// Creates `name.weight` (ones) and `name.bias` (zeros).
    pub fn new(b: &mut Builder, name: &str, dim: usize, bias: bool, eps: f64) -> Result<Self> {
        let p = b.param_placements(Placement::Replicate);
        let weight = b
            .store
            .param(&format!("{name}.weight"), &[dim], Init::Ones, &p)?;
        let bias = if bias {
            Some(
                b.store
                    .param(&format!("{name}.bias"), &[dim], Init::Zeros, &p)?,
            )
        } else {
            None
        };
        Ok(LayerNorm { weight, bias, eps })
    }

    /// Applies the layer, in the current [`precision`] scope's master dtype (f32: input and
    /// parameters cast up where they are not).
    pub fn forward(&self, x: &DTensor) -> Result<DTensor> {
        let x = precision::to_master(x)?;
        let w = precision::cast(&self.weight, x.dtype())?;
        let b = self
            .bias
            .as_ref()
            .map(|b| precision::cast(b, x.dtype()))
            .transpose()?;
        Ok(x.layer_norm(Some(&w), b.as_ref(), self.eps)?)
    }
}

/// RMS norm over the last dim.
#[derive(Clone)]
pub struct RmsNorm {
    /// `[D]`.
    pub weight: DTensor,
    eps: f64,
}

impl RmsNorm {
    /// Creates `name.weight` (ones).
    pub fn new(b: &mut Builder, name: &str, dim: usize, eps: f64) -> Result<Self> {
        let p = b.param_placements(Placement::Replicate);
        let weight = b
            .store
            .param(&format!("{name}.weight"), &[dim], Init::Ones, &p)?;
        Ok(RmsNorm { weight, eps })
    }

    /// Applies the layer, in the current [`precision`] scope's master dtype (as
    /// [`LayerNorm::forward`]).
    pub fn forward(&self, x: &DTensor) -> Result<DTensor> {
        let x = precision::to_master(x)?;
        let w = precision::cast(&self.weight, x.dtype())?;
        Ok(x.rms_norm(&w, self.eps)?)
    }
}

/// A norm layer of either kind.
#[derive(Clone)]
pub enum Norm {
    /// Layer norm.
    Layer(LayerNorm),
    /// RMS norm.
    Rms(RmsNorm),
}

impl Norm {
    /// Applies the layer.
    pub fn forward(&self, x: &DTensor) -> Result<DTensor> {
        match self {
            Norm::Layer(n) => n.forward(x),
            Norm::Rms(n) => n.forward(x),
        }
    }
}

/// Causal multi-head self-attention: a fused `qkv` projection `[3D, D]` whose output features
/// are ordered (head, {q, k, v}, head dim), so a column-parallel split keeps whole heads on each
/// rank and attention runs on the local heads; then `proj` `[D, D]`.
#[derive(Clone)]
pub struct Attention {
    /// The fused q/k/v projection.
    pub qkv: Linear,
    /// The output projection.
    pub proj: Linear,
    n_heads: usize,
}

impl Attention {
    /// Creates `name.qkv` and `name.proj`.
    pub fn new(
        b: &mut Builder,
        name: &str,
        dim: usize,
        n_heads: usize,
        std: f64,
        proj_std: f64,
    ) -> Result<Self> {
        if n_heads == 0 || dim % n_heads != 0 {
            return Err(ModelError::Config(format!(
                "{name}: model dim {dim} is not divisible by {n_heads} heads"
            )));
        }
        if b.plan.style(&format!("{name}.qkv")) == ParallelStyle::Colwise {
            b.check_divisible(&format!("{name}: heads"), n_heads)?;
        }
        Ok(Attention {
            qkv: Linear::new(b, &format!("{name}.qkv"), dim, 3 * dim, true, std)?,
            proj: Linear::new(b, &format!("{name}.proj"), dim, dim, true, proj_std)?,
            n_heads,
        })
    }

    /// `x: [B, T, D]` to `[B, T, D]`.
    pub fn forward(&self, x: &DTensor) -> Result<DTensor> {
        let (b, t, d) = (x.dim(0)?, x.dim(1)?, x.dim(2)?);
        let (h, hd) = (self.n_heads, d / self.n_heads);
        let bf16 = precision::local_gemm_dtype();
        // On CUDA under a bf16 policy the attention (flash, or the ring of context
        // parallelism) reads q/k/v in bf16: the projection hands them over in bf16 and the
        // output projection reads the attention's bf16 output (no casts between them).
        let lowp = bf16.is_some()
            && x.to_local().device().is_cuda()
            && cp::current_layout().0 != cp::SeqLayout::LoadBalanced;
        let qkv = match precision::activation_dtype() {
            Some(dt) if lowp => self.qkv.forward_to(x, dt)?,
            _ => self.qkv.forward(x)?,
        };
        // Where no mesh dim shards the sequence or holds a partial sum, attention on the
        // projection as it is (f32 and TF32 policies, and bf16 on CUDA: the paths that take
        // `packed_sdpa`): `flat_sdpa`, no reshapes to and from [B, T, H, 3, hd] and their graph
        // edges. Its strategies keep batch shards and feature shards of whole heads (a
        // column-parallel projection) where they are.
        let balanced = cp::current_layout().0 == cp::SeqLayout::LoadBalanced;
        let whole_sequences = qkv.placements().iter().all(|p| {
            matches!(
                p,
                Placement::Replicate | Placement::Shard(0) | Placement::Shard(2)
            )
        });
        if !balanced && whole_sequences && (lowp || bf16.is_none()) {
            let qkv = match bf16 {
                Some(d) if lowp => precision::cast(&qkv, d)?,
                _ => qkv,
            };
            let y = qkv.flat_sdpa(h, true, None)?;
            return self.proj.forward_to(&keep_cp_sequence(&y, x)?, x.dtype());
        }
        // The QKV weight is laid out head by head ([H, 3, d] rows), so a column shard of the
        // projection holds whole heads and the packed attention runs on it locally.
        let qkv = qkv.reshape(&[b, t, h, 3, hd])?;
        let y = match cp_dim(&qkv) {
            // Context parallelism: ring attention on the sequence pieces. The compiler would
            // often re-shard q/k/v to the heads or the batch instead (fewer bytes on the
            // wire), but each re-sharding keeps one more copy of them for backward; the ring
            // keeps only the projection's output and overlaps its transfers with compute.
            // Mixed precision: q/k/v go in (and K/V round the ring) in the GEMM dtype; the
            // ring computes each block in f32 (`cp`'s online softmax).
            Some(_) => {
                let qkv = match bf16 {
                    Some(d) => precision::cast(&qkv, d)?,
                    None => qkv,
                };
                let parts = qkv.unbind(3)?;
                let [q, k, v] = [0, 1, 2].map(|i| parts[i].transpose(1, 2));
                let y = cp::attention(
                    &q?,
                    &k?,
                    &v?,
                    true,
                    None,
                    cp::Strategy::Exchange(cp::current_variant()),
                )?;
                // Back in the master dtype, or (bf16 activations) as the ring made it: the
                // output projection reads either.
                let y = y.transpose(1, 2)?;
                if lowp {
                    y
                } else {
                    precision::cast(&y, x.dtype())?
                }
            }
            // Mixed precision: QK^T and PV in bf16, the masked softmax in f32. The
            // load-balanced context-parallel order (attention not sharded on the sequence
            // here) needs the stored-order mask of `packed_sdpa`: f32 there.
            // On CUDA the fused attention (flash attention, or the fused scaled softmax for
            // other head dims) takes bf16 operands, accumulates in f32 and computes the softmax
            // in f32 from bf16 scores, as autocast does: q/k/v come from the projection in
            // bf16, the bf16 output goes to the output projection as it is, and no [T, T] mask
            // is built on the host.
            None if lowp => {
                let qkv = precision::cast(&qkv, bf16.unwrap_or(x.dtype()))?;
                keep_cp_sequence(&qkv.packed_sdpa(true, None)?, x)?
            }
            None if bf16.is_some() && cp::current_layout().0 != cp::SeqLayout::LoadBalanced => {
                keep_cp_sequence(&mixed_attention(&qkv, hd)?, x)?
            }
            None => keep_cp_sequence(&qkv.packed_sdpa(true, None)?, x)?,
        };
        let y = y.reshape(&[b, t, d])?;
        self.proj.forward_to(&y, x.dtype())
    }
}

/// Causal attention on `qkv [B, T, H, 3, d]` -> `[B, T, H, d]` under a mixed-precision policy:
/// `QK^T` and `PV` in the policy's GEMM dtype ([`precision::matmul`], f32 accumulation, f32
/// out), the scale, mask and softmax in f32.
fn mixed_attention(qkv: &DTensor, hd: usize) -> Result<DTensor> {
    let t = qkv.dim(1)?;
    let parts = qkv.unbind(3)?;
    let [q, k, v] = [0, 1, 2].map(|i| parts[i].transpose(1, 2));
    let (q, k, v) = (q?, k?, v?);
    let scores = precision::matmul(&q, &k.transpose(2, 3)?)?;
    let scores = scores.affine(1.0 / (hd as f64).sqrt(), 0.0)?;
    // The causal mask [T, T]: 1 above the diagonal (a future key), replicated.
    let mask: Vec<u8> = (0..t)
        .flat_map(|i| (0..t).map(move |j| u8::from(j > i)))
        .collect();
    let mask = candle_core::Tensor::from_vec(mask, (t, t), qkv.to_local().device())?;
    let mask = candle_dtensor_core::distribute_tensor(
        &mask,
        qkv.mesh(),
        &vec![Placement::Replicate; qkv.mesh().ndim()],
    )?;
    let probs = scores.masked_fill(&mask, f64::NEG_INFINITY)?.softmax(3)?;
    Ok(precision::matmul(&probs, &v)?.transpose(1, 2)?)
}

/// The `cp` mesh dim (of size > 1) when it shards the sequence (dim 1) of `qkv [B, T, ..]`
/// and no other mesh dim does.
fn cp_dim(qkv: &DTensor) -> Option<usize> {
    let names = qkv.mesh().dim_names();
    let m = names.iter().position(|n| *n == "cp")?;
    let shape = qkv.mesh().shape();
    let pl = qkv.placements();
    let sole = (0..pl.len()).all(|o| o == m || shape[o] == 1 || pl[o].shard_dim() != Some(1));
    (shape[m] > 1 && pl[m] == Placement::Shard(1) && sole).then_some(m)
}

/// Context parallelism: the attention output `y [B, T, H, d]` back on the sequence sharding
/// its input `x [B, T, D]` has on the `cp` mesh dim. The compiler may run attention sharded on
/// the heads (an all_to_all is cheaper than exchanging K/V) and would, op by op, leave the
/// output there, so the projection after it would make a full-sequence partial sum on every
/// rank; one all_to_all back keeps every activation of the block 1/cp.
fn keep_cp_sequence(y: &DTensor, x: &DTensor) -> Result<DTensor> {
    let Some(m) = x.mesh().dim_names().iter().position(|n| *n == "cp") else {
        return Ok(y.clone());
    };
    if x.placements()[m] != Placement::Shard(1) || y.placements()[m] == Placement::Shard(1) {
        return Ok(y.clone());
    }
    let mut pl = y.placements().to_vec();
    pl[m] = Placement::Shard(1);
    Ok(y.redistribute(&pl)?)
}

/// The feed-forward block: `fc2(gelu(fc1(x)))`, or SwiGLU `fc2(silu(fc1(x)) * fc3(x))`.
#[derive(Clone)]
pub struct Mlp {
    /// `[H, D]`.
    pub fc1: Linear,
    /// `[D, H]`.
    pub fc2: Linear,
    /// `[H, D]` (SwiGLU gate).
    pub fc3: Option<Linear>,
}

impl Mlp {
    /// Creates `name.fc1`, `name.fc2` (and `name.fc3` for SwiGLU).
    pub fn new(
        b: &mut Builder,
        name: &str,
        dim: usize,
        hidden: usize,
        swiglu: bool,
        std: f64,
        proj_std: f64,
    ) -> Result<Self> {
        Ok(Mlp {
            fc1: Linear::new(b, &format!("{name}.fc1"), dim, hidden, true, std)?,
            fc3: if swiglu {
                Some(Linear::new(
                    b,
                    &format!("{name}.fc3"),
                    dim,
                    hidden,
                    true,
                    std,
                )?)
            } else {
                None
            },
            fc2: Linear::new(b, &format!("{name}.fc2"), hidden, dim, true, proj_std)?,
        })
    }

    /// Applies the block. Under a bf16 policy on CUDA the hidden activation is bf16
    /// ([`Mlp::forward_with`]); elsewhere it is in `x`'s dtype (on the CPU, whose bf16
    /// arithmetic converts element by element, bf16 hidden activations made the `small` bf16
    /// step 14% slower: BENCHMARKS.md).
    pub fn forward(&self, x: &DTensor) -> Result<DTensor> {
        let hidden = precision::activation_dtype().filter(|_| x.to_local().device().is_cuda());
        self.forward_with(x, hidden)
    }

    /// Applies the block with its hidden activation in `hidden` (`None`: `x`'s dtype):
    /// autocast's data flow for bf16. The first linear hands the activation over in `hidden`,
    /// GELU reads and writes it (bf16 with f32 arithmetic and one rounding), SiLU and the gate
    /// product are candle's ops in it, and the second linear reads it and writes the output
    /// in `x`'s dtype. Each linear is one node (`DTensor::linear_with_layout_to`); the first
    /// and its GELU are one node together ([`Linear::forward_gelu`]) unless the first is
    /// row-parallel.
    pub fn forward_with(&self, x: &DTensor, hidden: Option<candle_core::DType>) -> Result<DTensor> {
        let up = |l: &Linear| match hidden {
            Some(dt) => l.forward_to(x, dt),
            None => l.forward(x),
        };
        let h = match &self.fc3 {
            Some(fc3) => up(&self.fc1)?.silu()?.mul(&up(fc3)?)?,
            // fc1 and its GELU as one graph node where they can be.
            None => self.fc1.forward_gelu(x, hidden)?,
        };
        self.fc2.forward_to(&h, x.dtype())
    }
}

/// A block's feed-forward: a dense MLP or a mixture of experts.
// One per block, built once: the size difference costs nothing worth an extra box.
#[allow(clippy::large_enum_variant)]
pub enum FeedForward {
    /// The dense MLP.
    Dense(Mlp),
    /// A mixture of experts.
    Moe(Box<MoeLayer>),
}

impl FeedForward {
    /// The dense MLP, if this is one.
    pub fn dense(&self) -> Option<&Mlp> {
        match self {
            FeedForward::Dense(m) => Some(m),
            FeedForward::Moe(_) => None,
        }
    }

    /// The mixture of experts, if this is one.
    pub fn moe(&self) -> Option<&MoeLayer> {
        match self {
            FeedForward::Dense(_) => None,
            FeedForward::Moe(m) => Some(m),
        }
    }

    /// Applies it; the second value is a mixture of experts' load-balancing loss.
    pub fn forward(&self, x: &DTensor) -> Result<(DTensor, Option<DTensor>)> {
        match self {
            FeedForward::Dense(m) => Ok((m.forward(x)?, None)),
            FeedForward::Moe(m) => m.forward(x),
        }
    }
}

/// A pre-norm transformer block: `x + attn(ln1(x))`, then `x + mlp(ln2(x))`.
pub struct Block {
    /// First norm.
    pub ln1: Norm,
    /// Attention.
    pub attn: Attention,
    /// Second norm.
    pub ln2: Norm,
    /// Feed-forward.
    pub mlp: FeedForward,
}

impl Block {
    /// Applies the block.
    pub fn forward(&self, x: &DTensor) -> Result<DTensor> {
        Ok(self.forward_aux(x)?.0)
    }

    /// A copy of a dense block (`None` for a mixture-of-experts one), for a recompute that
    /// outlives the forward (activation checkpointing): its parameters are shared handles, so
    /// FSDP's refills reach it.
    pub(crate) fn dense_copy(&self) -> Option<Block> {
        Some(Block {
            ln1: self.ln1.clone(),
            attn: self.attn.clone(),
            ln2: self.ln2.clone(),
            mlp: FeedForward::Dense(self.mlp.dense()?.clone()),
        })
    }

    /// Applies the block; the second value is its mixture of experts' load-balancing loss.
    pub fn forward_aux(&self, x: &DTensor) -> Result<(DTensor, Option<DTensor>)> {
        let a = {
            let _l = candle_dtensor_core::debug::label("attn");
            self.attn.forward(&self.ln1.forward(x)?)?
        };
        let x = x.add(&a)?;
        let (m, aux) = {
            // The label covers ln2 too, as before the MoE variant (the per-block collective
            // pattern counts ln2's backward all_reduces under `mlp`).
            let _l = candle_dtensor_core::debug::label("mlp");
            self.mlp.forward(&self.ln2.forward(&x)?)?
        };
        Ok((x.add(&m)?, aux))
    }
}
