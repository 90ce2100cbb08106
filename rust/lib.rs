//! nybble's core: NF4 (and FP4, int8) blockwise quantization with SIMD kernels, the block
//! layouts, double quantization, and LoRA/QLoRA layer math. Pure Rust; the Python binding
//! lives in `py` and is compiled only with the `python` feature.

pub mod codebook;
pub mod codec;
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

pub use codebook::Format;
pub use codec::{dequantize_into, quantize, quantize_into, Quantized};
pub use error::{Error, Result};
