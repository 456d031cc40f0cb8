"""``qstate::encode_into_`` and ``qstate::decode`` (a state's encode and decode as ops): their kernels
(the CPU kernel, which runs the C kernel where it takes the call, and the formats' torch ops) write
the same codes and scales and read the same values bit for bit, eager and under
``torch.compile(fullgraph=True)``; compiled writes and reads of a state call the ops; bad arguments
raise before any write."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._inductor.utils import run_and_get_code

import qstate
from qstate._library import decode, encode_into_
from qstate._state_codec import decode_rows, encode_rows_into
from qstate.formats import get_format

SPECIALS = [float("inf"), float("-inf"), float("nan"), 0.0, 1e-40]


def _parts(fmt: str, signed: bool, block_size: int, rows: int, row_len: int):
    f = get_format(fmt)
    codes = torch.full((rows, f.packed_width(row_len)), 7, dtype=torch.uint8)
    scale = torch.full((rows, -(-row_len // block_size)), 0.5)
    return codes, scale, f.make_qmap(signed)


def _values(rows: int, row_len: int, dtype, seed: int, specials: int, signed: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows * row_len, generator=gen) * 3
    for k in range(min(specials, x.numel())):
        x[(k * 7919) % x.numel()] = SPECIALS[(seed + k) % len(SPECIALS)]
    return (x if signed else x.abs()).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


layouts = st.tuples(st.sampled_from(["8bit", "4bit", "fp8"]), st.booleans(), st.sampled_from([64, 128]),
                    st.integers(1, 3), st.sampled_from([1, 63, 130, 256]))


@settings(max_examples=60, deadline=None)
@given(layout=layouts, dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16),
       specials=st.integers(0, 3))
def test_cpu_kernels_equal_the_formats_ops(layout, dtype, seed, specials) -> None:
    fmt, signed, block_size, rows, row_len = layout
    x = _values(rows, row_len, dtype, seed, specials, signed)
    codes, scale, qmap = _parts(fmt, signed, block_size, rows, row_len)
    ref_codes, ref_scale = codes.clone(), scale.clone()
    encode_into_(codes, scale, x, qmap, fmt, signed, block_size, row_len)
    encode_rows_into(ref_codes, ref_scale, x, qmap, fmt, signed, block_size, row_len)
    _same(codes, ref_codes)
    _same(scale, ref_scale)
    _same(decode(codes, scale, qmap, fmt, signed, block_size, row_len),
          decode_rows(codes, scale, qmap, fmt, signed, block_size, row_len))


@settings(max_examples=8, deadline=None)
@given(layout=layouts, seed=st.integers(0, 2**16), specials=st.integers(0, 2))
def test_compiled_ops_equal_eager(layout, seed, specials) -> None:
    fmt, signed, block_size, rows, row_len = layout
    x = _values(rows, row_len, torch.float32, seed, specials, signed)

    def roundtrip(codes, scale, x, qmap):
        encode_into_(codes, scale, x, qmap, fmt, signed, block_size, row_len)
        return decode(codes, scale, qmap, fmt, signed, block_size, row_len)

    codes, scale, qmap = _parts(fmt, signed, block_size, rows, row_len)
    ref_codes, ref_scale = codes.clone(), scale.clone()
    out = torch.compile(roundtrip, fullgraph=True, dynamic=False)(codes, scale, x, qmap)
    encode_rows_into(ref_codes, ref_scale, x, qmap, fmt, signed, block_size, row_len)
    _same(codes, ref_codes)
    _same(scale, ref_scale)
    _same(out, decode_rows(ref_codes, ref_scale, qmap, fmt, signed, block_size, row_len))


@pytest.mark.parametrize("fmt,signed", [("8bit", True), ("4bit", False)])
def test_compiled_state_writes_call_the_ops(fmt, signed) -> None:
    torch._dynamo.reset()
    g = torch.arange(2 * 300, dtype=torch.float32).view(2, 300) / 64  # exact products: eager's roundings
    m = qstate.quantize(torch.linspace(0, 1, 600).view(2, 300), fmt, signed=signed)
    ref = m.clone()

    def step(m, g):
        m.lerp_(g, 0.25)
        return m.dequantize()

    out, code = run_and_get_code(torch.compile(step, fullgraph=True, dynamic=False), m, g)
    expected = step(ref, g)
    assert "torch.ops.qstate.encode_into_.default" in code[0]
    assert "torch.ops.qstate.decode.default" in code[0]
    _same(m.codes, ref.codes)
    _same(m.scale, ref.scale)
    _same(out, expected)


def test_bad_arguments_raise_before_any_write() -> None:
    codes, scale, qmap = _parts("8bit", True, 64, 2, 100)
    before = codes.clone(), scale.clone()
    cases = {
        "short codes": (codes[:, :50], scale, torch.ones(200), qmap),
        "scale": (codes, scale[:, :1], torch.ones(200), qmap),
        "values": (codes, scale, torch.ones(201), qmap),
        "qmap": (codes, scale, torch.ones(200), None),
        "values dtype": (codes, scale, torch.ones(200, dtype=torch.float64), qmap),
    }
    messages = {}
    for name, (c, s, v, m) in cases.items():
        with pytest.raises(ValueError) as info:
            encode_into_(c, s, v, m, "8bit", True, 64, 100)
        messages[name] = str(info.value)
    _same(codes, before[0])
    _same(scale, before[1])
    assert messages == {
        "short codes": "qstate::encode_into_: codes: expected torch.uint8 [2, 100] (2 rows of 100 8-bit codes), "
                       "got torch.uint8 [2, 50] on cpu",
        "scale": "qstate::encode_into_: scale: expected torch.float32 [2, 2] (2 rows of blocks of 64), got "
                 "torch.float32 [2, 1] on cpu",
        "values": "qstate::encode_into_: values: expected the elements of 2 rows of 100 (less under a row of "
                  "padding), got torch.float32 [201] on cpu",
        "qmap": "qstate::encode_into_: qmap: expected format '8bit''s map, torch.float32 [256], got NoneType",
        "values dtype": "qstate::encode_into_: values: expected torch.float32 or torch.bfloat16, got "
                        "torch.float64 [200] on cpu",
    }
    with pytest.raises(ValueError, match="qstate::decode: codes"):
        decode(codes[:, :50], scale, qmap, "8bit", True, 64, 100)


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8"])
def test_compiled_addcmul_with_a_value_on_a_state_runs_as_eager(fmt):
    # dynamo writes ``v.addcmul_(g, g, value=c)`` as inductor's ``prims.fma(g * g, c, v)`` then ``copy_``: an op
    # that exists only once inductor loads, handled by name; the result is eager's up to the fused
    # multiply-add's rounding, which moves a code by at most one step
    gen = torch.Generator().manual_seed(0)
    values, g = torch.rand(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
    compiled_v = qstate.quantize(values, fmt, signed=False)
    eager_v = qstate.quantize(values, fmt, signed=False)

    @torch.compile(fullgraph=True)
    def update(v, g):
        v.mul_(0.999).addcmul_(g, g, value=0.001)

    update(compiled_v, g)
    eager_v.mul_(0.999).addcmul_(g, g, value=0.001)
    assert type(compiled_v) is qstate.QuantizedState and compiled_v.format == fmt
    f = get_format(fmt)

    def error_bound(q):  # the format's worst-case encode error of each element of q
        per_element = q.scale.repeat_interleave(q.block_size, dim=1)[:, :q.row_len].reshape(q.shape)
        return f.max_abs_error(q.dequantize(), per_element, False)

    bound = error_bound(compiled_v) + error_bound(eager_v) + 1e-6
    assert ((compiled_v.dequantize() - eager_v.dequantize()).abs() <= bound).all()
