//! The model a user writes with candle-nn, shared by the library trainer's tests
//! (trainer_api, trainer_ckpt): a norm, a column- then row-parallel MLP with a residual, and a
//! head, each layer optionally an FSDP unit; and the batches it trains on.
#![allow(dead_code)]

use candle_core::{Device, Module, Tensor};
use candle_dtensor_models::dropins::rms_norm;
use candle_dtensor_parallel::tp_nn::{self, Group};
use candle_nn::VarBuilder;

/// Rows of the global batch.
pub const BATCH: usize = 8;
/// Model width.
pub const D: usize = 8;
/// MLP hidden size.
pub const H: usize = 16;
/// Outputs.
pub const OUT: usize = 4;

// ---------------------------------------------------------------------------------------------
// The user's model, written once with candle-nn.

/// Any candle-nn module, boxed.
pub struct Layer(pub Box<dyn Module + Send + Sync>);

impl Module for Layer {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.0.forward(x)
    }
}

pub struct Mlp {
    pub norm: Layer,
    pub fc1: Layer,
    pub fc2: Layer,
    pub head: Layer,
}

impl Mlp {
    /// Built from `vb`; with `tp`, `fc1` / `fc2` are column / row-parallel over that group;
    /// `wrap` makes each layer an FSDP unit (or leaves it).
    pub fn new(
        vb: VarBuilder,
        tp: Option<&Group>,
        wrap: &dyn Fn(&str, Layer) -> candle_core::Result<Layer>,
    ) -> candle_core::Result<Mlp> {
        let layer = |m: Box<dyn Module + Send + Sync>| Layer(m);
        let norm = layer(Box::new(rms_norm(D, 1e-5, vb.pp("norm"))?));
        let (fc1, fc2) = match tp {
            None => (
                layer(Box::new(candle_nn::linear(D, H, vb.pp("fc1"))?)),
                layer(Box::new(candle_nn::linear(H, D, vb.pp("fc2"))?)),
            ),
            Some(g) => (
                layer(Box::new(tp_nn::column_parallel_linear(
                    D,
                    H,
                    g,
                    vb.pp("fc1"),
                )?)),
                layer(Box::new(tp_nn::row_parallel_linear(H, D, g, vb.pp("fc2"))?)),
            ),
        };
        let head = layer(Box::new(candle_nn::linear(D, OUT, vb.pp("head"))?));
        Ok(Mlp {
            norm: wrap("norm", norm)?,
            fc1: wrap("fc1", fc1)?,
            fc2: wrap("fc2", fc2)?,
            head: wrap("head", head)?,
        })
    }

    /// This rank's loss: the mean squared error over its rows.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.fc1.forward(&self.norm.forward(x)?)?.gelu()?;
        let h = (self.fc2.forward(&h)? + x)?;
        candle_nn::loss::mse(&self.head.forward(&h)?, y)
    }
}

/// Rows `rows` of the global batch of `step`.
pub fn batch(step: usize, rows: std::ops::Range<usize>) -> candle_core::Result<(Tensor, Tensor)> {
    let dev = Device::Cpu;
    let x = (Tensor::arange(0f32, (BATCH * D) as f32, &dev)? + (step * BATCH * D) as f64)?;
    let x = (x * 0.37)?.sin()?.reshape((BATCH, D))?;
    let y = ((x.narrow(1, 0, OUT)? * 1.5)? - x.narrow(1, OUT, OUT)?.sqr()?)?;
    let n = rows.len();
    Ok((x.narrow(0, rows.start, n)?, y.narrow(0, rows.start, n)?))
}
