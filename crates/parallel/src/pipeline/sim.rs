//! A simulator of schedules: each rank runs its action list in order, an action starts when
//! the rank is free and the neighbouring stage's output it needs has arrived.

use std::collections::HashMap;

use candle_dtensor_kernels::compare::nan_max;

use super::actions::{Action, Schedule};
use super::error::ScheduleError;

/// Time units of each action, for one rank's whole share of the model (one stage when
/// `v == 1`): an action on one of `v` chunks costs `1 / v` of it. `p2p` is added to every
/// transfer between two different ranks.
///
/// The default is the usual unit model: `F = 1`, `B = 2`, split backward `I = 1`, `W = 1`,
/// transfers free.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    /// Forward.
    pub forward: f64,
    /// Full backward.
    pub backward: f64,
    /// Input-gradient backward (zero-bubble `I`).
    pub backward_input: f64,
    /// Weight-gradient backward (zero-bubble `W`).
    pub backward_weight: f64,
    /// Latency of one transfer between ranks.
    pub p2p: f64,
}

impl CostModel {
    /// Every cost finite and `>= 0`; otherwise the rule broken, naming the cost (a NaN would
    /// vanish from a makespan or a sleep and report a wrong bubble).
    ///
    /// # Errors
    ///
    /// The first cost that is negative, NaN or infinite.
    pub fn check(&self) -> Result<(), String> {
        let costs = [
            ("forward", self.forward),
            ("backward", self.backward),
            ("backward_input", self.backward_input),
            ("backward_weight", self.backward_weight),
            ("p2p", self.p2p),
        ];
        match costs.iter().find(|(_, c)| !(c.is_finite() && *c >= 0.0)) {
            Some((name, c)) => Err(format!(
                "cost model: {name} = {c}; every cost must be finite and >= 0"
            )),
            None => Ok(()),
        }
    }
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            forward: 1.0,
            backward: 2.0,
            backward_input: 1.0,
            backward_weight: 1.0,
            p2p: 0.0,
        }
    }
}

impl CostModel {
    /// The cost of `action` on a schedule with `v` chunks per rank.
    pub fn cost(&self, action: &Action, v: usize) -> f64 {
        let c = match action {
            Action::Forward { .. } => self.forward,
            Action::Backward { .. } => self.backward,
            Action::BackwardInput { .. } => self.backward_input,
            Action::BackwardWeight { .. } => self.backward_weight,
        };
        c / v.max(1) as f64
    }
}

/// One simulated action: what ran, when it started and ended.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slot {
    /// The action.
    pub action: Action,
    /// Start time.
    pub start: f64,
    /// End time.
    pub end: f64,
}

/// The simulated run of a schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// Per rank, its actions with their times, in list order.
    pub ranks: Vec<Vec<Slot>>,
    /// When the last action ends.
    pub makespan: f64,
}

impl Timeline {
    /// Busy time of rank `r` (sum of its actions' durations).
    pub fn busy(&self, r: usize) -> f64 {
        self.ranks
            .get(r)
            .map(|s| s.iter().map(|x| x.end - x.start).sum())
            .unwrap_or(0.0)
    }

    /// The bubble fraction: idle time over `p * makespan` (the share of the ranks' time
    /// between the first action's start and the last one's end spent waiting).
    pub fn bubble_fraction(&self) -> f64 {
        let p = self.ranks.len();
        if p == 0 || self.makespan <= 0.0 {
            return 0.0;
        }
        let busy: f64 = (0..p).map(|r| self.busy(r)).sum();
        1.0 - busy / (p as f64 * self.makespan)
    }
}

/// What an action waits for: (kind, mb, stage); kind 0 = forward output, 1 = input gradient
/// (Backward or BackwardInput), 2 = weight gradient.
type Key = (u8, usize, usize);

impl Schedule {
    /// Simulates the action lists under `cost` and returns every action's times.
    ///
    /// # Errors
    ///
    /// [`ScheduleError::Deadlock`] when no rank can run its next action;
    /// [`ScheduleError::Rule`] for a cost that is negative, NaN or infinite (a NaN would
    /// otherwise vanish from the makespan and report a wrong bubble).
    pub fn simulate(&self, cost: &CostModel) -> Result<Timeline, ScheduleError> {
        let (p, v) = (self.ranks(), self.chunks());
        if let Err(rule) = cost.check() {
            return Err(ScheduleError::Rule {
                schedule: self.kind().to_string(),
                p,
                m: self.micro_batches(),
                v,
                rule,
            });
        }
        let stages = self.stages();
        let mut done: HashMap<Key, (f64, usize)> = HashMap::new();
        let mut next = vec![0usize; p];
        let mut free = vec![0.0f64; p];
        let mut ranks: Vec<Vec<Slot>> = (0..p)
            .map(|r| Vec::with_capacity(self.actions(r).len()))
            .collect();
        loop {
            let mut progressed = false;
            for r in 0..p {
                while let Some(a) = self.actions(r).get(next[r]).copied() {
                    let s = self.stage_of(r, a.chunk());
                    let mb = a.mb();
                    // (key, whether it crosses ranks) of each dependency.
                    let deps: Vec<Key> = match a {
                        Action::Forward { .. } if s > 0 => vec![(0, mb, s - 1)],
                        Action::Forward { .. } => vec![],
                        Action::Backward { .. } | Action::BackwardInput { .. } => {
                            let mut d = vec![(0, mb, s)];
                            if s + 1 < stages {
                                d.push((1, mb, s + 1));
                            }
                            d
                        }
                        Action::BackwardWeight { .. } => vec![(1, mb, s)],
                    };
                    let mut ready = 0.0f64;
                    let mut all = true;
                    for k in deps {
                        match done.get(&k) {
                            Some(&(t, rank)) => {
                                let lat = if rank != r { cost.p2p } else { 0.0 };
                                ready = ready.max(t + lat);
                            }
                            None => {
                                all = false;
                                break;
                            }
                        }
                    }
                    if !all {
                        break;
                    }
                    let start = free[r].max(ready);
                    let end = start + cost.cost(&a, v);
                    let kind = match a {
                        Action::Forward { .. } => 0,
                        Action::Backward { .. } | Action::BackwardInput { .. } => 1,
                        Action::BackwardWeight { .. } => 2,
                    };
                    done.insert((kind, mb, s), (end, r));
                    free[r] = end;
                    ranks[r].push(Slot {
                        action: a,
                        start,
                        end,
                    });
                    next[r] += 1;
                    progressed = true;
                }
            }
            let finished = (0..p).all(|r| next[r] == self.actions(r).len());
            if finished {
                break;
            }
            if !progressed {
                return Err(ScheduleError::Deadlock {
                    schedule: self.kind().to_string(),
                    p,
                    m: self.micro_batches(),
                    v,
                    waiting: (0..p)
                        .filter_map(|r| self.actions(r).get(next[r]).map(|a| (r, *a)))
                        .collect(),
                });
            }
        }
        let makespan = free.iter().copied().fold(0.0, nan_max);
        Ok(Timeline { ranks, makespan })
    }

    /// The bubble fraction of the unit-cost simulation ([`CostModel::default`]: `F = 1`,
    /// `B = 2`, `I = W = 1`, free transfers).
    ///
    /// # Errors
    ///
    /// As [`Schedule::simulate`] (not for a schedule built by a constructor, which validated).
    pub fn bubble_fraction(&self) -> Result<f64, ScheduleError> {
        self.bubble_fraction_with(&CostModel::default())
    }

    /// The bubble fraction of the simulation under `cost`.
    ///
    /// # Errors
    ///
    /// As [`Schedule::simulate`].
    pub fn bubble_fraction_with(&self, cost: &CostModel) -> Result<f64, ScheduleError> {
        Ok(self.simulate(cost)?.bubble_fraction())
    }
}

/// The textbook bubble fraction of GPipe and 1F1B: `(p - 1) / (m + p - 1)`.
pub fn bubble_gpipe(p: usize, m: usize) -> f64 {
    (p as f64 - 1.0) / (m as f64 + p as f64 - 1.0)
}

/// Interleaved 1F1B's (Narayanan et al., 2021): bubble time `(p - 1) / v` per `m` units of
/// work, as a fraction of the total: `(p - 1) / (v m + p - 1)`.
pub fn bubble_interleaved(p: usize, m: usize, v: usize) -> f64 {
    (p as f64 - 1.0) / (v as f64 * m as f64 + p as f64 - 1.0)
}

/// ZB-H1's (Qi et al., 2023) with `T_F = T_B = T_W = 1`: bubble time
/// `(p - 1)(T_F + T_B - T_W) = p - 1` per rank against `3 m` of work:
/// `(p - 1) / (3 m + p - 1)`, about a third of 1F1B's.
pub fn bubble_zb_h1(p: usize, m: usize) -> f64 {
    (p as f64 - 1.0) / (3.0 * m as f64 + p as f64 - 1.0)
}

/// ZB-V's with every chunk action one unit (`F = I = W = 1/2` of a stage's): bubble time
/// `p - 1` chunk actions per rank against `6 m` of them: `(p - 1) / (6 m + p - 1)`, half ZB-H1's
/// (for `m >= p`; fewer micro-batches cannot fill the V).
pub fn bubble_zb_v(p: usize, m: usize) -> f64 {
    (p as f64 - 1.0) / (6.0 * m as f64 + p as f64 - 1.0)
}
