//! The floating-point element types nybble reads and writes, and their exact conversions.
//!
//! Inputs are widened (f16, bf16: exact) or rounded (f64: to nearest, ties to even) to f32
//! before anything else happens; outputs are computed in f32 and rounded to nearest-even.

use half::{bf16, f16};

/// An input element type: anything that converts to f32 the way the spec says.
pub trait Input: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
}

impl Input for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Input for f64 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
}

impl Input for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Input for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// An output element type: an f32 result rounded to nearest-even.
pub trait Output: Copy + Send + Sync + Default + 'static {
    fn from_f32(v: f32) -> Self;
}

impl Output for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl Output for f16 {
    #[inline(always)]
    fn from_f32(v: f32) -> f16 {
        f16::from_f32(v)
    }
}

impl Output for bf16 {
    #[inline(always)]
    fn from_f32(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}
