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

// ---------------------------------------------------------------------------------------------
// The layouts the library trainer's tests run the model on, and the model with its trainer.

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// How a run lays the user's model out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Layout {
    /// One device, no mesh.
    One,
    /// FSDP over `dp`.
    Fsdp,
    /// FSDP over `dp`, tensor parallelism over `tp`.
    FsdpTp,
    /// FSDP over `shard`, replicated over `replicate`.
    Hsdp,
    /// Tensor parallelism over `tp`, no FSDP.
    Tp,
}

impl Layout {
    /// The mesh (empty: one device).
    pub fn dims(self) -> Vec<(&'static str, usize)> {
        match self {
            Layout::One => vec![],
            Layout::Fsdp => vec![("dp", 2)],
            Layout::FsdpTp => vec![("dp", 2), ("tp", 2)],
            Layout::Hsdp => vec![("replicate", 2), ("shard", 2)],
            Layout::Tp => vec![("tp", 2)],
        }
    }

    /// This rank's data-parallel index and the data-parallel count (whose rows of the global
    /// batch it trains on), from its mesh coordinate.
    pub fn data_parallel(self, coord: &[usize]) -> (usize, usize) {
        match self {
            Layout::Fsdp | Layout::FsdpTp => (coord[0], 2),
            Layout::Hsdp => (coord[0] * 2 + coord[1], 4),
            Layout::One | Layout::Tp => (0, 1),
        }
    }
}

/// A layer as it is (no FSDP unit).
pub fn no_wrap(_: &str, l: Layer) -> candle_core::Result<Layer> {
    Ok(l)
}

/// The user's model laid out as `layout` (parameters from `seed`; each layer an FSDP unit
/// under FSDP) and a library trainer with `config` over its vars.
pub fn model_and_trainer(
    mesh: Option<&candle_dtensor_mesh::DeviceMesh>,
    layout: Layout,
    seed: u64,
    config: candle_dtensor_train::fit::TrainerConfig,
) -> Result<(Mlp, candle_dtensor_train::fit::Trainer), BoxErr> {
    use candle_core::DType;
    use candle_dtensor_parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
    use candle_dtensor_parallel::fsdp_vb::{reference_var_builder, FsdpVarMap};
    use candle_dtensor_train::fit::{TrainVars, Trainer};

    let tp = match (layout, mesh) {
        (Layout::FsdpTp | Layout::Tp, Some(m)) => Some(Group::from_mesh(m, "tp")?),
        _ => None,
    };
    match (layout, mesh) {
        (Layout::One | Layout::Tp, _) => {
            let (map, vb) = reference_var_builder(seed, DType::F32, &Device::Cpu);
            let vars = TrainVars::local(mesh, &map, vb);
            let model = Mlp::new(vars.var_builder()?, tp.as_ref(), &no_wrap)?;
            Ok((model, Trainer::new(vars, config)?))
        }
        (_, Some(mesh)) => {
            let mut fc = match layout {
                Layout::Hsdp => FsdpConfig::new(1, GradReduce::Avg),
                _ => FsdpConfig::new(0, GradReduce::Avg),
            };
            if layout == Layout::Hsdp {
                fc.replicate_dim = Some(0);
            }
            let fsdp = Fsdp::new(mesh, fc)?;
            let map = FsdpVarMap::new(&fsdp, seed);
            let vars = TrainVars::fsdp(mesh, &fsdp, &map, DType::F32);
            let wrap = |key: &str, l: Layer| -> candle_core::Result<Layer> {
                Ok(Layer(Box::new(map.wrap(key, l)?)))
            };
            let model = Mlp::new(vars.var_builder()?, tp.as_ref(), &wrap)?;
            Ok((model, Trainer::new(vars, config)?))
        }
        (_, None) => Err(format!("{layout:?} needs a mesh").into()),
    }
}
