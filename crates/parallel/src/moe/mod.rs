//! Expert parallelism for a mixture-of-experts feed-forward layer over the mesh dim `ep`: the
//! settings ([`MoeConfig`]), the communicators ([`MoeGroups`]), the routing tables
//! ([`routing`]) and the dispatch / combine ops ([`ops`]). The layer itself (router and expert
//! parameters, its forward) is candle-dtensor-models' `MoeLayer`, built on these.
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
//!    loop ([`local::grouped_linear`]).
//! 4. **Combine**: the reverse exchange, then each token's rows weighted by its router weights
//!    (f32) and summed.
//!
//! Backward is the same path reversed: each exchange's adjoint is the reverse exchange
//! ([`candle_dtensor_core::functional::exchange_rows`]); the router gets its gradient through
//! the combine weights and the balancing loss; expert weights get theirs locally (all-reduced
//! over the data dims other than `ep` unless FSDP reduces them). Every piece is one graph node
//! whose edges do not depend on the counts ([`ops`]), so ranks whose experts got no tokens build
//! the same graph as their peers.

pub(crate) mod error;
pub mod local;
pub mod routing;

pub use error::MoeError;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use candle_dtensor_comm::Comm;
use candle_dtensor_core::debug;
use candle_dtensor_core::functional::{
    exchange_gathered_rows, exchange_rows, ExchangePlan, ExchangeTimes, Group, RmaExchange,
    Transport,
};
use candle_dtensor_mesh::grid::{ravel, unravel};
use candle_dtensor_mesh::DeviceMesh;

use crate::error::{ParallelError, Result};
use crate::tp_plan::MeshRoles;
use routing::{CountTable, EpLayout, LocalRouting, TableError};

/// How tokens travel to their experts and back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DispatchKind {
    /// `all_to_all_v_single` (any backend).
    AllToAllV,
    /// Puts with a signal into the owners' RMA windows (backends with RMA put and signal:
    /// the local backend).
    Rma,
}

/// Mixture-of-experts settings of a GPT (candle-dtensor-models' `GptConfig::moe`).
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

/// What a layer measured since the last `MoeLayer::take_stats` (candle-dtensor-models).
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
        let cerr = |reason: String| -> ParallelError {
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

    /// The settings every rank agreed on.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// The mesh dim roles.
    pub fn roles(&self) -> &MeshRoles {
        &self.roles
    }

    /// This rank's data rank (its place in the count exchange).
    pub fn data_rank(&self) -> usize {
        self.my_data
    }

    /// The data dims other than `ep` and their groups: where expert gradients are all-reduced
    /// (unless FSDP manages the dim).
    pub fn sync_groups(&self) -> &[(usize, Group)] {
        &self.sync
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
        // The gathered counts are read on the host (a host synchronisation on a GPU).
        candle_dtensor_kernels::storage::note_host_read();
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

    /// Where this rank's ep group's experts live.
    pub fn ep_layout(&self) -> EpLayout {
        EpLayout {
            peers: self.ep_peers.clone(),
            me: self.ep_rank(),
            experts: self.cfg.experts,
        }
    }

    /// Moves rows over the ep group as `matrix` says (identity without an ep group).
    ///
    /// # Errors
    ///
    /// A bad matrix or a failed exchange.
    pub fn exchange(
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
    ///
    /// # Errors
    ///
    /// A bad matrix or a failed exchange.
    pub fn exchange_gathered(
        &self,
        x: &Tensor,
        rows: &Arc<Vec<u32>>,
        matrix: &[Vec<usize>],
        times: &ExchangeTimes,
    ) -> Result<Tensor> {
        let Some(g) = &self.ep else {
            return Ok(local::gather_rows(x, rows)?);
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
