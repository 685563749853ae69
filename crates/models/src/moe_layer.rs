//! The mixture-of-experts feed-forward layer of a GPT block: router, experts, balancing loss.
//! Its tokens travel to their experts and back through the expert-parallel dispatch of
//! [`candle_dtensor_parallel::moe`] (whose module docs describe the layer's math and the
//! exchange); this file holds the parameters and the forward around that exchange.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{DType, Tensor};
use candle_dtensor_core::functional::{copy_to_group, ExchangeTimes};
use candle_dtensor_core::{debug, DTensor, Placement, Placements};
use candle_dtensor_parallel::init::Init;
use candle_dtensor_parallel::moe::routing::{self, Admission, DispatchPlan, LocalRouting};
use candle_dtensor_parallel::moe::{local, MoeConfig, MoeError, MoeGroups, MoeStats};

use crate::builder::Builder;
use crate::error::{ModelError, Result};
use crate::precision;

/// A mixture-of-experts feed-forward layer; see the module docs.
pub struct MoeLayer {
    /// Router `[E, D]` (Replicate).
    pub router: DTensor,
    /// First expert projection `[E, H, D]` (`Shard(0)` over `ep`).
    pub w1: DTensor,
    /// Its bias `[E, H]`.
    pub b1: DTensor,
    /// Second projection `[E, D, H]`.
    pub w2: DTensor,
    /// Its bias `[E, D]`.
    pub b2: DTensor,
    /// SwiGLU's gate projection `[E, H, D]` and bias.
    pub w3: Option<(DTensor, DTensor)>,
    name: String,
    key: u32,
    d_model: usize,
    groups: Arc<MoeGroups>,
    dispatch_times: ExchangeTimes,
    combine_times: ExchangeTimes,
    stats: Mutex<MoeStats>,
    /// Whether the expert weights' gradients are all-reduced in backward over the data dims
    /// other than `ep` ([`MoeLayer::without_grad_sync`]).
    sync_grads: bool,
}

impl MoeLayer {
    /// Creates `name.router`, `name.experts.{w1,b1,w2,b2}` (and `w3`, `b3` for SwiGLU) on the
    /// builder's mesh; `key` identifies the layer in the count exchange (e.g. its block index).
    ///
    /// # Errors
    ///
    /// Parameter creation failures.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        b: &mut Builder,
        name: &str,
        key: u32,
        groups: &Arc<MoeGroups>,
        d_model: usize,
        hidden: usize,
        swiglu: bool,
        std: f64,
        proj_std: f64,
    ) -> Result<MoeLayer> {
        let cfg = groups.config();
        let e = cfg.experts;
        let rep: Placements = b
            .roles
            .placements(Placement::Replicate, Placement::Replicate);
        let mut sharded = rep.clone();
        if let Some(d) = b.roles.ep {
            sharded[d] = Placement::Shard(0);
        }
        let mut param = |n: &str, shape: &[usize], init: Init, p: &Placements| {
            b.store
                .param(&format!("{name}.{n}"), shape, init, p)
                .map_err(ModelError::from)
        };
        let router = param("router.weight", &[e, d_model], Init::Normal(std), &rep)?;
        let w1 = param(
            "experts.w1",
            &[e, hidden, d_model],
            Init::Normal(std),
            &sharded,
        )?;
        let b1 = param("experts.b1", &[e, hidden], Init::Zeros, &sharded)?;
        let w3 = if swiglu {
            Some((
                param(
                    "experts.w3",
                    &[e, hidden, d_model],
                    Init::Normal(std),
                    &sharded,
                )?,
                param("experts.b3", &[e, hidden], Init::Zeros, &sharded)?,
            ))
        } else {
            None
        };
        let w2 = param(
            "experts.w2",
            &[e, d_model, hidden],
            Init::Normal(proj_std),
            &sharded,
        )?;
        let b2 = param("experts.b2", &[e, d_model], Init::Zeros, &sharded)?;
        Ok(MoeLayer {
            router,
            w1,
            b1,
            w2,
            b2,
            w3,
            name: name.to_string(),
            key,
            d_model,
            groups: groups.clone(),
            dispatch_times: ExchangeTimes::new(),
            combine_times: ExchangeTimes::new(),
            stats: Mutex::new(MoeStats::default()),
            sync_grads: true,
        })
    }

    /// The layer without the backward all_reduce of the expert weights' gradients over the
    /// groups' data dims other than `ep`: for a caller that reduces every gradient over those
    /// dims itself, once per step (the pipeline trainer sums its stages' gradients over `dp`
    /// after the step's last micro-batch). Its [`MoeGroups`] may then live on a larger mesh
    /// than the parameters (the count exchange spans `dp` x `ep`, the parameters only `ep`).
    pub fn without_grad_sync(mut self) -> Self {
        self.sync_grads = false;
        self
    }

    /// The settings.
    pub fn config(&self) -> &MoeConfig {
        self.groups.config()
    }

    /// Returns and resets what the layer measured (backward exchange times included).
    pub fn take_stats(&self) -> MoeStats {
        let mut s = std::mem::take(&mut *self.stats.lock().unwrap_or_else(|e| e.into_inner()));
        let (_, db) = self.dispatch_times.take();
        let (_, cb) = self.combine_times.take();
        s.dispatch_ms += db.as_secs_f64() * 1e3;
        s.combine_ms += cb.as_secs_f64() * 1e3;
        s
    }

    /// Router probabilities `[B, T, E]` (f32), top-k weights `[B, T, k]` and experts.
    fn route(&self, x: &DTensor) -> Result<(DTensor, DTensor, DTensor)> {
        let _l = debug::label("router");
        let cfg = self.config();
        let f32_of = |t: &DTensor| -> Result<DTensor> {
            Ok(if t.dtype() == DType::F32 {
                t.clone()
            } else {
                t.to_dtype(DType::F32)?
            })
        };
        let logits = f32_of(x)?.linear(&f32_of(&self.router)?, None)?;
        let probs = logits.softmax(2)?;
        let (vals, idx) = probs.topk(cfg.top_k, 2, true)?;
        let gates = if cfg.top_k > 1 && cfg.normalize_top_k {
            vals.div(&vals.sum(&[2], true)?)?
        } else {
            vals
        };
        Ok((probs, gates, idx))
    }

    /// This rank's piece of an expert parameter, with the backward all_reduce over the data
    /// dims other than `ep` that FSDP does not manage.
    fn local_weight(&self, w: &DTensor) -> Result<Tensor> {
        let mut t = w.to_local().clone();
        if !self.sync_grads {
            return Ok(t);
        }
        for (d, g) in self.groups.sync_groups() {
            if !w.managed_grad_dims().contains(d) {
                t = copy_to_group(&t, g)?;
            }
        }
        Ok(t)
    }

    /// The local experts on the received rows. Each grouped GEMM runs in the current
    /// [`precision`] policy's GEMM dtype (bf16: rows, weights and biases cast after the weights'
    /// gradient syncs, so those stay in the master dtype) or the weights' dtype, and comes back
    /// in the rows' dtype; the activation (GELU / SwiGLU) runs in the rows' dtype.
    fn experts(&self, recv: &Tensor, segments: &Arc<Vec<routing::Segment>>) -> Result<Tensor> {
        let _l = debug::label("experts");
        let out = recv.dtype();
        let gemm = |x: &Tensor, w: &DTensor, b: &DTensor| -> Result<Tensor> {
            let (w, b) = (self.local_weight(w)?, self.local_weight(b)?);
            let dt = precision::local_gemm_dtype().unwrap_or(w.dtype());
            let c = |t: &Tensor| -> candle_core::Result<Tensor> {
                if t.dtype() == dt {
                    Ok(t.clone())
                } else {
                    t.to_dtype(dt)
                }
            };
            let y = local::grouped_linear(&c(x)?, &c(&w)?, &c(&b)?, segments)?;
            Ok(if y.dtype() == out {
                y
            } else {
                y.to_dtype(out)?
            })
        };
        let h = gemm(recv, &self.w1, &self.b1)?;
        let h = match &self.w3 {
            Some((w3, b3)) => local::swiglu(&h, &gemm(recv, w3, b3)?)?,
            None => candle_dtensor_core::gelu_local(&h)?,
        };
        gemm(&h, &self.w2, &self.b2)
    }

    /// `x: [B, T, D]` to `(y: [B, T, D], balancing loss)` (the loss is `None` with a zero
    /// coefficient). Collective over the data dims and `ep`.
    ///
    /// # Errors
    ///
    /// A shape other than `[B, T, d_model]`, [`MoeError::TokenCounts`], or a failed op or
    /// collective.
    pub fn forward(&self, x: &DTensor) -> Result<(DTensor, Option<DTensor>)> {
        let _l = debug::label("moe");
        let g = &self.groups;
        let cfg = self.config();
        let rank = x.mesh_rank();
        if x.rank() != 3 || x.shape()[2] != self.d_model {
            return Err(MoeError::Config {
                layer: self.name.clone(),
                rank,
                reason: format!(
                    "input of shape {:?}; expected [batch, seq, {}]",
                    x.shape(),
                    self.d_model
                ),
            }
            .into());
        }
        let t_start = Instant::now();
        let x_in = match g.roles().tp {
            Some(_) => x.redistribute(&g.roles().with_tp(x.placements(), Placement::Replicate))?,
            None => x.clone(),
        };
        let (probs, gates, idx) = self.route(&x_in)?;
        let local = x_in.to_local();
        let (bl, tl, d) = local.dims3()?;
        let n = bl * tl;
        let xs = local.reshape((n, d))?;
        // The routing is planned on the host: one read (a host synchronisation on a GPU).
        candle_dtensor_kernels::storage::note_host_read();
        let ids: Vec<u32> = idx.to_local().flatten_all()?.to_vec1()?;
        let routing = LocalRouting::new(ids, n, cfg.top_k, cfg.experts).map_err(|reason| {
            MoeError::Config {
                layer: self.name.clone(),
                rank,
                reason,
            }
        })?;
        let table = {
            let _l = debug::label("counts");
            g.count_table(&self.name, self.key, &routing)?
        };
        let cap = cfg
            .capacity_factor
            .map(|f| routing::capacity(f, table.total_tokens(), cfg.top_k, cfg.experts));
        let admission = Admission::new(&table, cap);
        let plan: DispatchPlan =
            routing::plan(&table, &admission, &routing, g.data_rank(), &g.ep_layout());
        let recv = {
            let _l = debug::label("dispatch");
            g.exchange_gathered(&xs, &plan.send_tokens, &plan.matrix, &self.dispatch_times)?
        };
        let t_dispatch = t_start.elapsed();
        let y = self.experts(&recv, &plan.segments)?;
        let t_comb = Instant::now();
        let out = {
            let _l = debug::label("combine");
            let back = g.exchange(&y, &plan.matrix, true, &self.combine_times)?;
            local::weighted_combine(
                &back,
                &gates.to_local().reshape((n, cfg.top_k))?,
                &plan.send_slots,
                n,
            )?
        };
        let t_combine = t_comb.elapsed();
        let out = out.reshape((bl, tl, d))?;
        let out =
            DTensor::from_local_with_shape(&out, x_in.mesh(), x_in.placements(), x_in.shape())?;
        let out = if out.placements() == x.placements() {
            out
        } else {
            out.redistribute(x.placements())?
        };
        let aux = if cfg.aux_loss_coef > 0.0 {
            Some(self.aux_loss(&probs, &plan.fractions)?)
        } else {
            None
        };
        let mut st = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        st.forwards += 1;
        st.dispatch_ms += t_dispatch.as_secs_f64() * 1e3;
        st.combine_ms += t_combine.as_secs_f64() * 1e3;
        st.dropped += plan.dropped;
        st.assignments += table.total_tokens() * cfg.top_k;
        st.tokens_per_expert = plan.kept_per_expert.clone();
        Ok((out, aux))
    }

    /// `coef * E * sum_i f_i * mean(probs[.., i])`.
    fn aux_loss(&self, probs: &DTensor, fractions: &[f64]) -> Result<DTensor> {
        let _l = debug::label("aux");
        let cfg = self.config();
        let mesh = probs.mesh();
        let f: Vec<f32> = fractions.iter().map(|&f| f as f32).collect();
        let f = Tensor::from_vec(f, cfg.experts, probs.device())?;
        let f = DTensor::from_local(&f, mesh, &vec![Placement::Replicate; mesh.ndim()])?;
        let p = probs.mean(&[0, 1], false)?;
        Ok(p.mul(&f)?
            .sum_all()?
            .affine(cfg.aux_loss_coef * cfg.experts as f64, 0.0)?)
    }
}
