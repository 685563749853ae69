//! One executor for every schedule: runs a rank's action list, moving activations and
//! gradients between neighbouring stages over point-to-point transfers.
//!
//! # Transfers
//!
//! Transfers are derived from the compute actions. A `Forward` on stage `s < p v - 1` sends
//! its output to stage `s + 1`; a `Backward` / `BackwardInput` on stage `s > 0` sends its
//! input gradient to stage `s - 1`, on whichever rank holds it ([`Schedule::place_of`]: rank
//! `(r + 1) % p` and `(r - 1) % p` for looped chunks, either neighbour or the rank itself in
//! ZB-V's V). A transfer to a stage on the same rank is handed over in memory. Each stream (a
//! sender, a receiver, activations or gradients) has a two-rank communicator of its own
//! ([`PipeComms`]), so every communicator carries one stream in one direction. That matters
//! because a communicator runs its ops in issue order: on one shared communicator a receive
//! posted early would hold up the sends queued behind it, and 1F1B's crossing streams could
//! deadlock.
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
/// Chunk `chunk`'s stage ([`Schedule::stage_of`]: `chunk * p + rank`, or the V of ZB-V) is the
/// first stage when it is 0 (its forward reads the
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

/// One direction of transfers: (sending rank, receiving rank, gradients rather than
/// activations), ranks of the pipeline communicator.
type Stream = (usize, usize, bool);

/// The point-to-point communicators of one pipeline rank: for each stream it sends or
/// receives, a two-rank communicator split from the pipeline communicator (the sender is its
/// rank 0, the receiver its rank 1).
pub struct PipeComms {
    pp: Comm,
    streams: HashMap<Stream, Comm>,
}

impl PipeComms {
    /// The streams of looped schedules (GPipe, 1F1B, interleaved 1F1B, ZB-H1): activations
    /// from each rank to the next and gradients back, including the wrap from the last rank to
    /// the first that interleaved schedules use. Collective over `pp` (whose rank `r` holds
    /// stage `r`, and chunk `c`'s stage `c p + r`).
    ///
    /// # Errors
    ///
    /// A failed split.
    pub fn new(pp: &Comm) -> Result<Self, PipelineError> {
        let p = pp.size();
        let streams: Vec<Stream> = if p == 1 {
            Vec::new()
        } else {
            (0..p)
                .flat_map(|i| [(i, (i + 1) % p, false), ((i + 1) % p, i, true)])
                .collect()
        };
        Self::split(pp, &streams)
    }

    /// The streams `schedule`'s transfers use (those between different ranks), e.g. for
    /// ZB-V's V both directions of activations and gradients between neighbours, and no wrap.
    /// Collective over `pp`: every rank passes the same schedule.
    ///
    /// # Errors
    ///
    /// A failed split; a schedule whose ranks differ from `pp`'s.
    pub fn for_schedule(pp: &Comm, schedule: &Schedule) -> Result<Self, PipelineError> {
        if schedule.ranks() != pp.size() {
            return Err(PipelineError::Setup(format!(
                "schedule {} has {} ranks, the pipeline communicator {}",
                schedule.kind(),
                schedule.ranks(),
                pp.size()
            )));
        }
        let mut streams: Vec<Stream> = (0..schedule.ranks())
            .flat_map(|r| {
                schedule
                    .actions(r)
                    .iter()
                    .filter_map(move |a| destination(schedule, r, a))
                    .filter(move |&(to, _, _)| to != r)
                    .map(move |(to, grad, _)| (r, to, grad))
            })
            .collect();
        streams.sort_unstable();
        streams.dedup();
        Self::split(pp, &streams)
    }

    /// Splits one communicator per stream, in the same order on every rank.
    fn split(pp: &Comm, streams: &[Stream]) -> Result<Self, PipelineError> {
        let r = pp.rank();
        let mut out = PipeComms {
            pp: pp.clone(),
            streams: HashMap::new(),
        };
        for &(from, to, grad) in streams {
            let members = [from, to];
            let mine: &[usize] = if r == from || r == to { &members } else { &[] };
            let kind = if grad { "grad" } else { "act" };
            if let Some(c) = pp.split(mine, &format!("{}.pp_{kind}{from}to{to}", pp.name()))? {
                out.streams.insert((from, to, grad), c);
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

    /// The communicator of a stream this rank is an end of.
    fn stream(&self, s: Stream) -> Result<&Comm, PipelineError> {
        self.streams.get(&s).ok_or_else(|| {
            PipelineError::Setup(format!(
                "rank {}: no communicator for the {} from pipeline rank {} to {} (build \
                 PipeComms with for_schedule for this schedule)",
                self.rank(),
                if s.2 { "gradients" } else { "activations" },
                s.0,
                s.1
            ))
        })
    }
}

/// Where action `a` of rank `r` sends its result: (receiving rank, gradient, key), or `None`
/// (the last stage's forward, the first stage's backward, `W`).
fn destination(schedule: &Schedule, r: usize, a: &Action) -> Option<(usize, bool, Key)> {
    let s = schedule.stage_of(r, a.chunk());
    match a {
        Action::Forward { .. } if s + 1 < schedule.stages() => {
            Some((schedule.place_of(s + 1).0, false, (a.mb(), s + 1)))
        }
        _ if a.sends_grad() && s > 0 => Some((schedule.place_of(s - 1).0, true, (a.mb(), s - 1))),
        _ => None,
    }
}

/// What action `a` of rank `r` receives: (sending rank, gradient, key), or `None`.
fn source(schedule: &Schedule, r: usize, a: &Action) -> Option<(usize, bool, Key)> {
    let s = schedule.stage_of(r, a.chunk());
    match a {
        Action::Forward { .. } if s > 0 => Some((schedule.place_of(s - 1).0, false, (a.mb(), s))),
        _ if a.sends_grad() && s + 1 < schedule.stages() => {
            Some((schedule.place_of(s + 1).0, true, (a.mb(), s)))
        }
        _ => None,
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
    comm: Comm,
    grads: bool,
    order: Vec<Key>,
    index: HashMap<Key, usize>,
    next_post: usize,
    posted: VecDeque<(Key, Work<Tensor>)>,
    arrived: HashMap<Key, Tensor>,
}

impl Inbound {
    fn new(comm: Comm, grads: bool, order: Vec<Key>) -> Self {
        let index = order.iter().enumerate().map(|(i, k)| (*k, i)).collect();
        Inbound {
            comm,
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
        schedule: &Schedule,
        rank: usize,
        action: Action,
    ) -> Result<(), PipelineError> {
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
            let chunk = schedule.place_of(k.1).1;
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
            // The sender is the stream communicator's rank 0.
            let work =
                self.comm
                    .recv(0, shape.0, shape.1)
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
    let last = schedule.stages() - 1;
    // Incoming streams, each in its sender's order.
    let mut inbound: HashMap<(usize, bool), Inbound> = HashMap::new();
    for from in (0..p).filter(|&r| r != rank) {
        for grad in [false, true] {
            let order: Vec<Key> = schedule
                .actions(from)
                .iter()
                .filter_map(|a| destination(schedule, from, a))
                .filter(|&(to, g, _)| to == rank && g == grad)
                .map(|(_, _, key)| key)
                .collect();
            if !order.is_empty() {
                let comm = comms.stream((from, rank, grad))?.clone();
                inbound.insert((from, grad), Inbound::new(comm, grad, order));
            }
        }
    }
    // Transfers between two stages of this rank, kept until used.
    let mut local: HashMap<(bool, Key), Tensor> = HashMap::new();
    let mut sends: Vec<(Action, Work<()>)> = Vec::new();
    let actions = schedule.actions(rank);

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
                if let Some((from, g, key)) = source(schedule, rank, b) {
                    if let Some(stream) = inbound.get_mut(&(from, g)) {
                        stream.post_until(key, &*stage, schedule, rank, a)?;
                    }
                }
            }
        }
        let w0 = Instant::now();
        let input = match source(schedule, rank, &a) {
            Some((from, g, key)) if from == rank => {
                Some(local.remove(&(g, key)).ok_or_else(|| {
                    PipelineError::Setup(format!(
                        "rank {rank}: {a}: its input from stage {} of this rank was not made \
                         before it",
                        if g { key.1 + 1 } else { key.1 - 1 }
                    ))
                })?)
            }
            Some((from, g, key)) => {
                let stream = inbound.get_mut(&(from, g)).ok_or_else(|| {
                    PipelineError::Setup(format!(
                        "rank {rank}: {a} needs input from pipeline rank {from}, which sends none"
                    ))
                })?;
                Some(stream.take(key, rank, a)?)
            }
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
        // What to pass on: the output (not the last stage's loss), or the input gradient (not
        // on the first stage).
        let out: Option<Tensor> = match a {
            Action::Forward { mb, chunk } => {
                let y = stage.forward(chunk, mb, input).map_err(stage_err)?;
                if s == last {
                    losses.push((mb, y.detach()));
                    None
                } else {
                    Some(y)
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
                    (Some(g), _) => Some(g),
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
        if let Some(t) = out {
            match destination(schedule, rank, &a) {
                // A stage of this rank (one rank, or ZB-V's turn): handed over in memory.
                Some((to, g, key)) if to == rank => {
                    local.insert((g, key), t);
                }
                Some((to, g, _)) => {
                    // The receiver is the stream communicator's rank 1.
                    let w = comms.stream((rank, to, g))?.send(&t, 1).map_err(|source| {
                        PipelineError::Comm {
                            rank,
                            action: a,
                            source: Box::new(source),
                        }
                    })?;
                    sends.push((a, w));
                }
                None => {
                    return Err(PipelineError::Setup(format!(
                        "rank {rank}: {a} on stage {s} made a result no stage takes"
                    )))
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
