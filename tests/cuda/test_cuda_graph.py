"""nybble's GPU work captured in a CUDA graph (`nybble.cuda.capture`) and replayed: the replays
equal eager calls bit for bit, over new inputs written into the captured buffers; memory the
captured work allocated stays the graph's; nothing in the captured paths waits for the device
(a wait inside a capture is an error, so capturing them is the test); quantize's finite check
surfaces at `cuda.check()`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import nybble
from nybble import LoraConfig, QLoraLinear

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")
cuda = pytest.importorskip("nybble.cuda")

NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def random(shape: tuple[int, ...], dtype: str, seed: int, scale: float = 1.0) -> Any:
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    return cp.asarray(x.astype(np.float32).astype(NP[dtype]))


def bits(a: Any) -> np.ndarray:
    a = cp.asnumpy(a)
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def replays_equal_eager(
    inputs: list[Any],
    outputs: list[Any],
    work: Callable[[], object],
    eager: Callable[[], list[Any]],
) -> None:
    """Captures `work` (which writes `outputs` from `inputs`), then for new values written into
    the inputs replays it and compares every output with `eager()` on the same inputs."""
    graph = cuda.capture(work, *inputs, *outputs)
    for round_ in range(3):
        for k, x in enumerate(inputs):
            x[...] = random(x.shape, x.dtype.name, 100 * round_ + k)
        # Memory freed since the capture is handed out again and written: a graph that still
        # used any of it would read or write someone else's array.
        junk = [cp.full(1 << 20, 7, cp.float32) for _ in range(8)]
        graph.replay()
        cp.cuda.get_current_stream().synchronize()
        for got, want in zip(outputs, eager(), strict=True):
            np.testing.assert_array_equal(bits(got), bits(want))
        del junk


def test_a_decode_step_of_gemvs_replays_as_eager_calls() -> None:
    """Weights of each kind the fused GEMV takes (NF4, FP4, nested scales, blocksize 128),
    1 to 8 tokens of each dtype, into fixed outputs."""
    cases = [
        ((256, 512), {}, "bfloat16", 1),
        ((96, 1024), {"codebook": "fp4"}, "float16", 3),
        ((320, 256), {"double_quant": True}, "bfloat16", 8),
        ((64, 512), {"blocksize": 128}, "float32", 2),
        ((128, 96), {}, "float32", 5),  # rows of 32-element groups
    ]
    weights, xs, ys = [], [], []
    for k, ((rows, cols), options, dtype, m) in enumerate(cases):
        weights.append(nybble.quantize(random((rows, cols), "float32", k, 0.05), **options))
        xs.append(random((m, cols), dtype, 10 + k))
        ys.append(cp.empty((m, rows), NP[dtype]))

    def step() -> None:
        for q, x, y in zip(weights, xs, ys, strict=True):
            cuda.nf4_matmul(x, q, out=y)

    def eager() -> list[Any]:
        return [cuda.nf4_matmul(x, q) for q, x in zip(weights, xs, strict=True)]

    replays_equal_eager(xs, ys, step, eager)


def test_gemv_outputs_allocated_in_a_capture_are_the_graphs() -> None:
    """The allocating GEMV takes an output allocated ahead by its previous call; inside a
    capture it must not (that memory is not the graph's): the captured call's output is memory
    the graph keeps, and replays into it equal eager calls."""
    q = nybble.quantize(random((256, 512), "float32", 3, 0.05))
    x = random((1, 512), "bfloat16", 4)
    for _ in range(3):
        cuda.nf4_matmul(x, q)  # eager calls leave an output allocated ahead
    held: list[Any] = []
    graph = cuda.capture(lambda: held.append(cuda.nf4_matmul(x, q)), x, warmup=0)
    (y,) = held
    assert y.data.ptr in {m.ptr for m in graph._allocations}
    for round_ in range(3):
        x[...] = random(x.shape, "bfloat16", 20 + round_)
        junk = [cp.full(1 << 16, 7, cp.float32) for _ in range(8)]
        graph.replay()
        cp.cuda.get_current_stream().synchronize()
        np.testing.assert_array_equal(bits(y), bits(cuda.nf4_matmul(x, q)))
        del junk


def test_a_capture_on_a_reused_stream_handle_takes_no_output_allocated_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CUDA may give a capture's new stream the handle of a stream used before (and since
    destroyed): an output allocated ahead on that earlier stream must not be taken inside the
    capture. Simulated by capturing on the very stream the eager calls ran on."""
    q = nybble.quantize(random((128, 256), "float32", 5, 0.05))
    x = random((2, 256), "float16", 6)
    earlier = cp.cuda.Stream(non_blocking=True)
    with earlier:
        for _ in range(3):
            cuda.nf4_matmul(x, q)  # leaves an output allocated ahead for `earlier`
    earlier.synchronize()
    monkeypatch.setattr(cp.cuda, "Stream", lambda non_blocking=False: earlier)
    held: list[Any] = []
    graph = cuda.capture(lambda: held.append(cuda.nf4_matmul(x, q)), x, warmup=0)
    assert held[0].data.ptr in {m.ptr for m in graph._allocations}


def test_the_cublas_paths_and_dequantize_replay_with_their_temporaries_kept() -> None:
    """More tokens than the GEMV takes and the transposed product dequantize the weight into a
    temporary inside the captured work; the graph keeps it while it lives."""
    q = nybble.quantize(random((192, 256), "float32", 1, 0.05))
    x = random((24, 256), "bfloat16", 2)
    dy = random((24, 192), "bfloat16", 3)
    y = cp.empty((24, 192), NP["bfloat16"])
    dx = cp.empty((24, 256), NP["bfloat16"])
    dense = cp.empty((192, 256), NP["float16"])

    def work() -> None:
        cuda.nf4_matmul(x, q, out=y)
        cuda.nf4_matmul_t(dy, q, out=dx)
        q.dequantize("float16", dense)

    def eager() -> list[Any]:
        return [cuda.nf4_matmul(x, q), cuda.nf4_matmul_t(dy, q), q.dequantize("float16")]

    replays_equal_eager([x, dy], [y, dx, dense], work, eager)


@pytest.mark.parametrize("dora", [False, True])
def test_a_qlora_layer_step_replays_as_eager_calls(dora: bool) -> None:
    """A QLoRA (and QDoRA) layer's forward and backward captured whole (its finite checks are
    device scans, its products cuBLAS, DoRA's row norms a GEMM per dequantized tile): outputs
    and adapter gradients equal eager steps."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((192, 128)) * 0.05).astype(np.float32)
    layer = QLoraLinear(w, LoraConfig(r=8, lora_alpha=16, use_rslora=True, use_dora=dora))
    layer.set_lora_b(rng.standard_normal((192, 8)) * 0.05)
    layer.cuda()
    x = random((2, 9, 128), "bfloat16", 5)
    dy = random((2, 9, 192), "bfloat16", 6)
    y = cp.empty((2, 9, 192), NP["bfloat16"])
    dx = cp.empty((2, 9, 128), NP["bfloat16"])
    grads: list[Any] = []

    def step() -> None:
        layer.forward(x, out=y)
        layer.backward(dy, out=dx)
        grads[:] = gradients()  # allocated by the captured backward

    def gradients() -> list[Any]:
        return [layer.grad_a, layer.grad_b] + ([layer.grad_magnitude] if dora else [])

    def eager() -> list[Any]:
        got = [layer.forward(x), layer.backward(dy)]
        return [*got, *(g.copy() for g in gradients())]

    graph = cuda.capture(step, x, dy, y, dx)
    captured = list(grads)
    for round_ in range(2):
        x[...] = random(x.shape, "bfloat16", 20 + round_)
        dy[...] = random(dy.shape, "bfloat16", 30 + round_)
        graph.replay()
        cp.cuda.get_current_stream().synchronize()
        replayed = [bits(a) for a in (y, dx, *captured)]
        for got, want in zip(replayed, eager(), strict=True):
            np.testing.assert_array_equal(got, bits(want))
    cuda.check()  # finite inputs: nothing pending


def test_quantize_in_a_capture_reports_non_finite_inputs_at_check() -> None:
    x = random((64, 256), "bfloat16", 7)
    made: list[nybble.NF4Tensor] = []

    def work() -> None:
        made[:] = [nybble.quantize(x)]

    graph = cuda.capture(work, x)
    q = made[0]
    for round_ in range(2):
        x[...] = random(x.shape, "bfloat16", 40 + round_)
        graph.replay()
        cp.cuda.get_current_stream().synchronize()
        want = nybble.quantize(x)
        np.testing.assert_array_equal(cp.asnumpy(q.codes), cp.asnumpy(want.codes))
        np.testing.assert_array_equal(bits(q.absmax), bits(want.absmax))
        cuda.check()
    x[3, 5] = cp.nan
    graph.replay()
    with pytest.raises(nybble.NonFiniteError) as e:
        cuda.check()
    assert e.value.index == 3 * 256 + 5
    cuda.check()  # reported once


def test_double_quantization_is_refused_inside_a_capture() -> None:
    x = random((64, 256), "float32", 8)
    with pytest.raises(RuntimeError, match="double quantization reads the scales back"):
        cuda.capture(lambda: nybble.quantize(x, double_quant=True), x, warmup=0)


def test_work_that_waits_inside_a_capture_raises_its_own_error() -> None:
    """A read back to the host inside the captured work is an error of that read (not of the
    capture it invalidated), and the next capture works."""
    x = random((8, 64), "float32", 9)

    def reads_back() -> None:
        x.get()

    with pytest.raises(Exception) as e:
        cuda.capture(reads_back, x, warmup=0)
    assert "invalidated" not in str(e.value).lower()
    y = cp.empty((8, 64), cp.float32)
    graph = cuda.capture(lambda: cp.multiply(x, 2, out=y), x, y)
    graph.replay()
    np.testing.assert_array_equal(cp.asnumpy(y), cp.asnumpy(x) * 2)


def launched(weight: Any, x: Any) -> bool:
    """Whether `weight`'s launch for tokens like x (the core's, which its checked and fast
    paths share) has launched, so that its next launch is programmatic where the weight's
    are."""
    return bool(weight._fast[(x.dtype, x.shape)].primed)


def edge_types(graph: Any) -> list[int]:
    """The dependency type of each edge of a captured graph, from the driver (0: the default,
    full serialization; 1: programmatic), or a skip where the driver cannot say."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
        get_edges = driver.cuGraphGetEdges_v2  # CUDA 12.3+: edges with their data
    except (OSError, AttributeError):
        pytest.skip("the driver does not list a graph's edge types")
    handle = ctypes.c_void_p(graph._graph.graph)
    count = ctypes.c_size_t(0)
    assert get_edges(handle, None, None, None, ctypes.byref(count)) == 0
    n = count.value
    sources, targets = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
    data = (ctypes.c_uint8 * (8 * n))()  # CUgraphEdgeData: from_port, to_port, type, 5 reserved
    assert get_edges(handle, sources, targets, data, ctypes.byref(count)) == 0
    return [data[8 * i + 2] for i in range(count.value)]


def test_a_decode_step_warmed_up_eagerly_captures_programmatic_gemvs() -> None:
    """Each weight's first call takes the checked path (which prepares its launches), the next
    ones the fast path: both share one launch, so the warm-up primes the launch the capture
    uses, and on sm_90 the graph's GEMVs follow each other through programmatic edges (each
    starting under the end of the one before it on replay) rather than full serialization."""
    from nybble.backends.cuda import backend

    qs = [nybble.quantize(random((512, 256), "float32", s, 0.02)) for s in range(4)]
    x = random((1, 256), "bfloat16", 9)
    outs = [cp.empty((1, 512), x.dtype) for _ in qs]

    def step() -> None:
        for q, y in zip(qs, outs, strict=True):
            cuda.nf4_matmul(x, q, out=y)

    graph = cuda.capture(step, x, *outs)
    weights = [backend().gemv_weight(q.packed) for q in qs]
    assert all(launched(w, x) for w in weights)
    types = edge_types(graph)
    assert len(types) == len(qs) - 1  # a chain
    want = 1 if weights[0].programmatic else 0
    assert types == [want] * len(types)
    eager = [cp.empty_like(y) for y in outs]
    for q, y in zip(qs, eager, strict=True):
        cuda.nf4_matmul(x, q, out=y)
    for y in outs:
        y.fill(0)
    graph.replay()
    for got, want_y in zip(outs, eager, strict=True):
        assert (bits(got) == bits(want_y)).all()


@pytest.mark.parametrize("double_quant", [False, True])
def test_programmatic_gemvs_wait_for_the_gemv_before_them(double_quant: bool) -> None:
    """On sm_90 the tensor-core GEMV launches programmatically: it starts under the end of the
    kernel before it and waits for it only before reading its tokens. A chain whose every GEMV
    reads the previous one's output equals the same chain launched plainly, bit for bit, eagerly
    and replayed from a graph; the first launch of each weight is a plain one."""
    from nybble.backends.cuda import launch

    n, steps = 2048, 24
    q = nybble.quantize(random((n, n), "float32", 1, 0.02), double_quant=double_quant)
    absmax = None if q.nested is not None else q.absmax
    weights = {
        mode: launch.GemvWeight(
            q.codes, absmax, q.nested, q.codebook, q.shape, q.blocksize, programmatic=mode
        )
        for mode in (False, True)
    }
    assert not weights[False].programmatic
    x0 = random((1, n), "bfloat16", 2)
    chain = {mode: [cp.empty((1, n), x0.dtype) for _ in range(steps)] for mode in weights}

    def run(mode: bool) -> None:
        x = x0
        for y in chain[mode]:
            weights[mode](x, y)
            x = y

    for mode in weights:
        run(mode)
    assert launched(weights[True], x0)
    for a, b in zip(chain[False], chain[True], strict=True):
        assert (bits(a) == bits(b)).all()
    graph = cuda.capture(lambda: run(True), x0, *chain[True])
    for y in chain[True]:
        y.fill(0)
    graph.replay()
    for a, b in zip(chain[False], chain[True], strict=True):
        assert (bits(a) == bits(b)).all()
