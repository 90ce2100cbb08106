"""Issue 39: no silent wrong answer from a scale that flips its block's signs or a number JSON
cannot hold, and no internal error type (TypeError, AttributeError, PyO3's extraction errors)
from arguments of the wrong type: a ValueError (FormatError for files) naming what is wrong."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nybble
from nybble import LoraConfig, NF4Tensor, bnb
from nybble.errors import FormatError
from nybble.memory.arch import Architecture
from nybble.tensor import NestedAbsmax

#: Scales that are not a block's absmax: negative (the tiniest too), NaN, infinite.
BAD_SCALES = [-1.0, -2.35e-38, -1e-45, np.nan, np.inf, -np.inf]


def _tensor(n: int = 256, double_quant: bool = False) -> NF4Tensor:
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    return nybble.quantize(x, double_quant=double_quant)


# --- scales: every way of making an NF4Tensor ------------------------------------------------


@pytest.mark.parametrize("bad", BAD_SCALES)
@pytest.mark.parametrize("block", [0, 2, 3])
def test_from_blocks_refuses_a_scale_that_is_not_an_absmax_naming_the_block(
    bad: float, block: int
) -> None:
    buf = _tensor().to_blocks()
    buf[36 * block : 36 * block + 4] = np.array([bad], "<f4").view(np.uint8)
    with pytest.raises(ValueError, match=rf"block {block}\b") as e:
        NF4Tensor.from_blocks(buf, (256,))
    assert "absmax" in str(e.value)


@pytest.mark.parametrize("small", [0.0, 1e-6, -3e-7])
def test_from_blocks_reads_back_what_double_quantization_decodes(small: float) -> None:
    """Blocks far below the mean scale decode a hair below zero (bitsandbytes' format does
    the same), and to_blocks writes them so: read back as written. A stray negative is not."""
    x = np.full(3 * 64, small, np.float32)  # blocks [small, small, 1]
    x[-1] = 1.0
    q = nybble.quantize(x, double_quant=True)
    assert np.any(q.absmax < 0)
    buf = q.to_blocks()
    back = NF4Tensor.from_blocks(buf, q.shape)
    np.testing.assert_array_equal(back.absmax, q.absmax)
    np.testing.assert_array_equal(back.dequantize(), q.dequantize())
    for stray in (-2.35e-38, -0.5):
        bad = buf.copy()
        bad[36:40] = np.array([stray], "<f4").view(np.uint8)
        with pytest.raises(ValueError, match=r"block 1\b"):
            NF4Tensor.from_blocks(bad, q.shape)


@pytest.mark.parametrize("bad", BAD_SCALES)
def test_the_constructor_refuses_bad_plain_scales_naming_the_block(bad: float) -> None:
    q = _tensor()
    absmax = q.absmax.copy()
    absmax[3] = bad
    with pytest.raises(ValueError, match=r"absmax: block 3\b"):
        NF4Tensor(q.codes, absmax, q.shape)


@pytest.mark.parametrize("offset", [-1.0, -1e-30, float("nan")])
def test_the_constructor_refuses_a_negative_nested_offset(offset: float) -> None:
    q = _tensor(double_quant=True)
    assert q.nested is not None
    nested = NestedAbsmax(q.nested.codes, q.nested.absmax2, offset)
    with pytest.raises(ValueError, match="offset"):
        NF4Tensor(q.codes, None, q.shape, nested=nested)


def test_the_constructor_refuses_nested_scales_that_decode_negative() -> None:
    q = nybble.quantize(np.r_[np.zeros(640, np.float32), 1.0], double_quant=True)
    assert q.nested is not None
    codes = q.nested.codes.copy()
    codes[2] = 0  # the map's -0.99 x absmax2 (0.9) + offset (0.09): far below zero
    offset = q.nested.offset
    with pytest.raises(ValueError, match=r"block 2\b"):
        NF4Tensor(q.codes, None, q.shape, nested=NestedAbsmax(codes, q.nested.absmax2, offset))
    # a real state decodes within the map's rounding of zero: accepted as it is
    zeros = nybble.quantize(np.r_[np.zeros(147, np.float32), 1.0], double_quant=True)
    assert np.any(zeros.absmax < 0)
    assert NF4Tensor(zeros.codes, None, zeros.shape, nested=zeros.nested).nested is not None


def test_bitsandbytes_states_get_the_same_scale_checks() -> None:
    plain = bnb.export_state(_tensor())
    plain["weight.absmax"][1] = -2.35e-38
    with pytest.raises(FormatError) as e:
        bnb.import_state(plain)
    assert e.value.field == "weight.absmax" and "block 1" in e.value.problem
    nested = bnb.export_state(
        nybble.quantize(np.r_[np.zeros(640, np.float32), 1.0], double_quant=True)
    )
    nested["weight.absmax"][0] = 0  # the map's -0.99: a scale far below zero
    with pytest.raises(FormatError, match=r"block 0\b"):
        bnb.import_state(nested)


# --- numbers JSON cannot hold --------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        (dict(alpha=1e999), "alpha"),
        (dict(lora_alpha=float("inf")), "alpha"),
        (dict(dropout=float("nan")), "dropout"),
        (dict(rank_pattern={"q_proj": 1e999}), "rank_pattern"),
        (dict(alpha_pattern={"q_proj": -1e999}), "alpha_pattern"),
    ],
)
def test_lora_config_refuses_non_finite_numbers_naming_the_field(
    fields: dict[str, Any], name: str
) -> None:
    with pytest.raises(ValueError, match=rf"LoraConfig\.{name}\b.*finite"):
        LoraConfig(**fields)


def test_nothing_non_finite_is_written_as_an_adapter_config() -> None:
    """`to_peft` validates: json.dumps would write inf as `Infinity`, which is not JSON."""
    with pytest.raises(ValueError, match=r"LoraConfig\.r "):
        LoraConfig(r=0).to_peft()
    text = json.dumps(LoraConfig(r=4, alpha=8).to_peft(), allow_nan=False)
    assert LoraConfig.from_peft(json.loads(text)).alpha == 8


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('{"r": 8, "lora_alpha": 1e999}', "lora_alpha"),
        ('{"r": 8, "lora_dropout": -1e999}', "lora_dropout"),
        ('{"r": 8, "alpha_pattern": {"q_proj": 1e400}}', "alpha_pattern.q_proj"),
        ('{"r": 8, "extra": [1, 2, 1e999]}', "extra[2]"),  # a field nybble does not read
    ],
)
def test_adapter_config_files_with_numbers_beyond_float64_are_refused(
    tmp_path: Path, text: str, field: str
) -> None:
    (tmp_path / "adapter_config.json").write_text(text)
    with pytest.raises(FormatError) as e:
        LoraConfig.from_peft(tmp_path)
    assert e.value.field == field and "float64" in e.value.problem


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ('"rope_theta": 1e999', "rope_theta"),
        ('"rope_scaling": {"factor": -1e999}', "rope_scaling.factor"),
    ],
)
def test_model_configs_with_numbers_beyond_float64_are_refused(
    tmp_path: Path, extra: str, field: str
) -> None:
    text = json.dumps(nybble.memory.MODEL_PRESETS["tiny"])[:-1] + ", " + extra + "}"
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(FormatError) as e:
        Architecture.from_json(path)
    assert e.value.field == field


# --- arguments of the wrong type -----------------------------------------------------------


@pytest.mark.parametrize("nested", [0, {}, (1, 2, 3), "nested", np.zeros(4, np.uint8)])
def test_nf4tensor_nested_of_the_wrong_type_is_a_value_error(nested: Any) -> None:
    q = _tensor()
    with pytest.raises(ValueError, match="nested"):
        NF4Tensor(q.codes, None, q.shape, nested=nested)


def test_nf4tensor_with_both_kinds_of_scale_is_refused() -> None:
    q = _tensor(double_quant=True)
    with pytest.raises(ValueError, match="not both"):
        NF4Tensor(q.codes, q.absmax, q.shape, nested=q.nested)


@pytest.mark.parametrize("orig_dtype", [None, [], "int8", np.int32])
def test_nf4tensor_orig_dtype_is_named(orig_dtype: Any) -> None:
    q = _tensor()
    with pytest.raises(ValueError, match="orig_dtype must be one of") as e:
        NF4Tensor(q.codes, q.absmax, q.shape, orig_dtype=orig_dtype)
    assert f"got {orig_dtype!r}" in str(e.value)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_quantize_takes_numpy_subclasses_as_the_arrays_they_hold(dtype: type) -> None:
    data = np.arange(-64, 64, dtype=dtype).reshape(2, 64) / 7
    want = nybble.quantize(np.asarray(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)  # numpy on np.matrix
        matrix, out = np.matrix(data), np.matrix(np.zeros((2, 64), np.float32))
    for x in (matrix, np.ma.masked_array(data)):
        q = nybble.quantize(x)
        assert q.shape == (2, 64)
        np.testing.assert_array_equal(q.codes, want.codes)
        np.testing.assert_array_equal(q.dequantize(), want.dequantize())
    want.dequantize(out=out)  # filled in place, as an ndarray would be
    np.testing.assert_array_equal(np.asarray(out), want.dequantize())


def test_quantize_refuses_masked_elements() -> None:
    x = np.ma.masked_array(np.ones(64, np.float32), mask=np.arange(64) == 5)
    with pytest.raises(ValueError, match="masked"):
        nybble.quantize(x)


@pytest.mark.parametrize("flag", ["no", None, 1, 0.0, [True]])
def test_quantize_double_quant_must_be_a_bool(flag: Any) -> None:
    with pytest.raises(ValueError, match="double_quant"):
        nybble.quantize(np.ones(64, np.float32), double_quant=flag)


def test_dequantize_names_its_arguments() -> None:
    with pytest.raises(ValueError, match="NF4Tensor"):
        nybble.dequantize(np.ones(4, np.float32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype .* got None"):
        _tensor().dequantize(None)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        (dict(rank_pattern=(0,)), "rank_pattern"),
        (dict(rank_pattern=((1, 2),)), "rank_pattern"),
        (dict(rank_pattern={1: 2}), "rank_pattern"),
        (dict(rank_pattern=[("q", 4)]), "rank_pattern"),
        (dict(alpha_pattern=(0,)), "alpha_pattern"),
        (dict(alpha_pattern=((1, 2, 3),)), "alpha_pattern"),
        (dict(alpha_pattern="q_proj"), "alpha_pattern"),
    ],
)
def test_lora_config_patterns_of_the_wrong_type_are_value_errors(
    fields: dict[str, Any], name: str
) -> None:
    with pytest.raises(ValueError, match=rf"LoraConfig\.{name}\b"):
        LoraConfig(**fields)


def test_lora_config_methods_name_their_arguments(tmp_path: Path) -> None:
    config = LoraConfig(rank_pattern={"q_proj": 4})
    for call in (lambda: config.targets(None), lambda: config.for_module(3)):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="module path"):
            call()
    with pytest.raises(ValueError, match="no field 'rank'"):
        config.with_(rank=4)
    for source in (None, 5, 2.5):
        with pytest.raises(ValueError, match=r"adapter_config\.json"):
            LoraConfig.from_peft(source)  # type: ignore[arg-type]
    both = np.array([1.0, 2.0])
    with pytest.raises(ValueError, match="alpha"):
        LoraConfig(alpha=both, lora_alpha=both).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize("config", [None, {"r": 4}, 4])
def test_lora_layers_name_a_config_of_the_wrong_type(config: Any) -> None:
    w = np.ones((16, 32), np.float32)
    for layer in (nybble.LoraLinear, nybble.QLoraLinear):
        with pytest.raises(ValueError, match=r"config must be a nybble\.LoraConfig"):
            layer(w, config)


def test_lora_layers_take_numpy_subclasses() -> None:
    w = np.random.default_rng(2).standard_normal((16, 32)).astype(np.float32)
    x = np.ones((2, 32), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)  # numpy on np.matrix
        wm, xm = np.matrix(w), np.matrix(x)
    for layer in (nybble.LoraLinear, nybble.QLoraLinear):
        want = layer(w, LoraConfig(r=4)).forward(x)
        np.testing.assert_array_equal(np.asarray(layer(wm, LoraConfig(r=4)).forward(xm)), want)
