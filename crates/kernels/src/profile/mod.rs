//! What a step costs on the device, counted rather than estimated:
//!
//! - [`Mark`]: a CUDA timing event recorded on a device's stream, and the GPU time between two
//!   of them, read without waiting once both completed (feature `cuda`; on the CPU, or without
//!   the feature, [`Mark::record`] gives `None`: host time is all there is).
//! - [`Stamp`] and [`Phases`]: the forward / backward / optimizer split of one step from any
//!   kind of stamp, the same arithmetic as the host-time split.
//! - [`cupti`]: the kernels a process ran and their summed GPU time, from CUPTI's activity
//!   records. The library is loaded at run time (no CUDA feature or link needed: a binary
//!   without CUPTI on its machine starts, and counting says why it is off).

pub mod cupti;
mod marks;

pub use marks::{Mark, Phases, Stamp};

/// Why a device measurement could not be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileError {
    /// A CUDA driver call failed.
    #[error("{what}: CUDA driver error: {message}")]
    Cuda {
        /// What was being done.
        what: &'static str,
        /// The driver's error.
        message: String,
    },
    /// The CUPTI library could not be loaded.
    #[error("kernel counting: cannot load CUPTI (tried {tried}): {message}")]
    NoCupti {
        /// The file names tried, in order.
        tried: String,
        /// What each candidate lacked (not found, or a CUPTI function missing), `; `-separated.
        message: String,
    },
    /// A CUPTI call failed.
    #[error("kernel counting: {call} returned CUPTI error {code}")]
    Cupti {
        /// The call.
        call: &'static str,
        /// CUPTI's result code.
        code: i32,
    },
    /// Another kernel counter is on in this process (CUPTI's activity buffers are global).
    #[error("kernel counting: a counter is already on in this process")]
    Busy,
}
