"""The fused quantized kernels (``qstate/optim/_kernels.py``): exact codes in block space, ragged rows, one graph."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch.utils._python_dispatch import TorchDispatchMode

import qstate
from qstate.formats import FORMATS
from qstate.optim import cpu_kernel_enabled
from qstate.optim import functional as F
from state_cases import written_by_update

#: aligned rows (a whole number of blocks), ragged rows, odd 4-bit rows, one row, one element, 3-D
SHAPES = [(4, 512), (64, 256), (33, 71), (7, 513), (1000,), (1,), (5, 3, 7)]


def _sgd_first_step(p: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, compile: bool) -> None:
    F.sgd([p], [g], [buf], [1], lr=0.1, momentum=0.9, compile=compile)


#: (format, rounding) of signed states: every format rounding to nearest, the map formats stochastically
SIGNED_KINDS = [(f, "nearest") for f in sorted(FORMATS)] + [(f, "stochastic") for f in sorted(FORMATS)
                                                          if FORMATS[f].supports_rounding("stochastic", True)]


@pytest.mark.parametrize("fmt,rounding", SIGNED_KINDS, ids=[f"{f}-{r}" for f, r in SIGNED_KINDS])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_compiled_state_is_bit_identical_to_quantize(fmt, rounding, shape):
    # SGD's first step stores the gradient exactly (0 * buf + 1 * g): the compiled kernel's codes,
    # scales and padding must equal the gradient written into a fresh state bit for bit (stochastic
    # rounding: by position, under the key the functional form draws; in block space and ragged rows alike)
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-6, 3, shape, generator=gen)
    buf = qstate.zeros_like(p, fmt, signed=True, dtype=torch.float32, rounding=rounding)
    p_ref = p.clone()
    torch.manual_seed(7)
    _sgd_first_step(p, g, buf, compile=True)
    want = written_by_update(g, fmt, seed=7, rounding=rounding)
    assert torch.equal(buf.codes, want.codes)
    assert torch.equal(buf.scale, want.scale)
    torch.testing.assert_close(p, p_ref - 0.1 * g, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(33, 71), (4, 512)], ids=str)
def test_mixed_block_sizes_match_eager(shape):
    # first moment 8bit (block 256), second moment 4bit (block 128): one block space of 256 columns
    gen = torch.Generator().manual_seed(1)
    out = {}
    for compile in (False, True):
        p = torch.randn(shape, generator=torch.Generator().manual_seed(2))
        m = qstate.zeros_like(p, "8bit", signed=True, dtype=torch.float32)
        v = qstate.zeros_like(p, "4bit", signed=False, dtype=torch.float32)
        gen.manual_seed(1)
        for step in range(1, 4):
            g = torch.randn(shape, generator=gen)
            F.adamw([p], [g], [m], [v], [step], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                    compile=compile)
        out[compile] = (p, m, v)
    (pe, me, ve), (pc, mc, vc) = out[False], out[True]
    torch.testing.assert_close(pc, pe, rtol=0, atol=1e-5)
    for qe, qc in ((me, mc), (ve, vc)):
        assert (qe.codes == qc.codes).float().mean() > 0.99
        torch.testing.assert_close(qc.dequantize(), qe.dequantize(), rtol=1e-2, atol=1e-6)


def test_aligned_ragged_and_square_shapes_share_one_graph():
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with cpu_kernel_enabled(False):  # the inductor kernel (on CPU the C kernel takes 8bit)
        for shape in [(3, 300), (256, 256), (512, 256), (1, 256), (2, 2), (300,), (256, 256)]:
            p = torch.randn(shape)
            buf = qstate.zeros_like(p, "8bit", signed=True, dtype=torch.float32)
            for step in (1, 2):
                F.sgd([p], [torch.randn(shape)], [buf], [step], lr=0.1, momentum=0.9, compile=True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("fmt", sorted(n for n, f in FORMATS.items() if f.make_qmap(True) is not None))
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_packed_table_encode_is_exact_at_every_threshold(fmt, signed):
    # the packed one-lookup encode (_codec.build_tables) against format.code_of on float bit patterns
    # spread over [-1, 1] and on every code threshold +- 3 ulps (where an inexact table would differ)
    from qstate.formats import get_format
    from qstate.formats._codec import _code_thresholds as code_thresholds, get_codec

    f = get_format(fmt)
    codec = get_codec(fmt, signed, torch.device("cpu"))
    top = int(torch.tensor(1.0).view(torch.int32))
    spread = torch.arange(0, top + 1, 997, dtype=torch.int32).view(torch.float32)
    t = code_thresholds(codec.qmap)
    near = [t]
    for direction in (2.0, -2.0):
        x = t
        for _ in range(3):
            x = torch.nextafter(x, torch.tensor(direction))
            near.append(x)
    y = torch.cat([spread, -spread, *near]).clamp(-1.0, 1.0)
    want = f.code_of(y, signed, f.make_qmap(signed))
    assert torch.equal(codec.encode(y, codec.tables), want)


@pytest.mark.parametrize("fmt", sorted(n for n, f in FORMATS.items() if f.supports_rounding("stochastic", True)))
@settings(max_examples=25)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 5000), decades=st.integers(0, 30))
def test_stochastic_encode_equals_format_code_of(fmt, seed, n, decades):
    # the kernels' encode (table lookup for the nearest code, then the shared stochastic_code) against
    # the eager MapFormat.code_of (searchsorted, then stochastic_code), bit for bit; map entries exact
    from qstate.formats import get_format
    from qstate.formats._codec import get_codec

    f = get_format(fmt)
    qmap = f.make_qmap(True)
    codec = get_codec(fmt, True, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) * 2 - 1) * 10.0 ** -torch.randint(0, decades + 1, (n,), generator=g)
    y = torch.cat([y, qmap, -qmap, torch.tensor([0.0, -0.0, 1e-38, -1e-38])]).clamp(-1.0, 1.0)
    want = f.code_of(y, True, qmap, rounding="stochastic")
    assert torch.equal(codec.encode(y, codec.tables, "stochastic"), want)
    assert torch.equal(want[n:n + qmap.numel()], torch.arange(qmap.numel(), dtype=torch.uint8))


def test_kernel_kind_names_each_states_rounding_and_fuses_only_what_it_encodes():
    from qstate.optim._engine.spec import StateKind
    from qstate.optim._engine.spec import fusable

    p, g = torch.randn(8, 64), torch.randn(8, 64)
    m = qstate.zeros_like(p, "4bit", rounding="stochastic")
    v = qstate.zeros_like(p, "4bit", signed=False)
    assert StateKind.of(m) == StateKind.quantized_as("4bit", 128, signed=True, rounding="stochastic")
    assert StateKind.of(v) == StateKind.quantized_as("4bit", 128, signed=False, rounding="nearest")
    assert fusable(p, g, [m, v])
    # a state whose format does not implement its rounding (built past the public API's checks) runs eagerly
    fp8 = qstate.zeros_like(p, "fp8")
    odd = qstate.QuantizedState(fp8.codes, fp8.scale, None, format="fp8", signed=True, block_size=256,
                                row_len=64, shape=(8, 64), dtype=torch.float32, rounding="stochastic")
    assert fusable(p, g, [fp8]) and not fusable(p, g, [odd])


def test_a_state_map_written_in_place_is_no_longer_fusable():
    # fusable() remembers a map it compared equal, until the map's version counter moves
    from qstate.optim._engine.spec import fusable

    p, g = torch.randn(8, 256), torch.randn(8, 256)
    m = qstate.zeros_like(p, "8bit")
    m.qmap = m.qmap.clone()  # states share their format's map: write to this state's own
    assert fusable(p, g, [m]) and fusable(p, g, [m])
    m.qmap[3] += 1.0
    assert not fusable(p, g, [m])
    m.qmap[3] -= 1.0
    assert fusable(p, g, [m])
    m.qmap.detach()[5] = 7.0  # a write through a view moves the same counter
    assert not fusable(p, g, [m])


class _RecordFusedUpdate(TorchDispatchMode):
    """The arguments of each ``qstate::fused_update`` call (the call runs as it would)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.qstate.fused_update.default:
            self.calls.append((args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("lr", [1e-3, torch.tensor(3e-4, dtype=torch.float64), torch.tensor(0.1)])
@pytest.mark.parametrize("grad_scale", [None, torch.tensor(4.0)])
def test_the_op_vector_is_the_eager_scalars_in_float64(lr, grad_scale):
    # the op's hyper vector is the eager scalars exactly, in float64 (ADAM.scalars of the group and step;
    # lr and 1 / grad_scale as the eager math has them: floats, or tensors as float32), whether built from
    # floats on the host or on the device from a tensor lr / grad scale; the fused kernels round it to float32
    from qstate.optim.adam import ADAM

    group = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    for step in (1, 7, 1000):
        p, g = torch.zeros(16, 16), torch.ones(16, 16)
        states = [torch.zeros(16, 16), torch.zeros(16, 16)]
        with _RecordFusedUpdate() as mode:
            F.adamw([p], [g], *([s] for s in states), [torch.tensor(step - 1.0)], lr=lr, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.1, compile=True, grad_scale=grad_scale)
        (args, _), = mode.calls
        unscale = 1.0 if grad_scale is None else grad_scale.double().reciprocal().float().item()
        given_lr = float(lr.float()) if isinstance(lr, torch.Tensor) else lr
        scalars = {"lr": given_lr, "grad_unscale": unscale, **ADAM.scalars(group, step)}
        want = torch.tensor([scalars[n] for n in ADAM.scalar_names], dtype=torch.float64)
        assert torch.equal(args[3], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bfloat16])
@pytest.mark.parametrize("start", [0, 255, 2**24 - 1, 2**24, 2**53])
def test_step_counts_advance_as_an_in_place_add(dtype, start):
    # a step tensor advances as `s += 1` does, however it rounds (the step reads and fills it)
    s, ref = torch.tensor(start, dtype=dtype), torch.tensor(start, dtype=dtype)
    p, g, m, v = torch.zeros(4), torch.ones(4), torch.zeros(4), torch.zeros(4)
    for _ in range(3):
        ref += 1
        F.adamw([p], [g], [m], [v], [s], lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        assert torch.equal(s, ref)


@pytest.mark.parametrize("state_format", ["fp32", "bf16", "8bit"])
def test_fused_update_passes_opcheck(state_format):
    """``qstate::fused_update`` as an AdamW step calls it (captured), checked by ``torch.library.opcheck``:
    its schema's mutations (params and states written, grads and hyper not) and its fake kernel."""
    from qstate.optim import AdamW

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(70, 64)), torch.nn.Parameter(torch.randn(64))]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = AdamW(ps, lr=1e-2, state_format=state_format)
    with _RecordFusedUpdate() as capture:
        opt.step()
    assert len(capture.calls) >= 1
    for args, kwargs in capture.calls:
        copied = tuple([t.clone() for t in a] if isinstance(a, list) else a for a in args)
        torch.library.opcheck(torch.ops.qstate.fused_update.default, copied, kwargs,
                              test_utils=("test_schema", "test_faketensor"))
