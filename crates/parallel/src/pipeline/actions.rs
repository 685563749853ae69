//! Pipeline schedules as data: per rank, the ordered list of compute actions it runs.
//!
//! Stage numbering follows Megatron: with `p` ranks and `v` model chunks per rank there are
//! `p * v` stages, and chunk `c` of rank `r` is stage `c * p + r` (so with `v == 1` the stage
//! is the rank). ZB-V places its two chunks per rank in a V instead: chunk 0 of rank `r` is
//! stage `r`, chunk 1 is stage `2 p - 1 - r` (rank 0 holds the first and the last stage, and
//! the turn from stage `p - 1` to `p` stays on rank `p - 1`). Transfers are not actions: they
//! are implied by the compute actions and derived by the executor and the simulator (a
//! forward on stage `s > 0` needs stage `s - 1`'s output of the same micro-batch; a backward
//! on stage `s < p * v - 1` needs stage `s + 1`'s input gradient).

use std::collections::HashMap;
use std::fmt;

use super::error::ScheduleError;

/// One compute step of a rank: a micro-batch `mb` through local model chunk `chunk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward of `mb` through `chunk` (keeps what backward needs).
    Forward {
        /// The micro-batch.
        mb: usize,
        /// The rank-local model chunk (`0..v`).
        chunk: usize,
    },
    /// Full backward: the input gradient and the parameter gradients.
    Backward {
        /// The micro-batch.
        mb: usize,
        /// The rank-local model chunk.
        chunk: usize,
    },
    /// Zero-bubble "B": the input gradient only (what the previous stage waits for).
    BackwardInput {
        /// The micro-batch.
        mb: usize,
        /// The rank-local model chunk.
        chunk: usize,
    },
    /// Zero-bubble "W": the parameter gradients of a micro-batch whose `BackwardInput` ran.
    BackwardWeight {
        /// The micro-batch.
        mb: usize,
        /// The rank-local model chunk.
        chunk: usize,
    },
}

impl Action {
    /// The micro-batch.
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. } => mb,
        }
    }

    /// The rank-local model chunk.
    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::BackwardInput { chunk, .. }
            | Action::BackwardWeight { chunk, .. } => chunk,
        }
    }

    /// The one-letter name used in schedule tables: `F`, `B`, `I` (backward input), `W`.
    pub fn letter(&self) -> char {
        match self {
            Action::Forward { .. } => 'F',
            Action::Backward { .. } => 'B',
            Action::BackwardInput { .. } => 'I',
            Action::BackwardWeight { .. } => 'W',
        }
    }

    /// Whether this action produces the input gradient the previous stage waits for
    /// (`Backward` or `BackwardInput`).
    pub fn sends_grad(&self) -> bool {
        matches!(self, Action::Backward { .. } | Action::BackwardInput { .. })
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Action::Forward { .. } => "Forward",
            Action::Backward { .. } => "Backward",
            Action::BackwardInput { .. } => "BackwardInput",
            Action::BackwardWeight { .. } => "BackwardWeight",
        };
        write!(f, "{name}(mb {}, chunk {})", self.mb(), self.chunk())
    }
}

/// Which generator made a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// GPipe: all forwards, then all backwards.
    GPipe,
    /// 1F1B (PipeDream-flush / Megatron): `p - r - 1` warm-up forwards, then one forward and
    /// one backward alternately, then the remaining backwards.
    OneFOneB,
    /// Megatron's interleaved 1F1B with `v` model chunks per rank.
    Interleaved1F1B,
    /// Zero-bubble ZB-H1 (Qi et al., 2023): backward split into input-gradient (`I`) and
    /// weight-gradient (`W`) work; `W`s fill the bubbles, with 1F1B's activation memory.
    ZeroBubbleH1,
    /// Zero-bubble ZB-V (Qi et al., 2024): two chunks per rank placed in a V, backward split
    /// into `I` and `W`; half ZB-H1's bubble with 1F1B's activation memory.
    ZeroBubbleV,
    /// Action lists given by the caller ([`Schedule::from_actions`]).
    Custom,
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ScheduleKind::GPipe => "GPipe",
            ScheduleKind::OneFOneB => "1F1B",
            ScheduleKind::Interleaved1F1B => "interleaved-1F1B",
            ScheduleKind::ZeroBubbleH1 => "ZB-H1",
            ScheduleKind::ZeroBubbleV => "ZB-V",
            ScheduleKind::Custom => "custom",
        })
    }
}

impl ScheduleKind {
    /// The names [`ScheduleKind::from_name`] takes (`--pp-schedule`), one per generator.
    pub const NAMES: [&'static str; 5] = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"];

    /// The generator named `name` (case-insensitive; `interleaved`, `zbh1` and `zbv` also
    /// accepted).
    ///
    /// # Errors
    ///
    /// [`ScheduleError::Unknown`] listing [`ScheduleKind::NAMES`].
    pub fn from_name(name: &str) -> Result<ScheduleKind, ScheduleError> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "gpipe" => ScheduleKind::GPipe,
            "1f1b" => ScheduleKind::OneFOneB,
            "interleaved-1f1b" | "interleaved" => ScheduleKind::Interleaved1F1B,
            "zb-h1" | "zbh1" => ScheduleKind::ZeroBubbleH1,
            "zb-v" | "zbv" => ScheduleKind::ZeroBubbleV,
            _ => {
                return Err(ScheduleError::Unknown {
                    name: name.to_string(),
                    known: ScheduleKind::NAMES.to_vec(),
                })
            }
        })
    }
}

/// A pipeline schedule: for each rank, the ordered compute actions it runs.
///
/// Built by a generator ([`Schedule::gpipe`], [`Schedule::one_f_one_b`],
/// [`Schedule::interleaved`], [`Schedule::zero_bubble_h1`], [`Schedule::zero_bubble_v`]) or
/// from explicit lists
/// ([`Schedule::from_actions`]); every constructor validates ([`Schedule::validate`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    kind: ScheduleKind,
    p: usize,
    m: usize,
    v: usize,
    /// Chunks placed in a V (ZB-V) rather than looped (Megatron's `c * p + r`).
    v_shape: bool,
    actions: Vec<Vec<Action>>,
}

impl Schedule {
    /// GPipe on `p` ranks with `m` micro-batches: every rank runs `F(0..m)`, then `B(0..m)`.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::Rule`] when `p` or `m` is 0.
    pub fn gpipe(p: usize, m: usize) -> Result<Self, ScheduleError> {
        check_basic(ScheduleKind::GPipe, p, m, 1)?;
        let actions = (0..p)
            .map(|_| {
                let mut a: Vec<Action> =
                    (0..m).map(|mb| Action::Forward { mb, chunk: 0 }).collect();
                a.extend((0..m).map(|mb| Action::Backward { mb, chunk: 0 }));
                a
            })
            .collect();
        Self::checked(ScheduleKind::GPipe, p, m, 1, actions)
    }

    /// 1F1B on `p` ranks with `m` micro-batches: rank `r` runs `min(p - r - 1, m)` warm-up
    /// forwards, then alternates one forward and one backward, then drains the backwards.
    /// At most `p - r` micro-batches' activations are alive on rank `r`.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::Rule`] when `p` or `m` is 0.
    pub fn one_f_one_b(p: usize, m: usize) -> Result<Self, ScheduleError> {
        check_basic(ScheduleKind::OneFOneB, p, m, 1)?;
        let actions = (0..p)
            .map(|r| {
                let warmup = (p - r - 1).min(m);
                let f = |mb| Action::Forward { mb, chunk: 0 };
                let b = |mb| Action::Backward { mb, chunk: 0 };
                let mut a: Vec<Action> = (0..warmup).map(f).collect();
                for i in 0..m - warmup {
                    a.push(f(warmup + i));
                    a.push(b(i));
                }
                a.extend((m - warmup..m).map(b));
                a
            })
            .collect();
        Self::checked(ScheduleKind::OneFOneB, p, m, 1, actions)
    }

    /// Megatron's interleaved 1F1B: `v` model chunks per rank (stage `c * p + r` is chunk `c`
    /// of rank `r`). Forwards go through the chunks in groups of `p` micro-batches
    /// (`mb = (k / (p v)) p + k % p`, chunk `(k / p) % v` for the rank's `k`-th forward;
    /// backwards the same with the chunks reversed); rank `r` runs
    /// `min(2 (p - r - 1) + (v - 1) p, m v)` warm-up forwards, then alternates, then drains.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::Rule`] when `p`, `m` or `v` is 0, or `m % p != 0` (Megatron's grouping
    /// of micro-batches in runs of `p` needs it).
    pub fn interleaved(p: usize, m: usize, v: usize) -> Result<Self, ScheduleError> {
        let kind = ScheduleKind::Interleaved1F1B;
        check_basic(kind, p, m, v)?;
        if m % p != 0 {
            return Err(rule(
                kind,
                p,
                m,
                v,
                format!(
                    "micro-batches must be a multiple of the stages (m % p == 0); {m} % {p} = {}",
                    m % p
                ),
            ));
        }
        let total = m * v;
        let mb_of = |k: usize| (k / (p * v)) * p + k % p;
        let actions = (0..p)
            .map(|r| {
                let warmup = (2 * (p - r - 1) + (v - 1) * p).min(total);
                let f = |k: usize| Action::Forward {
                    mb: mb_of(k),
                    chunk: (k / p) % v,
                };
                let b = |k: usize| Action::Backward {
                    mb: mb_of(k),
                    chunk: v - 1 - (k / p) % v,
                };
                let mut a: Vec<Action> = (0..warmup).map(f).collect();
                for i in 0..total - warmup {
                    a.push(f(warmup + i));
                    a.push(b(i));
                }
                a.extend((total - warmup..total).map(b));
                a
            })
            .collect();
        Self::checked(kind, p, m, v, actions)
    }

    /// ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B's forwards and
    /// input-gradient backwards (`I`), with the weight-gradient work (`W`) moved into the time
    /// a rank would otherwise wait.
    ///
    /// The order is made by a greedy list scheduler over unit times (`F = I = W = 1`, the
    /// paper's assumption): whenever rank `r` is free it runs, in priority order, the oldest
    /// pending `W` if `p` micro-batches wait for theirs, else the next `I` whose output
    /// gradient has arrived, else the next `F` whose input has arrived if fewer than `p - r`
    /// micro-batches are between `F` and `I` (1F1B's in-flight limit), else the oldest pending
    /// `W`. Its unit-time bubble is the paper's `(p - 1) / (3 m + p - 1)` (a third of
    /// 1F1B's bubble time). Memory: at most `p - r` micro-batches hold full activations
    /// (as 1F1B) and at most `p` more hold what `W` needs (the weight layers' inputs and
    /// output gradients). The executor runs the order whatever the real costs.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::Rule`] when `p` or `m` is 0.
    pub fn zero_bubble_h1(p: usize, m: usize) -> Result<Self, ScheduleError> {
        let kind = ScheduleKind::ZeroBubbleH1;
        check_basic(kind, p, m, 1)?;
        let actions = greedy_zb(p, m);
        Self::checked(kind, p, m, 1, actions)
    }

    /// ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): two chunks per
    /// rank placed in a V (chunk 0 of rank `r` is stage `r`, chunk 1 stage `2 p - 1 - r`), the
    /// backward split into `I` and `W` as in ZB-H1.
    ///
    /// The order is made by a greedy list scheduler over unit times (every chunk action 1):
    /// whenever rank `r` is free it runs, in priority order, the oldest pending `W` if `2 p`
    /// micro-batch chunks wait for theirs, else the next `I` whose output gradient has arrived
    /// (chunk 1's first: it is earlier in the backward), else the next `F` of chunk 1, then of
    /// chunk 0, whose input has arrived, if fewer than `2 p` chunk activations are alive on the
    /// rank (1F1B's peak: `p` micro-batches of a whole stage), else the oldest pending `W`. For
    /// `m >= p` its unit-time bubble is `(p - 1) / (6 m + p - 1)`, half ZB-H1's: each rank
    /// waits `p - 1` chunk actions (half a stage's) per step instead of `p - 1` stage actions.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::Rule`] when `p` or `m` is 0.
    pub fn zero_bubble_v(p: usize, m: usize) -> Result<Self, ScheduleError> {
        let kind = ScheduleKind::ZeroBubbleV;
        check_basic(kind, p, m, 2)?;
        Schedule {
            kind,
            p,
            m,
            v: 2,
            v_shape: true,
            actions: greedy_zb_v(p, m),
        }
        .validated()
    }

    /// A schedule from explicit per-rank action lists (`actions[r]` is rank `r`'s), with `m`
    /// micro-batches and `v` chunks per rank; validated like the generated ones.
    ///
    /// # Errors
    ///
    /// Any [`ScheduleError`] of [`Schedule::validate`].
    pub fn from_actions(
        m: usize,
        v: usize,
        actions: Vec<Vec<Action>>,
    ) -> Result<Self, ScheduleError> {
        let p = actions.len();
        check_basic(ScheduleKind::Custom, p, m, v)?;
        Self::checked(ScheduleKind::Custom, p, m, v, actions)
    }

    fn checked(
        kind: ScheduleKind,
        p: usize,
        m: usize,
        v: usize,
        actions: Vec<Vec<Action>>,
    ) -> Result<Self, ScheduleError> {
        Schedule {
            kind,
            p,
            m,
            v,
            v_shape: false,
            actions,
        }
        .validated()
    }

    /// The schedule if [`Schedule::validate`] passes.
    fn validated(self) -> Result<Self, ScheduleError> {
        self.validate()?;
        Ok(self)
    }

    /// The generator that made this schedule.
    pub fn kind(&self) -> ScheduleKind {
        self.kind
    }

    /// Pipeline ranks.
    pub fn ranks(&self) -> usize {
        self.p
    }

    /// Micro-batches.
    pub fn micro_batches(&self) -> usize {
        self.m
    }

    /// Model chunks per rank (`v`; 1 except for interleaved schedules).
    pub fn chunks(&self) -> usize {
        self.v
    }

    /// Stages in all: `p * v`.
    pub fn stages(&self) -> usize {
        self.p * self.v
    }

    /// The stage that chunk `chunk` of rank `rank` holds: `chunk * p + rank` (looped), or for
    /// ZB-V's V `rank` (chunk 0) and `2 p - 1 - rank` (chunk 1).
    pub fn stage_of(&self, rank: usize, chunk: usize) -> usize {
        if self.v_shape && chunk == 1 {
            2 * self.p - 1 - rank
        } else {
            chunk * self.p + rank
        }
    }

    /// The rank and chunk holding stage `stage`.
    pub fn place_of(&self, stage: usize) -> (usize, usize) {
        if self.v_shape && stage >= self.p {
            (2 * self.p - 1 - stage, 1)
        } else {
            (stage % self.p, stage / self.p)
        }
    }

    /// Whether the chunks are placed in a V (ZB-V) rather than looped.
    pub fn v_shaped(&self) -> bool {
        self.v_shape
    }

    /// Rank `rank`'s actions in order (empty for a rank out of range).
    pub fn actions(&self, rank: usize) -> &[Action] {
        self.actions.get(rank).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Whether the schedule splits backward into `BackwardInput` / `BackwardWeight`.
    pub fn splits_backward(&self) -> bool {
        self.actions
            .iter()
            .flatten()
            .any(|a| matches!(a, Action::BackwardInput { .. }))
    }

    /// The schedule of generator `kind` for `p` ranks, `m` micro-batches and `v` chunks per
    /// rank (`v` is chosen for interleaved 1F1B, must be 2 for ZB-V and 1 for the others).
    ///
    /// # Errors
    ///
    /// The generator's [`ScheduleError::Rule`], or a `v` other than 1 for a schedule without
    /// virtual stages, or [`ScheduleKind::Custom`] (which has no generator).
    pub fn generate(
        kind: ScheduleKind,
        p: usize,
        m: usize,
        v: usize,
    ) -> Result<Schedule, ScheduleError> {
        let flat = |s: Schedule| {
            if v == 1 {
                Ok(s)
            } else {
                Err(ScheduleError::Rule {
                    schedule: kind.to_string(),
                    p,
                    m,
                    v,
                    rule: format!("only interleaved 1F1B has virtual stages; v must be 1, got {v}"),
                })
            }
        };
        match kind {
            ScheduleKind::GPipe => flat(Schedule::gpipe(p, m)?),
            ScheduleKind::OneFOneB => flat(Schedule::one_f_one_b(p, m)?),
            ScheduleKind::Interleaved1F1B => Schedule::interleaved(p, m, v),
            ScheduleKind::ZeroBubbleH1 => flat(Schedule::zero_bubble_h1(p, m)?),
            ScheduleKind::ZeroBubbleV if v == 2 => Schedule::zero_bubble_v(p, m),
            ScheduleKind::ZeroBubbleV => Err(ScheduleError::Rule {
                schedule: kind.to_string(),
                p,
                m,
                v,
                rule: format!(
                    "ZB-V runs two chunks per rank, placed in a V (stages r and 2p-1-r); v must \
                     be 2, got {v}"
                ),
            }),
            ScheduleKind::Custom => Err(ScheduleError::Rule {
                schedule: kind.to_string(),
                p,
                m,
                v,
                rule: "a custom schedule has no generator: build it with Schedule::from_actions"
                    .into(),
            }),
        }
    }

    /// The schedule as text: one line per rank, actions as `F3`, `B3`, `I3`, `W3` (with the
    /// chunk after a dot when `v > 1`: `F3.1`).
    pub fn table(&self) -> String {
        let mut out = String::new();
        for (r, acts) in self.actions.iter().enumerate() {
            out.push_str(&format!("rank {r}:"));
            for a in acts {
                if self.v > 1 {
                    out.push_str(&format!(" {}{}.{}", a.letter(), a.mb(), a.chunk()));
                } else {
                    out.push_str(&format!(" {}{}", a.letter(), a.mb()));
                }
            }
            out.push('\n');
        }
        out
    }

    /// Checks the schedule can run: every rank has, for every micro-batch and chunk, exactly
    /// one `Forward` and either one `Backward` or one `BackwardInput` and one
    /// `BackwardWeight`; on each stage a micro-batch's forward comes before its backward and
    /// its `BackwardInput` before its `BackwardWeight`; and a simulation of the lists
    /// (each action waits for the neighbouring stage's output it needs) finishes.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::Order`] naming the rank and the action, [`ScheduleError::Deadlock`]
    /// naming every stuck rank's next action.
    pub fn validate(&self) -> Result<(), ScheduleError> {
        let (p, m, v) = (self.p, self.m, self.v);
        if self.actions.len() != p {
            return Err(rule(
                self.kind,
                p,
                m,
                v,
                format!("{} action lists for {p} ranks", self.actions.len()),
            ));
        }
        for (r, acts) in self.actions.iter().enumerate() {
            let bad = |problem: String| ScheduleError::Order {
                schedule: self.kind.to_string(),
                p,
                m,
                v,
                rank: r,
                problem,
            };
            // Position of each kind of action per (mb, chunk): F, B, I, W.
            let mut seen: HashMap<(usize, usize), [Option<usize>; 4]> = HashMap::new();
            for (i, a) in acts.iter().enumerate() {
                if a.mb() >= m || a.chunk() >= v {
                    return Err(bad(format!(
                        "{a} at position {i} is out of range (mb < {m}, chunk < {v})"
                    )));
                }
                let slot = match a {
                    Action::Forward { .. } => 0,
                    Action::Backward { .. } => 1,
                    Action::BackwardInput { .. } => 2,
                    Action::BackwardWeight { .. } => 3,
                };
                let e = seen.entry((a.mb(), a.chunk())).or_default();
                if let Some(j) = e[slot] {
                    return Err(bad(format!("{a} appears twice (positions {j} and {i})")));
                }
                let before_forward = slot > 0 && e[0].is_none();
                if before_forward {
                    return Err(bad(format!(
                        "{a} at position {i} comes before the micro-batch's forward"
                    )));
                }
                if slot == 3 && e[2].is_none() {
                    return Err(bad(format!(
                        "{a} at position {i} comes before the micro-batch's BackwardInput"
                    )));
                }
                e[slot] = Some(i);
            }
            for mb in 0..m {
                for chunk in 0..v {
                    let e = seen.get(&(mb, chunk)).copied().unwrap_or_default();
                    let ok = e[0].is_some()
                        && matches!(
                            (e[1], e[2], e[3]),
                            (Some(_), None, None) | (None, Some(_), Some(_))
                        );
                    if !ok {
                        return Err(bad(format!(
                            "micro-batch {mb} chunk {chunk} needs one Forward and either one \
                             Backward or one BackwardInput + one BackwardWeight (has F:{} B:{} \
                             I:{} W:{})",
                            e[0].is_some() as u8,
                            e[1].is_some() as u8,
                            e[2].is_some() as u8,
                            e[3].is_some() as u8
                        )));
                    }
                }
            }
        }
        self.simulate(&super::sim::CostModel::default()).map(|_| ())
    }
}

fn rule(kind: ScheduleKind, p: usize, m: usize, v: usize, rule: String) -> ScheduleError {
    ScheduleError::Rule {
        schedule: kind.to_string(),
        p,
        m,
        v,
        rule,
    }
}

fn check_basic(kind: ScheduleKind, p: usize, m: usize, v: usize) -> Result<(), ScheduleError> {
    if p == 0 {
        return Err(rule(
            kind,
            p,
            m,
            v,
            "needs at least one stage (p >= 1)".into(),
        ));
    }
    if m == 0 {
        return Err(rule(
            kind,
            p,
            m,
            v,
            "needs at least one micro-batch (m >= 1)".into(),
        ));
    }
    if v == 0 {
        return Err(rule(
            kind,
            p,
            m,
            v,
            "needs at least one chunk per rank (v >= 1)".into(),
        ));
    }
    Ok(())
}

/// ZB-H1's order: a unit-time greedy list scheduler (see [`Schedule::zero_bubble_h1`]).
fn greedy_zb(p: usize, m: usize) -> Vec<Vec<Action>> {
    // Finish times (unit steps) of F and I per (rank, mb).
    let mut f_done = vec![vec![usize::MAX; m]; p];
    let mut i_done = vec![vec![usize::MAX; m]; p];
    let mut next_f = vec![0usize; p];
    let mut next_i = vec![0usize; p];
    let mut pending_w: Vec<std::collections::VecDeque<usize>> = vec![Default::default(); p];
    let mut out = vec![Vec::with_capacity(3 * m); p];
    let mut t = 0usize;
    let finished = |next_i: &[usize], pending: &[std::collections::VecDeque<usize>]| {
        next_i.iter().all(|&n| n == m) && pending.iter().all(|q| q.is_empty())
    };
    // Each step every rank runs at most one unit action; results are visible from the next
    // step. The loop ends: some rank can always act (the last rank's I needs only its own F,
    // rank 0's F nothing), and each step of work shrinks what is left.
    while !finished(&next_i, &pending_w) && t < 8 * (m + p) + 8 {
        for r in 0..p {
            let i_ready = next_i[r] < next_f[r] && {
                let mb = next_i[r];
                if r + 1 == p {
                    f_done[r][mb] <= t
                } else {
                    i_done[r + 1][mb] <= t
                }
            };
            let f_ready = next_f[r] < m
                && next_f[r] - next_i[r] < p - r
                && (r == 0 || f_done[r - 1][next_f[r]] <= t);
            // Bound the micro-batches waiting for their W (their layer inputs and output
            // gradients stay alive) at p: with the cap the unit-time bubble is the paper's.
            let w_due = pending_w[r].len() >= p;
            if w_due {
                if let Some(mb) = pending_w[r].pop_front() {
                    out[r].push(Action::BackwardWeight { mb, chunk: 0 });
                }
            } else if i_ready {
                let mb = next_i[r];
                out[r].push(Action::BackwardInput { mb, chunk: 0 });
                i_done[r][mb] = t + 1;
                pending_w[r].push_back(mb);
                next_i[r] += 1;
            } else if f_ready {
                let mb = next_f[r];
                out[r].push(Action::Forward { mb, chunk: 0 });
                f_done[r][mb] = t + 1;
                next_f[r] += 1;
            } else if let Some(mb) = pending_w[r].pop_front() {
                out[r].push(Action::BackwardWeight { mb, chunk: 0 });
            }
        }
        t += 1;
    }
    out
}

/// ZB-V's order: a unit-time greedy list scheduler (see [`Schedule::zero_bubble_v`]).
fn greedy_zb_v(p: usize, m: usize) -> Vec<Vec<Action>> {
    let stages = 2 * p;
    let stage_of = |r: usize, c: usize| if c == 0 { r } else { stages - 1 - r };
    // Finish times (unit steps) of F and I per (stage, mb).
    let mut f_done = vec![vec![usize::MAX; m]; stages];
    let mut i_done = vec![vec![usize::MAX; m]; stages];
    // Per rank and chunk: the next micro-batch to run F / I on.
    let mut next_f = vec![[0usize; 2]; p];
    let mut next_i = vec![[0usize; 2]; p];
    let mut pending_w: Vec<std::collections::VecDeque<(usize, usize)>> =
        vec![Default::default(); p];
    let mut out = vec![Vec::with_capacity(6 * m); p];
    let cap = 2 * p;
    let finished = |next_i: &[[usize; 2]], pending: &[std::collections::VecDeque<_>]| {
        next_i.iter().all(|n| n[0] == m && n[1] == m) && pending.iter().all(|q| q.is_empty())
    };
    // Each step every rank runs at most one unit action; results are visible from the next
    // step. The loop ends: some rank can always act (rank 0's chunk 0 F needs nothing, the
    // last stage's I only its own F), and each step of work shrinks what is left.
    let mut t = 0usize;
    while !finished(&next_i, &pending_w) && t < 16 * (m + p) + 16 {
        for r in 0..p {
            let alive: usize = (0..2).map(|c| next_f[r][c] - next_i[r][c]).sum();
            let i_ready = |c: usize| {
                let (s, mb) = (stage_of(r, c), next_i[r][c]);
                mb < next_f[r][c]
                    && if s + 1 == stages {
                        f_done[s][mb] <= t
                    } else {
                        i_done[s + 1][mb] <= t
                    }
            };
            let f_ready = |c: usize| {
                let (s, mb) = (stage_of(r, c), next_f[r][c]);
                mb < m && alive < cap && (s == 0 || f_done[s - 1][mb] <= t)
            };
            let action = if pending_w[r].len() >= cap {
                pending_w[r].pop_front().map(|(chunk, mb)| (2, chunk, mb))
            } else if let Some(c) = [1, 0].into_iter().find(|&c| i_ready(c)) {
                Some((1, c, next_i[r][c]))
            } else if let Some(c) = [1, 0].into_iter().find(|&c| f_ready(c)) {
                Some((0, c, next_f[r][c]))
            } else {
                pending_w[r].pop_front().map(|(chunk, mb)| (2, chunk, mb))
            };
            let Some((kind, chunk, mb)) = action else {
                continue;
            };
            let s = stage_of(r, chunk);
            match kind {
                0 => {
                    out[r].push(Action::Forward { mb, chunk });
                    f_done[s][mb] = t + 1;
                    next_f[r][chunk] += 1;
                }
                1 => {
                    out[r].push(Action::BackwardInput { mb, chunk });
                    i_done[s][mb] = t + 1;
                    next_i[r][chunk] += 1;
                    pending_w[r].push_back((chunk, mb));
                }
                _ => out[r].push(Action::BackwardWeight { mb, chunk }),
            }
        }
        t += 1;
    }
    out
}
