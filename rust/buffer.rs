//! Fallible allocation of zeroed output buffers. A failed `vec![0; n]` aborts the process,
//! and the binding may be asked for outputs whose size comes from a Python integer (a
//! shape with a zero dimension elsewhere, a huge `n`): those return `Error::OutOfMemory`.

use std::alloc::{alloc_zeroed, Layout};

use crate::error::{Error, Result};

/// Element types for which all-zero bytes are the value zero.
///
/// # Safety
/// The all-zero bit pattern must be a valid value of the type.
pub unsafe trait ZeroBits: Copy {}
// SAFETY: zero bytes are 0 for the integers and +0.0 for the IEEE floats.
unsafe impl ZeroBits for u8 {}
// SAFETY: as above.
unsafe impl ZeroBits for f32 {}

/// A vector of `len` zeros, allocated like `vec![0; len]` (zeroed pages straight from the
/// allocator, no extra pass), or `Error::OutOfMemory` when that fails.
pub fn zeroed<T: ZeroBits>(len: usize) -> Result<Vec<T>> {
    let too_large = || Error::OutOfMemory {
        bytes: len.saturating_mul(std::mem::size_of::<T>()),
    };
    let layout = Layout::array::<T>(len).map_err(|_| too_large())?;
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: `layout` has a non-zero size.
    let ptr = unsafe { alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return Err(too_large());
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `[T; len]`,
    // and its `len` elements are initialised (zero bytes are a valid `T`).
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_buffers_are_zero_and_impossible_ones_are_errors() {
        assert_eq!(zeroed::<f32>(5).unwrap(), vec![0.0; 5]);
        assert!(zeroed::<u8>(0).unwrap().is_empty());
        assert!(matches!(
            zeroed::<f32>(usize::MAX / 2),
            Err(Error::OutOfMemory { .. })
        ));
        // Fits a Layout but no machine has it: the allocator says no, the process lives.
        assert!(matches!(
            zeroed::<u8>(1 << 62),
            Err(Error::OutOfMemory { .. })
        ));
    }
}
