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
//! Activation checkpointing ([`GptConfig::ac`]) applies to the stage's blocks by their global
//! index, as in [`Gpt`](crate::Gpt) (`full`: every block; `selective`: blocks 1, 3, 5, ...).
//!
//! Tensor parallelism inside a stage: build it on a mesh with a `tp` dim and the plan
//! ([`TpPlan::gpt`] without sequence parallelism); the hidden states between stages are then
//! replicated over `tp`, so each tensor-parallel rank exchanges the whole activation with its
//! counterpart in the neighbouring stage.
//!
//! Not covered (refused with [`ModelError::Unsupported`]): mixture-of-experts blocks, and
//! context or sequence parallelism inside a stage.

use std::ops::Range;

use candle_core::DType;
use candle_dtensor_core::{DTensor, Placement};
use candle_dtensor_mesh::DeviceMesh;
use candle_dtensor_parallel::init::Init;
use candle_dtensor_parallel::params::ParamStore;
use candle_dtensor_parallel::tp_plan::{MeshRoles, TpPlan};

use crate::builder::Builder;
use crate::checkpoint::checkpoint;
use crate::error::{ModelError, Result};
use crate::gpt::{block, dense_ff, init_stds, lm_logits, norm, GptConfig};
use crate::layers::{Block, Embedding, Linear, Norm};

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
    /// Checks that `cfg` can be split into pipeline stages: refuses (with
    /// [`ModelError::Unsupported`]) mixture-of-experts blocks, which the stages do not
    /// implement.
    ///
    /// # Errors
    ///
    /// As above, and [`GptConfig::validate`]'s errors.
    pub fn check_config(cfg: &GptConfig) -> Result<()> {
        cfg.validate(1)?;
        if cfg
            .moe
            .as_ref()
            .is_some_and(|m| (0..cfg.n_layers).any(|i| m.is_moe_block(i)))
        {
            return Err(ModelError::Unsupported(
                "mixture-of-experts blocks in pipeline stages".into(),
            ));
        }
        Ok(())
    }

    /// Parameter count of each block (for
    /// [`split_balanced`](candle_dtensor_parallel::pipeline::split_balanced)), counted by
    /// building one block into a scratch store on `mesh` (every block of a dense GPT has the
    /// same shapes).
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
        Ok(vec![store.global_numel(); cfg.n_layers])
    }

    /// Builds stage `stage` of `stages`, holding blocks `layers`, on `mesh` (the stage's
    /// sub-mesh: no `pp` dim), its parameters created in `store` (whose seed decides them, as
    /// [`Gpt::new`](crate::Gpt::new)'s; several stages of one rank may share a store).
    ///
    /// # Errors
    ///
    /// [`GptStage::check_config`]'s; `stage >= stages`, blocks out of range or empty; a mesh
    /// with a `cp` or `pp` dim or a sequence-parallel plan ([`ModelError::Unsupported`]);
    /// heads or vocabulary not divisible by `tp`; a failed build.
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
        Self::check_config(cfg)?;
        if stage >= stages || layers.is_empty() || layers.end > cfg.n_layers {
            return Err(ModelError::Config(format!(
                "pipeline stage {stage} of {stages} with blocks {layers:?} of {}: the rule is \
                 stage < stages and a non-empty run of blocks within the model",
                cfg.n_layers
            )));
        }
        let roles = MeshRoles::of(mesh)?;
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
        let (std, _) = init_stds(cfg);
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
            .map(|i| block(&mut b, cfg, i, |b, p| dense_ff(b, cfg, p)))
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
        for (i, blk) in self.layers.clone().zip(&self.blocks) {
            let label = format!("blocks.{i}");
            let _l = candle_dtensor_core::debug::label(&label);
            // Every block is dense (MoE is refused): the policy's index is the block's.
            x = match blk.dense_copy() {
                Some(b) if self.cfg.ac.checkpoints(i) => {
                    let (p, dt) = (self.cfg.precision, self.master_dtype());
                    checkpoint(&x, Some(&label), move |x| {
                        let _precision = crate::precision::scope(p, dt);
                        b.forward(x)
                    })?
                }
                _ => blk.forward(&x)?,
            };
        }
        let Some(ln) = &self.ln_f else {
            return Ok(x);
        };
        let _l = candle_dtensor_core::debug::label("head");
        let x = ln.forward(&x)?;
        lm_logits(
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
        })
    }

    /// Mean next-token cross-entropy over the tokens of `logits [B, T, V]` against
    /// `targets [B, T]` (as [`Gpt::loss`](crate::Gpt::loss) computes it; last stage).
    ///
    /// # Errors
    ///
    /// A failed op.
    pub fn loss(&self, logits: &DTensor, targets: &DTensor) -> Result<DTensor> {
        let (b, t, v) = (logits.dim(0)?, logits.dim(1)?, logits.dim(2)?);
        let _l = candle_dtensor_core::debug::label("loss");
        let logits = logits.reshape(&[b * t, v])?;
        let logits = if logits.dtype() == DType::F32 {
            logits
        } else {
            logits.to_dtype(DType::F32)?
        };
        let targets = targets.reshape(&[b * t])?;
        // Loss-parallel (as `Gpt::loss`): the logits stay sharded on the vocab.
        let layout = self
            .plan
            .loss_parallel
            .then(|| logits.placements().to_vec());
        Ok(logits.cross_entropy_with_layout(&targets, layout.as_deref())?)
    }
}
