//! Which device a rank computes on: `cpu`, `cuda` (ranks spread over every visible GPU,
//! `cuda:(rank % gpus)`) or `cuda:N` (every rank on GPU N).
//!
//! ```
//! use candle_dtensor::train::device::DeviceSpec;
//!
//! assert_eq!("cpu".parse::<DeviceSpec>()?, DeviceSpec::Cpu);
//! assert_eq!("cuda:1".parse::<DeviceSpec>()?, DeviceSpec::Cuda(Some(1)));
//! assert!("gpu".parse::<DeviceSpec>().is_err());
//! assert!(DeviceSpec::Cpu.device_for(3)?.is_cpu());
//! # Ok::<(), candle_dtensor::train::device::DeviceError>(())
//! ```

use std::str::FromStr;

use candle_core::Device;

/// Why a device could not be used.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The text is not `cpu`, `cuda` or `cuda:N`.
    #[error("unknown device {0:?}: use cpu, cuda or cuda:N")]
    Parse(String),
    /// This binary was built without CUDA.
    #[error(
        "device {0}: this build has no CUDA support; rebuild with `--features cuda` (or `nccl`), \
         after `eval \"$(scripts/setup_cuda.sh --auto)\"` provides a CUDA toolkit"
    )]
    NotCompiled(String),
    /// CUDA is compiled in but no usable GPU answered.
    #[error("device {device}: no usable CUDA device ({reason}); is the NVIDIA driver installed and a GPU visible (nvidia-smi, CUDA_VISIBLE_DEVICES)?")]
    Unavailable {
        /// The device asked for.
        device: String,
        /// What CUDA said.
        reason: String,
    },
}

/// A device choice for every rank of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU.
    Cpu,
    /// CUDA: `None` spreads ranks over the visible GPUs (`rank % gpus`), `Some(n)` puts every
    /// rank on GPU `n`.
    Cuda(Option<usize>),
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, DeviceError> {
        match s.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(None)),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceSpec::Cuda(Some(n))),
                _ => Err(DeviceError::Parse(s.to_string())),
            },
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Cuda(None) => write!(f, "cuda"),
            DeviceSpec::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

/// `Device::new_cuda(n)`, with a panic inside the driver bindings (a missing library) turned
/// into an error.
fn open_cuda(n: usize) -> Result<Device, String> {
    match std::panic::catch_unwind(|| Device::new_cuda(n)) {
        Ok(Ok(d)) => Ok(d),
        Ok(Err(e)) => Err(e.to_string()),
        Err(p) => Err(p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "the CUDA driver bindings panicked".into())),
    }
}

impl DeviceSpec {
    /// Whether this is a CUDA choice.
    pub fn is_cuda(&self) -> bool {
        matches!(self, DeviceSpec::Cuda(_))
    }

    /// Number of CUDA devices the driver reports (0 without CUDA support or a driver). None is
    /// opened to count it: opening every GPU from every rank made a context and a cuBLAS handle
    /// on each, and on GPUs in exclusive-process mode it failed on those other ranks held, so
    /// the count came out short and `rank % gpus` put several ranks on one GPU.
    pub fn cuda_device_count() -> usize {
        candle_dtensor_kernels::storage::cuda_device_count()
    }

    /// The device of the rank with index `local_rank` among the ranks of this host. A CUDA
    /// device keeps freed memory in its pool
    /// (`candle_dtensor_kernels::storage::retain_freed_memory`), and its buffers carry no
    /// cudarc events while its context has one stream
    /// (`candle_dtensor_kernels::storage::skip_unused_buffer_events`; `CDT_CUDA_BUFFER_EVENTS=1`
    /// keeps them). Code that makes cudarc streams of its own on this device's context
    /// (`CudaContext::new_stream`, below candle's API) turns cudarc's tracking back on
    /// (`enable_event_tracking`) before it makes them, as the NCCL backend does, or orders its
    /// buffers' uses across them itself: the contract of that `unsafe` call.
    ///
    /// # Errors
    ///
    /// CUDA asked for in a build without it, or no usable GPU.
    pub fn device_for(&self, local_rank: usize) -> Result<Device, DeviceError> {
        let ordinal = match self {
            DeviceSpec::Cpu => return Ok(Device::Cpu),
            DeviceSpec::Cuda(Some(n)) => *n,
            DeviceSpec::Cuda(None) => {
                if !candle_core::utils::cuda_is_available() {
                    return Err(DeviceError::NotCompiled(self.to_string()));
                }
                match Self::cuda_device_count() {
                    0 => {
                        return Err(DeviceError::Unavailable {
                            device: self.to_string(),
                            reason: open_cuda(0).err().unwrap_or_default(),
                        })
                    }
                    gpus => local_rank % gpus,
                }
            }
        };
        if !candle_core::utils::cuda_is_available() {
            return Err(DeviceError::NotCompiled(self.to_string()));
        }
        let device = open_cuda(ordinal).map_err(|reason| DeviceError::Unavailable {
            device: format!("cuda:{ordinal}"),
            reason,
        })?;
        // Freed memory stays in the pool across steps (a failure only costs speed).
        if let Err(e) = candle_dtensor_kernels::storage::retain_freed_memory(&device) {
            tracing::warn!(ordinal, error = %e, "freed GPU memory goes back to the driver");
        }
        // No cudarc event pair per buffer while nothing would use them (`CDT_CUDA_BUFFER_EVENTS=1`
        // keeps them, to measure what they cost).
        if std::env::var("CDT_CUDA_BUFFER_EVENTS").map_or(true, |v| v.trim() != "1") {
            // SAFETY: the device was just opened, on a context of its own (`CudaContext::new`
            // per device); the runtime's only cudarc stream on it is the NCCL backend's, which
            // turns tracking back on before making it. A caller making cudarc streams of its
            // own on it takes on the same contract (this function's docs).
            let skipped =
                unsafe { candle_dtensor_kernels::storage::skip_unused_buffer_events(&device) };
            tracing::debug!(ordinal, skipped, "cudarc per-buffer events");
        }
        Ok(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_resolve() {
        assert_eq!(
            "cuda".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Cuda(None)
        );
        assert_eq!(
            " cuda:0 ".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Cuda(Some(0))
        );
        for bad in ["", "gpu", "cuda:", "cuda:x", "cuda:-1", "metal"] {
            assert!(bad.parse::<DeviceSpec>().is_err(), "{bad:?}");
        }
        assert_eq!(DeviceSpec::Cuda(Some(2)).to_string(), "cuda:2");
        if !candle_core::utils::cuda_is_available() {
            // The default build: a clear error naming the feature, never a panic.
            let e = DeviceSpec::Cuda(None)
                .device_for(0)
                .unwrap_err()
                .to_string();
            assert!(e.contains("--features cuda"), "{e}");
            assert_eq!(DeviceSpec::cuda_device_count(), 0);
        }
    }
}
