//! Tensor-parallel plans: parameter-name patterns mapped to parallel styles, and the roles of
//! the mesh dims.
//!
//! A style only declares placements and module-boundary layouts (PyTorch's `ColwiseParallel`,
//! `RowwiseParallel`, `SequenceParallel`, vocab-parallel embedding); the collectives come from
//! the sharding compiler. For a transformer block without sequence parallelism this gives
//! Megatron's pattern (one all_reduce forward and one backward per attention and per MLP); with
//! it, one all_gather and one reduce_scatter each way.

use candle_dtensor_core::{Placement, Placements};
use candle_dtensor_mesh::DeviceMesh;

use crate::error::{ParallelError, Result};

/// How a module is parallelized over the tensor-parallel mesh dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParallelStyle {
    /// Linear `[out, in]`: weight and bias sharded on `out` (`Shard(0)`); the input is made
    /// Replicate (all-gathered from the sequence dim under sequence parallelism, fused with a
    /// reduce_scatter of its gradient); the output stays sharded on its last dim.
    Colwise,
    /// Linear: weight sharded on `in` (`Shard(1)`), bias Replicate; the input is sharded on its
    /// last dim; the output (a partial sum) is reduced: all_reduce to Replicate, or
    /// reduce_scatter to the sequence dim under sequence parallelism.
    Rowwise,
    /// Norms and dropout: parameters Replicate; activations sharded on the sequence dim
    /// (only meaningful with sequence parallelism; otherwise the same as `Replicate`).
    SequenceParallel,
    /// Embedding table sharded on the vocab dim; each rank looks up the ids it owns and the
    /// masked partial output is reduced like a row-parallel output.
    VocabParallel,
    /// Everything replicated.
    Replicate,
}

/// A tensor-parallel plan: the first matching pattern decides a module's style (default
/// [`ParallelStyle::Replicate`]). Patterns are module names with `*` matching any run of
/// characters, e.g. `blocks.*.attn.qkv`.
#[derive(Debug, Clone)]
pub struct TpPlan {
    rules: Vec<(String, ParallelStyle)>,
    /// Shard activations between blocks on the sequence dim (Megatron-SP).
    pub sequence_parallel: bool,
    /// Keep the LM-head logits sharded on the vocab dim into a loss-parallel cross-entropy
    /// (no gather of the vocab). When false the logits are gathered first.
    pub loss_parallel: bool,
}

fn glob(pattern: &str, s: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == s,
        Some((head, rest)) => {
            if !s.starts_with(head) {
                return false;
            }
            let s = &s[head.len()..];
            (0..=s.len()).any(|i| s.is_char_boundary(i) && glob(rest, &s[i..]))
        }
    }
}

impl TpPlan {
    /// An empty plan (everything replicated).
    pub fn new() -> Self {
        TpPlan {
            rules: Vec::new(),
            sequence_parallel: false,
            loss_parallel: true,
        }
    }

    /// Adds a rule.
    pub fn with(mut self, pattern: &str, style: ParallelStyle) -> Self {
        self.rules.push((pattern.to_string(), style));
        self
    }

    /// The plan of this crate's GPT: column-parallel qkv / fc1 (/ fc3), row-parallel proj / fc2,
    /// vocab-parallel token embedding, column-parallel LM head with loss-parallel
    /// cross-entropy, and (with `sp`) sequence-parallel norms.
    pub fn gpt(sp: bool) -> Self {
        let mut p = TpPlan::new()
            .with("blocks.*.attn.qkv", ParallelStyle::Colwise)
            .with("blocks.*.attn.proj", ParallelStyle::Rowwise)
            .with("blocks.*.mlp.fc1", ParallelStyle::Colwise)
            .with("blocks.*.mlp.fc3", ParallelStyle::Colwise)
            .with("blocks.*.mlp.fc2", ParallelStyle::Rowwise)
            .with("tok_emb", ParallelStyle::VocabParallel)
            .with("lm_head", ParallelStyle::Colwise);
        if sp {
            p = p
                .with("blocks.*.ln*", ParallelStyle::SequenceParallel)
                .with("ln_f", ParallelStyle::SequenceParallel);
        }
        p.sequence_parallel = sp;
        p
    }

    /// The style of module `name`.
    pub fn style(&self, name: &str) -> ParallelStyle {
        self.rules
            .iter()
            .find(|(p, _)| glob(p, name))
            .map(|(_, s)| *s)
            .unwrap_or(ParallelStyle::Replicate)
    }
}

impl Default for TpPlan {
    fn default() -> Self {
        TpPlan::new()
    }
}

/// Which mesh dims do what: tensor parallelism over `tp`, the batch sharded over `data`
/// (`dp`, HSDP's `replicate` and `shard`, and `ep`), mixture-of-experts experts sharded over
/// `ep` (for everything else `ep` is one more data-parallel dim).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshRoles {
    /// The tensor-parallel mesh dim.
    pub tp: Option<usize>,
    /// The expert-parallel mesh dim (also in `data`).
    pub ep: Option<usize>,
    /// Mesh dims sharding the batch, outermost first.
    pub data: Vec<usize>,
    /// The context-parallel mesh dim (`cp`): activations sharded on the sequence,
    /// parameters replicated (their gradients all-reduced over it by the dispatch rule).
    pub cp: Option<usize>,
    /// The pipeline-parallel mesh dim (`pp`): each coordinate along it holds one pipeline
    /// stage; the other dims form the sub-mesh a stage runs on. Parameters and activations
    /// are Replicate on it (a stage's parameters live on its own `pp` coordinate only).
    pub pp: Option<usize>,
    /// The mesh's number of dims.
    pub ndim: usize,
}

impl MeshRoles {
    /// Reads roles from dim names: `tp`; `dp`, `replicate`, `shard` (data); `ep` (data, and
    /// the experts of mixture-of-experts layers); `cp` (the sequence); `pp` (pipeline stages).
    ///
    /// # Errors
    ///
    /// A dim with another name.
    pub fn of(mesh: &DeviceMesh) -> Result<Self> {
        let mut roles = MeshRoles {
            tp: None,
            ep: None,
            data: Vec::new(),
            cp: None,
            pp: None,
            ndim: mesh.ndim(),
        };
        for (i, name) in mesh.dim_names().iter().enumerate() {
            match *name {
                "tp" => roles.tp = Some(i),
                "cp" => roles.cp = Some(i),
                "pp" => roles.pp = Some(i),
                "dp" | "replicate" | "shard" => roles.data.push(i),
                "ep" => {
                    roles.ep = Some(i);
                    roles.data.push(i);
                }
                other => {
                    return Err(ParallelError::Config(format!(
                    "unknown mesh dim name \"{other}\"; use dp, tp, ep, cp, pp, replicate or shard"
                )))
                }
            }
        }
        Ok(roles)
    }

    /// Placements with `on_tp` on the tensor-parallel dim and `on_data` on the data dims.
    pub fn placements(&self, on_tp: Placement, on_data: Placement) -> Placements {
        (0..self.ndim)
            .map(|m| {
                if Some(m) == self.tp {
                    on_tp
                } else if self.data.contains(&m) {
                    on_data
                } else {
                    Placement::Replicate
                }
            })
            .collect()
    }

    /// `placements` with the tensor-parallel dim replaced by `on_tp`.
    pub fn with_tp(&self, placements: &[Placement], on_tp: Placement) -> Placements {
        let mut p: Placements = placements.iter().copied().collect();
        if let Some(t) = self.tp {
            p[t] = on_tp;
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob("blocks.*.attn.qkv", "blocks.0.attn.qkv"));
        assert!(glob("blocks.*.attn.qkv", "blocks.12.attn.qkv"));
        assert!(!glob("blocks.*.attn.qkv", "blocks.0.attn.proj"));
        assert!(glob("blocks.*.ln*", "blocks.3.ln2"));
        assert!(glob("*", "anything"));
        let p = TpPlan::gpt(true);
        assert_eq!(p.style("blocks.1.mlp.fc2"), ParallelStyle::Rowwise);
        assert_eq!(p.style("blocks.1.ln1"), ParallelStyle::SequenceParallel);
        assert_eq!(p.style("pos_emb"), ParallelStyle::Replicate);
    }
}
