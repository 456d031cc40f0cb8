"""Exact extremes: -1 and +1 in every map, re-encoding as a fixed point, no underflow to 0, legacy 8bit maps."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qstate
import qstate.optim
from qstate import QuantizedState
from qstate.formats import FORMATS, dynamic_map, get_format
from qstate.formats.map_formats import LEGACY_SIGNED_8BIT_MAP, legacy_map_name

#: (format, signed, rounding) of every kind a state can have
KINDS = [(f, s, r) for f in sorted(FORMATS) for s in (True, False) for r in ("nearest", "stochastic")
         if get_format(f).supports_rounding(r, s)]
KIND_IDS = [f"{f}-{'signed' if s else 'unsigned'}-{r}" for f, s, r in KINDS]


def test_every_signed_map_has_exact_minus_one_and_one():
    for name in ("8bit", "4bit"):
        qmap = get_format(name).make_qmap(True)
        assert qmap[0].item() == -1.0 and qmap[-1].item() == 1.0 and bool((qmap.diff() > 0).all())
        assert get_format(name).make_qmap(False)[-1].item() == 1.0


def test_signed_8bit_map_mirrors_bitsandbytes_positive_half():
    qmap = get_format("8bit").make_qmap(True)
    positive = dynamic_map(True)[dynamic_map(True) > 0]
    assert torch.equal(qmap[qmap > 0], positive)
    # the negative half is the positive one mirrored, less its smallest entry (5.5e-7)
    assert torch.equal(-qmap[qmap < 0].flip(0), positive[1:])
    assert int((qmap == 0).sum()) == 1 and qmap.numel() == 256
    # bitsandbytes' own signed map is the legacy one, with no -1
    assert torch.equal(LEGACY_SIGNED_8BIT_MAP, dynamic_map(True)) and LEGACY_SIGNED_8BIT_MAP[0].item() > -1.0


def _blocks(seed: int, rows: int, row_len: int, block_size: int, signed: bool, exponent: int, negative_max: bool):
    """Rows of random values with magnitudes 1e-3 .. 1 times 2**exponent, each block's absmax element negative or
    positive (signed), every decoded value a normal float."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, row_len, generator=g) * 10 ** (torch.rand(rows, row_len, generator=g) * 3 - 3)
    if not signed:
        x = x.abs()
    for b in range(0, row_len, block_size):
        x[:, b] = 2.0 * (-1 if signed and negative_max else 1)  # each block's max, of the chosen sign
    return x * 2.0**exponent


@pytest.mark.parametrize("fmt,signed,rounding", KINDS, ids=KIND_IDS)
@settings(max_examples=25)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 4), row_len=st.integers(1, 600),
       block_size=st.sampled_from([None, 32, 64, 100]), exponent=st.integers(-60, 60), negative_max=st.booleans())
def test_reencoding_a_decoded_state_keeps_every_code_and_scale(fmt, signed, rounding, seed, rows, row_len,
                                                               block_size, exponent, negative_max):
    if block_size is not None and get_format(fmt).bits == 4 and block_size % 2:
        block_size += 1
    bs = block_size or get_format(fmt).default_block_size
    x = _blocks(seed, rows, row_len, bs, signed, exponent, negative_max)
    q = qstate.quantize(x, fmt, signed=signed, block_size=block_size, rounding=rounding)
    codes, scale = q.codes.clone(), q.scale.clone()
    q.copy_(q.dequantize())
    assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale)
    # a 1-D state of the same values (one row, a partial last block)
    q = qstate.quantize(x.view(-1), fmt, signed=signed, block_size=block_size, rounding=rounding)
    codes, scale = q.codes.clone(), q.scale.clone()
    q.copy_(q.dequantize())
    assert torch.equal(q.codes, codes) and torch.equal(q.scale, scale)


@pytest.mark.parametrize("fmt,signed,rounding", KINDS, ids=KIND_IDS)
def test_hundred_reencodes_keep_the_absmax_of_either_sign(fmt, signed, rounding):
    x = torch.tensor([-1.0, 0.3, -0.25, 1e-3, 0.5, -0.7] if signed else [1.0, 0.3, 0.25, 1e-3, 0.5, 0.7])
    q = qstate.quantize(x, fmt, signed=signed, block_size=6, rounding=rounding)
    first = q.dequantize()
    assert first[0].item() == x[0].item()  # -1.0 (or 1.0) exactly
    for _ in range(100):
        q.copy_(q.dequantize())
    assert torch.equal(q.dequantize(), first)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("tiny", [1e-36, 1e-40, 2.0**-149])
def test_unsigned_states_never_decode_a_positive_value_as_zero(fmt, tiny):
    # x / scale underflows float32 to 0 for blocks spanning more than ~1e45
    x = torch.tensor([1e10, tiny, 0.0, 3e-30])
    back = qstate.quantize(x, fmt, signed=False).dequantize()
    assert bool((back[[0, 1, 3]] > 0).all()) and back[2].item() == 0.0
    # the smallest positive code: what any positive value far below the absmax decodes as
    smallest = qstate.quantize(torch.tensor([1.0, 1e-30]), fmt, signed=False).dequantize()[1] * 1e10
    assert back[1].item() == pytest.approx(smallest.item(), rel=1e-6)
    # signed states: still the zero code, of either sign
    signed = qstate.quantize(torch.tensor([1e10, tiny, -tiny]), fmt, signed=True).dequantize()
    assert signed[1:].abs().max().item() == 0.0


def _legacy_state(like: QuantizedState, values: torch.Tensor) -> QuantizedState:
    """``values`` as a state of ``like``'s layout stored with bitsandbytes' signed map (a checkpoint written before
    the map had -1), built from the map's definition."""
    fmt = get_format("8bit")
    qmap = dynamic_map(True, 7, 8)
    codes, scale = fmt.encode(values.reshape(like.rows, like.row_len), like.block_size, True, qmap)
    return QuantizedState(codes, scale, qmap, format="8bit", signed=True, block_size=like.block_size,
                          row_len=like.row_len, shape=like.shape, dtype=like.dtype)


def _legacy_checkpoint():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 64))
    opt = qstate.optim.AdamW([p], lr=1e-2, min_quantize_numel=1, compile=False)
    p.grad = torch.randn(8, 64)
    opt.step()
    sd = opt.state_dict()
    old = sd["state"][0]["exp_avg"]
    values = torch.randn(8, 64)
    values[2, 5] = -40.0  # a negative absmax: -0.99297 * 40 in the legacy map
    sd["state"][0] = {**sd["state"][0], "exp_avg": _legacy_state(old, values)}  # not the optimizer's own dict
    buf = io.BytesIO()  # a pickled checkpoint of a legacy state loads as it was stored
    torch.save(sd, buf)
    buf.seek(0)
    return p, opt, torch.load(buf, weights_only=True), values


def test_legacy_map_is_recognized():
    assert legacy_map_name(dynamic_map(True)) is not None
    assert legacy_map_name(get_format("8bit").make_qmap(True)) is None
    assert legacy_map_name(get_format("8bit").make_qmap(False)) is None
    assert legacy_map_name(None) is None


def test_a_legacy_8bit_checkpoint_is_refused_then_converted():
    p, opt, sd, values = _legacy_checkpoint()
    legacy = sd["state"][0]["exp_avg"]
    assert torch.equal(legacy.qmap, dynamic_map(True))
    stored = {k: v.clone() for k, v in ((n, getattr(legacy, n)) for n in ("codes", "scale", "qmap"))}
    before = {n: s.dequantize().clone() for n, s in opt.state[p].items() if n != "step"}
    with pytest.raises(ValueError) as err:
        opt.load_state_dict(sd)
    assert "param 0" in str(err.value) and "'exp_avg'" in str(err.value)
    assert "create_dynamic_map(True, 7, 8)" in str(err.value) and "convert_state_dict" in str(err.value)
    # nothing changed: the optimizer's states, the state dict's tensors
    for n, v in before.items():
        assert torch.equal(opt.state[p][n].dequantize(), v)
    for n, v in stored.items():
        assert torch.equal(getattr(sd["state"][0]["exp_avg"], n), v)
    # a state-to-state copy of its codes would read them with another map: refused too
    with pytest.raises(ValueError, match="create_dynamic_map"):
        opt.state[p]["exp_avg"].copy_(legacy)
    assert torch.equal(opt.state[p]["exp_avg"].dequantize(), before["exp_avg"])
    # the explicit conversion: decoded with the legacy map, encoded with the current one
    decoded = legacy.dequantize()
    assert decoded[2, 5].item() == pytest.approx(-40.0 * 0.99296875, rel=1e-6)
    opt.load_state_dict(qstate.optim.convert_state_dict(sd, opt))
    loaded = opt.state[p]["exp_avg"]
    assert torch.equal(loaded.qmap, get_format("8bit").make_qmap(True))
    reference = qstate.quantize(decoded, "8bit", block_size=loaded.block_size)
    assert torch.equal(loaded.codes, reference.codes) and torch.equal(loaded.scale, reference.scale)
    assert loaded.dequantize()[2, 5].item() == decoded[2, 5].item()  # the block's absmax: exact now
    for n, v in stored.items():  # the converted dict is new; the input is unchanged
        assert torch.equal(getattr(sd["state"][0]["exp_avg"], n), v)
    opt.step()  # and the optimizer runs on it
