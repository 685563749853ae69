//! A local world's rank thread on the device `--device` names (train_gpt, train_llama).

use candle_dtensor::comm::{new_comm, Comm, CommOptions};
use candle_dtensor::train::device::DeviceSpec;

/// `comm` itself on the CPU; otherwise a communicator of the local backend over the same
/// ranks on this rank's GPU (`cuda:(rank % gpus)` or `cuda:N`). Collective: every rank of the
/// world calls it.
pub fn on_device(
    comm: Comm,
    spec: &DeviceSpec,
    options: CommOptions,
) -> Result<Comm, Box<dyn std::error::Error + Send + Sync>> {
    Ok(match spec {
        DeviceSpec::Cpu => comm,
        spec => {
            let dev = spec.device_for(comm.rank())?;
            new_comm("local", &dev, "world_cuda", options)?
        }
    })
}
