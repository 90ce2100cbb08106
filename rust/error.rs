//! The errors of the core. The Python binding maps each to a Python exception.

use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// An input holds NaN or ±inf (after conversion to f32) at this flat index.
    NonFinite { index: usize },
    /// An argument has a value outside its domain; the message names it.
    InvalidArgument(String),
    /// Two sizes that must agree do not.
    SizeMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    /// A buffer of this many bytes could not be allocated.
    OutOfMemory { bytes: usize },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NonFinite { index } => {
                write!(
                    f,
                    "input has a non-finite value (NaN or inf) at flat index {index}"
                )
            }
            Error::InvalidArgument(msg) => f.write_str(msg),
            Error::SizeMismatch {
                what,
                expected,
                got,
            } => {
                write!(f, "{what}: expected {expected}, got {got}")
            }
            Error::OutOfMemory { bytes } => {
                write!(f, "cannot allocate a buffer of {bytes} bytes")
            }
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Checks that `got == expected`.
pub fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(Error::SizeMismatch {
            what,
            expected,
            got,
        })
    }
}

/// `a * b`, or an error naming `what` when the product does not fit in a `usize` (sizes
/// from Python are arbitrary integers: their products must never wrap).
pub fn checked_mul(what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| {
        Error::InvalidArgument(format!("{what}: {a} x {b} does not fit in a 64-bit size"))
    })
}
