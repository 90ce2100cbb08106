//! The base formats: their value tables and the rule that turns a normalised value
//! `v = x / absmax` (in `[-1, 1]`) into a code. This is the one place these numbers live.

// The tables are written with bitsandbytes' decimal literals, longer than f32 needs.
#![allow(clippy::excessive_precision)]
// Table lookups by a code masked to the table's size, or by a count of thresholds below a
// value (at most the table's size minus one), and the compile-time loops that build the
// midpoints: in range by construction (see `lib.rs`).
#![allow(clippy::indexing_slicing, clippy::arithmetic_side_effects)]

/// NF4 codebook (index -> value), the exact f32 values of bitsandbytes and the QLoRA paper.
pub const NF4: [f32; 16] = [
    -1.0,
    -0.696_192_800_998_687_7,
    -0.525_073_051_452_636_7,
    -0.394_917_488_098_144_53,
    -0.284_441_381_692_886_35,
    -0.184_773_430_228_233_34,
    -0.091_050_036_251_544_95,
    0.0,
    0.079_580_299_556_255_34,
    0.160_930_201_411_247_25,
    0.246_112_301_945_686_34,
    0.337_915_241_718_292_24,
    0.440_709_829_330_444_34,
    0.562_617_003_917_694_1,
    0.722_956_836_223_602_3,
    1.0,
];

/// Decision thresholds of NF4: `(c[k] + c[k+1]) / 2` in f32. A value exactly on a
/// threshold takes the lower code (the comparison is a strict `>`).
pub const NF4_MIDPOINTS: [f32; 15] = nf4_midpoints();

const fn nf4_midpoints() -> [f32; 15] {
    let mut m = [0.0f32; 15];
    let mut k = 0;
    while k < 15 {
        // Halving is exact, so this is the f32 rounding of the true midpoint.
        m[k] = (NF4[k] + NF4[k + 1]) * 0.5;
        k += 1;
    }
    m
}

/// The NF4 code of a normalised value: how many thresholds lie strictly below it.
#[inline]
pub fn nf4_code(v: f32) -> u8 {
    NF4_MIDPOINTS.iter().filter(|&&m| v > m).count() as u8
}

/// NF4 code of 0.0; it fills all-zero blocks and the padding nibble of an odd length.
pub const NF4_ZERO_CODE: u8 = 7;

/// bitsandbytes' FP4 (e2m1 without infinities, scaled to max 1) in code order: bit 3 is
/// the sign, bits 0-2 the magnitude. Code 8 is +0.0, as in bitsandbytes' table.
pub const FP4: [f32; 16] = [
    0.0,
    0.005_208_333_5,
    0.666_666_7,
    1.0,
    0.333_333_34,
    0.5,
    0.166_666_67,
    0.25,
    0.0,
    -0.005_208_333_5,
    -0.666_666_7,
    -1.0,
    -0.333_333_34,
    -0.5,
    -0.166_666_67,
    -0.25,
];

/// FP4 magnitude thresholds, as bitsandbytes writes them (decimal literals, not the exact
/// midpoints), ascending; `FP4_MAGNITUDE_CODES[k]` is the code of the k-th smallest magnitude.
pub const FP4_THRESHOLDS: [f32; 7] = [
    0.002_604_17,
    0.085_937_5,
    0.208_333_33,
    0.291_666_67,
    0.416_666_7,
    0.583_333,
    0.833_333_3,
];
pub const FP4_MAGNITUDE_CODES: [u8; 8] = [0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011];

/// The FP4 code of a normalised value: sign bit for `v < 0`, then the nearest magnitude.
#[inline]
pub fn fp4_code(v: f32) -> u8 {
    let sign = if v < 0.0 { 0b1000 } else { 0 };
    let a = v.abs();
    let rank = FP4_THRESHOLDS.iter().filter(|&&t| a > t).count();
    sign | FP4_MAGNITUDE_CODES[rank]
}

/// FP4 code of 0.0.
pub const FP4_ZERO_CODE: u8 = 0;

/// Symmetric linear int8: code `q` (two's complement in a byte) stands for `q / 127`.
pub fn int8_value(code: u8) -> f32 {
    (code as i8) as f32 / 127.0
}

/// The int8 code of a normalised value: `round(v * 127)`, ties to even, within ±127.
#[inline]
pub fn int8_code(v: f32) -> u8 {
    ((v * 127.0).round_ties_even().clamp(-127.0, 127.0) as i8) as u8
}

/// bitsandbytes' signed dynamic 8-bit map (`create_dynamic_map(signed=True)`), sorted; it
/// quantizes the scales under double quantization. Index 127 is 0.0, index 255 is 1.0.
#[rustfmt::skip]
pub const DYNAMIC_MAP: [f32; 256] = [
    -0.99296874, -0.9789063, -0.96484375, -0.9507812, -0.93671876, -0.92265624, -0.9085938, -0.89453125,
    -0.8804687, -0.86640626, -0.85234374, -0.8382813, -0.82421875, -0.8101562, -0.79609376, -0.78203124,
    -0.7679688, -0.75390625, -0.7398437, -0.72578126, -0.7117188, -0.6976563, -0.68359375, -0.6695312,
    -0.65546876, -0.6414063, -0.6273438, -0.61328125, -0.5992187, -0.58515626, -0.5710938, -0.5570313,
    -0.54296875, -0.5289062, -0.5148437, -0.50078124, -0.4867187, -0.47265625, -0.45859373, -0.44453126,
    -0.43046874, -0.41640624, -0.40234375, -0.38828123, -0.37421876, -0.36015624, -0.34609374, -0.33203125,
    -0.31796873, -0.30390626, -0.28984374, -0.27578127, -0.26171875, -0.24765624, -0.23359375, -0.21953125,
    -0.20546874, -0.19140625, -0.17734376, -0.16328125, -0.14921875, -0.13515624, -0.12109375, -0.107031256,
    -0.09859375, -0.09578126, -0.092968754, -0.09015625, -0.08734375, -0.08453125, -0.08171876, -0.07890625,
    -0.07609375, -0.07328125, -0.070468746, -0.067656256, -0.06484375, -0.06203125, -0.059218753, -0.05640625,
    -0.05359375, -0.05078125, -0.04796875, -0.04515625, -0.042343747, -0.03953125, -0.036718752, -0.03390625,
    -0.03109375, -0.028281251, -0.02546875, -0.02265625, -0.019843752, -0.01703125, -0.01421875, -0.01140625,
    -0.00971875, -0.009156249, -0.00859375, -0.00803125, -0.00746875, -0.00690625, -0.00634375, -0.00578125,
    -0.0052187503, -0.0046562497, -0.00409375, -0.0035312497, -0.00296875, -0.00240625, -0.00184375, -0.0012812499,
    -0.0009437501, -0.00083125, -0.00071875006, -0.0006062501, -0.00049375003, -0.00038125002, -0.00026875004, -0.00015625001,
    -0.00008875, -0.00006625, -0.00004375, -0.000021249998, -0.00000775, -0.0000032500002, -0.00000055000004, 0.,
    0.00000055000004, 0.0000032500002, 0.00000775, 0.000021249998, 0.00004375, 0.00006625, 0.00008875, 0.00015625001,
    0.00026875004, 0.00038125002, 0.00049375003, 0.0006062501, 0.00071875006, 0.00083125, 0.0009437501, 0.0012812499,
    0.00184375, 0.00240625, 0.00296875, 0.0035312497, 0.00409375, 0.0046562497, 0.0052187503, 0.00578125,
    0.00634375, 0.00690625, 0.00746875, 0.00803125, 0.00859375, 0.009156249, 0.00971875, 0.01140625,
    0.01421875, 0.01703125, 0.019843752, 0.02265625, 0.02546875, 0.028281251, 0.03109375, 0.03390625,
    0.036718752, 0.03953125, 0.042343747, 0.04515625, 0.04796875, 0.05078125, 0.05359375, 0.05640625,
    0.059218753, 0.06203125, 0.06484375, 0.067656256, 0.070468746, 0.07328125, 0.07609375, 0.07890625,
    0.08171876, 0.08453125, 0.08734375, 0.09015625, 0.092968754, 0.09578126, 0.09859375, 0.107031256,
    0.12109375, 0.13515624, 0.14921875, 0.16328125, 0.17734376, 0.19140625, 0.20546874, 0.21953125,
    0.23359375, 0.24765624, 0.26171875, 0.27578127, 0.28984374, 0.30390626, 0.31796873, 0.33203125,
    0.34609374, 0.36015624, 0.37421876, 0.38828123, 0.40234375, 0.41640624, 0.43046874, 0.44453126,
    0.45859373, 0.47265625, 0.4867187, 0.50078124, 0.5148437, 0.5289062, 0.54296875, 0.5570313,
    0.5710938, 0.58515626, 0.5992187, 0.61328125, 0.6273438, 0.6414063, 0.65546876, 0.6695312,
    0.68359375, 0.6976563, 0.7117188, 0.72578126, 0.7398437, 0.75390625, 0.7679688, 0.78203124,
    0.79609376, 0.8101562, 0.82421875, 0.8382813, 0.85234374, 0.86640626, 0.8804687, 0.89453125,
    0.9085938, 0.92265624, 0.93671876, 0.9507812, 0.96484375, 0.9789063, 0.99296874, 1.,
];
/// Thresholds between neighbours of the dynamic map (its nearest-value rule, ties down).
pub static DYNAMIC_MIDPOINTS: [f32; 255] = dynamic_midpoints();

const fn dynamic_midpoints() -> [f32; 255] {
    let mut m = [0.0f32; 255];
    let mut k = 0;
    while k < 255 {
        m[k] = (DYNAMIC_MAP[k] + DYNAMIC_MAP[k + 1]) * 0.5;
        k += 1;
    }
    m
}

/// A base format: 4-bit NF4 or FP4 (two codes per byte) or 8-bit int8 (one per byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Nf4,
    Fp4,
    Int8,
    /// The dynamic 8-bit map, for double-quantized scales (not a base format of weights).
    Dynamic8,
}

impl Format {
    /// Every format, in the order error messages list their names.
    pub const ALL: [Format; 4] = [Format::Nf4, Format::Fp4, Format::Int8, Format::Dynamic8];

    /// The format called `name` (its `name()`), if any.
    pub fn parse(name: &str) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Format::Nf4 => "nf4",
            Format::Fp4 => "fp4",
            Format::Int8 => "int8",
            Format::Dynamic8 => "dynamic8",
        }
    }

    /// Bits per stored code.
    pub fn bits(self) -> usize {
        match self {
            Format::Nf4 | Format::Fp4 => 4,
            Format::Int8 | Format::Dynamic8 => 8,
        }
    }

    /// Bytes of codes for `n` values.
    pub fn code_bytes(self, n: usize) -> usize {
        match self.bits() {
            4 => n.div_ceil(2),
            _ => n,
        }
    }

    /// The code of a normalised value.
    #[inline]
    pub fn code(self, v: f32) -> u8 {
        match self {
            Format::Nf4 => nf4_code(v),
            Format::Fp4 => fp4_code(v),
            Format::Int8 => int8_code(v),
            Format::Dynamic8 => DYNAMIC_MIDPOINTS.partition_point(|&m| m < v) as u8,
        }
    }

    /// The decision thresholds `code` compares against, ascending: NF4's 15 midpoints, FP4's 7
    /// magnitude thresholds (applied to `|v|`, the sign bit set apart), the dynamic map's 255
    /// midpoints. int8 has none: its code is arithmetic (`int8_code`).
    pub fn thresholds(self) -> &'static [f32] {
        match self {
            Format::Nf4 => &NF4_MIDPOINTS,
            Format::Fp4 => &FP4_THRESHOLDS,
            Format::Int8 => &[],
            Format::Dynamic8 => &DYNAMIC_MIDPOINTS,
        }
    }

    /// The code that decodes to zero (all-zero blocks, padding).
    pub fn zero_code(self) -> u8 {
        match self {
            Format::Nf4 => NF4_ZERO_CODE,
            Format::Fp4 => FP4_ZERO_CODE,
            Format::Int8 => 0,
            Format::Dynamic8 => 127,
        }
    }

    /// The value of a code (4-bit formats use only codes 0..16).
    pub fn value(self, code: u8) -> f32 {
        match self {
            Format::Nf4 => NF4[(code & 0x0F) as usize],
            Format::Fp4 => FP4[(code & 0x0F) as usize],
            Format::Int8 => int8_value(code),
            Format::Dynamic8 => DYNAMIC_MAP[code as usize],
        }
    }

    /// The 16-entry value table of a 4-bit format.
    pub fn table16(self) -> Option<&'static [f32; 16]> {
        match self {
            Format::Nf4 => Some(&NF4),
            Format::Fp4 => Some(&FP4),
            Format::Int8 | Format::Dynamic8 => None,
        }
    }

    /// All code values, indexed by code (16 entries for 4-bit formats, 256 for int8).
    pub fn values(self) -> Vec<f32> {
        (0..1usize << self.bits())
            .map(|c| self.value(c as u8))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nf4_is_strictly_increasing_with_fixed_ends() {
        assert!(NF4.windows(2).all(|w| w[0] < w[1]));
        assert_eq!((NF4[0], NF4[7], NF4[15]), (-1.0, 0.0, 1.0));
    }

    #[test]
    fn nf4_codes_its_own_values_and_ties_go_down() {
        for (k, &c) in NF4.iter().enumerate() {
            assert_eq!(nf4_code(c) as usize, k);
        }
        for (k, &m) in NF4_MIDPOINTS.iter().enumerate() {
            assert_eq!(nf4_code(m) as usize, k, "midpoint {k} takes the lower code");
            assert_eq!(nf4_code(m.next_up()) as usize, k + 1);
        }
        assert_eq!(nf4_code(0.0), 7);
        assert_eq!(nf4_code(-0.0), 7);
    }

    #[test]
    fn fp4_codes_its_own_values() {
        for (code, &c) in FP4.iter().enumerate() {
            assert_eq!(
                fp4_code(c),
                if code == 8 { 0 } else { code as u8 },
                "value {c}"
            );
        }
    }

    #[test]
    fn dynamic_map_is_sorted_with_zero_and_one() {
        assert!(DYNAMIC_MAP.windows(2).all(|w| w[0] < w[1]));
        assert_eq!((DYNAMIC_MAP[127], DYNAMIC_MAP[255]), (0.0, 1.0));
        for (k, &v) in DYNAMIC_MAP.iter().enumerate() {
            assert_eq!(Format::Dynamic8.code(v) as usize, k);
        }
        for (k, &m) in DYNAMIC_MIDPOINTS.iter().enumerate() {
            assert_eq!(
                Format::Dynamic8.code(m) as usize,
                k,
                "ties take the lower code"
            );
        }
    }

    #[test]
    fn names_parse_back_and_unknown_names_do_not() {
        for f in Format::ALL {
            assert_eq!(Format::parse(f.name()), Some(f));
        }
        assert_eq!(Format::parse("NF4"), None);
        assert_eq!(Format::parse(""), None);
    }

    #[test]
    fn thresholds_are_ascending_and_are_where_the_code_steps_up() {
        for f in [Format::Nf4, Format::Dynamic8] {
            let t = f.thresholds();
            assert_eq!(t.len() + 1, f.values().len(), "{}", f.name());
            assert!(t.windows(2).all(|w| w[0] < w[1]));
            for (k, &m) in t.iter().enumerate() {
                assert_eq!(f.code(m) as usize, k, "{} ties go down", f.name());
                assert_eq!(f.code(m.next_up()) as usize, k + 1);
            }
        }
        let t = Format::Fp4.thresholds();
        assert_eq!(t.len(), 7);
        assert!(t.windows(2).all(|w| w[0] < w[1]));
        for (k, &m) in t.iter().enumerate() {
            assert_eq!(fp4_code(m), FP4_MAGNITUDE_CODES[k]);
            assert_eq!(fp4_code(m.next_up()), FP4_MAGNITUDE_CODES[k + 1]);
            assert_eq!(fp4_code(-m.next_up()), 0b1000 | FP4_MAGNITUDE_CODES[k + 1]);
        }
        assert!(Format::Int8.thresholds().is_empty());
    }

    #[test]
    fn fp4_magnitude_codes_list_the_magnitudes_in_ascending_order() {
        let magnitudes = FP4_MAGNITUDE_CODES.map(|c| FP4[c as usize]);
        assert!(magnitudes.windows(2).all(|w| w[0] < w[1]));
        let mut sorted = FP4_MAGNITUDE_CODES;
        sorted.sort_unstable();
        assert_eq!(sorted, [0, 1, 2, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn zero_codes_decode_to_zero() {
        for f in Format::ALL {
            assert_eq!(f.value(f.zero_code()), 0.0, "{}", f.name());
            assert_eq!(f.code(0.0), f.zero_code(), "{}", f.name());
        }
    }

    #[test]
    fn int8_codes_its_own_values() {
        for q in -127i8..=127 {
            assert_eq!(int8_code(int8_value(q as u8)), q as u8);
        }
    }
}
