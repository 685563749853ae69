//! One executor for every schedule: runs a rank's action list, moving activations and
//! gradients between neighbouring stages over point-to-point transfers.
//!
//! # Transfers
//!
//! Transfers are derived from the compute actions. A `Forward` on stage `s < p v - 1` sends
//! its output to stage `s + 1` (rank `(r + 1) % p`); a `Backward` / `BackwardInput` on stage
//! `s > 0` sends its input gradient to stage `s - 1` (rank `(r - 1) % p`). Each direction of
//! each neighbouring pair has a two-rank communicator of its own ([`PipeComms`]), so every
//! communicator carries one stream in one direction. That matters because a communicator runs
//! its ops in issue order: on one shared communicator a receive posted early would hold up the
//! sends queued behind it, and 1F1B's crossing streams could deadlock.
//!
//! A receiver knows its sender's action list (every rank holds the whole schedule), so it
//! knows the order of the messages on each incoming stream and posts the receives in that
//! order, keeping what arrives until its action runs. Before running action `i` it posts the
//! receives that actions `i` and `i + 1` need, so the next action's input moves while this one
//! computes; sends are posted and not waited for until the end (the local backend buffers
//! them; completed ones are reaped after each action).
//!
//! # Timing
//!
//! Each action's compute time is busy time; the time blocked on a receive before an action
//! and on the outstanding sends at the end is idle. The report's bubble fraction is
//! `1 - busy / wall`, wall measured from a barrier at the start.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use candle_core::{DType, Shape, Tensor};
use candle_dtensor_comm::{Comm, Work};

use super::actions::{Action, Schedule};
use super::error::{PipelineError, StageError};

/// One rank's share of a pipelined model: `v` model chunks (one with non-interleaved
/// schedules), each holding a contiguous run of layers.
///
/// Stage `chunk * p + rank` is the first stage when it is 0 (its forward reads the
/// micro-batch itself: `input` is `None`) and the last when it is `p v - 1` (its forward
/// returns the micro-batch's loss, and its backward starts from it: `grad_out` is `None`).
/// For a correct global loss the last stage scales each micro-batch's loss by the global
/// batch (e.g. sum over the micro-batch's tokens divided by the global token count), so that
/// the micro-batch losses add up to the full batch's.
///
/// A stage keeps what its backward needs between `forward` and `backward` (per chunk and
/// micro-batch) and accumulates parameter gradients over micro-batches. With candle's
/// autograd: make the received activation a `Var` (`Var::from_tensor`), run the chunk, keep
/// the output; in backward run `(out * grad_out).sum_all()?.backward()?` (or `out.backward()`
/// on the loss), read the `Var`'s gradient as the input gradient and add the parameters'.
/// Inside a stage any candle or DTensor code runs (e.g. tensor parallelism on a sub-mesh).
pub trait Stage {
    /// Forward of micro-batch `mb` through local chunk `chunk`; `input` is the previous
    /// stage's output (`None` on the first stage). Returns the output (the loss on the last
    /// stage).
    ///
    /// # Errors
    ///
    /// Whatever the stage's computation raises.
    fn forward(
        &mut self,
        chunk: usize,
        mb: usize,
        input: Option<Tensor>,
    ) -> Result<Tensor, StageError>;

    /// Full backward of `mb` through `chunk`: `grad_out` is the gradient of the chunk's output
    /// (`None` on the last stage, whose output is the loss). Accumulates the parameter
    /// gradients and returns the input gradient (`None` allowed on the first stage only).
    ///
    /// # Errors
    ///
    /// Whatever the stage's computation raises.
    fn backward(
        &mut self,
        chunk: usize,
        mb: usize,
        grad_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, StageError>;

    /// Zero-bubble `B`: the input gradient only; keeps what [`Stage::backward_weight`] needs.
    /// The default refuses (a stage that cannot split its backward cannot run ZB schedules).
    ///
    /// # Errors
    ///
    /// By default always; otherwise whatever the computation raises.
    fn backward_input(
        &mut self,
        chunk: usize,
        mb: usize,
        grad_out: Option<Tensor>,
    ) -> Result<Option<Tensor>, StageError> {
        let _ = (chunk, mb, grad_out);
        Err("this stage does not split its backward (no backward_input)".into())
    }

    /// Zero-bubble `W`: accumulates the parameter gradients of `mb` on `chunk` after its
    /// [`Stage::backward_input`]. The default refuses.
    ///
    /// # Errors
    ///
    /// By default always; otherwise whatever the computation raises.
    fn backward_weight(&mut self, chunk: usize, mb: usize) -> Result<(), StageError> {
        let _ = (chunk, mb);
        Err("this stage does not split its backward (no backward_weight)".into())
    }

    /// Shape and dtype of `chunk`'s input for micro-batch `mb` (what the previous stage
    /// sends; asked for chunks that are not the first stage).
    ///
    /// # Errors
    ///
    /// When the stage cannot tell.
    fn input_shape(&self, chunk: usize, mb: usize) -> Result<(Shape, DType), StageError>;

    /// Shape and dtype of `chunk`'s output for micro-batch `mb` (the gradient the next stage
    /// sends back; asked for chunks that are not the last stage).
    ///
    /// # Errors
    ///
    /// When the stage cannot tell.
    fn output_shape(&self, chunk: usize, mb: usize) -> Result<(Shape, DType), StageError>;
}

/// The point-to-point communicators of one pipeline rank: for each direction of each
/// neighbouring pair (including the wrap from the last rank to the first that interleaved
/// schedules use), a two-rank communicator split from the pipeline communicator.
pub struct PipeComms {
    pp: Comm,
    /// Activations to rank `r + 1` (we are rank 0 of it).
    act_send: Option<Comm>,
    /// Activations from rank `r - 1` (we are rank 1 of it).
    act_recv: Option<Comm>,
    /// Gradients to rank `r - 1` (we are rank 1 of it).
    grad_send: Option<Comm>,
    /// Gradients from rank `r + 1` (we are rank 0 of it).
    grad_recv: Option<Comm>,
}

impl PipeComms {
    /// Splits the pipeline communicator `pp` (its rank `r` holds stage `r`, and chunk `c`'s
    /// stage `c p + r`) into the per-direction communicators. Collective over `pp`.
    ///
    /// # Errors
    ///
    /// A failed split.
    pub fn new(pp: &Comm) -> Result<Self, PipelineError> {
        let (p, r) = (pp.size(), pp.rank());
        let mut out = PipeComms {
            pp: pp.clone(),
            act_send: None,
            act_recv: None,
            grad_send: None,
            grad_recv: None,
        };
        if p == 1 {
            return Ok(out);
        }
        for i in 0..p {
            let next = (i + 1) % p;
            let members = [i, next];
            let mine: &[usize] = if r == i || r == next { &members } else { &[] };
            let act = pp.split(mine, &format!("{}.pp_act{i}", pp.name()))?;
            let grad = pp.split(mine, &format!("{}.pp_grad{i}", pp.name()))?;
            if r == i {
                out.act_send = act.clone();
                out.grad_recv = grad.clone();
            }
            if r == next {
                out.act_recv = act;
                out.grad_send = grad;
            }
        }
        Ok(out)
    }

    /// This rank in the pipeline.
    pub fn rank(&self) -> usize {
        self.pp.rank()
    }

    /// Pipeline ranks.
    pub fn size(&self) -> usize {
        self.pp.size()
    }
}

/// Times of one executed action, from the start of the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepTime {
    /// The action.
    pub action: Action,
    /// When its compute started.
    pub start: Duration,
    /// When its compute ended.
    pub end: Duration,
    /// How long the rank blocked on the action's input before it.
    pub waited: Duration,
}

/// What one rank's run of a schedule measured, and the last stage's losses.
#[derive(Debug, Clone)]
pub struct PipelineReport {
    /// The rank.
    pub rank: usize,
    /// Time in the stage's forward / backward calls.
    pub busy: Duration,
    /// Time blocked on receives and, at the end, on outstanding sends.
    pub idle: Duration,
    /// From the starting barrier to the last send's completion.
    pub wall: Duration,
    /// Every action with its times.
    pub steps: Vec<StepTime>,
    /// The last stage's forward outputs (the micro-batch losses, detached), by micro-batch,
    /// on the rank holding the last stage; empty elsewhere.
    pub losses: Vec<(usize, Tensor)>,
}

impl PipelineReport {
    /// This rank's bubble: `1 - busy / wall`.
    pub fn bubble_fraction(&self) -> f64 {
        let wall = self.wall.as_secs_f64();
        if wall <= 0.0 {
            return 0.0;
        }
        1.0 - self.busy.as_secs_f64() / wall
    }

    /// The pipeline's bubble over all ranks' reports: `1 - sum(busy) / (p * max(wall))`
    /// (the simulator's definition; the ranks start together at the barrier).
    pub fn combined_bubble(reports: &[PipelineReport]) -> f64 {
        let wall = reports
            .iter()
            .map(|r| r.wall.as_secs_f64())
            .fold(0.0, candle_dtensor_kernels::compare::nan_max);
        if reports.is_empty() || wall <= 0.0 {
            return 0.0;
        }
        let busy: f64 = reports.iter().map(|r| r.busy.as_secs_f64()).sum();
        1.0 - busy / (reports.len() as f64 * wall)
    }
}

type Key = (usize, usize); // (micro-batch, receiving stage)

/// One incoming stream: the keys in the sender's order, the receives posted, what arrived.
struct Inbound {
    comm: Option<Comm>,
    peer: usize,
    grads: bool,
    order: Vec<Key>,
    index: HashMap<Key, usize>,
    next_post: usize,
    posted: VecDeque<(Key, Work<Tensor>)>,
    arrived: HashMap<Key, Tensor>,
}

impl Inbound {
    fn new(comm: Option<Comm>, peer: usize, grads: bool, order: Vec<Key>) -> Self {
        let index = order.iter().enumerate().map(|(i, k)| (*k, i)).collect();
        Inbound {
            comm,
            peer,
            grads,
            order,
            index,
            next_post: 0,
            posted: VecDeque::new(),
            arrived: HashMap::new(),
        }
    }

    /// Posts receives in stream order up to and including `key`.
    fn post_until(
        &mut self,
        key: Key,
        stage: &dyn Stage,
        p: usize,
        rank: usize,
        action: Action,
    ) -> Result<(), PipelineError> {
        let Some(comm) = &self.comm else {
            return Ok(()); // local delivery (p == 1)
        };
        let want =
            self.index.get(&key).copied().ok_or_else(|| {
                PipelineError::Setup(format!(
                "rank {rank}: {action} needs {} for micro-batch {} stage {} that no stage sends",
                if self.grads { "a gradient" } else { "an activation" },
                key.0,
                key.1
            ))
            })?;
        while self.next_post <= want {
            let k = self.order[self.next_post];
            let chunk = k.1 / p;
            let shape = if self.grads {
                stage.output_shape(chunk, k.0)
            } else {
                stage.input_shape(chunk, k.0)
            }
            .map_err(|source| PipelineError::Stage {
                rank,
                action,
                source,
            })?;
            let work =
                comm.recv(self.peer, shape.0, shape.1)
                    .map_err(|source| PipelineError::Comm {
                        rank,
                        action,
                        source: Box::new(source),
                    })?;
            self.posted.push_back((k, work));
            self.next_post += 1;
        }
        Ok(())
    }

    /// Takes `key`'s tensor, waiting for the receives in stream order up to it.
    fn take(&mut self, key: Key, rank: usize, action: Action) -> Result<Tensor, PipelineError> {
        loop {
            if let Some(t) = self.arrived.remove(&key) {
                return Ok(t);
            }
            let Some((k, work)) = self.posted.pop_front() else {
                return Err(PipelineError::Setup(format!(
                    "rank {rank}: {action}: input for micro-batch {} stage {} never posted",
                    key.0, key.1
                )));
            };
            let t = work.wait().map_err(|source| PipelineError::Comm {
                rank,
                action,
                source: Box::new(source),
            })?;
            self.arrived.insert(k, t);
        }
    }
}

/// Runs rank `comms.rank()`'s actions of `schedule` on `stage`.
///
/// Collective over the pipeline communicator: every rank calls it with the same schedule.
/// Every wait is bounded by the communicators' op timeout (a receive is posted at most one
/// action ahead of its use, so the timeout must cover about two actions of the slowest rank
/// plus the transfer).
///
/// # Errors
///
/// [`PipelineError::Setup`] when the schedule's ranks differ from the communicator's (before
/// anything runs), [`PipelineError::Stage`] when the stage fails, [`PipelineError::Comm`] when
/// a transfer fails or times out (naming the action it was for).
pub fn run_schedule(
    stage: &mut dyn Stage,
    schedule: &Schedule,
    comms: &PipeComms,
) -> Result<PipelineReport, PipelineError> {
    let (p, rank) = (comms.size(), comms.rank());
    if schedule.ranks() != p {
        return Err(PipelineError::Setup(format!(
            "schedule {} has {} ranks, the pipeline communicator {p}",
            schedule.kind(),
            schedule.ranks()
        )));
    }
    let stages = schedule.stages();
    let last = stages - 1;
    let prev = (rank + p - 1) % p;
    let next = (rank + 1) % p;
    // Incoming streams in their senders' order.
    let act_order: Vec<Key> = schedule
        .actions(prev)
        .iter()
        .filter(|a| matches!(a, Action::Forward { .. }))
        .map(|a| (a.mb(), schedule.stage_of(prev, a.chunk()) + 1))
        .filter(|&(_, s)| s <= last)
        .collect();
    let grad_order: Vec<Key> = schedule
        .actions(next)
        .iter()
        .filter(|a| a.sends_grad())
        .map(|a| (a.mb(), schedule.stage_of(next, a.chunk())))
        .filter(|&(_, s)| s > 0)
        .map(|(mb, s)| (mb, s - 1))
        .collect();
    // Senders are communicator rank 0 on activation streams... and rank 1 on gradient ones.
    let mut acts_in = Inbound::new(comms.act_recv.clone(), 0, false, act_order);
    let mut grads_in = Inbound::new(comms.grad_recv.clone(), 1, true, grad_order);
    let mut sends: Vec<(Action, Work<()>)> = Vec::new();
    let actions = schedule.actions(rank);

    // What an action receives: (is it a gradient, key).
    let need = |a: &Action| -> Option<(bool, Key)> {
        let s = schedule.stage_of(rank, a.chunk());
        match a {
            Action::Forward { .. } if s > 0 => Some((false, (a.mb(), s))),
            Action::Backward { .. } | Action::BackwardInput { .. } if s < last => {
                Some((true, (a.mb(), s)))
            }
            _ => None,
        }
    };

    comms
        .pp
        .barrier()
        .and_then(|w| w.wait())
        .map_err(PipelineError::from)?;
    let t0 = Instant::now();
    let mut busy = Duration::ZERO;
    let mut idle = Duration::ZERO;
    let mut steps = Vec::with_capacity(actions.len());
    let mut losses = Vec::new();
    for (i, &a) in actions.iter().enumerate() {
        for j in [i, i + 1] {
            if let Some(b) = actions.get(j) {
                if let Some((g, key)) = need(b) {
                    let inbound = if g { &mut grads_in } else { &mut acts_in };
                    inbound.post_until(key, &*stage, p, rank, a)?;
                }
            }
        }
        let w0 = Instant::now();
        let input = match need(&a) {
            Some((true, key)) => Some(grads_in.take(key, rank, a)?),
            Some((false, key)) => Some(acts_in.take(key, rank, a)?),
            None => None,
        };
        let start = Instant::now();
        let waited = start - w0;
        idle += waited;
        let s = schedule.stage_of(rank, a.chunk());
        let stage_err = |source| PipelineError::Stage {
            rank,
            action: a,
            source,
        };
        // What to send: (is it a gradient, tensor).
        let out: Option<(bool, Tensor)> = match a {
            Action::Forward { mb, chunk } => {
                let y = stage.forward(chunk, mb, input).map_err(stage_err)?;
                if s == last {
                    losses.push((mb, y.detach()));
                    None
                } else {
                    Some((false, y))
                }
            }
            Action::Backward { mb, chunk } | Action::BackwardInput { mb, chunk } => {
                let g = if matches!(a, Action::Backward { .. }) {
                    stage.backward(chunk, mb, input)
                } else {
                    stage.backward_input(chunk, mb, input)
                }
                .map_err(stage_err)?;
                match (g, s) {
                    (_, 0) => None,
                    (Some(g), _) => Some((true, g)),
                    (None, _) => {
                        return Err(PipelineError::Setup(format!(
                            "rank {rank}: {a} on stage {s} returned no input gradient"
                        )))
                    }
                }
            }
            Action::BackwardWeight { mb, chunk } => {
                stage.backward_weight(chunk, mb).map_err(stage_err)?;
                None
            }
        };
        let end = Instant::now();
        busy += end - start;
        steps.push(StepTime {
            action: a,
            start: start - t0,
            end: end - t0,
            waited,
        });
        if let Some((grad, t)) = out {
            let key = if grad {
                (a.mb(), s - 1)
            } else {
                (a.mb(), s + 1)
            };
            let (comm, peer, local) = if grad {
                (&comms.grad_send, 0, &mut grads_in)
            } else {
                (&comms.act_send, 1, &mut acts_in)
            };
            match comm {
                Some(c) => {
                    let w = c.send(&t, peer).map_err(|source| PipelineError::Comm {
                        rank,
                        action: a,
                        source: Box::new(source),
                    })?;
                    sends.push((a, w));
                }
                // One rank: the stream loops back.
                None => {
                    local.arrived.insert(key, t);
                }
            }
        }
        // Reap completed sends (surfacing their errors early).
        let mut k = 0;
        while k < sends.len() {
            if sends[k].1.is_completed() {
                let (sa, w) = sends.swap_remove(k);
                w.wait().map_err(|source| PipelineError::Comm {
                    rank,
                    action: sa,
                    source: Box::new(source),
                })?;
            } else {
                k += 1;
            }
        }
    }
    let w0 = Instant::now();
    for (sa, w) in sends {
        w.wait().map_err(|source| PipelineError::Comm {
            rank,
            action: sa,
            source: Box::new(source),
        })?;
    }
    idle += w0.elapsed();
    let wall = t0.elapsed();
    tracing::debug!(
        rank,
        schedule = %schedule.kind(),
        busy_ms = busy.as_secs_f64() * 1e3,
        wall_ms = wall.as_secs_f64() * 1e3,
        "pipeline schedule ran"
    );
    Ok(PipelineReport {
        rank,
        busy,
        idle,
        wall,
        steps,
        losses,
    })
}
