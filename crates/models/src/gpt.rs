//! A GPT: token + position embedding, pre-norm blocks, final norm, LM head (tied or untied);
//! with [`GptConfig::moe`], every n-th block's MLP is a mixture of experts ([`crate::moe_layer`]).

use std::sync::Mutex;

use candle_core::{DType, Tensor};
use candle_dtensor_core::cp::{self, SeqLayout};
use candle_dtensor_core::{DTensor, Placement};
use candle_dtensor_mesh::DeviceMesh;

use candle_dtensor_parallel::fsdp::Fsdp;
use candle_dtensor_parallel::init::Init;
use candle_dtensor_parallel::moe::{MoeConfig, MoeGroups, MoeStats};
use candle_dtensor_parallel::params::ParamStore;
use candle_dtensor_parallel::tp_plan::{MeshRoles, TpPlan};

use crate::builder::Builder;
use crate::checkpoint::{checkpoint, AcMode};
use crate::error::{ModelError, Result};
use crate::layers::{
    Attention, Block, Embedding, FeedForward, LayerNorm, Linear, Mlp, Norm, RmsNorm,
};
use crate::moe_layer::MoeLayer;
use crate::precision::{self, Precision};

/// Which norm the blocks use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// LayerNorm with bias.
    LayerNorm,
    /// RMSNorm.
    RmsNorm,
}

/// GPT hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct GptConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Model width.
    pub d_model: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Transformer blocks.
    pub n_layers: usize,
    /// Context length (position embeddings).
    pub seq_len: usize,
    /// MLP hidden size as a multiple of `d_model`.
    pub mlp_ratio: usize,
    /// SwiGLU instead of GELU.
    pub swiglu: bool,
    /// Tie the LM head to the token embedding.
    pub tied: bool,
    /// Norm kind.
    pub norm: NormKind,
    /// Norm epsilon.
    pub eps: f64,
    /// Mixture-of-experts blocks (`None`: every block dense).
    pub moe: Option<MoeConfig>,
    /// Activation checkpointing of the blocks ([`AcMode`]; the presets: none). It changes
    /// what backward keeps and recomputes, never a value or a gradient.
    pub ac: AcMode,
    /// Mixed-precision policy ([`Precision`]; the presets: f32): which dtype each op computes
    /// in. The master weights stay in the build dtype either way.
    pub precision: Precision,
}

impl GptConfig {
    /// The `tiny` preset: vocab 512, d_model 256, 4 heads, seq 128, 1 block, 4x GELU MLP,
    /// pre-LayerNorm, untied head.
    pub fn tiny() -> Self {
        GptConfig {
            vocab: 512,
            d_model: 256,
            n_heads: 4,
            n_layers: 1,
            seq_len: 128,
            mlp_ratio: 4,
            swiglu: false,
            tied: false,
            norm: NormKind::LayerNorm,
            eps: 1e-5,
            moe: None,
            ac: AcMode::None,
            precision: Precision::F32,
        }
    }

    /// The `small` preset: vocab 1024, d_model 384, 8 heads, seq 128, 4 blocks.
    pub fn small() -> Self {
        GptConfig {
            vocab: 1024,
            d_model: 384,
            n_heads: 8,
            n_layers: 4,
            ..GptConfig::tiny()
        }
    }

    /// The `gpt2` preset: GPT-2 small's shape (124M parameters): vocabulary 50304 (50257
    /// padded to a multiple of 64, as nanoGPT does), width 768, 12 heads, 12 blocks, 1024
    /// positions, 4x GELU MLP, pre-LayerNorm, head tied to the token embedding.
    pub fn gpt2() -> Self {
        GptConfig {
            vocab: 50304,
            d_model: 768,
            n_heads: 12,
            n_layers: 12,
            seq_len: 1024,
            tied: true,
            ..GptConfig::tiny()
        }
    }

    /// The `gpt2-medium` preset: GPT-2 medium's shape (350M parameters): as [`Self::gpt2`]
    /// with width 1024, 16 heads and 24 blocks.
    pub fn gpt2_medium() -> Self {
        GptConfig {
            d_model: 1024,
            n_heads: 16,
            n_layers: 24,
            ..GptConfig::gpt2()
        }
    }

    /// The names [`Self::preset`] knows.
    pub const PRESETS: [&'static str; 4] = ["tiny", "small", "gpt2", "gpt2-medium"];

    /// A preset by name ([`Self::PRESETS`]).
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "small" => Ok(Self::small()),
            "gpt2" => Ok(Self::gpt2()),
            "gpt2-medium" => Ok(Self::gpt2_medium()),
            other => Err(ModelError::Config(format!(
                "unknown preset \"{other}\"; presets: {}",
                Self::PRESETS.join(", ")
            ))),
        }
    }

    /// Checks the shape can be built: every size at least 1, the width divisible by the
    /// heads, and, for `tp` tensor-parallel ranks, the heads and the vocabulary divisible by
    /// `tp`. The error names the field, the values and the rule.
    pub fn validate(&self, tp: usize) -> Result<()> {
        let bad = |m: String| Err(ModelError::Config(m));
        for (field, v) in [
            ("vocab", self.vocab),
            ("d_model (width)", self.d_model),
            ("n_heads (heads)", self.n_heads),
            ("n_layers (layers)", self.n_layers),
            ("seq_len", self.seq_len),
            ("mlp_ratio", self.mlp_ratio),
        ] {
            if v == 0 {
                return bad(format!("model: {field} = 0 (rule: at least 1)"));
            }
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return bad(format!(
                "model: width {} is not divisible by the {} heads (rule: width % heads == 0)",
                self.d_model, self.n_heads
            ));
        }
        let tp = tp.max(1);
        if !self.n_heads.is_multiple_of(tp) {
            return bad(format!(
                "model: tp={tp} does not divide the {} attention heads (rule: heads % tp == 0)",
                self.n_heads
            ));
        }
        if !self.vocab.is_multiple_of(tp) {
            return bad(format!(
                "model: tp={tp} does not divide the vocabulary of {} (rule: vocab % tp == 0)",
                self.vocab
            ));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!(
                "model: norm eps {} is not a finite number > 0",
                self.eps
            ));
        }
        Ok(())
    }
}

/// How a forward pass lays the sequence over the `cp` mesh dim.
struct CpPlan {
    dim: usize,
    n: usize,
    layout: SeqLayout,
    /// The stored order: position of each stored token.
    order: Vec<usize>,
}

/// The GPT; see the module docs.
pub struct Gpt {
    /// Hyper-parameters.
    pub cfg: GptConfig,
    /// Token embedding.
    pub tok_emb: Embedding,
    /// Position embedding `[seq_len, D]` (replicated).
    pub pos_emb: DTensor,
    /// The blocks.
    pub blocks: Vec<Block>,
    /// Final norm.
    pub ln_f: Norm,
    /// Untied LM head `[V, D]`.
    pub head: Option<Linear>,
    roles: MeshRoles,
    plan: TpPlan,
    fsdp: Option<Fsdp>,
    /// FSDP units: the embeddings, each block, the final norm and head.
    block_units: Vec<usize>,
    embed_unit: Option<usize>,
    head_unit: Option<usize>,
    /// The load-balancing loss of the last [`Gpt::loss`] (summed over the MoE blocks).
    last_aux: Mutex<Option<DTensor>>,
    /// The master weights' dtype (the activations' between ops under [`GptConfig::precision`]).
    dtype: DType,
}

/// The configured norm `name` (shared with the pipeline stages, `gpt_pp`).
pub(crate) fn norm(b: &mut Builder, name: &str, cfg: &GptConfig) -> Result<Norm> {
    Ok(match cfg.norm {
        NormKind::LayerNorm => Norm::Layer(LayerNorm::new(b, name, cfg.d_model, true, cfg.eps)?),
        NormKind::RmsNorm => Norm::Rms(RmsNorm::new(b, name, cfg.d_model, cfg.eps)?),
    })
}

/// Initialisation scale of the weights, and of the output projections (scaled by the whole
/// model's depth, GPT-2's residual scaling).
pub(crate) fn init_stds(cfg: &GptConfig) -> (f64, f64) {
    (0.02, 0.02 / ((2 * cfg.n_layers.max(1)) as f64).sqrt())
}

/// Block `i` (`blocks.{i}.ln1`, `.attn`, `.ln2`, then its feed-forward from `ff`, given the
/// block's name prefix), its parameters created in that order (shared with `gpt_pp`).
pub(crate) fn block(
    b: &mut Builder,
    cfg: &GptConfig,
    i: usize,
    ff: impl FnOnce(&mut Builder, &str) -> Result<FeedForward>,
) -> Result<Block> {
    let (std, proj_std) = init_stds(cfg);
    let p = format!("blocks.{i}");
    Ok(Block {
        ln1: norm(b, &format!("{p}.ln1"), cfg)?,
        attn: Attention::new(
            b,
            &format!("{p}.attn"),
            cfg.d_model,
            cfg.n_heads,
            std,
            proj_std,
        )?,
        ln2: norm(b, &format!("{p}.ln2"), cfg)?,
        mlp: ff(b, &p)?,
    })
}

/// The dense feed-forward of the block named `p`.
pub(crate) fn dense_ff(b: &mut Builder, cfg: &GptConfig, p: &str) -> Result<FeedForward> {
    let (std, proj_std) = init_stds(cfg);
    Ok(FeedForward::Dense(Mlp::new(
        b,
        &format!("{p}.mlp"),
        cfg.d_model,
        cfg.mlp_ratio * cfg.d_model,
        cfg.swiglu,
        std,
        proj_std,
    )?))
}

/// Logits `[B, T, V]` of the final hidden states `x`: the untied `head`, or the token table
/// `tok` tied (replicated over tp), the head first; replicated over tp unless the plan is loss-parallel
/// (shared with `gpt_pp`).
pub(crate) fn lm_logits(
    x: &DTensor,
    head: Option<&Linear>,
    tok: Option<&Embedding>,
    roles: &MeshRoles,
    plan: &TpPlan,
) -> Result<DTensor> {
    lm_logits_to(x, head, tok, roles, plan, None)
}

/// [`lm_logits`] with the logits in `out` (`None`: `x`'s dtype).
fn lm_logits_to(
    x: &DTensor,
    head: Option<&Linear>,
    tok: Option<&Embedding>,
    roles: &MeshRoles,
    plan: &TpPlan,
    out: Option<DType>,
) -> Result<DTensor> {
    let logits = match (head, tok, out) {
        (Some(h), _, None) => h.forward(x)?,
        (Some(h), _, Some(dt)) => h.forward_to(x, dt)?,
        (None, Some(tok), _) => {
            let layout = roles.with_tp(x.placements(), Placement::Replicate);
            match out {
                Some(dt) => precision::linear_to(x, &tok.weight, None, Some(&layout), dt)?,
                None => precision::linear(x, &tok.weight, None, Some(&layout))?,
            }
        }
        (None, None, _) => {
            return Err(ModelError::Config(
                "the LM head: neither an untied head nor the token table to tie".into(),
            ))
        }
    };
    if !plan.loss_parallel && roles.tp.is_some() {
        return Ok(logits.redistribute(&roles.with_tp(logits.placements(), Placement::Replicate))?);
    }
    Ok(logits)
}

impl Gpt {
    /// Builds the model on `mesh` with `plan`, initialised from `seed` (the same global values
    /// on any mesh). Returns the model and its parameter store.
    pub fn new(
        cfg: &GptConfig,
        mesh: &DeviceMesh,
        plan: &TpPlan,
        seed: u64,
        dtype: DType,
    ) -> Result<(Gpt, ParamStore)> {
        Self::build(cfg, mesh, plan, seed, dtype, None)
    }

    /// Like [`Gpt::new`], with the parameters sharded by `fsdp` (one unit per block plus a root
    /// unit for the embeddings, final norm and head).
    pub fn build(
        cfg: &GptConfig,
        mesh: &DeviceMesh,
        plan: &TpPlan,
        seed: u64,
        dtype: DType,
        fsdp: Option<&Fsdp>,
    ) -> Result<(Gpt, ParamStore)> {
        let mut store = ParamStore::new(mesh, seed, dtype);
        // FSDP units in forward order: the embeddings, one per block, then the final norm and
        // head (kept after forward: backward starts there). A tied head needs the token table
        // at both ends, so then embeddings and head form one kept unit.
        let embed_unit =
            fsdp.map(|f| f.add_unit(if cfg.tied { "root" } else { "embed" }, cfg.tied));
        if let (Some(f), Some(u)) = (fsdp, embed_unit) {
            store = store.with_fsdp(f.clone(), u);
        }
        let mut block_units = Vec::new();
        let roles = MeshRoles::of(mesh)?;
        let dense_hidden = cfg.mlp_ratio * cfg.d_model;
        let moe = cfg
            .moe
            .as_ref()
            .filter(|m| (0..cfg.n_layers).any(|i| m.is_moe_block(i)));
        let groups = match moe {
            Some(m) => Some(MoeGroups::new(
                mesh,
                m,
                cfg.d_model,
                m.expert_hidden(dense_hidden),
            )?),
            None => None,
        };
        let gpt = {
            let mut b = Builder {
                store: &mut store,
                roles: roles.clone(),
                plan: plan.clone(),
            };
            let (std, proj_std) = init_stds(cfg);
            let tok_emb = Embedding::new(&mut b, "tok_emb", cfg.vocab, cfg.d_model, std)?;
            let pp = b
                .roles
                .placements(Placement::Replicate, Placement::Replicate)
                .to_vec();
            let pos_emb = b.store.param(
                "pos_emb.weight",
                &[cfg.seq_len, cfg.d_model],
                Init::Normal(std),
                &pp,
            )?;
            let mut blocks = Vec::with_capacity(cfg.n_layers);
            for i in 0..cfg.n_layers {
                if let Some(f) = fsdp {
                    let u = f.add_unit(&format!("blocks.{i}"), false);
                    b.store.set_unit(u);
                    block_units.push(u);
                }
                blocks.push(block(&mut b, cfg, i, |b, p| match (moe, &groups) {
                    (Some(m), Some(g)) if m.is_moe_block(i) => {
                        Ok(FeedForward::Moe(Box::new(MoeLayer::new(
                            b,
                            &format!("{p}.moe"),
                            i as u32,
                            g,
                            cfg.d_model,
                            m.expert_hidden(dense_hidden),
                            cfg.swiglu,
                            std,
                            proj_std,
                        )?)))
                    }
                    _ => dense_ff(b, cfg, p),
                })?);
            }
            let head_unit = match (fsdp, embed_unit) {
                (Some(_), Some(u)) if cfg.tied => Some(u),
                (Some(f), _) => Some(f.add_unit("head", true)),
                _ => None,
            };
            if let Some(u) = head_unit {
                b.store.set_unit(u);
            }
            let ln_f = norm(&mut b, "ln_f", cfg)?;
            let head = if cfg.tied {
                None
            } else {
                Some(Linear::new(
                    &mut b,
                    "lm_head",
                    cfg.d_model,
                    cfg.vocab,
                    false,
                    std,
                )?)
            };
            Gpt {
                cfg: cfg.clone(),
                tok_emb,
                pos_emb,
                blocks,
                ln_f,
                head,
                roles,
                plan: plan.clone(),
                fsdp: fsdp.cloned(),
                block_units,
                embed_unit,
                head_unit,
                last_aux: Mutex::new(None),
                dtype,
            }
        };
        // The forward drives every unit: nothing needs to stay gathered until first use.
        if let Some(f) = fsdp {
            f.reshard_all()?;
        }
        Ok((gpt, store))
    }

    /// The mesh roles.
    pub fn roles(&self) -> &MeshRoles {
        &self.roles
    }

    /// Placements of a `[B, T]` batch of ids: batch sharded over the data dims, Replicate on
    /// the tensor-parallel dim.
    pub fn batch_placements(&self) -> Vec<Placement> {
        self.roles
            .placements(Placement::Replicate, Placement::Shard(0))
            .to_vec()
    }

    /// The mixture-of-experts layers, in block order.
    pub fn moe_layers(&self) -> impl Iterator<Item = &MoeLayer> {
        self.blocks.iter().filter_map(|b| b.mlp.moe())
    }

    /// What each mixture-of-experts layer measured since the last call (block order).
    pub fn take_moe_stats(&self) -> Vec<MoeStats> {
        self.moe_layers().map(MoeLayer::take_stats).collect()
    }

    /// The load-balancing loss (summed over the mixture-of-experts blocks) of the last
    /// [`Gpt::loss`], if it had one (a scalar, possibly `Partial`).
    pub fn last_aux_loss(&self) -> Option<DTensor> {
        self.last_aux
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Logits `[B, T, V]` for ids `[B, T]` (vocab-sharded under tensor parallelism with
    /// loss-parallel; replicated otherwise).
    ///
    /// With a `cp` mesh dim the sequence is sharded over it (see [`Gpt::forward_aux`]); the
    /// logits come back in the natural order of `ids`.
    pub fn forward(&self, ids: &DTensor) -> Result<DTensor> {
        let logits = self.forward_aux(ids)?.0;
        match self.context_parallel(ids)? {
            Some(cp) if cp.layout == SeqLayout::LoadBalanced => {
                let t = ids.dim(1)?;
                let mut inv = vec![0u32; t];
                for (i, &p) in cp.order.iter().enumerate() {
                    inv[p] = i as u32;
                }
                Ok(logits.index_select(&self.replicated_ids(&inv, ids)?, 1)?)
            }
            _ => Ok(logits),
        }
    }

    /// The context-parallel layout for ids `[B, T]` on a mesh with a `cp` dim of size > 1:
    /// load-balanced when `2 x cp` divides `T`, else contiguous.
    fn context_parallel(&self, ids: &DTensor) -> Result<Option<CpPlan>> {
        let Some(d) = self.roles.cp else {
            return Ok(None);
        };
        let n = ids.mesh().shape()[d];
        if n <= 1 {
            return Ok(None);
        }
        let t = ids.dim(1)?;
        let layout = if t % (2 * n) == 0 {
            SeqLayout::LoadBalanced
        } else {
            SeqLayout::Contiguous
        };
        let order = match layout {
            SeqLayout::LoadBalanced => cp::load_balanced_order(t, n)?,
            SeqLayout::Contiguous => {
                // Every rank holds part of the sequence (checked, typed).
                cp::positions("gpt", t, n, 0, layout)?;
                (0..t).collect()
            }
        };
        Ok(Some(CpPlan {
            dim: d,
            n,
            layout,
            order,
        }))
    }

    /// `v` as a replicated u32 DTensor on `like`'s mesh.
    fn replicated_ids(&self, v: &[u32], like: &DTensor) -> Result<DTensor> {
        let t = Tensor::new(v, like.to_local().device())?;
        let pl = vec![Placement::Replicate; like.mesh().ndim()];
        Ok(candle_dtensor_core::distribute_tensor(
            &t,
            like.mesh(),
            &pl,
        )?)
    }

    /// `x [B, T, ..]` in the context-parallel stored order, sharded on the sequence over `cp`.
    fn to_stored(&self, x: &DTensor, cp: &CpPlan) -> Result<DTensor> {
        let x = if cp.layout == SeqLayout::LoadBalanced {
            let order: Vec<u32> = cp.order.iter().map(|&i| i as u32).collect();
            x.index_select(&self.replicated_ids(&order, x)?, 1)?
        } else {
            x.clone()
        };
        let mut pl = x.placements().to_vec();
        pl[cp.dim] = Placement::Shard(1);
        Ok(x.redistribute(&pl)?)
    }

    /// [`Gpt::forward`] and the load-balancing loss of the mixture-of-experts blocks (summed;
    /// `None` without them).
    ///
    /// Context parallelism: on a mesh with a `cp` dim (of size > 1) the ids are stored in the
    /// load-balanced order when `2 x cp` divides `T` (rank `i` holds chunks `i` and `2cp-1-i`),
    /// contiguously otherwise, and sharded on the sequence over `cp`; positions follow, and
    /// attention runs context-parallel (`candle_dtensor_core::cp`). The logits returned here
    /// are in that stored order ([`Gpt::forward`] restores the natural one; [`Gpt::loss`]
    /// stores the targets alike, the mean being order-free).
    pub fn forward_aux(&self, ids: &DTensor) -> Result<(DTensor, Option<DTensor>)> {
        self.forward_logits(ids, false)
    }

    /// [`Gpt::forward_aux`]; with `loss_logits`, the logits in the dtype the loss reads
    /// ([`Gpt::loss`]): under the bf16 policy on CUDA, where the fused cross-entropy takes
    /// them (logits not sharded on the vocabulary), bf16 as the LM head's GEMM makes them
    /// (autocast's: no f32 copy of the `[B, T, V]` logits, and a bf16 gradient into the
    /// head's backward); in the master dtype otherwise.
    fn forward_logits(
        &self,
        ids: &DTensor,
        loss_logits: bool,
    ) -> Result<(DTensor, Option<DTensor>)> {
        let _precision = precision::scope(self.cfg.precision, self.dtype);
        let t = ids.dim(1)?;
        if t > self.cfg.seq_len {
            return Err(ModelError::Config(format!(
                "sequence of {t} tokens exceeds the context length {}",
                self.cfg.seq_len
            )));
        }
        let cp_plan = self.context_parallel(ids)?;
        let _cp_scope = cp_plan.as_ref().map(|c| cp::layout_scope(c.layout, c.n));
        let stored;
        let ids = match &cp_plan {
            Some(c) => {
                stored = self.to_stored(ids, c)?;
                &stored
            }
            None => ids,
        };
        if let (Some(f), Some(u)) = (&self.fsdp, self.embed_unit) {
            f.pre_forward(u)?;
        }
        let mut x = {
            let _l = candle_dtensor_core::debug::label("embed");
            let x = self.tok_emb.forward(ids)?;
            let pos = self.pos_emb.narrow(0, 0, t)?;
            let pos = match &cp_plan {
                Some(c) if c.layout == SeqLayout::LoadBalanced => {
                    // Each rank selects its own rows (the order sharded like the sequence):
                    // no full [T, D] copy of the positions per rank.
                    let order: Vec<u32> = c.order.iter().map(|&i| i as u32).collect();
                    let order = Tensor::new(order.as_slice(), pos.to_local().device())?;
                    let mut pl = vec![Placement::Replicate; pos.mesh().ndim()];
                    pl[c.dim] = Placement::Shard(0);
                    let order = candle_dtensor_core::distribute_tensor(&order, pos.mesh(), &pl)?;
                    pos.index_select(&order, 0)?
                }
                _ => pos,
            };
            x.add(&precision::to_master(&pos)?)?
        };
        if let (Some(f), Some(u)) = (&self.fsdp, self.embed_unit) {
            let local = f.post_forward(u, x.to_local())?;
            x = DTensor::from_local_with_shape(&local, x.mesh(), x.placements(), x.shape())?;
        }
        let mut aux: Option<DTensor> = None;
        let mut add_aux = |a: Option<DTensor>| -> Result<()> {
            if let Some(a) = a {
                aux = Some(match aux.take() {
                    Some(s) => s.add(&a)?,
                    None => a,
                });
            }
            Ok(())
        };
        for (i, blk) in self.blocks.iter().enumerate() {
            let _l = candle_dtensor_core::debug::label(&format!("blocks.{i}"));
            match (&self.fsdp, self.block_units.get(i)) {
                (Some(f), Some(&u)) => {
                    f.pre_forward(u)?;
                    let (y, a) = self.block_forward(i, blk, &x)?;
                    add_aux(a)?;
                    let local = f.post_forward(u, y.to_local())?;
                    x = DTensor::from_local_with_shape(
                        &local,
                        y.mesh(),
                        y.placements(),
                        y.shape(),
                    )?;
                }
                _ => {
                    let (y, a) = self.block_forward(i, blk, &x)?;
                    add_aux(a)?;
                    x = y;
                }
            }
        }
        let _l = candle_dtensor_core::debug::label("head");
        if let (Some(f), Some(u)) = (&self.fsdp, self.head_unit) {
            if Some(u) != self.embed_unit {
                f.pre_forward(u)?;
            }
        }
        let x = self.ln_f.forward(&x)?;
        let vocab_sharded = self.plan.loss_parallel && self.roles.tp.is_some();
        let out = precision::activation_dtype().filter(|_| {
            loss_logits
                && !vocab_sharded
                && x.to_local().device().is_cuda()
                && candle_dtensor_core::fused::cuda_enabled()
        });
        let logits = lm_logits_to(
            &x,
            self.head.as_ref(),
            Some(&self.tok_emb),
            &self.roles,
            &self.plan,
            out,
        )?;
        Ok((logits, aux))
    }

    /// Block `i`'s forward, under [`checkpoint`] where [`GptConfig::ac`] says so for its rank
    /// among the dense blocks (mixture-of-experts blocks are not checkpointed: their routing
    /// statistics would be counted twice).
    fn block_forward(
        &self,
        i: usize,
        blk: &Block,
        x: &DTensor,
    ) -> Result<(DTensor, Option<DTensor>)> {
        // The policy counts dense blocks only (mixture-of-experts blocks are never checkpointed).
        let dense = self.blocks[..i]
            .iter()
            .filter(|b| b.mlp.dense().is_some())
            .count();
        match blk.dense_copy() {
            Some(b) if self.cfg.ac.checkpoints(dense) => {
                let label = format!("blocks.{i}");
                // The recompute (in backward, outside this forward's scope) runs under the
                // same precision policy as the forward it replays.
                let (p, dt) = (self.cfg.precision, self.dtype);
                let y = checkpoint(x, Some(&label), move |x| {
                    let _precision = precision::scope(p, dt);
                    b.forward(x)
                })?;
                Ok((y, None))
            }
            _ => blk.forward_aux(x),
        }
    }

    /// Mean next-token cross-entropy of ids `[B, T]` against targets `[B, T]`, plus the
    /// mixture-of-experts blocks' load-balancing loss ([`Gpt::last_aux_loss`]).
    pub fn loss(&self, ids: &DTensor, targets: &DTensor) -> Result<DTensor> {
        let (logits, aux) = self.forward_logits(ids, true)?;
        let stored;
        let cp_plan = self.context_parallel(ids)?;
        let targets = match &cp_plan {
            Some(c) => {
                stored = self.to_stored(targets, c)?;
                &stored
            }
            None => targets,
        };
        let _l = candle_dtensor_core::debug::label("loss");
        // Loss-parallel: keep the logits where they are (sharded on the vocab dim). Context
        // parallelism: keep them on their rows too (in the stored order, as the targets are).
        let keep = self.plan.loss_parallel || cp_plan.is_some();
        let ce = token_loss(&logits, targets, keep)?;
        *self.last_aux.lock().unwrap_or_else(|e| e.into_inner()) = aux.clone();
        match aux {
            Some(a) => {
                let _l = candle_dtensor_core::debug::label("moe_aux");
                Ok(ce.add(&a)?)
            }
            None => Ok(ce),
        }
    }
}

/// The mean next-token cross-entropy of `logits [B, T, V]` against `targets [B, T]`: the
/// dispatched `cross_entropy` on the logits as the head made them (no `[B T, V]` reshape, whose
/// backward would zero-fill and add a gradient of the logits' size, the step's largest tensor:
/// 0.8 GB for GPT-2 at 8 x 1024 in bf16). Its strategies take rows sharded on the batch or the
/// sequence (a partial sum over the global count, uneven and empty shards included) or the
/// vocabulary (loss-parallel). With `keep`, the logits stay on their placements (loss-parallel,
/// context parallelism's stored order).
///
/// Mixed precision: the loss in f32. The fused cross-entropy computes it in f32 from bf16
/// logits (on CUDA, the vocabulary not sharded); anything else takes f32 logits.
pub(crate) fn token_loss(logits: &DTensor, targets: &DTensor, keep: bool) -> Result<DTensor> {
    let fused_bf16 = logits.dtype() == DType::BF16
        && candle_dtensor_core::fused::cross_entropy_applies(logits.to_local())
        && !logits.is_sharded_on(2);
    let cast;
    let logits = if logits.dtype() == DType::F32 || fused_bf16 {
        logits
    } else {
        cast = logits.to_dtype(DType::F32)?;
        &cast
    };
    let layout = keep.then(|| logits.placements().to_vec());
    Ok(logits.cross_entropy_with_layout(targets, layout.as_deref())?)
}

#[cfg(test)]
mod preset_tests {
    use super::*;

    #[test]
    fn presets_and_their_shapes() {
        for name in GptConfig::PRESETS {
            let c = GptConfig::preset(name).unwrap();
            c.validate(1).unwrap();
        }
        let g = GptConfig::preset("gpt2").unwrap();
        assert_eq!(
            (g.vocab, g.d_model, g.n_heads, g.n_layers, g.seq_len),
            (50304, 768, 12, 12, 1024)
        );
        assert!(g.tied);
        let m = GptConfig::preset("gpt2-medium").unwrap();
        assert_eq!((m.d_model, m.n_heads, m.n_layers), (1024, 16, 24));
        let e = GptConfig::preset("gpt3").unwrap_err().to_string();
        assert!(e.contains("gpt2-medium"), "{e}");
    }

    #[test]
    fn validate_names_the_field_and_rule() {
        let bad = |c: GptConfig, tp: usize| c.validate(tp).unwrap_err().to_string();
        let e = bad(
            GptConfig {
                d_model: 250,
                ..GptConfig::tiny()
            },
            1,
        );
        assert!(e.contains("width 250") && e.contains("4 heads"), "{e}");
        let e = bad(
            GptConfig {
                n_heads: 6,
                d_model: 252,
                ..GptConfig::tiny()
            },
            4,
        );
        assert!(e.contains("tp=4") && e.contains("6 attention heads"), "{e}");
        let e = bad(
            GptConfig {
                vocab: 510,
                ..GptConfig::tiny()
            },
            4,
        );
        assert!(e.contains("vocabulary of 510"), "{e}");
        let e = bad(
            GptConfig {
                n_layers: 0,
                ..GptConfig::tiny()
            },
            1,
        );
        assert!(e.contains("n_layers (layers) = 0"), "{e}");
        GptConfig::gpt2().validate(4).unwrap();
    }
}

#[cfg(test)]
mod token_loss_tests {
    use super::*;
    use candle_core::{Device, Var};
    use candle_dtensor_comm::LocalWorld;
    use candle_dtensor_core::distribute_tensor;
    use std::time::Duration;

    type R<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

    /// The loss (its global value) and the whole logits' gradient.
    type Seen = (f32, Vec<f32>);

    /// A mesh, the logits' placements, the batch and the sequence length.
    type Case = (Vec<(&'static str, usize)>, Vec<Placement>, usize, usize);

    const V: usize = 8;

    fn data(b: usize, t: usize) -> R<(Tensor, Tensor)> {
        let x: Vec<f32> = (0..b * t * V)
            .map(|i| ((i * 7919 % 613) as f32 / 613.0 - 0.5) * 4.0)
            .collect();
        let ids: Vec<u32> = (0..b * t).map(|i| (i * 31 % V) as u32).collect();
        Ok((
            Tensor::from_vec(x, (b, t, V), &Device::Cpu)?,
            Tensor::from_vec(ids, (b, t), &Device::Cpu)?,
        ))
    }

    /// One device: the mean of `-log_softmax` at the targets, and its gradient.
    fn single_device(b: usize, t: usize) -> R<Seen> {
        let (x, ids) = data(b, t)?;
        let var = Var::from_tensor(&x)?;
        let lsm = candle_nn::ops::log_softmax(var.as_tensor(), 2)?;
        let loss = lsm.gather(&ids.unsqueeze(2)?, 2)?.neg()?.mean_all()?;
        let g = loss.backward()?;
        let g = g.get(var.as_tensor()).ok_or("no gradient")?;
        Ok((loss.to_scalar()?, g.flatten_all()?.to_vec1()?))
    }

    /// The loss of logits `[b, t, V]` placed by `pl` (targets on the same rows, replicated on
    /// a vocabulary shard): through `token_loss` on the 3-D logits (`flat` false) or through
    /// the `[b t, V]` reshape the model used before (`flat` true).
    fn on_mesh(mesh: &DeviceMesh, pl: &[Placement], (b, t): (usize, usize), flat: bool) -> R<Seen> {
        let (full, ids) = data(b, t)?;
        let tpl: Vec<Placement> = pl
            .iter()
            .map(|p| match p {
                Placement::Shard(2) => Placement::Replicate,
                _ => *p,
            })
            .collect();
        let targets = distribute_tensor(&ids, mesh, &tpl)?;
        let var = Var::from_tensor(distribute_tensor(&full, mesh, pl)?.to_local())?;
        let logits = DTensor::from_local_with_shape(var.as_tensor(), mesh, pl, full.dims())?;
        let keep = pl.iter().any(|p| p.shard_dim().is_some_and(|d| d > 0));
        let ce = if flat {
            logits
                .reshape(&[b * t, V])?
                .cross_entropy(&targets.reshape(&[b * t])?)?
        } else {
            token_loss(&logits, &targets, keep)?
        };
        let loss = ce.redistribute(&vec![Placement::Replicate; pl.len()])?;
        let grads = loss.to_local().backward()?;
        let g = grads
            .get(var.as_tensor())
            .cloned()
            .unwrap_or(var.as_tensor().zeros_like()?);
        let g = DTensor::from_local_with_shape(&g, mesh, pl, full.dims())?.full_tensor()?;
        Ok((
            loss.to_local().to_scalar::<f32>()?,
            g.flatten_all()?.to_vec1()?,
        ))
    }

    /// The loss of `[B, T, V]` logits without a reshape equals one device's (value and
    /// gradient) on every layout the model makes: one rank, batch shards even, uneven and
    /// empty (torch.chunk leaves rank 3 no rows of 9), replicated rows, a vocabulary shard,
    /// sequence shards (context parallelism) alone and beside batch shards. Where the
    /// flattening reshape moved nothing (even batch shards, one rank, replicated rows), it is
    /// also the reshaped loss to the bit.
    #[test]
    fn token_loss_is_one_devices_loss() {
        let (s, r) = (Placement::Shard, Placement::Replicate);
        let cases: Vec<Case> = vec![
            (vec![("dp", 1)], vec![s(0)], 4, 3),
            (vec![("dp", 2)], vec![s(0)], 4, 3),
            (vec![("dp", 2)], vec![s(0)], 3, 3),
            (vec![("dp", 4)], vec![s(0)], 9, 3),
            (vec![("dp", 4)], vec![s(0)], 2, 3),
            (vec![("dp", 2), ("tp", 1)], vec![s(0), r], 5, 3),
            (vec![("dp", 2)], vec![r], 4, 3),
            (vec![("tp", 2)], vec![s(2)], 4, 3),
            (vec![("dp", 2), ("tp", 2)], vec![s(0), s(2)], 3, 3),
            (vec![("cp", 2)], vec![s(1)], 2, 6),
            (vec![("dp", 2), ("cp", 2)], vec![s(0), s(1)], 3, 5),
        ];
        for (dims, pl, b, t) in cases {
            let world: usize = dims.iter().map(|d| d.1).product();
            let what = format!("{dims:?} {pl:?} [{b}, {t}, {V}]");
            let (want, want_g) = single_device(b, t).unwrap();
            let outs = LocalWorld::new(world)
                .with_timeout(Duration::from_secs(60))
                .launch(|comm| -> R<[Seen; 2]> {
                    let mesh = DeviceMesh::new(comm, &dims)?;
                    Ok([
                        on_mesh(&mesh, &pl, (b, t), false)?,
                        on_mesh(&mesh, &pl, (b, t), true)?,
                    ])
                })
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let moved_nothing = pl
                .iter()
                .zip(&dims)
                .all(|(p, d)| d.1 == 1 || *p == r || (*p == s(0) && b % d.1 == 0));
            for [(l, g), (l2, g2)] in outs {
                assert!(
                    l.is_finite() && (l - want).abs() <= 1e-6 * want.abs(),
                    "{what}: loss {l} vs one device's {want}"
                );
                for (a, w) in g.iter().zip(&want_g) {
                    assert!((a - w).abs() <= 1e-6, "{what}: gradient {a} vs {w}");
                }
                if moved_nothing {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(l.to_bits(), l2.to_bits(), "{what}: loss {l} vs {l2}");
                    assert_eq!(bits(&g), bits(&g2), "{what}: gradient");
                }
            }
        }
    }
}
