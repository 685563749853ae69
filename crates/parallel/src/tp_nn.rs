//! Tensor parallelism for models written with candle-nn: drop-in replacements for
//! `candle_nn::linear` / `linear_no_bias` / `embedding` that hold this rank's piece of the
//! parameter and run Megatron-LM's collectives ([`candle_dtensor_core::functional`]) on plain
//! tensors, implementing `candle_nn::Module`.
//!
//! - [`ColumnParallelLinear`]: `W [out, in]` split by output features. Forward: `f` (identity;
//!   backward all_reduces the input's gradient), the local linear, output sharded on the last
//!   dim (or gathered with [`ColumnParallelLinear::with_gather_output`]).
//! - [`RowParallelLinear`]: `W [out, in]` split by input features, input sharded on its last
//!   dim (a column-parallel output), or scattered with
//!   [`RowParallelLinear::with_input_is_parallel`]`(false)`. Forward: the local linear, `g`
//!   (all_reduce; identity backward), then the replicated bias.
//! - [`VocabParallelEmbedding`]: the table split by rows; masked lookup + all_reduce.
//!
//! A column-parallel layer followed by a row-parallel one is Megatron's MLP (one all_reduce
//! forward, one backward for the input's gradient); column-parallel Q/K/V split by heads
//! ([`TpLinearConfig::block`] = the head dim) and a row-parallel output projection is its
//! attention. A user's model runs tensor-parallel by building these types where it built
//! candle-nn's, from the same `VarBuilder`:
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_dtensor::comm::LocalWorld;
//! use candle_dtensor::dtensor::functional::Group;
//! use candle_dtensor::parallel::fsdp_vb::reference_var_builder;
//! use candle_dtensor::parallel::tp_nn::{column_parallel_linear, row_parallel_linear};
//!
//! LocalWorld::run(2, |comm| {
//!     let tp = Group::new(&comm);
//!     let (_vars, vb) = reference_var_builder(0, DType::F32, &Device::Cpu);
//!     // Was: candle_nn::linear(8, 32, vb.pp("fc1")) and candle_nn::linear(32, 8, vb.pp("fc2")).
//!     let fc1 = column_parallel_linear(8, 32, &tp, vb.pp("fc1"))?; // this rank: 16 outputs
//!     let fc2 = row_parallel_linear(32, 8, &tp, vb.pp("fc2"))?; // this rank: 16 inputs
//!     let x = Tensor::ones((4, 8), DType::F32, &Device::Cpu)?;
//!     let y = fc2.forward(&fc1.forward(&x)?.gelu()?)?; // [4, 8], the same on both ranks
//!     assert_eq!(y.dims(), &[4, 8]);
//!     Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
//! })?;
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```
//!
//! # Parameters
//!
//! Each layer asks the `VarBuilder` for its piece only, under the names candle-nn uses
//! (`weight`, `bias`), with candle-nn's initialisation computed for the global shape (Kaiming
//! fan-in of all input features, the bias bound `1/sqrt(in)`, `N(0, 1)` embeddings). The
//! backends of this crate ([`crate::fsdp_vb::reference_var_builder`] and
//! [`crate::fsdp_vb::FsdpVarMap`], see [`crate::init::PieceRequest`]) then create exactly the
//! rows/cols of the single-device parameter with the same seed, so a tensor-parallel model
//! starts where its single-device twin starts. Another backend (a plain `VarMap`) initialises
//! the piece with the same statistics but its own random values.
//!
//! Built from an [`crate::fsdp_vb::FsdpVarMap`]'s `VarBuilder` on a 2-D mesh, the pieces are
//! FSDP parameters sharded over the data-parallel dim: FSDP x TP for candle-nn code.
//!
//! # Uneven splits
//!
//! Features (or blocks of [`TpLinearConfig::block`] features, or vocabulary rows) are split as
//! torch.chunk splits them: `ceil(len / n)` per rank, the last ranks fewer. A split that would
//! leave a rank with nothing is refused with [`ParallelError::Config`] on every rank: an empty
//! piece makes candle drop that rank's graph nodes, so its backward would skip collectives the
//! other ranks wait in.

use std::ops::Range;

use candle_core::{Module, Shape, Tensor};
use candle_dtensor_core::functional::{self as f, GatherBackward};
use candle_nn::init::NormalOrUniform;
use candle_nn::{Init, VarBuilder};

pub use candle_dtensor_core::functional::Group;

use crate::error::{ParallelError, Result};
use crate::init::{with_piece, PieceRequest};

/// Options of [`ColumnParallelLinear::new`] and [`RowParallelLinear::new`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpLinearConfig {
    /// A bias (`candle_nn::linear`) or none (`candle_nn::linear_no_bias`).
    pub bias: bool,
    /// Split the sharded features in whole blocks of this many (the head dim, so that every
    /// rank holds whole attention heads); 1 splits anywhere.
    pub block: usize,
}

impl TpLinearConfig {
    /// No bias, split anywhere (`candle_nn::linear_no_bias`).
    pub fn no_bias() -> Self {
        TpLinearConfig {
            bias: false,
            block: 1,
        }
    }
}

impl Default for TpLinearConfig {
    /// A bias, split anywhere.
    fn default() -> Self {
        TpLinearConfig {
            bias: true,
            block: 1,
        }
    }
}

/// This rank's range of `len` features split over `g` in blocks of `block` (torch.chunk of the
/// blocks), refused when some rank would get none (see the module docs).
fn split(what: &str, len: usize, block: usize, g: &Group) -> Result<Range<usize>> {
    if block == 0 || len % block != 0 {
        return Err(ParallelError::Config(format!(
            "{what}: {len} features are not whole blocks of {block}"
        )));
    }
    let blocks = len / block;
    let sizes: Vec<usize> = (0..g.size()).map(|r| g.chunk_of(blocks, r).0).collect();
    let empty: Vec<usize> = (0..g.size()).filter(|&r| sizes[r] == 0).collect();
    if !empty.is_empty() {
        let unit = if block == 1 {
            String::new()
        } else {
            format!(" blocks of {block}")
        };
        return Err(ParallelError::Config(format!(
            "{what}: {blocks}{unit} split over the {} ranks of group {} leave rank(s) {empty:?} \
             without any (torch.chunk sizes {sizes:?}); an empty piece would drop that rank's \
             graph nodes and desynchronise the backward collectives. Use fewer ranks or more \
             features",
            g.size(),
            g.name()
        )));
    }
    let (s, off) = g.chunk(blocks);
    Ok(off * block..(off + s) * block)
}

/// candle-nn's initialisation hint with any shape-dependent part (Kaiming's fan) resolved for
/// the global shape, so a piece is initialised as the whole parameter would be.
fn global_hint(h: Init, global: &Shape) -> Init {
    match h {
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(global) as f64).sqrt();
            match dist {
                NormalOrUniform::Normal => Init::Randn {
                    mean: 0.0,
                    stdev: std,
                },
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    Init::Uniform {
                        lo: -bound,
                        up: bound,
                    }
                }
            }
        }
        other => other,
    }
}

/// The piece of parameter `name` (global shape `global`) at `indices`, from `vb`.
fn get_piece(
    vb: &VarBuilder,
    name: &str,
    global: &[usize],
    indices: Vec<Vec<usize>>,
    hint: Init,
) -> Result<Tensor> {
    let hint = global_hint(hint, &Shape::from(global));
    let request = PieceRequest {
        global: global.to_vec(),
        indices,
    };
    let dims = request.dims();
    Ok(with_piece(request, || {
        vb.get_with_hints(dims.as_slice(), name, hint)
    })?)
}

/// candle-nn's bias initialisation for `in_dim` inputs.
fn bias_hint(in_dim: usize) -> Init {
    let bound = 1.0 / (in_dim as f64).sqrt();
    Init::Uniform {
        lo: -bound,
        up: bound,
    }
}

/// `[.., len]` viewed as `[.., len / block, block]`.
fn as_blocks(x: &Tensor, block: usize) -> candle_core::Result<Tensor> {
    let mut dims = x.dims().to_vec();
    let last = dims.pop().unwrap_or(0);
    dims.extend([last / block, block]);
    x.reshape(dims)
}

/// `[.., blocks, block]` back to `[.., blocks * block]`.
fn from_blocks(x: &Tensor) -> candle_core::Result<Tensor> {
    x.flatten_from(x.rank().saturating_sub(2))
}

/// A linear layer split by output features; see the module docs.
#[derive(Debug, Clone)]
pub struct ColumnParallelLinear {
    local: candle_nn::Linear,
    group: Group,
    out_features: usize,
    block: usize,
    range: Range<usize>,
    gather_output: bool,
}

impl ColumnParallelLinear {
    /// Creates this rank's rows of `weight [out_dim, in_dim]` (and of `bias [out_dim]`) from
    /// `vb`, as `candle_nn::linear_b(in_dim, out_dim, cfg.bias, vb)` would create the whole.
    ///
    /// # Errors
    ///
    /// A split leaving a rank without features, or the `VarBuilder`'s error.
    pub fn new(
        in_dim: usize,
        out_dim: usize,
        cfg: TpLinearConfig,
        group: &Group,
        vb: VarBuilder,
    ) -> Result<Self> {
        let what = format!("column-parallel linear {}: output features", vb.prefix());
        let range = split(&what, out_dim, cfg.block, group)?;
        let rows: Vec<usize> = range.clone().collect();
        let weight = get_piece(
            &vb,
            "weight",
            &[out_dim, in_dim],
            vec![rows.clone(), (0..in_dim).collect()],
            candle_nn::init::DEFAULT_KAIMING_NORMAL,
        )?;
        let bias = if cfg.bias {
            Some(get_piece(
                &vb,
                "bias",
                &[out_dim],
                vec![rows],
                bias_hint(in_dim),
            )?)
        } else {
            None
        };
        Ok(ColumnParallelLinear {
            local: candle_nn::Linear::new(weight, bias),
            group: group.clone(),
            out_features: out_dim,
            block: cfg.block,
            range,
            gather_output: false,
        })
    }

    /// Gather the output over the group (`[.., out]` on every rank; backward keeps this
    /// rank's columns of the gradient), e.g. for logits consumed on every rank. Off by
    /// default: the output stays `[.., out_range().len()]`.
    pub fn with_gather_output(mut self, gather: bool) -> Self {
        self.gather_output = gather;
        self
    }

    /// This rank's rows of the weight, `[out_range().len(), in]`.
    pub fn weight(&self) -> &Tensor {
        self.local.weight()
    }

    /// This rank's piece of the bias.
    pub fn bias(&self) -> Option<&Tensor> {
        self.local.bias()
    }

    /// The global output features this rank computes.
    pub fn out_range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The group.
    pub fn group(&self) -> &Group {
        &self.group
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = f::copy_to_group(x, &self.group)?;
        let y = self.local.forward(&x)?;
        if !self.gather_output {
            return Ok(y);
        }
        let blocks = f::all_gather(
            &as_blocks(&y, self.block)?,
            &self.group,
            y.rank() - 1,
            self.out_features / self.block,
            GatherBackward::Chunk,
        )?;
        from_blocks(&blocks)
    }
}

/// A linear layer split by input features; see the module docs.
#[derive(Debug, Clone)]
pub struct RowParallelLinear {
    local: candle_nn::Linear,
    bias: Option<Tensor>,
    group: Group,
    in_features: usize,
    block: usize,
    range: Range<usize>,
    input_is_parallel: bool,
}

impl RowParallelLinear {
    /// Creates this rank's columns of `weight [out_dim, in_dim]` and the whole (replicated)
    /// `bias [out_dim]` from `vb`, as `candle_nn::linear_b(in_dim, out_dim, cfg.bias, vb)`
    /// would create them.
    ///
    /// # Errors
    ///
    /// A split leaving a rank without features, or the `VarBuilder`'s error.
    pub fn new(
        in_dim: usize,
        out_dim: usize,
        cfg: TpLinearConfig,
        group: &Group,
        vb: VarBuilder,
    ) -> Result<Self> {
        let what = format!("row-parallel linear {}: input features", vb.prefix());
        let range = split(&what, in_dim, cfg.block, group)?;
        let weight = get_piece(
            &vb,
            "weight",
            &[out_dim, in_dim],
            vec![(0..out_dim).collect(), range.clone().collect()],
            candle_nn::init::DEFAULT_KAIMING_NORMAL,
        )?;
        let bias = if cfg.bias {
            Some(vb.get_with_hints(out_dim, "bias", bias_hint(in_dim))?)
        } else {
            None
        };
        Ok(RowParallelLinear {
            local: candle_nn::Linear::new(weight, None),
            bias,
            group: group.clone(),
            in_features: in_dim,
            block: cfg.block,
            range,
            input_is_parallel: true,
        })
    }

    /// Whether the input arrives split on its last dim (a column-parallel output, the
    /// default) or whole, to be scattered here (backward all_gathers its gradient).
    pub fn with_input_is_parallel(mut self, parallel: bool) -> Self {
        self.input_is_parallel = parallel;
        self
    }

    /// This rank's columns of the weight, `[out, in_range().len()]`.
    pub fn weight(&self) -> &Tensor {
        self.local.weight()
    }

    /// The bias (the same on every rank).
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The global input features this rank's piece multiplies.
    pub fn in_range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The group.
    pub fn group(&self) -> &Group {
        &self.group
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = if self.input_is_parallel {
            x.clone()
        } else {
            let b = as_blocks(x, self.block)?;
            let dim = b.rank() - 2;
            from_blocks(&f::scatter_to_group(&b, &self.group, dim)?)?
        };
        let have = x.dim(candle_core::D::Minus1)?;
        if have != self.range.len() {
            return Err(candle_core::Error::wrap(ParallelError::Config(format!(
                "row-parallel linear (group {}, rank {}): the input has {have} features; this \
                 rank's piece takes features {:?} of {}",
                self.group.name(),
                self.group.rank(),
                self.range,
                self.in_features
            ))));
        }
        let y = f::reduce_from_group(&self.local.forward(&x)?, &self.group)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// An embedding split by vocabulary rows; see the module docs.
#[derive(Debug, Clone)]
pub struct VocabParallelEmbedding {
    weight: Tensor,
    vocab: usize,
    group: Group,
    range: Range<usize>,
}

impl VocabParallelEmbedding {
    /// Creates this rank's rows of `weight [vocab, hidden]` from `vb`, as
    /// `candle_nn::embedding(vocab, hidden, vb)` would create the whole table.
    ///
    /// # Errors
    ///
    /// A split leaving a rank without rows, or the `VarBuilder`'s error.
    pub fn new(vocab: usize, hidden: usize, group: &Group, vb: VarBuilder) -> Result<Self> {
        let what = format!("vocab-parallel embedding {}: vocabulary rows", vb.prefix());
        let range = split(&what, vocab, 1, group)?;
        let weight = get_piece(
            &vb,
            "weight",
            &[vocab, hidden],
            vec![range.clone().collect(), (0..hidden).collect()],
            Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        )?;
        Ok(VocabParallelEmbedding {
            weight,
            vocab,
            group: group.clone(),
            range,
        })
    }

    /// This rank's rows of the table.
    pub fn embeddings(&self) -> &Tensor {
        &self.weight
    }

    /// The vocabulary rows this rank holds.
    pub fn vocab_range(&self) -> Range<usize> {
        self.range.clone()
    }
}

impl Module for VocabParallelEmbedding {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        Ok(f::vocab_parallel_embedding(
            ids,
            &self.weight,
            self.vocab,
            &self.group,
        )?)
    }
}

/// `candle_nn::linear(in_dim, out_dim, vb)`, split by output features over `group`.
///
/// # Errors
///
/// As [`ColumnParallelLinear::new`].
pub fn column_parallel_linear(
    in_dim: usize,
    out_dim: usize,
    group: &Group,
    vb: VarBuilder,
) -> Result<ColumnParallelLinear> {
    ColumnParallelLinear::new(in_dim, out_dim, TpLinearConfig::default(), group, vb)
}

/// `candle_nn::linear_no_bias(in_dim, out_dim, vb)`, split by output features over `group`.
///
/// # Errors
///
/// As [`ColumnParallelLinear::new`].
pub fn column_parallel_linear_no_bias(
    in_dim: usize,
    out_dim: usize,
    group: &Group,
    vb: VarBuilder,
) -> Result<ColumnParallelLinear> {
    ColumnParallelLinear::new(in_dim, out_dim, TpLinearConfig::no_bias(), group, vb)
}

/// `candle_nn::linear(in_dim, out_dim, vb)`, split by input features over `group`.
///
/// # Errors
///
/// As [`RowParallelLinear::new`].
pub fn row_parallel_linear(
    in_dim: usize,
    out_dim: usize,
    group: &Group,
    vb: VarBuilder,
) -> Result<RowParallelLinear> {
    RowParallelLinear::new(in_dim, out_dim, TpLinearConfig::default(), group, vb)
}

/// `candle_nn::linear_no_bias(in_dim, out_dim, vb)`, split by input features over `group`.
///
/// # Errors
///
/// As [`RowParallelLinear::new`].
pub fn row_parallel_linear_no_bias(
    in_dim: usize,
    out_dim: usize,
    group: &Group,
    vb: VarBuilder,
) -> Result<RowParallelLinear> {
    RowParallelLinear::new(in_dim, out_dim, TpLinearConfig::no_bias(), group, vb)
}

/// `candle_nn::embedding(vocab, hidden, vb)`, split by vocabulary rows over `group`.
///
/// # Errors
///
/// As [`VocabParallelEmbedding::new`].
pub fn vocab_parallel_embedding(
    vocab: usize,
    hidden: usize,
    group: &Group,
    vb: VarBuilder,
) -> Result<VocabParallelEmbedding> {
    VocabParallelEmbedding::new(vocab, hidden, group, vb)
}
