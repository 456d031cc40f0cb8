"""Quantizer correctness: maps, nearest-code search, packing, second-moment safety."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qstate
from qstate.formats import FORMATS, dynamic_map, get_format

MAP_KINDS = [(f, s) for f in ("8bit", "4bit") for s in (True, False)]


def brute_force_codes(y: torch.Tensor, qmap: torch.Tensor, signed: bool) -> torch.Tensor:
    """argmin over the whole map (first minimum), plus the unsigned no-zero rule."""
    idx = (y.reshape(-1, 1).double() - qmap.double()).abs().argmin(dim=1).view(y.shape)
    if not signed:
        zero = int((qmap == 0).nonzero()[0, 0])
        idx = torch.where((idx == zero) & (y > 0), idx + 1, idx)
    return idx.to(torch.uint8)


@pytest.mark.parametrize("fmt,signed", MAP_KINDS)
@settings(max_examples=30)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 9), row_len=st.integers(1, 700),
       block_size=st.sampled_from([None, 16, 64]))
def test_codes_equal_brute_force_nearest(fmt, signed, seed, rows, row_len, block_size):
    f = get_format(fmt)
    bs = block_size or f.default_block_size
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, row_len, generator=g) * 10 ** (torch.rand(rows, row_len, generator=g) * 8 - 6)
    x = x if signed else x.abs()
    qmap = f.make_qmap(signed)
    codes, scale = f.encode(x, bs, signed, qmap)
    # the normalization the format applies, done here in plain torch
    nb = -(-row_len // bs)
    xp = torch.nn.functional.pad(x, (0, nb * bs - row_len)).view(rows, nb, bs)
    absmax = xp.abs().amax(-1, keepdim=True)
    y = (xp / torch.where(absmax == 0, 1, absmax)).view(rows, -1)[:, :row_len]
    assert torch.equal(scale, absmax.squeeze(-1))
    assert torch.equal(f.unpack(codes, row_len), brute_force_codes(y, qmap, signed))


@pytest.mark.parametrize("signed", [True, False])
@settings(max_examples=30)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 3000))
def test_fp8_codes_equal_brute_force_nearest(signed, seed, n):
    f = get_format("fp8")
    x = torch.randn(1, n, generator=torch.Generator().manual_seed(seed)) * 100
    x = x if signed else x.abs()
    codes, scale = f.encode(x, 256, signed, None)
    y = x / torch.where(scale == 0, 1, scale).repeat_interleave(256, 1)[:, :n]
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~grid.isnan()
    dist = (y.reshape(-1, 1).double() - grid.double()).abs()
    dist[:, ~finite] = float("inf")
    best = dist.min(1).values
    chosen = dist.gather(1, codes.view(-1, 1).long()).squeeze(1)
    # nearest value (ties may go either way: round-half-even)
    assert torch.equal(chosen, best)


def test_dynamic_maps_match_bitsandbytes_construction():
    m8s, m8u = dynamic_map(True), dynamic_map(False)
    assert m8s.numel() == 256 and m8u.numel() == 256
    assert m8s.max() == 1.0 and m8u.max() == 1.0 and m8u.min() == 0.0
    assert (m8s == 0).sum() == 1 and (m8s < 0).sum() == 127
    assert m8u[1].item() == pytest.approx(0.325e-6)
    m4 = dynamic_map(True, 3, 4)
    assert m4.tolist() == pytest.approx(
        [-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
         0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0]
    )


def test_codes_equal_bitsandbytes_quantize_blockwise():
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    x = torch.randn(4096)
    for signed in (True, False):
        v = x if signed else x.abs()
        qmap = dynamic_map(signed)
        codes_bnb, _state = bnb_f.quantize_blockwise(v, code=qmap, blocksize=256)
        q = qstate.quantize(v, "8bit", signed=signed, block_size=256)
        ours = q.codes.view(-1)
        if not signed:  # bnb may round a tiny positive to 0; qstate never does
            keep = codes_bnb.view(-1) != 0
            ours, codes_bnb = ours[keep], codes_bnb.view(-1)[keep]
        assert torch.equal(ours, codes_bnb.view(-1))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_unsigned_round_trip_keeps_positive_values_positive(fmt):
    # one block mixing 1 with values down to 1e-38: none may come back as 0
    x = torch.logspace(-38, 0, 256)
    q = qstate.quantize(x, fmt, signed=False, block_size=256)
    deq = q.dequantize()
    assert bool((deq > 0).all())
    # zeros stay exact zeros
    z = x.clone()
    z[::3] = 0
    dz = qstate.quantize(z, fmt, signed=False, block_size=256).dequantize()
    assert torch.equal(dz == 0, z == 0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_holds_zero_exactly(fmt):
    for signed in (True, False):
        q = qstate.zeros_like(torch.empty(3, 5), fmt, signed=signed)
        assert torch.equal(q.dequantize(), torch.zeros(3, 5))


def test_4bit_packs_two_codes_per_byte_low_nibble_first():
    f = get_format("4bit")
    codes = torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.uint8)
    packed = f.pack(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x05]]
    assert torch.equal(f.unpack(packed, 5), codes)
