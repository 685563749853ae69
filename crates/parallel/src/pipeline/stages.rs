//! Splitting a model's layers into pipeline stages.

use std::ops::Range;

use super::error::PipelineError;

/// Splits layers with the given parameter counts into `stages` contiguous, non-empty runs
/// whose largest parameter count is as small as possible (ties go to the earliest split).
/// Stage `s` gets the layers `ranges[s]`.
///
/// # Errors
///
/// [`PipelineError::Split`] when `stages` is 0 or exceeds the number of layers (a stage would
/// be empty).
pub fn split_balanced(
    param_counts: &[usize],
    stages: usize,
) -> Result<Vec<Range<usize>>, PipelineError> {
    let n = param_counts.len();
    let err = |rule: String| PipelineError::Split {
        layers: n,
        stages,
        rule,
    };
    if stages == 0 {
        return Err(err("needs at least one stage".into()));
    }
    if stages > n {
        return Err(err(format!(
            "more stages than layers ({stages} > {n}): every stage needs at least one layer"
        )));
    }
    let mut prefix = vec![0usize; n + 1];
    for (i, c) in param_counts.iter().enumerate() {
        prefix[i + 1] = prefix[i] + c;
    }
    // best[k][i]: the smallest largest stage over splits of the first i layers into k stages;
    // cut[k][i]: where the last of those stages starts.
    let mut best = vec![vec![usize::MAX; n + 1]; stages + 1];
    let mut cut = vec![vec![0usize; n + 1]; stages + 1];
    best[0][0] = 0;
    for k in 1..=stages {
        for i in k..=n {
            for j in (k - 1)..i {
                if best[k - 1][j] == usize::MAX {
                    continue;
                }
                let cost = best[k - 1][j].max(prefix[i] - prefix[j]);
                if cost < best[k][i] {
                    best[k][i] = cost;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut ranges = vec![0..0; stages];
    let mut end = n;
    for k in (1..=stages).rev() {
        let start = cut[k][end];
        ranges[k - 1] = start..end;
        end = start;
    }
    Ok(ranges)
}

/// Splits `layers` layers into stages of the given sizes, in order.
///
/// # Errors
///
/// [`PipelineError::Split`] when a size is 0 (an empty stage) or the sizes do not add up to
/// `layers`.
pub fn split_explicit(layers: usize, sizes: &[usize]) -> Result<Vec<Range<usize>>, PipelineError> {
    let err = |rule: String| PipelineError::Split {
        layers,
        stages: sizes.len(),
        rule,
    };
    if sizes.is_empty() {
        return Err(err("needs at least one stage".into()));
    }
    if let Some(s) = sizes.iter().position(|&n| n == 0) {
        return Err(err(format!(
            "stage {s} of {sizes:?} is empty: every stage needs at least one layer"
        )));
    }
    let total: usize = sizes.iter().sum();
    if total != layers {
        return Err(err(format!(
            "stage sizes {sizes:?} add up to {total}, not to the {layers} layers"
        )));
    }
    let mut start = 0;
    Ok(sizes
        .iter()
        .map(|&n| {
            let r = start..start + n;
            start += n;
            r
        })
        .collect())
}
