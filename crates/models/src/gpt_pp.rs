//! The [`Gpt`](crate::Gpt) as pipeline stages: one stage holds a contiguous run of blocks, the
//! first stage also the token and position embeddings, the last also the final norm and the
//! LM head (and computes the loss).
//!
//! A stage builds only its own parameters, under the same names as the one-device model
//! (`tok_emb.weight`, `blocks.{i}.…`, `ln_f.…`, `lm_head.weight`) and with the same
//! initialisation scales (the output projections' scale uses the whole model's block count).
//! Every parameter's value is a function of `(seed, name, index)` ([`candle_dtensor_parallel::init`]),
//! so a stage's parameters equal the corresponding ones of [`Gpt::new`](crate::Gpt::new) with
//! the same seed.
//!
//! A tied LM head: the last stage holds its own copy of the token table (`tok_emb.weight`, the
//! same initial values as the first stage's) and uses it as the head; the trainer keeps the
//! copies equal by summing their gradients between the first and the last stage before every
//! update (`candle_dtensor_train::pipeline` does). A single stage (first and last) uses one
//! table for both.
//!
//! Activation checkpointing ([`GptConfig::ac`]) applies to the stage's dense blocks by their
//! rank among the whole model's dense blocks, as in [`Gpt`](crate::Gpt) (`full`: every dense
//! block; `selective`: every other one); mixture-of-experts blocks are never checkpointed.
//!
//! Tensor parallelism inside a stage: build it on a mesh with a `tp` dim and the plan
//! ([`TpPlan::gpt`] without sequence parallelism); the hidden states between stages are then
//! replicated over `tp`, so each tensor-parallel rank exchanges the whole activation with its
//! counterpart in the neighbouring stage.
//!
//! Mixture-of-experts blocks ([`GptConfig::moe`], built with [`GptStage::with_moe`]): the
//! stage's MoE blocks are the one-device model's ([`MoeLayer`], same names and values), their
//! experts sharded over the stage mesh's `ep` dim when it has one (the batch then sharded over
//! `ep` too, `Shard(0)`, as the one-device model's data dims shard it); each forward routes
//! the micro-batch's tokens through the given [`MoeGroups`] (count exchange over its data
//! dims, dispatch and combine over `ep`) and returns the stage's load-balancing loss
//! ([`GptStage::forward_aux`]). The layers reduce no expert gradient over data dims other
//! than `ep` ([`MoeLayer::without_grad_sync`]): the pipeline trainer sums every gradient over
//! `dp` once per step.
//!
//! Not covered (refused with [`ModelError::Unsupported`]): mixture-of-experts blocks in a
//! tensor-parallel stage, and context or sequence parallelism inside a stage.

use std::ops::Range;
use std::sync::Arc;

use candle_core::DType;
use candle_dtensor_core::{DTensor, Placement};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_parallel::init::Init;
use candle_dtensor_parallel::moe::MoeGroups;
use candle_dtensor_parallel::params::ParamStore;
use candle_dtensor_parallel::tp_plan::{MeshRoles, TpPlan};

use crate::builder::Builder;
use crate::checkpoint::checkpoint;
use crate::error::{ModelError, Result};
use crate::gpt::{block, dense_ff, init_stds, lm_logits, norm, GptConfig};
use crate::layers::{Block, Embedding, FeedForward, Linear, Norm};
use crate::moe_layer::MoeLayer;

/// What a stage's forward starts from.
pub enum StageInput<'a> {
    /// Token ids `[B, T]` (the first stage).
    Ids(&'a DTensor),
    /// The previous stage's hidden states `[B, T, D]`.
    Hidden(&'a DTensor),
}

/// One pipeline stage of the GPT; see the module docs.
pub struct GptStage {
    /// Hyper-parameters of the whole model.
    pub cfg: GptConfig,
    /// This stage's index (`0..stages`).
    pub stage: usize,
    /// Stages in all.
    pub stages: usize,
    /// The blocks this stage holds (global block indices).
    pub layers: Range<usize>,
    /// Token embedding: on the first stage, and on the last with a tied head (its copy).
    pub tok_emb: Option<Embedding>,
    /// Position embedding `[seq_len, D]` (first stage only).
    pub pos_emb: Option<DTensor>,
    /// The stage's blocks, in order (`layers`).
    pub blocks: Vec<Block>,
    /// Final norm (last stage only).
    pub ln_f: Option<Norm>,
    /// Untied LM head `[V, D]` (last stage only).
    pub head: Option<Linear>,
    roles: MeshRoles,
    plan: TpPlan,
    /// The master weights' dtype (the activations' between ops under the precision policy).
    dtype: DType,
}

impl GptStage {
    /// Checks that `cfg` can be split into pipeline stages ([`GptConfig::validate`]).
    ///
    /// # Errors
    ///
    /// [`GptConfig::validate`]'s errors.
    pub fn check_config(cfg: &GptConfig) -> Result<()> {
        cfg.validate(1)
    }

    /// Whether block `i` of `cfg` is a mixture of experts.
    fn is_moe(cfg: &GptConfig, i: usize) -> bool {
        cfg.moe.as_ref().is_some_and(|m| m.is_moe_block(i))
    }

    /// Whether `cfg` has any mixture-of-experts block (a stage of it needs [`MoeGroups`]).
    pub fn has_moe(cfg: &GptConfig) -> bool {
        (0..cfg.n_layers).any(|i| Self::is_moe(cfg, i))
    }

    /// Global parameter count of each block (for
    /// [`split_balanced`](candle_dtensor_parallel::pipeline::split_balanced)): a dense block
    /// counted by building one into a scratch store on `mesh` (every dense block has the same
    /// shapes); a mixture-of-experts block as that block with its dense MLP replaced by the
    /// router `[E, D]` and the `E` experts' weights and biases (every expert counted).
    ///
    /// # Errors
    ///
    /// [`GptStage::check_config`]'s, or a failed build.
    pub fn block_param_counts(cfg: &GptConfig, mesh: &DeviceMesh) -> Result<Vec<usize>> {
        Self::check_config(cfg)?;
        let mut store = ParamStore::new(mesh, 0, DType::F32);
        let mut b = Builder {
            store: &mut store,
            roles: MeshRoles::of(mesh)?,
            plan: TpPlan::new(),
        };
        block(&mut b, cfg, 0, |b, p| dense_ff(b, cfg, p))?;
        let dense = store.global_numel();
        let moe = match &cfg.moe {
            Some(m) => {
                let mut mlp = ParamStore::new(mesh, 0, DType::F32);
                let mut b = Builder {
                    store: &mut mlp,
                    roles: MeshRoles::of(mesh)?,
                    plan: TpPlan::new(),
                };
                dense_ff(&mut b, cfg, "blocks.0")?;
                let (e, d) = (m.experts, cfg.d_model);
                let h = m.expert_hidden(cfg.mlp_ratio * cfg.d_model);
                // w1, b1, w2, b2 (and SwiGLU's w3, b3) of every expert, and the router.
                let per_expert = (h * d + h) * if cfg.swiglu { 2 } else { 1 } + d * h + d;
                dense - mlp.global_numel() + e * d + e * per_expert
            }
            None => dense,
        };
        Ok((0..cfg.n_layers)
            .map(|i| if Self::is_moe(cfg, i) { moe } else { dense })
            .collect())
    }

    /// Builds stage `stage` of `stages`, holding blocks `layers`, on `mesh` (the stage's
    /// sub-mesh: no `pp` dim), its parameters created in `store` (whose seed decides them, as
    /// [`Gpt::new`](crate::Gpt::new)'s; several stages of one rank may share a store).
    ///
    /// # Errors
    ///
    /// [`GptStage::check_config`]'s; `stage >= stages`, blocks out of range or empty; a mesh
    /// with a `cp` or `pp` dim or a sequence-parallel plan ([`ModelError::Unsupported`]);
    /// heads or vocabulary not divisible by `tp`; mixture-of-experts blocks among `layers`
    /// (they need [`GptStage::with_moe`]); a failed build.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &GptConfig,
        mesh: &DeviceMesh,
        plan: &TpPlan,
        stage: usize,
        stages: usize,
        layers: Range<usize>,
        store: &mut ParamStore,
    ) -> Result<Self> {
        Self::with_moe(cfg, mesh, plan, stage, stages, layers, store, None)
    }

    /// [`GptStage::new`] with the communicators of its mixture-of-experts blocks: `moe`, built
    /// on a mesh whose `ep` dim (if any) is the stage mesh's and whose data dims hold the
    /// stage mesh's (e.g. `dp` x `ep` for a stage on `ep`: the count exchange, the capacity
    /// and the balancing loss's fractions then span every data-parallel rank of the
    /// micro-batch). Needed when `layers` holds a mixture-of-experts block.
    ///
    /// # Errors
    ///
    /// As [`GptStage::new`]; `moe` missing while `layers` holds a mixture-of-experts block
    /// ([`ModelError::Config`]), or such a block with a `tp` dim in the stage mesh or the
    /// groups' ([`ModelError::Unsupported`]).
    #[allow(clippy::too_many_arguments)]
    pub fn with_moe(
        cfg: &GptConfig,
        mesh: &DeviceMesh,
        plan: &TpPlan,
        stage: usize,
        stages: usize,
        layers: Range<usize>,
        store: &mut ParamStore,
        moe: Option<&Arc<MoeGroups>>,
    ) -> Result<Self> {
        Self::check_config(cfg)?;
        if stage >= stages || layers.is_empty() || layers.end > cfg.n_layers {
            return Err(ModelError::Config(format!(
                "pipeline stage {stage} of {stages} with blocks {layers:?} of {}: the rule is \
                 stage < stages and a non-empty run of blocks within the model",
                cfg.n_layers
            )));
        }
        let roles = MeshRoles::of(mesh)?;
        if layers.clone().any(|i| Self::is_moe(cfg, i)) {
            let Some(g) = moe else {
                return Err(ModelError::Config(format!(
                    "pipeline stage {stage}: blocks {layers:?} hold mixture-of-experts blocks, \
                     which need the MoE groups (GptStage::with_moe)"
                )));
            };
            if roles.tp.is_some() || g.roles().tp.is_some() {
                return Err(ModelError::Unsupported(format!(
                    "mixture-of-experts blocks in a tensor-parallel pipeline stage (stage mesh \
                     dims {:?})",
                    mesh.dim_names()
                )));
            }
        }
        if roles.cp.is_some() || roles.pp.is_some() || plan.sequence_parallel {
            return Err(ModelError::Unsupported(format!(
                "a pipeline stage on a mesh with dims {:?}{} (cp, pp and sequence parallelism \
                 inside a stage are not implemented)",
                mesh.dim_names(),
                if plan.sequence_parallel {
                    ", sequence parallel"
                } else {
                    ""
                }
            )));
        }
        if let Some(d) = roles.tp {
            cfg.validate(mesh.size(d)?)?;
        }
        let mut b = Builder {
            store,
            roles: roles.clone(),
            plan: plan.clone(),
        };
        let (std, proj_std) = init_stds(cfg);
        let (first, last) = (stage == 0, stage + 1 == stages);
        let (mut tok_emb, pos_emb) = if first {
            let tok = Embedding::new(&mut b, "tok_emb", cfg.vocab, cfg.d_model, std)?;
            let pl = roles
                .placements(Placement::Replicate, Placement::Replicate)
                .to_vec();
            let pos = b.store.param(
                "pos_emb.weight",
                &[cfg.seq_len, cfg.d_model],
                Init::Normal(std),
                &pl,
            )?;
            (Some(tok), Some(pos))
        } else {
            (None, None)
        };
        let blocks = layers
            .clone()
            .map(|i| {
                block(&mut b, cfg, i, |b, p| match (&cfg.moe, moe) {
                    (Some(m), Some(g)) if m.is_moe_block(i) => Ok(FeedForward::Moe(Box::new(
                        MoeLayer::new(
                            b,
                            &format!("{p}.moe"),
                            i as u32,
                            g,
                            cfg.d_model,
                            m.expert_hidden(cfg.mlp_ratio * cfg.d_model),
                            cfg.swiglu,
                            std,
                            proj_std,
                        )?
                        .without_grad_sync(),
                    ))),
                    _ => dense_ff(b, cfg, p),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (ln_f, head) = if last {
            let ln = norm(&mut b, "ln_f", cfg)?;
            let head = if cfg.tied {
                if tok_emb.is_none() {
                    // The tied head's copy of the token table (same name, same values).
                    tok_emb = Some(Embedding::new(
                        &mut b,
                        "tok_emb",
                        cfg.vocab,
                        cfg.d_model,
                        std,
                    )?);
                }
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
            (Some(ln), head)
        } else {
            (None, None)
        };
        let dtype = b.store.vars().first().map_or(DType::F32, |v| v.dtype());
        Ok(GptStage {
            cfg: cfg.clone(),
            stage,
            stages,
            layers,
            tok_emb,
            pos_emb,
            blocks,
            ln_f,
            head,
            roles,
            plan: plan.clone(),
            dtype,
        })
    }

    fn master_dtype(&self) -> DType {
        self.dtype
    }

    /// Sets the dtype the activations are kept in between ops (the precision policy's master
    /// dtype; by default the parameters' dtype). A pipeline whose FSDP gathers bf16 copies of
    /// f32 master shards sets f32, so the stage computes as the model without a pipeline does
    /// (bf16 parameters cast up where the policy computes in f32).
    pub fn set_master_dtype(&mut self, dtype: DType) {
        self.dtype = dtype;
    }

    /// Whether this is the first stage (embeddings).
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }

    /// Whether this is the last stage (final norm, head, loss).
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }

    /// The stage's forward: embeddings (first stage, from [`StageInput::Ids`]) or the previous
    /// stage's hidden states, then the blocks; on the last stage the final norm and head.
    /// Returns hidden states `[B, T, D]`, or logits `[B, T, V]` on the last stage.
    ///
    /// # Errors
    ///
    /// Ids given to a later stage or hidden states to the first, a sequence longer than the
    /// context, a failed op.
    pub fn forward(&self, input: StageInput<'_>) -> Result<DTensor> {
        Ok(self.forward_aux(input)?.0)
    }

    /// [`GptStage::forward`] and the load-balancing loss of the stage's mixture-of-experts
    /// blocks (summed over them, over the micro-batch's tokens as
    /// [`Gpt::forward_aux`](crate::Gpt::forward_aux) computes it; `None` without such blocks
    /// or with a zero coefficient).
    ///
    /// # Errors
    ///
    /// As [`GptStage::forward`]; a failed dispatch.
    pub fn forward_aux(&self, input: StageInput<'_>) -> Result<(DTensor, Option<DTensor>)> {
        // The GPT's precision policy (as `Gpt::forward_aux`); parameters in the store's dtype.
        let _precision = crate::precision::scope(self.cfg.precision, self.master_dtype());
        let embed = match (&self.tok_emb, &self.pos_emb) {
            (Some(tok), Some(pos)) if self.is_first() => Some((tok, pos)),
            _ => None,
        };
        let mut x = match (input, embed) {
            (StageInput::Ids(ids), Some((tok, pos))) => {
                let t = ids.dim(1)?;
                if t > self.cfg.seq_len {
                    return Err(ModelError::Config(format!(
                        "sequence of {t} tokens exceeds the context length {}",
                        self.cfg.seq_len
                    )));
                }
                let _l = candle_dtensor_core::debug::label("embed");
                let pos = crate::precision::to_master(&pos.narrow(0, 0, t)?)?;
                tok.forward(ids)?.add(&pos)?
            }
            (StageInput::Hidden(h), None) => h.clone(),
            _ => {
                return Err(ModelError::Config(format!(
                    "pipeline stage {}: the first stage takes token ids, the others the \
                     previous stage's hidden states",
                    self.stage
                )))
            }
        };
        let mut aux: Option<DTensor> = None;
        for (i, blk) in self.layers.clone().zip(&self.blocks) {
            let label = format!("blocks.{i}");
            let _l = candle_dtensor_core::debug::label(&label);
            // The policy counts dense blocks only, over the whole model (as `Gpt`'s).
            let dense = (0..i).filter(|&j| !Self::is_moe(&self.cfg, j)).count();
            x = match blk.dense_copy() {
                Some(b) if self.cfg.ac.checkpoints(dense) => {
                    let (p, dt) = (self.cfg.precision, self.master_dtype());
                    checkpoint(&x, Some(&label), move |x| {
                        let _precision = crate::precision::scope(p, dt);
                        b.forward(x)
                    })?
                }
                _ => {
                    let (y, a) = blk.forward_aux(&x)?;
                    if let Some(a) = a {
                        aux = Some(match aux.take() {
                            Some(s) => s.add(&a)?,
                            None => a,
                        });
                    }
                    y
                }
            };
        }
        let Some(ln) = &self.ln_f else {
            return Ok((x, aux));
        };
        let _l = candle_dtensor_core::debug::label("head");
        let x = ln.forward(&x)?;
        let logits = lm_logits(
            &x,
            self.head.as_ref(),
            self.tok_emb.as_ref(),
            &self.roles,
            &self.plan,
        )
        .map_err(|e| match e {
            ModelError::Config(m) => {
                ModelError::Config(format!("pipeline stage {}: {m}", self.stage))
            }
            other => other,
        })?;
        Ok((logits, aux))
    }

    /// The stage's mixture-of-experts layers, in block order.
    pub fn moe_layers(&self) -> impl Iterator<Item = &MoeLayer> {
        self.blocks.iter().filter_map(|b| b.mlp.moe())
    }

    /// Mean next-token cross-entropy over the tokens of `logits [B, T, V]` against
    /// `targets [B, T]` (as [`Gpt::loss`](crate::Gpt::loss) computes it; last stage).
    ///
    /// # Errors
    ///
    /// A failed op.
    pub fn loss(&self, logits: &DTensor, targets: &DTensor) -> Result<DTensor> {
        let _l = candle_dtensor_core::debug::label("loss");
        // Loss-parallel (as `Gpt::loss`): the logits stay sharded on the vocab.
        crate::gpt::token_loss(logits, targets, self.plan.loss_parallel)
    }
}
