//! The backend kit: what the built-in backends are written with, public so that a backend
//! outside this workspace can be written with it too (`examples/kit_backend.rs` is one).
//!
//! - [`cpu`]: the per-communicator op queue ([`cpu::queue`]), byte views of candle CPU
//!   storage and pooled byte buffers ([`cpu::bytes`]), output buffers and the reduction
//!   kernels ([`cpu::kernels`]), and how a result reaches the caller ([`cpu::produce`],
//!   [`cpu::deliver`]).
//! - [`desc`]: what a rank issued at a collective index ([`desc::OpDesc`]) and the rule that
//!   says whether two ranks are in step, why a communicator is unusable ([`desc::Failure`]),
//!   and the checks of `split` lists and split sizes.
//! - [`agree`]: fault-tolerant agreement among the live ranks, over a small message interface
//!   ([`agree::Net`]), for [`Comm::agree`](crate::Comm::agree) and
//!   [`Comm::shrink`](crate::Comm::shrink).
//! - Helpers of the seam: [`check_output`], [`dtype_names`], [`NotCompiled`].
//! - Re-exported from the top level, where users find them too: [`store`], [`env`], [`auth`],
//!   [`link`], [`memory`].

pub mod agree;
pub mod cpu;
pub mod desc;

pub use crate::backend::{check_output, dtype_names, NotCompiled};
#[doc(no_inline)]
pub use crate::{auth, env, link, memory, store};
