//! Kernels for candle-dtensor, knowing nothing about distribution:
//!
//! - [`storage`]: the storage seam, the one module above the communicators that touches a
//!   tensor's memory (byte and typed views, row copies, graph-node outputs on any device, the
//!   release and refill of a parameter's storage, host staging).
//! - [`fused`]: one-pass f32 CPU kernels with hand-written backward passes (GELU, norms,
//!   softmax, log-softmax, cross-entropy and its loss-parallel parts, row-broadcast add); the
//!   row kernels among them also on CUDA (f32/bf16, feature `cuda`, kernels in `cuda/*.cu`
//!   compiled by build.rs).
//! - [`error`]: the typed errors of the fused kernels' device paths.
//! - [`multi_tensor`]: the global gradient norm and clip coefficient over many tensors, kept on
//!   the device (two launches on CUDA, no host read).
//! - [`region`]: a few candle ops computed on detached tensors and recorded as one graph node
//!   (linear, attention).
//! - [`autodiff`]: differentiable neural-network ops on plain tensors, any device: the fused kernel
//!   for f32 on the CPU, the primitive composition ([`autodiff::reference`]) otherwise.
//! - [`profile`]: what a step costs on the device, counted: GPU time between CUDA timing
//!   events, and the kernels the process ran (CUPTI, loaded at run time).
//! - [`compare`]: element-wise comparisons for checking a kernel against its reference.

#[doc(hidden)]
pub use candle_core;

pub mod storage;

pub mod autodiff;
pub mod compare;
#[cfg(feature = "cuda")]
mod cublaslt;
#[cfg(feature = "cuda")]
mod cuda;
pub mod error;
#[cfg(feature = "cuda")]
mod fa_rows;
pub mod flash;
// Used by the cuBLASLt path (feature `cuda`); its tests run everywhere.
pub mod fused;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod gemm_layout;
pub mod multi_tensor;
pub mod profile;
pub mod region;
