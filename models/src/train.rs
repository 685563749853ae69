//! Training utilities: a DTensor-aware global gradient-norm clip.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use candle_dtensor_comm::ReduceOp;

use crate::error::Result;
use crate::params::ParamStore;

/// The global L2 norm of all parameter gradients, exactly as on one device, with a single
/// all_reduce over the whole mesh: each rank contributes the squared norm of its local pieces,
/// divided by how many ranks hold an identical replica of that piece.
pub fn grad_norm(store: &ParamStore, grads: &GradStore) -> Result<f64> {
    let mesh = store.mesh();
    let mut local = 0f64;
    for p in store.params() {
        let Some(g) = grads.get(&p.var) else { continue };
        let sq = g
            .to_dtype(DType::F64)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f64>()?;
        local += sq / p.replicas.max(1) as f64;
    }
    let t = Tensor::new(&[local], mesh.root_comm().device())?;
    let total = mesh.root_comm().all_reduce(&t, ReduceOp::Sum)?.wait()?;
    Ok(total.to_vec1::<f64>()?[0].sqrt())
}

/// Scales every gradient so the global norm is at most `max_norm`; returns the norm before
/// clipping. Call on every rank.
pub fn clip_grad_norm(store: &ParamStore, grads: &mut GradStore, max_norm: f64) -> Result<f64> {
    let norm = grad_norm(store, grads)?;
    if norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for p in store.params() {
            if let Some(g) = grads.get(&p.var) {
                let scaled = g.affine(scale, 0.0)?;
                grads.insert(&p.var, scaled);
            }
        }
    }
    Ok(norm)
}
