//! FSDP for unmodified candle-nn / candle-transformers modules: a `VarBuilder` whose backend
//! creates sharded parameters, FSDP units chosen by name pattern, and wrappers that run a unit's
//! forward hooks around any forward.
//!
//! - [`FsdpVarMap::var_builder`] hands modules full parameters that hold their initial values
//!   (so modules that read a parameter while they are built work) and are sharded by FSDP.
//! - Units: by default each top-level name prefix (`l1` in `l1.weight`) is one unit; with
//!   [`FsdpVarMap::with_units`] every name matching a pattern such as `model.layers.{i}` makes
//!   one unit per match and everything else goes into one root unit (`fully_shard` per block
//!   plus the root in PyTorch).
//! - [`FsdpVarMap::wrap`] (a module) and [`FsdpVarMap::forward`] (any closure) run a unit's
//!   hooks: gather before, release after, re-gather before its backward. A unit nobody wraps
//!   (the blocks inside a candle-transformers model) is gathered by the first wrapped forward
//!   and released as its gradients complete; wrap the root, at least.
//! - [`reference_var_builder`] builds the same modules on one device with the same initial
//!   values, for checks.
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_dtensor::comm::LocalWorld;
//! use candle_dtensor::mesh::DeviceMesh;
//! use candle_dtensor::parallel::fsdp::{Fsdp, FsdpConfig, GradReduce};
//! use candle_dtensor::parallel::fsdp_vb::FsdpVarMap;
//! use candle_nn::Optimizer;
//!
//! LocalWorld::run(2, |comm| {
//!     let mesh = DeviceMesh::new(comm, &[("dp", 2)])?;
//!     // Each rank's loss is the mean over its own half of the batch: average the gradients.
//!     let fsdp = Fsdp::new(&mesh, FsdpConfig::new(0, GradReduce::Avg))?;
//!     let map = FsdpVarMap::new(&fsdp, 0);
//!     let vb = map.var_builder(DType::F32);
//!     let l1 = map.wrap("l1", candle_nn::linear(4, 16, vb.pp("l1"))?)?;
//!     let l2 = map.wrap("l2", candle_nn::linear(16, 3, vb.pp("l2"))?)?;
//!     let mut opt = fsdp.optimizer(candle_nn::SGD::new(map.all_vars(), 0.1)?);
//!     let x = Tensor::ones((4, 4), DType::F32, &Device::Cpu)?; // this rank's half of the batch
//!     for _ in 0..2 {
//!         let loss = l2.forward(&l1.forward(&x)?.relu()?)?.sqr()?.mean_all()?;
//!         let grads = fsdp.backward(&loss)?; // backward + reduce-scattered shard gradients
//!         opt.step(&grads)?;
//!     }
//!     Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
//! })?;
//! # Ok::<(), Box<dyn std::error::Error + Send + Sync>>(())
//! ```

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Module, Shape, Tensor, Var};
use candle_nn::init::NormalOrUniform;
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init as NnInit, VarBuilder, VarMap};

use crate::error::{ParallelError, Result};
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
/// and in a single-device reference). A tensor-parallel layer of [`crate::tp_nn`] asking for
/// its piece ([`crate::init::with_piece`]) gets those elements of the global parameter.
pub fn initial_value(
    h: NnInit,
    seed: u64,
    name: &str,
    shape: &Shape,
    dtype: DType,
) -> candle_core::Result<Tensor> {
    if let Some(p) = crate::init::take_piece(shape.dims()) {
        let global = Shape::from(p.global.clone());
        return crate::init::piece(
            init_of(h, &global),
            seed,
            name,
            &p.global,
            &p.indices,
            dtype,
            &Device::Cpu,
        );
    }
    full(
        init_of(h, shape),
        seed,
        name,
        shape.dims(),
        dtype,
        &Device::Cpu,
    )
}

/// How parameter names map to units.
#[derive(Clone, Debug)]
enum UnitRule {
    /// One unit per top-level name prefix.
    TopLevel,
    /// One unit per match of a pattern (segments separated by `.`, `{i}` matching a number);
    /// the rest in the root unit.
    Patterns(Vec<Vec<String>>),
}

/// The name of the unit holding every parameter no pattern of [`FsdpVarMap::with_units`]
/// matches.
pub const ROOT_UNIT: &str = "root";

impl UnitRule {
    fn key(&self, name: &str) -> String {
        match self {
            UnitRule::TopLevel => name.split('.').next().unwrap_or(name).to_string(),
            UnitRule::Patterns(patterns) => {
                let segs: Vec<&str> = name.split('.').collect();
                for p in patterns {
                    if p.len() < segs.len()
                        && p.iter().zip(&segs).all(|(pat, seg)| {
                            if pat == "{i}" {
                                !seg.is_empty() && seg.bytes().all(|b| b.is_ascii_digit())
                            } else {
                                pat == seg
                            }
                        })
                    {
                        return segs[..p.len()].join(".");
                    }
                }
                ROOT_UNIT.to_string()
            }
        }
    }
}

struct State {
    rule: UnitRule,
    units: Vec<(String, usize)>,
    vars: Vec<(String, Var)>,
}

/// The shard vars and units of modules built through [`FsdpVarMap::var_builder`].
#[derive(Clone)]
pub struct FsdpVarMap {
    fsdp: Fsdp,
    seed: u64,
    device: Device,
    state: Arc<Mutex<State>>,
}

struct Backend {
    map: FsdpVarMap,
}

impl FsdpVarMap {
    /// A map creating parameters initialised from `seed`, on the shard communicator's device;
    /// one unit per top-level name prefix.
    pub fn new(fsdp: &Fsdp, seed: u64) -> Self {
        FsdpVarMap {
            fsdp: fsdp.clone(),
            seed,
            device: fsdp.device(),
            state: Arc::new(Mutex::new(State {
                rule: UnitRule::TopLevel,
                units: Vec::new(),
                vars: Vec::new(),
            })),
        }
    }

    /// Units by name pattern: every parameter whose name starts with a match of one of
    /// `patterns` (segments separated by `.`; `{i}` matches a number, e.g.
    /// `model.layers.{i}`) goes into the unit of that match (`model.layers.3`); all others go
    /// into one root unit, [`ROOT_UNIT`]. Call before building modules.
    ///
    /// # Errors
    ///
    /// An empty pattern, or parameters were already created.
    pub fn with_units(self, patterns: &[&str]) -> Result<Self> {
        {
            let mut st = self.lock();
            if !st.vars.is_empty() {
                return Err(ParallelError::Config(
                    "FsdpVarMap::with_units must be called before any parameter is created".into(),
                ));
            }
            let parsed: Vec<Vec<String>> = patterns
                .iter()
                .map(|p| p.split('.').map(str::to_string).collect::<Vec<_>>())
                .collect();
            if let Some(bad) = patterns
                .iter()
                .zip(&parsed)
                .find(|(_, segs)| segs.iter().any(String::is_empty))
            {
                return Err(ParallelError::Config(format!(
                    "FSDP unit pattern {:?} has an empty segment",
                    bad.0
                )));
            }
            st.rule = UnitRule::Patterns(parsed);
        }
        Ok(self)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A `VarBuilder` whose tensors are FSDP full parameters (see the module docs).
    pub fn var_builder(&self, dtype: DType) -> VarBuilder<'static> {
        VarBuilder::from_backend(
            Box::new(Backend { map: self.clone() }),
            dtype,
            self.device.clone(),
        )
    }

    fn unit_for(&self, name: &str) -> usize {
        let mut st = self.lock();
        let key = st.rule.key(name);
        if let Some((_, u)) = st.units.iter().find(|(k, _)| *k == key) {
            return *u;
        }
        // The root unit runs first and last (embeddings, final norm, head): kept after forward.
        let root = matches!(st.rule, UnitRule::Patterns(_)) && key == ROOT_UNIT;
        let u = self.fsdp.add_undriven_unit(&key, root);
        st.units.push((key, u));
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

    /// Every parameter's name and shard var, in creation order (empty shards included).
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        self.lock().vars.clone()
    }

    /// The shard var of parameter `name`.
    pub fn var(&self, name: &str) -> Option<Var> {
        self.lock()
            .vars
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }

    /// The units created so far, `(name, index)` in creation order.
    pub fn units(&self) -> Vec<(String, usize)> {
        self.lock().units.clone()
    }

    fn unit_of_key(&self, key: &str) -> Result<usize> {
        let st = self.lock();
        st.units
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, u)| *u)
            .ok_or_else(|| {
                ParallelError::Config(format!(
                    "no FSDP unit \"{key}\": units are [{}]",
                    st.units
                        .iter()
                        .map(|(k, _)| k.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
    }

    /// Wraps a module whose parameters form unit `key` so its forward runs the unit's hooks.
    /// The module may use any forward signature through [`FsdpModule::run`].
    ///
    /// # Errors
    ///
    /// No unit `key`.
    pub fn wrap<M>(&self, key: &str, module: M) -> Result<FsdpModule<M>> {
        let unit = self.unit_of_key(key)?;
        self.fsdp.set_driven(unit)?;
        Ok(FsdpModule {
            inner: module,
            fsdp: self.fsdp.clone(),
            unit,
        })
    }

    /// Runs `f` as the forward of unit `key` (e.g. [`ROOT_UNIT`] around a whole model's
    /// forward): gathered before, released after (except the root), re-gathered before its
    /// backward. Marks the unit as driven.
    ///
    /// # Errors
    ///
    /// No unit `key`, or as [`Fsdp::forward`].
    pub fn forward(
        &self,
        key: &str,
        f: impl FnOnce() -> candle_core::Result<Tensor>,
    ) -> Result<Tensor> {
        let unit = self.unit_of_key(key)?;
        self.fsdp.set_driven(unit)?;
        self.fsdp.forward(unit, f)
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
        if !dev.same_device(&self.map.device) {
            return Err(candle_core::Error::Msg(format!(
                "FSDP var builder: {name}: parameters live on {:?}, the device of the FSDP \
                 communicator, not {:?}",
                self.map.device.location(),
                dev.location()
            )));
        }
        if let Some((_, v)) = self.map.lock().vars.iter().find(|(n, _)| n == name) {
            return Err(candle_core::Error::Msg(format!(
                "FSDP var builder: parameter {name} requested twice (shape {:?}, already {:?}); \
                 share the module instead",
                s.dims(),
                v.dims()
            )));
        }
        let value = initial_value(h, self.map.seed, name, &s, dtype)?.to_device(dev)?;
        let unit = self.map.unit_for(name);
        let (shard, full) = self.map.fsdp.add_param(unit, name, &value)?;
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

/// A module run as one FSDP unit: gathered before its forward, released after, and
/// re-gathered before its backward.
pub struct FsdpModule<M> {
    inner: M,
    fsdp: Fsdp,
    unit: usize,
}

impl<M> FsdpModule<M> {
    /// The FSDP unit index.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// Runs `f` (any forward of the module: with a cache, positions, ...) as the unit's
    /// forward. The module is only reachable inside, where its parameters are gathered.
    ///
    /// # Errors
    ///
    /// As [`Fsdp::forward`].
    pub fn run(&self, f: impl FnOnce(&M) -> candle_core::Result<Tensor>) -> Result<Tensor> {
        self.fsdp.forward(self.unit, || f(&self.inner))
    }
}

impl<M: Module> Module for FsdpModule<M> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.run(|m| m.forward(x))?)
    }
}

struct Reference {
    map: VarMap,
    seed: u64,
}

impl SimpleBackend for Reference {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: NnInit,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let mut data = self.map.data().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = data.get(name) {
            if v.shape() != &s {
                return Err(candle_core::Error::Msg(format!(
                    "reference var builder: {name} requested as {:?}, exists as {:?}",
                    s.dims(),
                    v.dims()
                )));
            }
            return Ok(v.as_tensor().clone());
        }
        let var = Var::from_tensor(&initial_value(h, self.seed, name, &s, dtype)?.to_device(dev)?)?;
        let t = var.as_tensor().clone();
        data.insert(name.to_string(), var);
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        Err(candle_core::Error::Msg(format!(
            "reference var builder: {name}: parameters are created with a shape, not loaded"
        )))
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.map
            .data()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(name)
    }
}

/// A single-device `VarBuilder` creating the same initial values as an [`FsdpVarMap`] with
/// `seed`, and the `VarMap` holding them (for a candle-nn optimizer: `map.all_vars()`).
pub fn reference_var_builder(
    seed: u64,
    dtype: DType,
    device: &Device,
) -> (VarMap, VarBuilder<'static>) {
    let map = VarMap::new();
    let vb = VarBuilder::from_backend(
        Box::new(Reference {
            map: map.clone(),
            seed,
        }),
        dtype,
        device.clone(),
    );
    (map, vb)
}
