//! FSDP for unmodified candle-nn modules: a `VarBuilder` whose backend creates sharded
//! parameters, and a module wrapper that runs the unit hooks.
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_dtensor_comm::LocalWorld;
//! use candle_dtensor_mesh::DeviceMesh;
//! use candle_dtensor_models::fsdp::{Fsdp, FsdpConfig, GradReduce};
//! use candle_dtensor_models::fsdp_vb::FsdpVarMap;
//! use candle_nn::Optimizer;
//!
//! LocalWorld::run(2, |comm| {
//!     let mesh = DeviceMesh::new(comm, &[("dp", 2)])?;
//!     let mut cfg = FsdpConfig::new(0);
//!     cfg.grad_reduce = GradReduce::Avg; // each rank's loss is its local mean
//!     let fsdp = Fsdp::new(&mesh, cfg)?;
//!     let map = FsdpVarMap::new(&fsdp, 0);
//!     let vb = map.var_builder(DType::F32);
//!     let l1 = map.wrap("l1", candle_nn::linear(4, 16, vb.pp("l1"))?)?;
//!     let l2 = map.wrap("l2", candle_nn::linear(16, 3, vb.pp("l2"))?)?;
//!     let mut opt = candle_nn::SGD::new(map.all_vars(), 0.1)?;
//!     let x = Tensor::ones((4, 4), DType::F32, &Device::Cpu)?; // this rank's half of the batch
//!     let loss = l2.forward(&l1.forward(&x)?.relu()?)?.sqr()?.mean_all()?;
//!     let mut grads = loss.backward()?;
//!     fsdp.finish_backward(&mut grads)?; // reduce-scattered shard gradients
//!     opt.step(&grads)?;
//!     Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
//! })?;
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Module, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init as NnInit, VarBuilder};

use crate::error::{ModelError, Result};
use crate::fsdp::Fsdp;
use crate::init::{full, Init};

/// Our deterministic init for a candle-nn init of `shape`.
pub fn init_of(h: NnInit, shape: &Shape) -> Init {
    match h {
        NnInit::Const(v) => Init::Const(v),
        NnInit::Randn { mean, stdev } => Init::NormalMean(mean, stdev),
        NnInit::Uniform { lo, up } => Init::Uniform(lo, up),
        NnInit::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let std = non_linearity.gain() / (fan.for_shape(shape) as f64).sqrt();
            match dist {
                NormalOrUniform::Normal => Init::Normal(std),
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    Init::Uniform(-bound, bound)
                }
            }
        }
    }
}

/// The value a parameter `name` of `shape` initialised with `h` gets (the same on every rank
/// and in a single-device reference).
pub fn initial_value(
    h: NnInit,
    seed: u64,
    name: &str,
    shape: &Shape,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    full(
        init_of(h, shape),
        seed,
        name,
        shape.dims(),
        dtype,
        &Device::Cpu,
    )
}

struct State {
    units: Vec<(String, usize)>,
    vars: Vec<(String, Var)>,
}

/// The shard vars and units of modules built through [`FsdpVarMap::var_builder`].
#[derive(Clone)]
pub struct FsdpVarMap {
    fsdp: Fsdp,
    seed: u64,
    state: Arc<Mutex<State>>,
}

struct Backend {
    map: FsdpVarMap,
}

fn unit_key(name: &str) -> &str {
    name.split('.').next().unwrap_or(name)
}

impl FsdpVarMap {
    /// A map creating parameters initialised from `seed`.
    pub fn new(fsdp: &Fsdp, seed: u64) -> Self {
        FsdpVarMap {
            fsdp: fsdp.clone(),
            seed,
            state: Arc::new(Mutex::new(State {
                units: Vec::new(),
                vars: Vec::new(),
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A `VarBuilder` whose tensors are FSDP full parameters; each top-level name prefix (e.g.
    /// `l1` in `l1.weight`) is one unit, in creation order (= forward order).
    pub fn var_builder(&self, dtype: DType) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(Backend { map: self.clone() }), dtype, Device::Cpu)
    }

    fn unit_for(&self, key: &str) -> usize {
        let mut st = self.lock();
        if let Some((_, u)) = st.units.iter().find(|(k, _)| k == key) {
            return *u;
        }
        let u = self.fsdp.add_unit(key, false);
        st.units.push((key.to_string(), u));
        u
    }

    /// The shard vars (for an optimizer), in creation order. Empty shards (a rank past the
    /// end of a small parameter's rows) are left out: there is nothing to update, and candle-nn
    /// optimizers reject them.
    pub fn all_vars(&self) -> Vec<Var> {
        self.lock()
            .vars
            .iter()
            .filter(|(_, v)| v.elem_count() > 0)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// The shard var of parameter `name`.
    pub fn var(&self, name: &str) -> Option<Var> {
        self.lock()
            .vars
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }

    /// Wraps a module built under prefix `key` so its forward runs the FSDP unit hooks.
    ///
    /// # Errors
    ///
    /// No parameter was created under `key`.
    pub fn wrap<M: Module>(&self, key: &str, module: M) -> Result<FsdpModule<M>> {
        let unit = self
            .lock()
            .units
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, u)| *u)
            .ok_or_else(|| {
                ModelError::Config(format!("no FSDP parameters were created under \"{key}\""))
            })?;
        Ok(FsdpModule {
            inner: module,
            fsdp: self.fsdp.clone(),
            unit,
        })
    }
}

impl SimpleBackend for Backend {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: NnInit,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        if !dev.is_cpu() {
            return Err(candle_core::Error::Msg(format!(
                "FSDP var builder: {name}: only CPU parameters are supported"
            )));
        }
        let value = initial_value(h, self.map.seed, name, &s, dtype)?;
        let unit = self.map.unit_for(unit_key(name));
        let (shard, full) = self.map.fsdp.add_param(unit, &value)?;
        self.map.lock().vars.push((name.to_string(), shard));
        Ok(full)
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: DType,
        _dev: &Device,
    ) -> candle_core::Result<Tensor> {
        Err(candle_core::Error::Msg(format!(
            "FSDP var builder: {name}: parameters are created with a shape, not loaded"
        )))
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        false
    }
}

/// A candle `Module` run as one FSDP unit: gathered before its forward, released after, and
/// re-gathered before its backward.
pub struct FsdpModule<M> {
    inner: M,
    fsdp: Fsdp,
    unit: usize,
}

impl<M> FsdpModule<M> {
    /// The wrapped module.
    pub fn inner(&self) -> &M {
        &self.inner
    }

    /// The FSDP unit index.
    pub fn unit(&self) -> usize {
        self.unit
    }
}

impl<M: Module> Module for FsdpModule<M> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fsdp.pre_forward(self.unit)?;
        let y = self.inner.forward(x)?;
        Ok(self.fsdp.post_forward(self.unit, &y)?)
    }
}
