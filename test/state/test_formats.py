"""Quantizer correctness: maps, nearest-code search, packing, second-moment safety."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qstate
from qstate.formats import FORMATS, dynamic_map, get_format, normal_map

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



def test_4bit_signed_map_is_nf4():
    # QLoRA's NF4 table (bitsandbytes' hard-coded constants, computed there with scipy)
    nf4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
           0.24611230194568634, 0.33791524188995483, 0.44070982933044434, 0.5626170039176392,
           0.7229568362328674, 1.0]
    m = normal_map()
    assert m.dtype == torch.float32 and m.tolist() == pytest.approx(nf4, abs=1e-6)
    # exact -1, 0, +1; 7 negative and 8 positive entries
    assert m[0].item() == -1.0 and m[7].item() == 0.0 and m[-1].item() == 1.0
    assert int((m < 0).sum()) == 7 and int((m > 0).sum()) == 8
    assert torch.equal(get_format("4bit").make_qmap(True), m)
    assert torch.equal(get_format("4bit").make_qmap(False), torch.tensor([(k / 15) ** 2 for k in range(16)]))


def test_4bit_unsigned_decodes_sqrt_within_half_a_linear_step():
    # a second moment spanning decades in one block: sqrt of the decoded value is within 0.59 of
    # sqrt(absmax) / 15 of the true sqrt (nearest in v: sqrt(k^2 + k + 1/2) - k <= 0.59 for k >= 1), and within
    # one such step below the smallest entry (rounded up); a map linear in v reads all v under absmax / 30
    # as absmax / 15, i.e. sqrt(v) up to 1/sqrt(15) of sqrt(absmax) too large
    g = torch.Generator().manual_seed(0)
    v = 10 ** (torch.rand(64, 128, generator=g) * -8)
    v[:, 0] = 1.0
    back = qstate.quantize(v, "4bit", signed=False).dequantize()
    assert bool((back > 0).all())  # a positive value never decodes as 0
    err = (back.sqrt() - v.sqrt()).abs()
    assert float(err.max()) <= 1 / 15 + 1e-6
    assert float(err[v >= 1 / 225].max()) <= 0.59 / 15
    small = v < 1 / 225  # below the smallest positive entry: rounds up to it, never down
    assert torch.equal(back[small], torch.full_like(back[small], float((1 / 15) ** 2)))
    with pytest.raises(ValueError, match="offset must be in"):
        normal_map(0.5)

def test_codes_equal_bitsandbytes_quantize_blockwise():
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    for signed in (True, False):
        v = x if signed else x.abs()
        qmap = dynamic_map(signed)
        codes_bnb, bnb_state = bnb_f.quantize_blockwise(v, code=qmap, blocksize=256)
        q = qstate.quantize(v, "8bit", signed=signed, block_size=256)
        assert torch.equal(q.scale.view(-1), bnb_state.absmax.view(-1).float())
        ours, theirs = q.codes.view(-1), codes_bnb.view(-1)
        y = v / q.scale.view(-1).repeat_interleave(256)
        if not signed:  # bnb may round a tiny positive to 0; qstate never does
            keep = theirs != 0
            ours, theirs, y = ours[keep], theirs[keep], y[keep]
        # bitsandbytes' CPU kernel does not always pick the nearest code near a midpoint
        # (bitsandbytes 0.50.2: ~0.2% of codes, one code apart); qstate always does
        differ = ours != theirs
        assert differ.float().mean() < 0.005
        assert bool(((ours[differ].int() - theirs[differ].int()).abs() == 1).all())
        ours_err = (qmap[ours[differ].long()] - y[differ]).abs()
        theirs_err = (qmap[theirs[differ].long()] - y[differ]).abs()
        assert bool((ours_err <= theirs_err).all())


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


# ------------------------------------------------------------------ stochastic rounding
SR_KINDS = [f for f in ("8bit", "4bit")]  # signed map formats: the ones that implement it


def reference_lowbias32(u: int) -> int:
    """lowbias32 in Python integers (the spec of qstate/formats/_rounding.py)."""
    u ^= u >> 16
    u = (u * 0x7FEB352D) & 0xFFFFFFFF
    u ^= u >> 15
    u = (u * 0x846CA68B) & 0xFFFFFFFF
    return u ^ (u >> 16)


def reference_stochastic_code(y: float, qmap: list[float]) -> int:
    """The spec, one value at a time: float32 arithmetic in numpy, integers in Python."""
    np = pytest.importorskip("numpy")
    y32 = np.float32(y)
    h = reference_lowbias32(int(np.array(y32).view(np.uint32)))
    c = max([i for i, v in enumerate(qmap) if np.float32(v) <= y32], default=0)
    c = min(c, len(qmap) - 2)
    lo, hi = np.float32(qmap[c]), np.float32(qmap[c + 1])
    if y32 >= hi:
        return c + 1
    if y32 <= lo:
        return c
    return c + int(np.float32(h >> 8) * (hi - lo) < (y32 - lo) * np.float32(2**24))


def _spread(seed: int, n: int) -> torch.Tensor:
    """Normalized values in [-1, 1] over many magnitudes, plus every map entry of both maps and -0.0."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.rand(n, generator=g) * 2 - 1) * 10 ** (-6 * torch.rand(n, generator=g))
    entries = [get_format(f).make_qmap(True) for f in SR_KINDS]
    return torch.cat([y, *entries, torch.tensor([-0.0, 0.0])])


@settings(max_examples=20)
@given(u=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_lowbias32_equals_the_python_reference(u):
    from qstate.formats import lowbias32

    y = torch.tensor(u, dtype=torch.int64).to(torch.int32).view(torch.float32)  # every bit pattern
    assert lowbias32(y).tolist() == [reference_lowbias32(x) for x in u]


@pytest.mark.parametrize("fmt", SR_KINDS)
@settings(max_examples=10)
@given(seed=st.integers(0, 2**31))
def test_stochastic_codes_equal_the_scalar_reference(fmt, seed):
    f = get_format(fmt)
    qmap = f.make_qmap(True)
    y = _spread(seed, 300)
    got = f.code_of(y, True, qmap, rounding="stochastic")
    want = [reference_stochastic_code(v, qmap.tolist()) for v in y.tolist()]
    assert got.tolist() == want


@pytest.mark.parametrize("fmt", SR_KINDS)
def test_stochastic_rounding_keeps_map_values_zero_and_absmax_exact(fmt):
    f = get_format(fmt)
    qmap = f.make_qmap(True)
    codes = f.code_of(torch.cat([qmap, torch.tensor([-0.0])]), True, qmap, rounding="stochastic")
    assert codes.tolist() == list(range(qmap.numel())) + [f.zero_code(True)]
    # every code between the two neighbours around a value, never further
    y = _spread(0, 100_000)
    sr = f.code_of(y, True, qmap, rounding="stochastic").long()
    lo = torch.searchsorted(qmap, y, right=True).clamp(1, qmap.numel() - 1) - 1
    assert bool(((sr == lo) | (sr == lo + 1)).all())
    # blocks: the same scales as round-to-nearest, and the same codes where it is exact: zeros and
    # each block's absmax element (+-1, exact in every map)
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    x[1] = 0
    x[2, :5] = 0
    x[3, 7] = -50.0
    sr = qstate.quantize(x, fmt, rounding="stochastic", block_size=64)
    rn = qstate.quantize(x, fmt, block_size=64)
    assert torch.equal(sr.scale, rn.scale)
    sr_codes, rn_codes = f.unpack(sr.codes, 300), f.unpack(rn.codes, 300)
    absmax = torch.zeros(6, 300, dtype=torch.bool)
    for b in range(0, 300, 64):
        blk = x[:, b:b + 64].abs()
        absmax[:, b:b + 64] = (blk == blk.amax(1, keepdim=True)) & (blk > 0)
    exact = absmax | (x == 0)
    assert torch.equal(sr_codes[exact], rn_codes[exact])
    assert bool((sr_codes[~exact] != rn_codes[~exact]).any())  # and it does round otherwise


@pytest.mark.parametrize("fmt", SR_KINDS)
@settings(max_examples=10)
@given(bucket=st.integers(0, 254), frac=st.floats(0.02, 0.98))
def test_stochastic_rounding_is_unbiased_in_a_bucket(fmt, bucket, frac):
    # 200k distinct consecutive float32 values around lo + frac * (hi - lo): the mean of their decoded
    # values equals the mean of the values (Bernoulli std of the mean: 0.0011 of the bucket width)
    f = get_format(fmt)
    qmap = f.make_qmap(True)
    c = bucket % (qmap.numel() - 1)
    lo, hi = float(qmap[c]), float(qmap[c + 1])
    start = torch.tensor(lo + frac * (hi - lo), dtype=torch.float32).view(torch.int32)
    n = 200_000
    bits = start - n // 2 + torch.arange(n, dtype=torch.int32)
    y = bits.view(torch.float32)
    y = y[(y > lo) & (y < hi)]
    decoded = qmap[f.code_of(y, True, qmap, rounding="stochastic").long()].double()
    assert abs(float(decoded.mean() - y.double().mean())) < 0.007 * (hi - lo)
    assert bool(((decoded == lo) | (decoded == hi)).all())


@pytest.mark.parametrize("fmt", SR_KINDS)
@settings(max_examples=15)
@given(seed=st.integers(0, 2**31), rows=st.integers(2, 40), cols=st.integers(1, 400),
       block_size=st.sampled_from([None, 16, 64]), data=st.data())
def test_stochastic_codes_of_row_slices_equal_the_whole(fmt, seed, rows, cols, block_size, data):
    # decisions depend on the normalized value only: any rows quantized alone get the codes they get
    # inside the whole tensor (what every shard of a DTensor / FSDP2 state relies on)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    a = data.draw(st.integers(0, rows - 1))
    b = data.draw(st.integers(a + 1, rows))
    whole = qstate.quantize(x, fmt, rounding="stochastic", block_size=block_size)
    part = qstate.quantize(x[a:b], fmt, rounding="stochastic", block_size=block_size)
    assert torch.equal(part.codes, whole.codes[a:b]) and torch.equal(part.scale, whole.scale[a:b])
    assert torch.equal(whole[a:b].dequantize(), part.dequantize())


@pytest.mark.parametrize("fmt,signed", [("4bit", False), ("8bit", False), ("fp8", True)])
def test_stochastic_rounding_is_rejected_where_not_implemented(fmt, signed):
    with pytest.raises(ValueError, match="is not implemented for"):
        qstate.quantize(torch.rand(4, 8), fmt, signed=signed, rounding="stochastic")
    with pytest.raises(ValueError, match="is not implemented for"):
        qstate.zeros_like(torch.rand(4, 8), fmt, signed=signed, rounding="stochastic")
    assert not get_format(fmt).supports_rounding("stochastic", signed)


# ------------------------------------------------------------------ fp8: stochastic rounding of unsigned states
#: float8_e4m3fn's non-negative finite values by code (0x00..0x7e), computed from the encoding's definition
#: (exponent bias 7, 3 mantissa bits, subnormals below 2**-6) rather than by torch's conversion
FP8_NON_NEGATIVE = [(c & 7) * 2.0**-9 if c < 8 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7) for c in range(127)]


def _fp8_spread(seed: int, n: int) -> torch.Tensor:
    """Normalized values of unsigned fp8 states: positive over 2**-14 .. 2**9 (below the smallest code, subnormal,
    normal, past 448), every code's value, and the special values."""
    g = torch.Generator().manual_seed(seed)
    y = 2.0 ** (23 * torch.rand(n, generator=g) - 14)
    special = [0.0, -0.0, -1.0, -1e-30, 448.0, 464.0, 1e30, float("inf"), float("nan")]
    return torch.cat([y, torch.tensor(FP8_NON_NEGATIVE), torch.tensor(special)])


def test_fp8_non_negative_values_are_the_codes_values():
    from qstate.formats.fp8 import NON_NEGATIVE_VALUES

    assert NON_NEGATIVE_VALUES.tolist() == FP8_NON_NEGATIVE


@settings(max_examples=10)
@given(seed=st.integers(0, 2**31))
def test_fp8_unsigned_stochastic_codes_equal_the_scalar_reference(seed):
    # the shared spec (reference_stochastic_code) on the non-negative codes, then never 0 for y > 0; y <= 0
    # and NaN keep round-to-nearest's codes
    f = get_format("fp8")
    y = _fp8_spread(seed, 300)
    got = f.code_of(y, False, None, rounding="stochastic").tolist()
    nearest = f.code_of(y, False, None).tolist()
    want = [max(1, reference_stochastic_code(v, FP8_NON_NEGATIVE)) if v > 0 else c
            for v, c in zip(y.tolist(), nearest)]
    assert got == want


def test_fp8_unsigned_stochastic_rounding_takes_a_neighbouring_code_never_zero():
    f = get_format("fp8")
    grid = torch.tensor(FP8_NON_NEGATIVE)
    y = _fp8_spread(0, 100_000)
    y = y[y > 0]
    sr = f.code_of(y, False, None, rounding="stochastic").long()
    below = (torch.searchsorted(grid, y, right=True) - 1).clamp(0, 125)
    assert bool(((sr == below) | (sr == below + 1)).all())
    assert bool((sr >= 1).all())
    on_grid = y <= 448
    on_grid &= grid[below.clamp(max=126)] == y
    assert torch.equal(sr[on_grid], below[on_grid])  # values on a code encode exactly
    assert bool((sr[y >= 448] == 126).all())
    # blocks: the same scales as round-to-nearest, exact zeros and absmaxes, and the round trip within one
    # code step: 2**-3 relative (normal codes) plus the subnormal step 2**-9 * scale
    x = torch.rand(5, 300, generator=torch.Generator().manual_seed(1)) ** 8
    x[1] = 0
    x[2, :7] = 0
    sr_q = qstate.quantize(x, "fp8", signed=False, rounding="stochastic", block_size=64)
    rn_q = qstate.quantize(x, "fp8", signed=False, block_size=64)
    assert torch.equal(sr_q.scale, rn_q.scale)
    deq = sr_q.dequantize()
    assert torch.equal(deq == 0, x == 0)
    scale = sr_q.scale.repeat_interleave(64, 1)[:, :300]
    assert bool(((deq - x).abs() <= x * 2.0**-3 + scale * 2.0**-9).all())
    is_max = x == scale * 448
    assert torch.equal(deq[is_max], x[is_max])


@pytest.mark.parametrize("code", [0, 1, 5, 8, 20, 56, 100, 125])
@settings(max_examples=5)
@given(frac=st.floats(0.02, 0.98))
def test_fp8_unsigned_stochastic_rounding_is_unbiased_between_two_codes(code, frac):
    # consecutive float32 values around lo + frac * (hi - lo), subnormal and normal steps: the mean decoded
    # value equals the mean value (Bernoulli std of the mean: about 0.0011 of the step)
    f = get_format("fp8")
    lo, hi = FP8_NON_NEGATIVE[code], FP8_NON_NEGATIVE[code + 1]
    start = torch.tensor(lo + frac * (hi - lo), dtype=torch.float32).view(torch.int32)
    y = (start - 100_000 + torch.arange(200_000, dtype=torch.int32)).view(torch.float32)
    y = y[(y > lo) & (y < hi)]
    decoded = f.code_of(y, False, None, rounding="stochastic").view(torch.float8_e4m3fn).double()
    if code == 0:  # below the smallest positive code: never 0, so every value takes it
        assert bool((decoded == hi).all())
        return
    assert abs(float(decoded.mean() - y.double().mean())) < 0.007 * (hi - lo)
    assert bool(((decoded == lo) | (decoded == hi)).all())


def test_fp8_ema_held_by_round_to_nearest_follows_its_decay_with_stochastic_rounding():
    # v <- 0.999 v (AdamW's second moment with beta2 = 0.999 and no gradient) for 700 steps from 96 (a code): the
    # 0.1% step is under half a code step (2**-5 relative), so round-to-nearest keeps every v at 96, while
    # stochastic rounding (new draws each step, as the optimizers' per-step keys give) follows 96 * 0.999**700
    from qstate.formats import position_hash32

    f = get_format("fp8")
    index = torch.arange(4096)
    v_rn = v_sr = torch.full((4096,), 96.0)
    keys = torch.randint(0, 2**62, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    for key in keys:  # a random 64-bit key per step, as the optimizers draw them
        v_rn = f.code_of(v_rn * 0.999, False, None).view(torch.float8_e4m3fn).float()
        draws = position_hash32(key, index)
        v_sr = f.code_of(v_sr * 0.999, False, None, "stochastic", draws).view(torch.float8_e4m3fn).float()
    assert bool((v_rn == 96).all())
    exact = 96 * 0.999**700
    assert abs(float(v_sr.double().mean()) / exact - 1) < 0.02
