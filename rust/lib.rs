//! nybble's core: NF4 (and FP4, int8) blockwise quantization with SIMD kernels, the block
//! layouts, double quantization, and LoRA/QLoRA layer math. Pure Rust; the Python binding
//! lives in `py` (and `py_launch`, the kernel launches' binding) and is compiled only with the
//! `python` feature.
//!
//! Nothing reachable from Python may panic (PyO3 would turn it into a `PanicException`) or
//! abort. Outside tests, clippy holds the crate to that (`cargo clippy -- -D warnings` in CI):
//! no `unwrap`/`expect`/`panic!`/`unreachable!`/`todo!`/`unimplemented!`; no indexing or
//! slicing that can fail, and no arithmetic that can overflow, in the modules that handle
//! sizes coming from Python (`py`, `py_launch`, `layout`, `linalg`, `qmatmul`, `lora`, `codec`,
//! `double_quant`, `buffer`): they use `get`, iterators and checked arithmetic. The kernels
//! (`simd`, `codebook`) index and compute offsets freely: their callers have checked that
//! every slice has the length its element count needs and that the blocksize is a power of
//! two from 32 to 4096, so their indices stay below slice lengths (`<= isize::MAX`). Each
//! allowed exception carries its reason. Outputs are allocated fallibly (`buffer::zeroed`),
//! so an impossible size is a MemoryError, not an abort.

#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented,
        clippy::indexing_slicing,
        clippy::arithmetic_side_effects
    )
)]

pub mod buffer;
pub mod codebook;
pub mod codec;
#[cfg(unix)]
pub mod cuda_launch;
pub mod double_quant;
pub mod element;
pub mod error;
pub mod layout;
pub mod linalg;
pub mod lora;
pub mod qmatmul;
pub mod simd;

#[cfg(feature = "python")]
mod py;
#[cfg(all(feature = "python", unix))]
mod py_launch;

pub use codebook::Format;
pub use codec::{dequantize_into, quantize, quantize_into, Quantized};
pub use error::{Error, Result};
