"""Contract suite: every format x signedness x appearance dtype.

Each op on a QuantizedState is checked against the same op on the
dequantized tensor (exact for layout ops), and the round-trip error against
the format's per-element bound.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qstate
from qstate.formats import FORMATS
from state_cases import KIND_IDS, KINDS, block_sizes, scale_per_element, shapes, values

EXAMPLES = 12


def _state(data, fmt, signed, dtype, max_numel=100_000):
    shape = data.draw(shapes(max_numel), label="shape")
    bs = data.draw(block_sizes(fmt), label="block_size")
    x = values(shape, data.draw(st.integers(0, 2**31)), signed, dtype)
    return x, qstate.quantize(x, fmt, signed=signed, block_size=bs)


def _aligned_cut(q, data):
    """A dim-0 cut point every layout op must accept (row, or block in a 1-D state)."""
    n = q.shape[0]
    step = 1 if q.dim() >= 2 else q.block_size
    return data.draw(st.integers(0, n // step), label="cut") * step


@pytest.mark.parametrize("fmt,signed,dtype", KINDS, ids=KIND_IDS)
class TestContract:
    @settings(max_examples=EXAMPLES)
    @given(data=st.data())
    def test_round_trip_within_bound(self, fmt, signed, dtype, data):
        x, q = _state(data, fmt, signed, dtype)
        assert (q.format, q.signed, q.dtype, tuple(q.shape)) == (fmt, signed, dtype, tuple(x.shape))
        deq = q.dequantize(torch.float32)
        scale = scale_per_element(q)
        bound = FORMATS[fmt].max_abs_error(x.float(), scale, signed)
        err = (deq - x.float()).abs()
        # plus fp32 rounding of y = x / scale and of code * scale
        assert bool((err <= bound + scale * 1e-6).all()), float((err - bound).max())
        assert torch.equal(q.dequantize(), deq.to(dtype))
        if not signed:  # second-moment safety: a positive value never comes back as 0
            assert not bool(((x.float() > 0) & (deq == 0)).any())

    @settings(max_examples=EXAMPLES)
    @given(data=st.data())
    def test_layout_ops_match_dequantized(self, fmt, signed, dtype, data):
        x, q = _state(data, fmt, signed, dtype)
        d = q.dequantize()
        n = q.shape[0]
        cut = _aligned_cut(q, data)

        def same(out, ref):
            assert isinstance(out, qstate.QuantizedState) and out.dtype == dtype
            assert out.block_size == q.block_size and out.format == fmt
            assert torch.equal(out.dequantize(), ref), (out.shape, ref.shape)

        same(q.clone(), d)
        same(q.detach(), d)
        same(torch.ops.aten.alias(q), d)
        same(q.view(-1), d.view(-1))
        same(q.reshape(q.shape), d)
        same(q.view(-1).view(q.shape), d)
        same(q[cut:], d[cut:])
        same(q[:cut], d[:cut])
        same(q.narrow(0, 0, cut), d.narrow(0, 0, cut))
        same(torch.cat([q[:cut], q[cut:]]), d)
        if cut:
            for a, b in zip(q.split(cut), d.split(cut)):
                same(a, b)
            if q.dim() >= 2:
                for a, b in zip(q.chunk(3), d.chunk(3)):
                    same(a, b)
        pad = data.draw(st.integers(0, 5 * (q.block_size if q.dim() == 1 else 1)), label="pad")
        spec = [0, 0] * (q.dim() - 1) + [0, pad]
        same(torch.nn.functional.pad(q, spec), torch.nn.functional.pad(d, spec))
        same(torch.zeros_like(q), torch.zeros_like(d))
        same(q.to("cpu"), d)
        assert n == x.shape[0]

    @settings(max_examples=EXAMPLES)
    @given(data=st.data())
    def test_math_reads_match_dequantized(self, fmt, signed, dtype, data):
        x, q = _state(data, fmt, signed, dtype, max_numel=20_000)
        d = q.dequantize()
        g = torch.randn(q.shape).to(dtype)
        f32 = q.dequantize(torch.float32)
        cases = {
            # a dtype conversion reads the state: q.to(dtype) == q.dequantize(dtype)
            "float": (q.float(), f32),
            "mul": (q * 0.5, d * 0.5),
            "mul_t": (q * g, d * g),
            "add": (q + g, d + g),
            "sub": (g - q, g - d),
            "div": (q / 3.0, d / 3.0),
            "sqrt": (q.abs().sqrt(), d.abs().sqrt()),
            "maximum": (torch.maximum(q, g), torch.maximum(d, g)),
            "lerp": (q.lerp(g, 0.1), d.lerp(g, 0.1)),
            "addcmul": (torch.addcmul(q, g, g, value=0.01), torch.addcmul(d, g, g, value=0.01)),
            "to_f32": (q.to(torch.float32), f32),
            "to_bf16": (q.to(torch.bfloat16), q.dequantize(torch.bfloat16)),
        }
        for name, (out, ref) in cases.items():
            assert not isinstance(out, qstate.QuantizedState) or name in ("float", "to_f32", "to_bf16"), name
            got = out.dequantize() if isinstance(out, qstate.QuantizedState) else out
            assert got.dtype == ref.dtype and torch.equal(got, ref), name

    @settings(max_examples=EXAMPLES)
    @given(data=st.data())
    def test_writes_requantize_into_the_same_layout(self, fmt, signed, dtype, data):
        x, q = _state(data, fmt, signed, dtype, max_numel=20_000)
        y = values(q.shape, data.draw(st.integers(0, 2**31)), signed, dtype)
        expect = qstate.quantize(y, fmt, signed=signed, block_size=q.block_size)
        codes_before = q.codes
        q.copy_(y)
        assert q.codes is codes_before
        assert torch.equal(q.codes, expect.codes) and torch.equal(q.scale, expect.scale)
        plain = torch.empty(q.shape, dtype=torch.float32)
        plain.copy_(q)
        assert torch.equal(plain, expect.dequantize(torch.float32))
        other = qstate.zeros_like(x, fmt, signed=signed, block_size=q.block_size)
        other.copy_(q)
        assert torch.equal(other.codes, q.codes) and torch.equal(other.scale, q.scale)
        # in-place math: fp32 math on the fp32 values, requantized into the same layout (a state of that
        # layout, written with those values)
        g = y.float().abs()
        ref = q.dequantize(torch.float32).lerp(g, 0.25)
        want = qstate.zeros_like(x, fmt, signed=signed, block_size=q.block_size)
        want.copy_(ref)
        q.lerp_(g, 0.25)
        assert torch.equal(q.codes, want.codes) and torch.equal(q.scale, want.scale)
        q.zero_()
        assert torch.equal(q.dequantize(), torch.zeros_like(x))


def test_bytes_per_element_targets():
    """8bit/fp8 <= 1.02 and 4bit <= 0.54 bytes per element at 1M and 1M+1, default block sizes."""
    targets = {"8bit": 1.02, "fp8": 1.02, "4bit": 0.54}
    for fmt, target in targets.items():
        for n in (1 << 20, (1 << 20) + 1):
            q = qstate.zeros_like(torch.empty(n), fmt)
            assert q.storage_nbytes() / n <= target, (fmt, n, q.storage_nbytes() / n)
            assert q.codes.numel() == math.ceil(n * FORMATS[fmt].bits / 8)
