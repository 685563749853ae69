//! Learning-rate schedules and which parameters get weight decay: the two choices of an
//! optimizer setup that every GPT recipe (nanoGPT, torchtitan) makes beyond AdamW itself.
//!
//! - [`LrSchedule`]: linear warmup to the peak rate, then constant, cosine or linear decay to a
//!   minimum rate at the last step. The rate is a pure function of the step index, so a run
//!   resumed from a checkpoint at step `k` continues the schedule exactly.
//! - [`WeightDecay`]: decay every parameter (candle-nn's and PyTorch's default for one param
//!   group), or only the matrices (nanoGPT's and torchtitan-style recipes: no decay for norms,
//!   biases and, by default, embeddings).
//!
//! ```
//! use candle_dtensor::train::schedule::{Decay, LrSchedule};
//!
//! let s = LrSchedule::new(1e-3, 10, Decay::Cosine, 100, 1e-4).unwrap();
//! assert_eq!(s.lr_at(0), 1e-4); // (0 + 1) / 10 of the peak
//! assert_eq!(s.lr_at(9), 1e-3); // warmup ends at the peak
//! assert!((s.lr_at(99) - 1e-4).abs() < 1e-6); // the last step is at (nearly) the minimum
//! assert!(LrSchedule::new(1e-3, 200, Decay::Cosine, 100, 0.0).is_err()); // warmup > steps
//! ```

use std::f64::consts::PI;

/// How the rate falls after the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Decay {
    /// Stay at the peak.
    #[default]
    Constant,
    /// Half a cosine from the peak to the minimum.
    Cosine,
    /// A straight line from the peak to the minimum.
    Linear,
}

impl std::str::FromStr for Decay {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, ScheduleError> {
        match s {
            "none" | "constant" => Ok(Decay::Constant),
            "cosine" => Ok(Decay::Cosine),
            "linear" => Ok(Decay::Linear),
            other => Err(ScheduleError::UnknownDecay(other.to_string())),
        }
    }
}

/// A schedule that cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScheduleError {
    /// Warmup longer than the run.
    #[error("lr schedule: warmup of {warmup} steps exceeds the {steps} steps of the run (rule: warmup <= steps)")]
    WarmupTooLong {
        /// Warmup steps asked for.
        warmup: usize,
        /// Steps of the run.
        steps: usize,
    },
    /// A rate that is negative, NaN or infinite.
    #[error("lr schedule: {field} = {value} is not a finite number >= 0")]
    BadRate {
        /// `lr` or `min_lr`.
        field: &'static str,
        /// The value given.
        value: f64,
    },
    /// A minimum above the peak.
    #[error("lr schedule: min_lr {min_lr} exceeds the peak lr {lr} (rule: min_lr <= lr)")]
    MinAbovePeak {
        /// The peak.
        lr: f64,
        /// The minimum.
        min_lr: f64,
    },
    /// A decay name that is not one of `none`, `constant`, `cosine`, `linear`.
    #[error("lr schedule: unknown decay {0:?} (known: none, constant, cosine, linear)")]
    UnknownDecay(String),
}

/// Linear warmup, then [`Decay`] to `min_lr` over the remaining steps of a run of `steps`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// The peak rate (reached at the last warmup step).
    pub lr: f64,
    /// Steps of linear warmup (0: start at the peak).
    pub warmup: usize,
    /// The decay after the warmup.
    pub decay: Decay,
    /// Steps of the whole run (the decay ends at its last step).
    pub steps: usize,
    /// The rate the decay ends at.
    pub min_lr: f64,
}

impl LrSchedule {
    /// A checked schedule; see [`ScheduleError`] for the rules.
    pub fn new(
        lr: f64,
        warmup: usize,
        decay: Decay,
        steps: usize,
        min_lr: f64,
    ) -> Result<LrSchedule, ScheduleError> {
        for (field, value) in [("lr", lr), ("min_lr", min_lr)] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(ScheduleError::BadRate { field, value });
            }
        }
        if warmup > steps {
            return Err(ScheduleError::WarmupTooLong { warmup, steps });
        }
        if decay != Decay::Constant && min_lr > lr {
            return Err(ScheduleError::MinAbovePeak { lr, min_lr });
        }
        Ok(LrSchedule {
            lr,
            warmup,
            decay,
            steps,
            min_lr,
        })
    }

    /// A constant rate (no warmup, no decay).
    pub fn constant(lr: f64) -> LrSchedule {
        LrSchedule {
            lr,
            warmup: 0,
            decay: Decay::Constant,
            steps: 0,
            min_lr: lr,
        }
    }

    /// The rate of step `step` (0-based): `lr * (step + 1) / warmup` during the warmup, then the
    /// decay from `lr` at step `warmup` to `min_lr` at step `steps - 1`.
    pub fn lr_at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.lr * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.steps.saturating_sub(1).saturating_sub(self.warmup);
        if self.decay == Decay::Constant || span == 0 {
            return self.lr;
        }
        let t = ((step - self.warmup) as f64 / span as f64).min(1.0);
        let coeff = match self.decay {
            Decay::Cosine => 0.5 * (1.0 + (PI * t).cos()),
            Decay::Linear => 1.0 - t,
            Decay::Constant => 1.0,
        };
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

/// Which parameters AdamW decays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDecay {
    /// Every parameter (one parameter group, as candle-nn's AdamW).
    #[default]
    All,
    /// Parameters of two or more dims only: no decay for norms' scales and biases; embeddings
    /// (see [`is_embedding`]) decay only when `embeddings` is set.
    Matrices {
        /// Decay the embedding tables too.
        embeddings: bool,
    },
}

impl std::str::FromStr for WeightDecay {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "all" => Ok(WeightDecay::All),
            "matrices" => Ok(WeightDecay::Matrices { embeddings: false }),
            "matrices+embeddings" => Ok(WeightDecay::Matrices { embeddings: true }),
            other => Err(format!(
                "unknown weight-decay policy {other:?} (known: all, matrices, matrices+embeddings)"
            )),
        }
    }
}

/// Whether the parameter called `name` is an embedding table: its module's last path segment
/// is `emb`, `wte` or `wpe`, ends in `_emb` or `embed`, or contains `embed_` or `embedding`
/// (`tok_emb.weight`, `pos_emb.weight`, `model.embed_tokens.weight`, `wte.weight`).
pub fn is_embedding(name: &str) -> bool {
    let module = name.rsplit_once('.').map_or(name, |(m, _)| m);
    let last = module.rsplit('.').next().unwrap_or(module);
    last == "emb"
        || last.ends_with("_emb")
        || last.ends_with("embed")
        || last.contains("embed_")
        || last.contains("embedding")
        || last == "wte"
        || last == "wpe"
}

impl WeightDecay {
    /// Whether a parameter called `name` of global shape `dims` is decayed.
    pub fn decays(&self, name: &str, dims: &[usize]) -> bool {
        match *self {
            WeightDecay::All => true,
            WeightDecay::Matrices { embeddings } => {
                dims.len() >= 2 && (embeddings || !is_embedding(name))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_reaches_the_minimum_at_the_last_step() {
        let s = LrSchedule::new(1.0, 4, Decay::Cosine, 12, 0.1).unwrap();
        let lrs: Vec<f64> = (0..12).map(|i| s.lr_at(i)).collect();
        assert_eq!(&lrs[..4], &[0.25, 0.5, 0.75, 1.0]);
        assert_eq!(lrs[4], 1.0);
        assert!((lrs[11] - 0.1).abs() < 1e-15, "{lrs:?}");
        // Half-way through the decay (step 4 + 3.5): the mean of peak and minimum.
        let mid = 0.1 + 0.5 * (1.0 + (PI * 3.0 / 7.0).cos()) * 0.9;
        assert!((lrs[7] - mid).abs() < 1e-15);
        assert!(lrs.windows(2).skip(4).all(|w| w[1] <= w[0]), "{lrs:?}");
        // Past the run: stays at the minimum.
        assert!((s.lr_at(40) - 0.1).abs() < 1e-15);
    }

    #[test]
    fn linear_and_constant() {
        let s = LrSchedule::new(2.0, 0, Decay::Linear, 5, 0.0).unwrap();
        let lrs: Vec<f64> = (0..5).map(|i| s.lr_at(i)).collect();
        assert_eq!(lrs, [2.0, 1.5, 1.0, 0.5, 0.0]);
        let c = LrSchedule::new(3e-4, 2, Decay::Constant, 10, 0.0).unwrap();
        assert_eq!(c.lr_at(0), 1.5e-4);
        assert_eq!(c.lr_at(9), 3e-4);
        assert_eq!(LrSchedule::constant(1e-3).lr_at(123), 1e-3);
        // One-step runs and warmup == steps do not divide by zero.
        assert_eq!(
            LrSchedule::new(1.0, 0, Decay::Cosine, 1, 0.0)
                .unwrap()
                .lr_at(0),
            1.0
        );
        let w = LrSchedule::new(1.0, 3, Decay::Cosine, 3, 0.0).unwrap();
        assert_eq!(w.lr_at(2), 1.0);
    }

    #[test]
    fn bad_schedules_name_the_rule() {
        let e = LrSchedule::new(1e-3, 11, Decay::Cosine, 10, 0.0).unwrap_err();
        assert_eq!(
            e,
            ScheduleError::WarmupTooLong {
                warmup: 11,
                steps: 10
            }
        );
        assert!(e.to_string().contains("warmup <= steps"));
        assert!(LrSchedule::new(f64::NAN, 0, Decay::Cosine, 10, 0.0).is_err());
        assert!(LrSchedule::new(1e-3, 0, Decay::Cosine, 10, -1.0).is_err());
        assert!(LrSchedule::new(1e-3, 0, Decay::Linear, 10, 1e-2).is_err());
        assert!("cosinus".parse::<Decay>().is_err());
        assert_eq!("cosine".parse::<Decay>().unwrap(), Decay::Cosine);
    }

    #[test]
    fn matrices_only_skips_norms_biases_and_embeddings() {
        let m = WeightDecay::Matrices { embeddings: false };
        assert!(m.decays("blocks.0.attn.qkv.weight", &[96, 32]));
        assert!(!m.decays("blocks.0.attn.qkv.bias", &[96]));
        assert!(!m.decays("blocks.0.ln1.weight", &[32]));
        assert!(!m.decays("tok_emb.weight", &[256, 32]));
        assert!(!m.decays("pos_emb.weight", &[64, 32]));
        assert!(!m.decays("model.embed_tokens.weight", &[256, 32]));
        assert!(m.decays("lm_head.weight", &[256, 32]));
        let e = WeightDecay::Matrices { embeddings: true };
        assert!(e.decays("tok_emb.weight", &[256, 32]));
        assert!(!e.decays("ln_f.bias", &[32]));
        assert!(WeightDecay::All.decays("ln_f.bias", &[32]));
        assert_eq!("matrices".parse::<WeightDecay>().unwrap(), m);
    }
}
