//! A mixture-of-experts feed-forward layer with expert parallelism over the mesh dim `ep`.
//!
//! # The layer
//!
//! Router: `softmax(x W_r^T)` over the experts, in f32 (a DTensor `linear` + `softmax`, so the
//! router weight's gradient is reduced like any replicated parameter's), then `topk` (k = 1 or
//! 2; ties to the lower expert), the top-k weights renormalised to sum to 1 when `k > 1`
//! ([`MoeConfig::normalize_top_k`], GShard / Mixtral). Experts: MLPs like the dense one (GELU,
//! or SwiGLU with the model's `swiglu`), weights `[E, H, D]` with biases. Load balancing: the
//! Switch / GShard auxiliary loss `coef * E * sum_i f_i * P_i` with `f_i` the fraction of all
//! assignments routed to expert `i` and `P_i` the mean router probability of `i`, over the
//! global batch (Megatron's top-k form). An optional capacity factor keeps at most
//! `ceil(factor * tokens * k / E)` assignments per expert, first choices first, then in batch
//! order; the others are dropped (counted; the token keeps only its residual). Dropless by
//! default.
//!
//! # Expert parallelism
//!
//! Expert weights are `Shard(0)` over `ep` (torch.chunk: uneven counts allowed), Replicate on
//! the other dims, where FSDP may shard them further over `dp`. Tokens are sharded over every
//! data dim (`ep` included) and are made Replicate over `tp` (attention may be tensor parallel;
//! the experts are not). One forward:
//!
//! 1. **Count exchange**: one `all_gather` of every data rank's assignment counts per (slot,
//!    expert) over the data dims (flattened), so every rank knows every count: the splits of
//!    its ep group, the global capacity admission and the balancing loss's `f_i`, all computed
//!    alike on every rank; a rank whose counts do not add up is named ([`MoeError::TokenCounts`]).
//! 2. **Dispatch**: this rank's kept assignments gathered expert-major (tokens in order within
//!    an expert), then one `all_to_all_v` over `ep` (or RMA puts into the owners' windows,
//!    [`DispatchKind::Rma`]); the receiver holds, per source rank, its rows for each local
//!    expert.
//! 3. **Experts**: one grouped matmul per (source, local expert) run of rows, no per-token
//!    loop ([`ops::grouped_linear`]).
//! 4. **Combine**: the reverse exchange, then each token's rows weighted by its router weights
//!    (f32) and summed.
//!
//! Backward is the same path reversed: each exchange's adjoint is the reverse exchange
//! ([`candle_dtensor_core::functional::exchange_rows`]); the router gets its gradient through
//! the combine weights and the balancing loss; expert weights get theirs locally (all-reduced
//! over the data dims other than `ep` unless FSDP reduces them). Every piece is one graph node
//! whose edges do not depend on the counts ([`ops`]), so ranks whose experts got no tokens build
//! the same graph as their peers.

pub mod ops;
pub mod routing;

use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{DType, Tensor};
use candle_dtensor_comm::Comm;
use candle_dtensor_core::functional::{
    copy_to_group, exchange_gathered_rows, exchange_rows, ExchangePlan, ExchangeTimes, Group,
    RmaExchange, Transport,
};
use candle_dtensor_core::{debug, DTensor, Placement, Placements};
use candle_dtensor_mesh::grid::{ravel, unravel};
use candle_dtensor_mesh::DeviceMesh;

use crate::error::{ModelError, Result};
use crate::init::Init;
use crate::layers::Builder;
use crate::plan::MeshRoles;
use routing::{Admission, CountTable, DispatchPlan, EpLayout, LocalRouting, TableError};

/// How tokens travel to their experts and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchKind {
    /// `all_to_all_v_single` (any backend).
    AllToAllV,
    /// Puts with a signal into the owners' RMA windows (backends with RMA put and signal:
    /// the local backend).
    Rma,
}

/// Mixture-of-experts settings of a GPT ([`crate::GptConfig::moe`]).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Number of experts.
    pub experts: usize,
    /// Experts per token (1: Switch, 2: GShard).
    pub top_k: usize,
    /// Every `every`-th block is a mixture of experts (blocks `every - 1`, `2 every - 1`, ...;
    /// 1: all of them).
    pub every: usize,
    /// Hidden size of each expert (`None`: the dense MLP's, `mlp_ratio * d_model`).
    pub hidden: Option<usize>,
    /// Capacity factor (`None`: dropless).
    pub capacity_factor: Option<f64>,
    /// Coefficient of the load-balancing loss (0: none).
    pub aux_loss_coef: f64,
    /// Renormalise the top-k router weights to sum to 1 (only for `top_k > 1`).
    pub normalize_top_k: bool,
    /// The token transport.
    pub dispatch: DispatchKind,
}

impl MoeConfig {
    /// `experts` experts, `top_k` per token, every block, dropless, balancing loss 0.01,
    /// all_to_all_v.
    pub fn new(experts: usize, top_k: usize) -> Self {
        MoeConfig {
            experts,
            top_k,
            every: 1,
            hidden: None,
            capacity_factor: None,
            aux_loss_coef: 0.01,
            normalize_top_k: true,
            dispatch: DispatchKind::AllToAllV,
        }
    }

    /// Whether block `i` is a mixture of experts.
    pub fn is_moe_block(&self, i: usize) -> bool {
        self.every > 0 && (i + 1) % self.every == 0
    }

    /// The expert hidden size for a model whose dense MLP has `dense_hidden`.
    pub fn expert_hidden(&self, dense_hidden: usize) -> usize {
        self.hidden.unwrap_or(dense_hidden)
    }
}

impl FromStr for MoeConfig {
    type Err = String;

    /// `experts=8,top_k=2[,every=1][,hidden=512][,capacity=1.25][,aux=0.01][,normalize=true]
    /// [,dispatch=a2a|rma]`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let mut c = MoeConfig::new(0, 1);
        let mut have_experts = false;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("MoE option {part:?} is not KEY=VALUE"))?;
            let (k, v) = (k.trim(), v.trim());
            let int = |v: &str| {
                v.parse::<usize>()
                    .map_err(|_| format!("MoE option {k}: {v:?} is not a non-negative integer"))
            };
            let float = |v: &str| {
                v.parse::<f64>()
                    .ok()
                    .filter(|f| f.is_finite() && *f >= 0.0)
                    .ok_or_else(|| format!("MoE option {k}: {v:?} is not a non-negative number"))
            };
            match k {
                "experts" => {
                    c.experts = int(v)?;
                    have_experts = true;
                }
                "top_k" | "k" => c.top_k = int(v)?,
                "every" => c.every = int(v)?,
                "hidden" => c.hidden = Some(int(v)?),
                "capacity" | "capacity_factor" => {
                    c.capacity_factor = match v {
                        "none" | "dropless" => None,
                        v => Some(float(v)?),
                    }
                }
                "aux" | "aux_loss_coef" => c.aux_loss_coef = float(v)?,
                "normalize" => {
                    c.normalize_top_k = v
                        .parse()
                        .map_err(|_| format!("MoE option normalize: {v:?} is not true/false"))?
                }
                "dispatch" => {
                    c.dispatch = match v {
                        "a2a" | "all_to_all_v" | "alltoallv" => DispatchKind::AllToAllV,
                        "rma" => DispatchKind::Rma,
                        other => {
                            return Err(format!("MoE option dispatch: {other:?}; use a2a or rma"))
                        }
                    }
                }
                other => {
                    return Err(format!(
                        "unknown MoE option {other:?}; options: experts, top_k, every, hidden, \
                         capacity, aux, normalize, dispatch"
                    ))
                }
            }
        }
        if !have_experts {
            return Err("MoE options need experts=N".into());
        }
        Ok(c)
    }
}

/// What went wrong in a mixture-of-experts layer. Every variant names the rank reporting it
/// (`rank`, in the mesh's root communicator) and, for disagreements, the rank at fault
/// (`peer`); every rank reaches the same verdict.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum MoeError {
    /// A configuration no layout can run (top-k larger than the experts, an `ep` dim larger
    /// than the experts, a zero size, ...).
    #[error("MoE {layer} (rank {rank}): {reason}")]
    Config {
        /// The layer (or `config`).
        layer: String,
        /// The reporting rank.
        rank: usize,
        /// What is wrong.
        reason: String,
    },
    /// Ranks were built with different routing tables (experts, top-k, sizes, capacity,
    /// transport).
    #[error(
        "MoE {layer} (rank {rank}): rank {peer} disagrees on the routing table: its {field} is \
         {theirs}, the other ranks' is {ours}"
    )]
    RoutingMismatch {
        /// The layer.
        layer: String,
        /// The reporting rank.
        rank: usize,
        /// The rank whose table differs from the majority's.
        peer: usize,
        /// The field.
        field: &'static str,
        /// The majority's value.
        ours: String,
        /// The peer's value.
        theirs: String,
    },
    /// A rank's exchanged counts disagree with its own token count, or come from another
    /// layer.
    #[error("MoE {layer} (rank {rank}): rank {peer} sent bad routing counts: {reason}")]
    TokenCounts {
        /// The layer.
        layer: String,
        /// The reporting rank.
        rank: usize,
        /// The rank whose counts are off.
        peer: usize,
        /// What is off.
        reason: String,
    },
    /// The RMA dispatch was asked for on a backend that cannot run it.
    #[error("MoE (rank {rank}): the RMA dispatch needs RMA windows with put and signal: {reason}")]
    RmaUnsupported {
        /// The reporting rank.
        rank: usize,
        /// The backend's capabilities, or its error.
        reason: String,
    },
}

/// What a layer measured since the last [`MoeLayer::take_stats`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeStats {
    /// Forward passes.
    pub forwards: usize,
    /// Count exchange, permutation and dispatch exchange, forward, plus the dispatch's reverse
    /// exchange in backward (ms).
    pub dispatch_ms: f64,
    /// Combine exchange and weighting, forward, plus the combine's reverse exchange in
    /// backward (ms).
    pub combine_ms: f64,
    /// Kept assignments per expert in the last forward (over the whole batch).
    pub tokens_per_expert: Vec<usize>,
    /// Assignments dropped by the capacity, summed over the forwards.
    pub dropped: usize,
    /// Assignments routed, summed over the forwards.
    pub assignments: usize,
}

/// The communicators and layout the layers of one model share.
pub struct MoeGroups {
    roles: MeshRoles,
    /// The ep group (`None`: no `ep` dim, every expert local).
    ep: Option<Group>,
    /// The count-exchange group over the data dims (`None`: one data rank).
    data: Option<Group>,
    /// Mesh dims of the data group, ascending.
    data_dims: Vec<usize>,
    /// This rank's data rank.
    my_data: usize,
    /// The data rank of every ep rank of this rank's group.
    ep_peers: Vec<usize>,
    /// Data dims other than `ep` and their groups: where expert gradients are all-reduced
    /// (unless FSDP manages the dim).
    sync: Vec<(usize, Group)>,
    transport: Transport,
    mesh: DeviceMesh,
    cfg: MoeConfig,
}

impl MoeGroups {
    /// Checks `cfg` against every rank's (one all_gather over the world) and against the mesh,
    /// then creates the count-exchange communicator (a flattened mesh dim over the data dims
    /// when there are several) and, for [`DispatchKind::Rma`], the windows. Collective over the
    /// mesh.
    ///
    /// # Errors
    ///
    /// [`MoeError::RoutingMismatch`] naming a rank whose settings differ,
    /// [`MoeError::Config`] for settings no layout can run (every rank reports it),
    /// [`MoeError::RmaUnsupported`], or a failed collective.
    pub fn new(
        mesh: &DeviceMesh,
        cfg: &MoeConfig,
        d_model: usize,
        hidden: usize,
    ) -> Result<Arc<Self>> {
        let roles = MeshRoles::of(mesh)?;
        let rank = mesh.rank();
        let ep_dim = roles.ep;
        let ep_size = match ep_dim {
            Some(d) => mesh.size(d)?,
            None => 1,
        };
        check_agreement(mesh.root_comm(), cfg, d_model, hidden, ep_size)?;
        let cerr = |reason: String| -> ModelError {
            MoeError::Config {
                layer: "config".into(),
                rank,
                reason,
            }
            .into()
        };
        if cfg.experts == 0 || cfg.top_k == 0 || cfg.every == 0 || hidden == 0 {
            return Err(cerr(format!(
                "experts ({}), top_k ({}), every ({}) and the expert hidden size ({hidden}) must \
                 be positive",
                cfg.experts, cfg.top_k, cfg.every
            )));
        }
        if cfg.top_k > cfg.experts {
            return Err(cerr(format!(
                "top_k {} is larger than the {} experts",
                cfg.top_k, cfg.experts
            )));
        }
        if ep_size > cfg.experts {
            return Err(cerr(format!(
                "the ep mesh dim has {ep_size} ranks but there are only {} experts (every ep \
                 rank must own at least one expert's place)",
                cfg.experts
            )));
        }
        if cfg
            .capacity_factor
            .is_some_and(|f| f <= 0.0 || !f.is_finite())
        {
            return Err(cerr(format!(
                "capacity factor {:?} must be a positive number (or none: dropless)",
                cfg.capacity_factor
            )));
        }
        let names = mesh.dim_names();
        let data_dims = roles.data.clone();
        let data = match data_dims.as_slice() {
            [] => None,
            [d] => Some(Group::from_mesh(mesh, names[*d])?),
            many => {
                let dn: Vec<&str> = many.iter().map(|&d| names[d]).collect();
                let flat = mesh.flatten(&dn, &dn.join("+"))?;
                Some(Group::new(flat.comm(0)?))
            }
        }
        .filter(|g| g.size() > 1);
        let shape = mesh.shape();
        let coord = mesh.coordinate();
        let data_shape: Vec<usize> = data_dims.iter().map(|&d| shape[d]).collect();
        let data_coord: Vec<usize> = data_dims.iter().map(|&d| coord[d]).collect();
        let my_data = ravel(&data_coord, &data_shape);
        let ep = match ep_dim {
            Some(d) => Some(Group::from_mesh(mesh, names[d])?),
            None => None,
        };
        let ep_peers = match ep_dim {
            Some(d) => {
                let pos = data_dims.iter().position(|&x| x == d).unwrap_or(0);
                (0..ep_size)
                    .map(|j| {
                        let mut c = data_coord.clone();
                        c[pos] = j;
                        ravel(&c, &data_shape)
                    })
                    .collect()
            }
            None => vec![my_data],
        };
        let sync = data_dims
            .iter()
            .filter(|&&d| Some(d) != ep_dim)
            .map(|&d| Ok((d, Group::from_mesh(mesh, names[d])?)))
            .collect::<Result<Vec<_>>>()?;
        let transport = match (cfg.dispatch, &ep) {
            (DispatchKind::Rma, Some(g)) if g.size() > 1 => {
                let ex = RmaExchange::new(g).map_err(|e| MoeError::RmaUnsupported {
                    rank,
                    reason: e.to_string(),
                })?;
                Transport::Rma(Arc::new(ex))
            }
            _ => Transport::AllToAllV,
        };
        Ok(Arc::new(MoeGroups {
            roles,
            ep,
            data,
            data_dims,
            my_data,
            ep_peers,
            sync,
            transport,
            mesh: mesh.clone(),
            cfg: cfg.clone(),
        }))
    }

    /// The global rank of data rank `r` of this rank's data group.
    fn global_rank(&self, r: usize) -> usize {
        let shape = self.mesh.shape();
        let mut coord = self.mesh.coordinate();
        let data_shape: Vec<usize> = self.data_dims.iter().map(|&d| shape[d]).collect();
        for (i, c) in unravel(r, &data_shape).iter().enumerate() {
            coord[self.data_dims[i]] = *c;
        }
        ravel(&coord, &shape)
    }

    /// The ep size.
    pub fn ep_size(&self) -> usize {
        self.ep.as_ref().map_or(1, Group::size)
    }

    /// This rank's ep coordinate.
    pub fn ep_rank(&self) -> usize {
        self.ep.as_ref().map_or(0, Group::rank)
    }

    /// The transport in use.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// The count exchange: every data rank's payload, checked.
    fn exchange_counts(&self, layer: &str, key: u32, local: &LocalRouting) -> Result<CountTable> {
        let rank = self.mesh.rank();
        let Some(g) = &self.data else {
            return Ok(CountTable::single(local));
        };
        let payload = local.payload(key);
        let dev = g.comm().device().clone();
        let t = Tensor::from_vec(payload.clone(), payload.len(), &dev)?;
        debug::record(
            "all_gather",
            g.name(),
            (payload.len() * 4 * g.size()) as u64,
        );
        let t0 = Instant::now();
        let raw = g.comm().all_gather_single(&t)?.wait()?;
        debug::add_comm_wait(t0.elapsed());
        let raw: Vec<u32> = raw.to_vec1()?;
        CountTable::parse(&raw, g.size(), local.top_k, local.experts).map_err(|e| {
            let (peer, reason) = match e {
                TableError::Layer { peer, theirs, ours } => (
                    peer,
                    format!("they are the counts of layer {theirs}, the others' of layer {ours}"),
                ),
                TableError::Tokens {
                    peer,
                    n_tokens,
                    slot,
                    routed,
                } => (
                    peer,
                    format!("{n_tokens} tokens but {routed} assignments in slot {slot}"),
                ),
                TableError::Length { got, expected } => (
                    self.my_data,
                    format!("{got} values gathered, expected {expected}"),
                ),
            };
            MoeError::TokenCounts {
                layer: layer.to_string(),
                rank,
                peer: self.global_rank(peer),
                reason,
            }
            .into()
        })
    }

    /// Runs the routing exchange over the data group for `local` (public so that callers and
    /// tests can drive the count exchange directly; the layer calls it every forward).
    ///
    /// # Errors
    ///
    /// [`MoeError::TokenCounts`] naming the first rank whose payload is off, or a failed
    /// collective.
    pub fn count_table(&self, layer: &str, key: u32, local: &LocalRouting) -> Result<CountTable> {
        self.exchange_counts(layer, key, local)
    }

    fn ep_layout(&self) -> EpLayout {
        EpLayout {
            peers: self.ep_peers.clone(),
            me: self.ep_rank(),
            experts: self.cfg.experts,
        }
    }

    /// Moves rows over the ep group as `matrix` says (identity without an ep group).
    fn exchange(
        &self,
        x: &Tensor,
        matrix: &[Vec<usize>],
        reverse: bool,
        times: &ExchangeTimes,
    ) -> Result<Tensor> {
        let Some(g) = &self.ep else {
            return Ok(x.clone());
        };
        let mut plan = ExchangePlan::new(matrix.to_vec(), g.rank())?;
        if reverse {
            plan = plan.reversed();
        }
        Ok(exchange_rows(x, g, &self.transport, &plan, Some(times))?)
    }

    /// The dispatch: `x`'s rows `rows` (send order) moved as `matrix` says, the permutation
    /// fused into the exchange where the communicator reads rows in place (a local gather
    /// without an ep group).
    fn exchange_gathered(
        &self,
        x: &Tensor,
        rows: &Arc<Vec<u32>>,
        matrix: &[Vec<usize>],
        times: &ExchangeTimes,
    ) -> Result<Tensor> {
        let Some(g) = &self.ep else {
            return Ok(ops::gather_rows(x, rows)?);
        };
        let plan = ExchangePlan::new(matrix.to_vec(), g.rank())?;
        Ok(exchange_gathered_rows(
            x,
            rows,
            g,
            &self.transport,
            &plan,
            Some(times),
        )?)
    }
}

/// The settings every rank must share, as one fixed-size record.
const AGREE_FIELDS: [&str; 10] = [
    "record version",
    "experts",
    "top_k",
    "d_model",
    "expert hidden size",
    "ep size",
    "capacity factor",
    "flags (normalize_top_k, rma dispatch)",
    "aux loss coefficient",
    "every",
];

fn check_agreement(
    comm: &Comm,
    cfg: &MoeConfig,
    d_model: usize,
    hidden: usize,
    ep_size: usize,
) -> Result<()> {
    let flags =
        u32::from(cfg.normalize_top_k) << 1 | u32::from(cfg.dispatch == DispatchKind::Rma) << 2;
    let mine: [u32; 10] = [
        0x4d6f_4501,
        cfg.experts as u32,
        cfg.top_k as u32,
        d_model as u32,
        hidden as u32,
        ep_size as u32,
        cfg.capacity_factor.map_or(0, |f| (f as f32).to_bits()),
        flags,
        (cfg.aux_loss_coef as f32).to_bits(),
        cfg.every as u32,
    ];
    let rank = comm.rank();
    if comm.size() == 1 {
        return Ok(());
    }
    let t = Tensor::from_vec(mine.to_vec(), mine.len(), comm.device())?;
    let all: Vec<u32> = comm.all_gather_single(&t)?.wait()?.to_vec1()?;
    let n = comm.size();
    let show = |f: usize, v: u32| -> String {
        match f {
            6 if v == 0 => "none (dropless)".into(),
            6 | 8 => format!("{}", f32::from_bits(v)),
            _ => v.to_string(),
        }
    };
    for (f, field) in AGREE_FIELDS.iter().enumerate() {
        let vals: Vec<u32> = (0..n).map(|r| all[r * mine.len() + f]).collect();
        let ours = {
            let mut best = (vals[0], 0);
            for &v in &vals {
                let c = vals.iter().filter(|&&w| w == v).count();
                if c > best.1 {
                    best = (v, c);
                }
            }
            best.0
        };
        if let Some(peer) = vals.iter().position(|&v| v != ours) {
            return Err(MoeError::RoutingMismatch {
                layer: "config".into(),
                rank,
                peer,
                field,
                ours: show(f, ours),
                theirs: show(f, vals[peer]),
            }
            .into());
        }
    }
    Ok(())
}

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
        let cfg = &groups.cfg;
        let e = cfg.experts;
        let rep: Placements = b
            .roles
            .placements(Placement::Replicate, Placement::Replicate);
        let mut sharded = rep.clone();
        if let Some(d) = b.roles.ep {
            sharded[d] = Placement::Shard(0);
        }
        let mut param = |n: &str, shape: &[usize], init: Init, p: &Placements| {
            b.store.param(&format!("{name}.{n}"), shape, init, p)
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
        })
    }

    /// The settings.
    pub fn config(&self) -> &MoeConfig {
        &self.groups.cfg
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
        for (d, g) in &self.groups.sync {
            if !w.managed_grad_dims().contains(d) {
                t = copy_to_group(&t, g)?;
            }
        }
        Ok(t)
    }

    /// The local experts on the received rows.
    fn experts(&self, recv: &Tensor, segments: &Arc<Vec<routing::Segment>>) -> Result<Tensor> {
        let _l = debug::label("experts");
        let w1 = self.local_weight(&self.w1)?;
        let b1 = self.local_weight(&self.b1)?;
        let h = ops::grouped_linear(recv, &w1, &b1, segments)?;
        let h = match &self.w3 {
            Some((w3, b3)) => {
                let gate = ops::grouped_linear(
                    recv,
                    &self.local_weight(w3)?,
                    &self.local_weight(b3)?,
                    segments,
                )?;
                ops::swiglu(&h, &gate)?
            }
            None => candle_dtensor_core::gelu_local(&h)?,
        };
        let w2 = self.local_weight(&self.w2)?;
        let b2 = self.local_weight(&self.b2)?;
        Ok(ops::grouped_linear(&h, &w2, &b2, segments)?)
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
        let x_in = match g.roles.tp {
            Some(_) => x.redistribute(&g.roles.with_tp(x.placements(), Placement::Replicate))?,
            None => x.clone(),
        };
        let (probs, gates, idx) = self.route(&x_in)?;
        let local = x_in.to_local();
        let (bl, tl, d) = local.dims3()?;
        let n = bl * tl;
        let xs = local.reshape((n, d))?;
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
            g.exchange_counts(&self.name, self.key, &routing)?
        };
        let cap = cfg
            .capacity_factor
            .map(|f| routing::capacity(f, table.total_tokens(), cfg.top_k, cfg.experts));
        let admission = Admission::new(&table, cap);
        let plan: DispatchPlan =
            routing::plan(&table, &admission, &routing, g.my_data, &g.ep_layout());
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
            ops::weighted_combine(
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
