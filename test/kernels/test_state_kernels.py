"""The C kernel's encode and decode of CPU states (``quantize``, ``copy_``, ``dequantize``) against the
formats' torch ops (the same calls with ``cpu_kernel_enabled(False)``): the same codes, scales and
values, bit for bit, on every format, signedness, layout, value dtype and non-finite values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qstate
from qstate.optim import cpu_kernel_enabled
from qstate.optim._engine.cpu.kernel import _compiler

pytestmark = pytest.mark.skipif(_compiler() is None, reason="no C compiler: the C kernel never runs")

SHAPES = [(5,), (3, 301), (2, 3, 129), (4097,), (0,), (64, 256), (1, 2048)]
SPECIALS = [float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, 3e38]


def _values(shape, dtype, seed: int, specials: int, signed: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.rand((), generator=gen) * 10
    flat = x.view(-1)
    for k in range(min(specials, flat.numel())):
        flat[(k * 7919) % flat.numel()] = SPECIALS[(seed + k) % len(SPECIALS)]
    if not signed:
        x = x.abs()
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, exactly (a NaN equals a NaN of any payload)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    return True


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(["8bit", "4bit", "fp8"]), signed=st.booleans(), shape=st.sampled_from(SHAPES),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16), specials=st.integers(0, 3),
       block_size=st.sampled_from([None, 64, 2048]))
def test_encode_and_decode_equal_the_formats_ops(fmt, signed, shape, dtype, seed, specials, block_size) -> None:
    x = _values(shape, dtype, seed, specials, signed)
    fast = qstate.quantize(x, fmt, signed=signed, block_size=block_size)
    with cpu_kernel_enabled(False):
        ref = qstate.quantize(x, fmt, signed=signed, block_size=block_size)
        ref_values = ref.dequantize()
    assert _same(fast.codes, ref.codes) and _same(fast.scale, ref.scale)
    assert _same(fast.dequantize(), ref_values)
    assert _same(fast.dequantize(torch.float32), ref.dequantize(torch.float32))
    # copy_ into a state holding other values
    y = _values(shape, dtype, seed + 1, specials, signed)
    fast.copy_(y)
    with cpu_kernel_enabled(False):
        ref.copy_(y)
    assert _same(fast.codes, ref.codes) and _same(fast.scale, ref.scale)


def test_copy_leaves_the_source_unchanged_and_bumps_versions() -> None:
    """The values are read, never written (the kernel's ``RULE_KEEPS_PARAM``), even when read-only."""
    x = torch.randn(300, 70)
    before = x.clone()
    q = qstate.zeros_like(x, "8bit")
    versions = q.codes._version, q.scale._version
    q.copy_(x)
    assert torch.equal(x, before)
    assert q.codes._version > versions[0] and q.scale._version > versions[1]
    read_only = torch.frombuffer(bytearray(x.numpy().tobytes()), dtype=torch.float32).view(300, 70)
    q.copy_(read_only)
    assert torch.equal(q.dequantize(), qstate.quantize(x, "8bit").dequantize())


def test_bad_writes_raise_and_leave_the_state_unchanged() -> None:
    q = qstate.quantize(torch.rand(4, 300), "8bit", signed=False)
    codes, scale = q.codes.clone(), q.scale.clone()
    with pytest.raises(ValueError, match="negative"):
        q.copy_(-torch.rand(4, 300))
    with pytest.raises(ValueError, match="shape"):
        q.copy_(torch.rand(5, 300))
    assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale)


def test_stochastic_rounding_states_keep_the_formats_encode() -> None:
    """A stochastic-rounding state's writes draw by position (the formats' encode): the C encode, which
    rounds to nearest, does not take them."""
    x = torch.randn(8, 512)
    q = qstate.quantize(x, "8bit", rounding="stochastic")
    with cpu_kernel_enabled(False):
        ref = qstate.quantize(x, "8bit", rounding="stochastic")
    assert torch.equal(q.codes, ref.codes) and torch.equal(q.scale, ref.scale)
    assert math.isfinite(float(q.dequantize().sum()))
