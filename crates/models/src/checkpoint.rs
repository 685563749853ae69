//! Activation checkpointing: run a piece of the model without keeping its activations for
//! backward, and recompute them when backward reaches it.
//!
//! candle has no checkpoint API; [`checkpoint`] builds one from two custom graph nodes:
//!
//! - Forward runs `f` on a *detached* copy of the input's local tensor, so the autograd graph
//!   `f` builds (its activations) is dropped as soon as the output is copied out. What the
//!   outer graph keeps is the input (and the output, as any node does).
//! - The output is a node over the input whose backward recomputes `f` from a fresh leaf holding
//!   the saved input, runs backward of `sum(y * grad)` on that subgraph (the recompute's own
//!   graph, freed when the node's backward returns) and returns the input's gradient.
//! - The gradients of the parameters `f` uses reach the outer backward through a chain of tie
//!   nodes: at forward, every variable of `f`'s graph is tied into a scalar that the output node
//!   also depends on. The output node runs its backward before the ties (they are its
//!   ancestors), stashes each variable's gradient, and each tie hands its variable the stashed
//!   gradient. So `loss.backward()` returns every gradient in one `GradStore`, summed as usual
//!   with other uses of the same variable; the training loop changes nothing.
//!
//! # Requirements on `f`
//!
//! - `f` depends on tensors that track gradients only through its input and through
//!   parameters: candle `Var`s, or FSDP's full parameters (graph nodes over a shard `Var`).
//!   A tracked intermediate of the outer graph captured by `f` would be backpropagated twice.
//! - `f` is deterministic (the models of this crate have no dropout): the recompute must give
//!   the values forward gave.
//! - Collectives: `f`'s forward collectives (tensor / sequence parallelism) run again in the
//!   recompute, inside backward, followed by their adjoints. Every rank walks the same graph in
//!   the same order, so every rank recomputes the same pieces in the same order (as PyTorch's
//!   checkpoint). They are recorded as backward collectives under the label given.
//! - FSDP: the parameters' full tensors must hold data when the recompute runs. Wrapping the
//!   checkpointed output in [`Fsdp::post_forward`](candle_dtensor_parallel::fsdp::Fsdp) does
//!   that: its pre-backward node re-gathers the unit before the checkpoint's backward, and the
//!   recompute's inner backward runs the full parameters' FSDP nodes (stash, reduce_scatter,
//!   release) as a plain backward would.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use candle_core::{CustomOp2, Layout, Shape, Tensor, Var};
use candle_dtensor_core::{DTensor, Placement};
use candle_dtensor_kernels::storage::{self, DeviceStorage};
use candle_dtensor_mesh::DeviceMesh;

use crate::error::{ModelError, Result};

/// Which blocks of a [`Gpt`](crate::Gpt) run under [`checkpoint`] (`--ac` of train_gpt).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AcMode {
    /// Keep every activation (no recompute).
    #[default]
    None,
    /// Checkpoint every dense block: backward recomputes each block's forward, the graph keeps
    /// only each block's input.
    Full,
    /// Checkpoint every other dense block (the 2nd, 4th, ... dense block: blocks 1, 3, 5, ...
    /// of a model without mixture-of-experts blocks; torchtitan's layer-selective policy with
    /// frequency 2): about half of `Full`'s saving for half of its recompute.
    Selective,
}

impl AcMode {
    /// The names [`AcMode::from_str`] knows.
    pub const NAMES: [&'static str; 3] = ["none", "full", "selective"];

    /// Whether the `i`-th dense block (counted from 0 over the dense blocks only) runs under
    /// [`checkpoint`]. Mixture-of-experts blocks never do (their routing statistics and
    /// dispatch are not replayed).
    pub fn checkpoints(self, i: usize) -> bool {
        match self {
            AcMode::None => false,
            AcMode::Full => true,
            AcMode::Selective => i % 2 == 1,
        }
    }

    /// The name `--ac` takes.
    pub fn name(self) -> &'static str {
        match self {
            AcMode::None => "none",
            AcMode::Full => "full",
            AcMode::Selective => "selective",
        }
    }
}

impl std::fmt::Display for AcMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AcMode {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "none" => Ok(AcMode::None),
            "full" => Ok(AcMode::Full),
            "selective" => Ok(AcMode::Selective),
            other => Err(ModelError::Config(format!(
                "activation checkpointing {other:?}: not one of {}",
                AcMode::NAMES.join(", ")
            ))),
        }
    }
}

/// The recomputed function of a checkpoint.
type Recompute = Arc<dyn Fn(&DTensor) -> Result<DTensor> + Send + Sync>;

/// Gradients of a checkpoint's variables, from its output node's backward to its ties.
type Stash = Arc<Mutex<HashMap<usize, Tensor>>>;

/// The checkpoint's output: a node over `(input, tie chain)` whose forward hands out the value
/// computed beforehand and whose backward recomputes.
struct Recomputed {
    value: Mutex<Option<Tensor>>,
    f: Recompute,
    /// The context-parallel settings the forward ran under.
    cp: candle_dtensor_core::cp::Settings,
    /// The input's mesh, placements and global shape.
    mesh: DeviceMesh,
    placements: Vec<Placement>,
    shape: Vec<usize>,
    vars: Vec<Tensor>,
    stash: Stash,
    label: Option<String>,
}

impl Recomputed {
    fn forward<S: DeviceStorage>(&self, _s: &S, _l: &Layout) -> candle_core::Result<(S, Shape)> {
        let value = self
            .value
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg("checkpoint: output already built".into()))?;
        Ok((storage::output_of::<S>(&value)?, value.shape().clone()))
    }
}

impl CustomOp2 for Recomputed {
    fn name(&self) -> &'static str {
        "activation-checkpoint"
    }

    candle_dtensor_kernels::device_fwd2!(forward, first_only);

    fn bwd(
        &self,
        x: &Tensor,
        tie: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let _b = candle_dtensor_core::debug::enter_backward(self.label.as_deref());
        let leaf = Var::from_tensor(&x.detach())?;
        let input = DTensor::from_local_with_shape(
            leaf.as_tensor(),
            &self.mesh,
            &self.placements,
            &self.shape,
        )
        .map_err(ModelError::from)?;
        // The forward's context-parallel settings (its causal positions) hold for the recompute
        // too: backward runs after the forward's scopes have ended.
        let _cp = self.cp.enter();
        let y = (self.f)(&input)?;
        let y = y.to_local();
        if y.shape() != grad.shape() {
            return Err(ModelError::Recompute(format!(
                "the recompute gave shape {:?}, forward {:?} (rule: the checkpointed function \
                 is deterministic)",
                y.dims(),
                grad.dims()
            ))
            .into());
        }
        let grad = grad.to_dtype(y.dtype())?;
        let mut grads = y.mul(&grad)?.sum_all()?.backward()?;
        let gx = match grads.remove(leaf.as_tensor()) {
            Some(g) => g,
            None => x.zeros_like()?,
        };
        {
            let mut stash = self.stash.lock().unwrap_or_else(|e| e.into_inner());
            for (i, v) in self.vars.iter().enumerate() {
                if let Some(g) = grads.remove(v) {
                    stash.insert(i, g);
                }
            }
        }
        Ok((Some(gx), Some(tie.zeros_like()?)))
    }
}

/// Ties variable `index` of a checkpoint into its scalar chain: forward copies the scalar,
/// backward passes the scalar's gradient on and hands the variable its stashed gradient.
struct Tie {
    index: usize,
    stash: Stash,
}

impl Tie {
    fn forward<S: DeviceStorage>(&self, s: &S, l: &Layout) -> candle_core::Result<(S, Shape)> {
        Ok((storage::owned_copy(s, l)?, l.shape().clone()))
    }
}

impl CustomOp2 for Tie {
    fn name(&self) -> &'static str {
        "activation-checkpoint-tie"
    }

    candle_dtensor_kernels::device_fwd2!(forward, first_only);

    fn bwd(
        &self,
        _chain: &Tensor,
        _var: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let g = self
            .stash
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.index);
        Ok((Some(grad.clone()), g))
    }
}

/// `f(x)`, keeping only `x` for backward and recomputing `f` there (see the module docs for
/// how, and for what `f` must satisfy). The value, and every gradient `loss.backward()` yields,
/// are those of `f(x)` without the checkpoint. `label` names the recompute's collectives in a
/// `CommDebugMode` (recorded as backward).
///
/// # Errors
///
/// `f`'s own errors; candle's, building the nodes. In backward (as a candle error wrapping
/// it): [`ModelError::Recompute`] when the recompute's output shape differs from forward's,
/// and the recompute's own errors.
pub fn checkpoint<F>(x: &DTensor, label: Option<&str>, f: F) -> Result<DTensor>
where
    F: Fn(&DTensor) -> Result<DTensor> + Send + Sync + 'static,
{
    let local = x.to_local();
    let detached =
        DTensor::from_local_with_shape(&local.detach(), x.mesh(), x.placements(), x.shape())?;
    let y = f(&detached)?;
    let y_local = y.to_local();
    // The variables f's graph reaches (its parameters, or FSDP's shards behind their full
    // parameters), in a fixed order: the same on every rank.
    let vars: Vec<Tensor> = y_local
        .sorted_nodes()
        .into_iter()
        .filter(|n| n.is_variable())
        .cloned()
        .collect();
    if vars.is_empty() && !local.track_op() {
        // Nothing to differentiate: no node.
        return Ok(y.clone());
    }
    let stash: Stash = Arc::new(Mutex::new(HashMap::new()));
    let mut chain = Tensor::zeros((), local.dtype(), local.device())?;
    for (index, v) in vars.iter().enumerate() {
        chain = chain.apply_op2(
            v,
            Tie {
                index,
                stash: stash.clone(),
            },
        )?;
    }
    let value = y_local.detach();
    let (mesh, placements, shape) = (
        y.mesh().clone(),
        y.placements().to_vec(),
        y.shape().to_vec(),
    );
    // f's graph goes here: only its output's value is kept.
    drop(y);
    let out = local.apply_op2(
        &chain,
        Recomputed {
            value: Mutex::new(Some(value)),
            f: Arc::new(f),
            cp: candle_dtensor_core::cp::Settings::current(),
            mesh: x.mesh().clone(),
            placements: x.placements().to_vec(),
            shape: x.shape().to_vec(),
            vars,
            stash,
            label: label.map(str::to_string),
        },
    )?;
    Ok(DTensor::from_local_with_shape(
        &out,
        &mesh,
        &placements,
        &shape,
    )?)
}
