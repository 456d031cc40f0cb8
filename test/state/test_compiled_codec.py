"""The compiled encode and decode that serve CUDA states (``qstate._compiled_codec``), run here on CPU
states in place of the C kernel's: the codes, scales and values of the formats' torch ops, bit for bit,
for every format and signedness, float32 and bfloat16 values; one compile per kind of state for any
number of blocks; states that are not whole blocks keep the formats' ops."""

from __future__ import annotations

import pytest
import torch

import qstate
from qstate._compiled_codec import COMPILED
from qstate._state_codec import rows_of
from qstate._state_kernels import _KERNELS, register_state_kernels
from qstate.formats import get_format

KINDS = [(f, s) for f in ("8bit", "4bit", "fp8") for s in (True, False)]


@pytest.fixture
def compiled_codec_on_cpu():
    cpu = _KERNELS["cpu"]
    register_state_kernels("cpu", COMPILED, traced=False)
    try:
        yield
    finally:
        register_state_kernels("cpu", cpu)


def _values(shape, signed, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10 ** (torch.rand(shape, generator=g) * 4 - 2)
    return (x if signed else x.abs()).to(dtype)


def _formats_ops(q, x):
    """The codes and scales the formats' torch encode gives ``x`` in ``q``'s layout, and their values."""
    f = get_format(q.format)
    codes, scale = f.encode(rows_of(x, q.rows, q.row_len), q.block_size, q.signed, q.qmap)
    return codes, scale, f.decode(codes, scale, q.row_len, q.block_size, q.qmap).reshape(-1)[:q.numel()]


@pytest.mark.parametrize("fmt,signed", [pytest.param(f, s, marks=() if (f, s) in (("8bit", True), ("4bit", False))
                                                     else pytest.mark.exhaustive) for f, s in KINDS])
def test_compiled_codec_equals_the_formats_ops(compiled_codec_on_cpu, fmt, signed):
    shapes = [(8, 512), (3, 1024), (2048,), (5, 257)]  # the last: partial blocks, the formats' ops
    for i, shape in enumerate(shapes):
        for dtype in (torch.float32, torch.bfloat16):
            x = _values(shape, signed, dtype, seed=i)
            q = qstate.quantize(x, fmt, signed=signed)
            assert COMPILED.encodes(q, x) == (shape != (5, 257))
            codes, scale, values = _formats_ops(q, x)
            assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale), (shape, dtype)
            assert torch.equal(q.dequantize(torch.float32).view(-1), values), (shape, dtype)
            q.mul_(0.5)  # an in-place op: decode, math, encode
            codes, scale, _ = _formats_ops(q, values.view(shape) * 0.5)
            assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale), (shape, dtype, "mul_")


def test_one_compile_per_kind_for_any_number_of_blocks(compiled_codec_on_cpu):
    from torch._dynamo.utils import counters

    qstate.quantize(torch.randn(4, 512), "8bit").dequantize()  # compiles this kind's encode and decode
    before = counters["stats"]["unique_graphs"]
    for rows in (2, 7, 33, 64):
        qstate.quantize(torch.randn(rows, 512), "8bit").dequantize()
    assert counters["stats"]["unique_graphs"] == before
