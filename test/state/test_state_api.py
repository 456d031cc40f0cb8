"""Reprs, errors, the op table, serialization and torch.compile of QuantizedState."""

from __future__ import annotations

import io
import itertools

import expecttest
import pytest
import torch

import qstate
from qstate.formats import FORMATS


def _err(fn) -> str:
    with pytest.raises(Exception) as info:
        fn()
    return f"{type(info.value).__name__}: {info.value}"


class TestReprAndErrors(expecttest.TestCase):
    def test_repr(self):
        lines = [
            repr(qstate.quantize(torch.randn(3, 5, dtype=d).abs(), f, signed=s))
            for f, s, d in itertools.product(sorted(FORMATS), (True, False), (torch.float32, torch.bfloat16))
        ]
        self.assertExpectedInline("\n".join(lines), """\
QuantizedState(format='4bit', signed, block_size=128, shape=(3, 5), dtype=torch.float32, device='cpu')
QuantizedState(format='4bit', signed, block_size=128, shape=(3, 5), dtype=torch.bfloat16, device='cpu')
QuantizedState(format='4bit', unsigned, block_size=128, shape=(3, 5), dtype=torch.float32, device='cpu')
QuantizedState(format='4bit', unsigned, block_size=128, shape=(3, 5), dtype=torch.bfloat16, device='cpu')
QuantizedState(format='8bit', signed, block_size=256, shape=(3, 5), dtype=torch.float32, device='cpu')
QuantizedState(format='8bit', signed, block_size=256, shape=(3, 5), dtype=torch.bfloat16, device='cpu')
QuantizedState(format='8bit', unsigned, block_size=256, shape=(3, 5), dtype=torch.float32, device='cpu')
QuantizedState(format='8bit', unsigned, block_size=256, shape=(3, 5), dtype=torch.bfloat16, device='cpu')
QuantizedState(format='fp8', signed, block_size=256, shape=(3, 5), dtype=torch.float32, device='cpu')
QuantizedState(format='fp8', signed, block_size=256, shape=(3, 5), dtype=torch.bfloat16, device='cpu')
QuantizedState(format='fp8', unsigned, block_size=256, shape=(3, 5), dtype=torch.float32, device='cpu')
QuantizedState(format='fp8', unsigned, block_size=256, shape=(3, 5), dtype=torch.bfloat16, device='cpu')""")
        self.assertExpectedInline(repr(qstate.quantize(torch.randn(3, 5), "4bit", rounding="stochastic")), """\
QuantizedState(format='4bit', signed, block_size=128, rounding='stochastic', shape=(3, 5), dtype=torch.float32, device='cpu')""")

    def _unchanged_after(self, q, fn) -> str:
        codes, scale = q.codes.clone(), q.scale.clone()
        msg = _err(fn)
        self.assertTrue(torch.equal(q.codes, codes) and torch.equal(q.scale, scale))
        return msg

    def test_unsigned_states_refuse_negative_values(self):
        x = torch.tensor([[0.5, -0.25, 1.0, -2.0]])
        self.assertExpectedInline(_err(lambda: qstate.quantize(x, "8bit", signed=False)), """\
ValueError: quantize(signed=False): an unsigned state holds values >= 0, got 2 negative value(s) (the lowest -2); use signed=True, or clamp_min(0) explicitly""")  # noqa: B950
        v = qstate.quantize(x.abs(), "4bit", signed=False)
        self.assertExpectedInline(self._unchanged_after(v, lambda: v.copy_(x)), """\
ValueError: copy_ into a state [4bit unsigned block_size=128 dtype=torch.float32 shape=(1, 4) device=cpu]: an unsigned state holds values >= 0, got 2 negative value(s) (the lowest -2); use signed=True, or clamp_min(0) explicitly""")  # noqa: B950
        self.assertExpectedInline(self._unchanged_after(v, lambda: v.sub_(1.0)), """ValueError: copy_ into a state [4bit unsigned block_size=128 dtype=torch.float32 shape=(1, 4) device=cpu]: an unsigned state holds values >= 0, got 2 negative value(s) (the lowest -0.777778); use signed=True, or clamp_min(0) explicitly""")  # noqa: B950
        v.copy_(torch.tensor([[-0.0, 0.0, 1.0, 2.0]]))  # -0.0 is not negative
        assert torch.equal(v.dequantize()[0, :2], torch.zeros(2))

    def test_copy_errors_leave_destination_unchanged(self):
        q = qstate.quantize(torch.randn(4, 300), "8bit")
        self.assertExpectedInline(
            self._unchanged_after(q, lambda: q.copy_(qstate.quantize(torch.randn(4, 300), "4bit"))),
            """ValueError: copy_: expected a state of kind [8bit signed block_size=256 dtype=torch.float32 shape=(4, 300) device=cpu], got [4bit signed block_size=128 dtype=torch.float32 shape=(4, 300) device=cpu]; copy_ never converts a state: copy its values (dst.copy_(src.dequantize())) or convert a state dict with qstate.optim.convert_state_dict(state_dict, optimizer)""",
        )
        self.assertExpectedInline(
            self._unchanged_after(q, lambda: q.copy_(qstate.quantize(torch.randn(4, 300), "8bit", block_size=64))),
            """ValueError: copy_: expected a state of kind [8bit signed block_size=256 dtype=torch.float32 shape=(4, 300) device=cpu], got [8bit signed block_size=64 dtype=torch.float32 shape=(4, 300) device=cpu]; copy_ never converts a state: copy its values (dst.copy_(src.dequantize())) or convert a state dict with qstate.optim.convert_state_dict(state_dict, optimizer)""",
        )
        self.assertExpectedInline(
            self._unchanged_after(q, lambda: q.copy_(qstate.quantize(torch.rand(4, 300), "8bit", signed=False))),
            """ValueError: copy_: expected a state of kind [8bit signed block_size=256 dtype=torch.float32 shape=(4, 300) device=cpu], got [8bit unsigned block_size=256 dtype=torch.float32 shape=(4, 300) device=cpu]; copy_ never converts a state: copy its values (dst.copy_(src.dequantize())) or convert a state dict with qstate.optim.convert_state_dict(state_dict, optimizer)""",
        )
        self.assertExpectedInline(
            self._unchanged_after(q, lambda: q.copy_(qstate.quantize(torch.randn(4, 300), "8bit", rounding="stochastic"))),
            """ValueError: copy_: expected a state of kind [8bit signed block_size=256 dtype=torch.float32 shape=(4, 300) device=cpu], got [8bit signed block_size=256 rounding=stochastic dtype=torch.float32 shape=(4, 300) device=cpu]; copy_ never converts a state: copy its values (dst.copy_(src.dequantize())) or convert a state dict with qstate.optim.convert_state_dict(state_dict, optimizer)""",
        )
        self.assertExpectedInline(
            self._unchanged_after(q, lambda: q.copy_(torch.randn(3, 300))),
            """ValueError: copy_: expected a source of shape (4, 300), got (3, 300) [8bit signed block_size=256 dtype=torch.float32 shape=(4, 300) device=cpu]""",
        )
        self.assertExpectedInline(
            self._unchanged_after(q, lambda: q.copy_(torch.ones(4, 300, dtype=torch.int64))),
            """TypeError: copy_: a quantized state takes floating-point values, got torch.int64 [8bit signed block_size=256 dtype=torch.float32 shape=(4, 300) device=cpu]""",
        )

    def test_layout_errors(self):
        v = qstate.quantize(torch.randn(1000), "8bit")
        self.assertExpectedInline(
            self._unchanged_after(v, lambda: v[100:]),
            """NotImplementedError: slice: [100:1000] of a 1-D state stored as 1 row(s) of 1000 would split a block; start must be a multiple of block_size=256 within a row, or of the row length 1000 [8bit signed block_size=256 dtype=torch.float32 shape=(1000,) device=cpu]""",
        )
        m = qstate.quantize(torch.randn(6, 10), "fp8")
        self.assertExpectedInline(
            _err(lambda: m.view(7, 10)),
            """RuntimeError: view: shape [7, 10] is invalid for a state of 60 elements [fp8 signed block_size=256 dtype=torch.float32 shape=(6, 10) device=cpu]""",
        )
        self.assertExpectedInline(
            _err(lambda: torch.nn.functional.pad(m, [1, 0])),
            """NotImplementedError: constant_pad_nd: a QuantizedState pads only zeros at the end of dim 0 (pad=[0, ..., 0, k], value=0) or, for 2-D states, at the end of dim 1 too, got pad=[1, 0], value=0.0 [fp8 signed block_size=256 dtype=torch.float32 shape=(6, 10) device=cpu]""",
        )

    def test_unknown_op_names_op_and_types(self):
        q = qstate.quantize(torch.randn(4, 4), "8bit")
        self.assertExpectedInline(
            _err(lambda: torch.cross(q, torch.randn(4, 4), dim=1)),
            """NotImplementedError: QuantizedState does not support aten.linalg_cross.default (tensor arguments: QuantizedState, Tensor); dequantize() first, or register a handler for it with qstate.ops.register""",
        )

    def test_construction_errors(self):
        x = torch.randn(10)
        self.assertExpectedInline(_err(lambda: qstate.quantize(x, "3bit")),
                                  """ValueError: unknown state format '3bit'; expected one of ['4bit', '8bit', 'fp8']""")
        self.assertExpectedInline(_err(lambda: qstate.quantize(x, "4bit", block_size=33)),
                                  """ValueError: format '4bit': block_size must be even (two codes per byte), got 33""")
        self.assertExpectedInline(_err(lambda: qstate.quantize(x.half(), "8bit")),
                                  """TypeError: quantize: a quantized state appears as torch.float32 or torch.bfloat16, got torch.float16""")
        self.assertExpectedInline(_err(lambda: qstate.quantize(x, "8bit", rounding="up")),
                                  """ValueError: format '8bit': rounding must be one of ['nearest', 'stochastic'], got 'up'""")
        self.assertExpectedInline(_err(lambda: qstate.zeros_like(x, "4bit", signed=False, rounding="stochastic")),
                                  """ValueError: format '4bit': rounding='stochastic' is not implemented for unsigned states""")
        self.assertExpectedInline(_err(lambda: qstate.quantize(x, "fp8", rounding="stochastic")),
                                  """ValueError: format 'fp8': rounding='stochastic' is not implemented for signed states""")


def test_block_size_is_fixed_at_construction():
    q = qstate.quantize(torch.randn(5, 1000), "8bit", block_size=64)
    for out in (q[1:3], q.view(-1), q.clone(), torch.cat([q, q]), torch.nn.functional.pad(q, [0, 0, 0, 3]), q.to("cpu")):
        assert out.block_size == 64 and out.scale.shape[-1] == -(-out.row_len // 64)
    q.copy_(torch.randn(5, 1000) * 1e4)
    assert q.block_size == 64


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_rounding_is_fixed_at_construction_and_kept_by_every_op(fmt):
    q = qstate.quantize(torch.randn(6, 300), fmt, rounding="stochastic", block_size=64)
    flat = qstate.quantize(torch.randn(1000), fmt, rounding="stochastic", block_size=64)
    names, ctx = q.__tensor_flatten__()
    unflat = type(q).__tensor_unflatten__({n: getattr(q, n) for n in names}, ctx, q.shape, q.stride())
    outs = [q[1:3], q.view(-1), q.reshape(6, 300), q.clone(), q.detach(), torch.ops.aten.alias(q), q.to("cpu"),
            torch.cat([q, q]), torch.nn.functional.pad(q, [0, 0, 0, 3]), torch.zeros_like(q), torch.empty_like(q),
            q.new_zeros((2, 300)), *q.split(4), *q.chunk(3), q.narrow(0, 1, 2), unflat,
            flat[64:], torch.cat([flat[:128], flat[128:]]), torch.nn.functional.pad(flat, [0, 5])]
    for out in outs:
        assert isinstance(out, qstate.QuantizedState) and out.rounding == "stochastic", out
    assert qstate.quantize(torch.randn(3, 4), fmt).rounding == "nearest"  # the default
    assert "stochastic" in q._stable_hash_for_caching()
    # writes round stochastically: copy_ and in-place math give the codes of quantize(..., rounding=)
    y = torch.randn(6, 300)
    q.copy_(y)
    want = qstate.quantize(y, fmt, rounding="stochastic", block_size=64)
    assert torch.equal(q.codes, want.codes) and torch.equal(q.scale, want.scale)
    assert not torch.equal(q.codes, qstate.quantize(y, fmt, block_size=64).codes)
    ref = q.dequantize().lerp(y, 0.1)
    q.lerp_(y, 0.1)
    assert torch.equal(q.codes, qstate.quantize(ref, fmt, rounding="stochastic", block_size=64).codes)
    # a state of another rounding is another kind: no copy, no cat
    with pytest.raises(ValueError, match="rounding=stochastic"):
        torch.cat([q, qstate.quantize(y, fmt, block_size=64)])


def test_stochastic_state_write_under_compile_matches_eager():
    x = torch.randn(33, 70)
    qe, qc = (qstate.quantize(torch.randn(33, 70), "4bit", rounding="stochastic") for _ in range(2))
    qe.copy_(x)
    torch.compile(lambda q, v: q.copy_(v), fullgraph=True)(qc, x)
    assert qc.rounding == "stochastic"
    assert torch.equal(qe.codes, qc.codes) and torch.equal(qe.scale, qc.scale)


def test_views_alias_and_write_through():
    q = qstate.quantize(torch.randn(6, 300), "8bit")
    rows = q[2:4]
    y = torch.randn(2, 300)
    rows.copy_(y)
    assert torch.equal(q.dequantize()[2:4], qstate.quantize(y, "8bit").dequantize())
    assert q.view(-1).codes.data_ptr() == q.codes.data_ptr()


def test_registered_ops_cover_the_listed_families():
    ops = set(qstate.ops.registered_ops())
    for name in ("aten.copy_.default", "aten._to_copy.default", "aten.clone.default", "aten.detach.default",
                 "aten.alias.default", "aten.view.default", "aten._unsafe_view.default", "aten.slice.Tensor",
                 "aten.split.Tensor", "aten.cat.default", "aten.constant_pad_nd.default", "aten.zeros_like.default",
                 "aten.empty_like.default", "aten.is_pinned.default", "aten._pin_memory.default",
                 "aten.lerp.Scalar", "aten.mul.Tensor", "aten.add.Tensor", "aten.sqrt.default",
                 "aten.maximum.default", "_c10d_functional.all_gather_into_tensor.default",
                 "_c10d_functional.wait_tensor.default"):
        assert name in ops, name


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_weights_only_round_trip(fmt, dtype):
    q = qstate.quantize(torch.randn(7, 33).abs().to(dtype), fmt, signed=False if fmt == "4bit" else True)
    buf = io.BytesIO()
    torch.save({"exp_avg": q, "step": torch.tensor(3.0)}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["exp_avg"]
    assert isinstance(loaded, qstate.QuantizedState)
    assert (loaded.format, loaded.signed, loaded.block_size, loaded.rounding, loaded.dtype) == \
        (q.format, q.signed, q.block_size, q.rounding, dtype)
    assert torch.equal(loaded.dequantize(), q.dequantize())
    buf.seek(0)
    on_meta = torch.load(buf, weights_only=True, map_location="meta")["exp_avg"]
    assert on_meta.device.type == "meta" and on_meta.codes.device.type == "meta"
    if torch.cuda.is_available():
        buf.seek(0)
        on_gpu = torch.load(buf, weights_only=True, map_location="cuda")["exp_avg"]
        assert on_gpu.device.type == "cuda" and torch.equal(on_gpu.dequantize().cpu(), q.dequantize())


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_save_load_keeps_stochastic_rounding(fmt):
    q = qstate.quantize(torch.randn(7, 33), fmt, rounding="stochastic")
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded.rounding == "stochastic" and torch.equal(loaded.codes, q.codes)
    # a state pickled before rounding existed (9 rebuild arguments) loads as round-to-nearest
    rebuild, args = q.__reduce_ex__(2)
    assert rebuild(*args[:9]).rounding == "nearest" and rebuild(*args).rounding == "stochastic"
    with pytest.raises(ValueError, match="not implemented for unsigned states"):
        rebuild(*args[:4], False, *args[5:])


def _adam_like(m, v, g, beta1: float, beta2: float):
    m_new = m.float().lerp(g, 1 - beta1)
    v_new = v.float().mul(beta2).addcmul(g, g, value=1 - beta2)
    m.copy_(m_new)
    v.copy_(v_new)
    return m_new / (v_new.sqrt() + 1e-8)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_compile_fullgraph_matches_eager(fmt):
    torch._dynamo.reset()
    g = torch.randn(33, 70)
    states = [(qstate.quantize(torch.randn(33, 70), fmt), qstate.quantize(torch.rand(33, 70), fmt, signed=False))
              for _ in range(2)]
    (me, ve), (mc, vc) = states
    mc.copy_(me)
    vc.copy_(ve)
    upd_e = _adam_like(me, ve, g, 0.9, 0.999)
    upd_c = torch.compile(_adam_like, fullgraph=True)(mc, vc, g, 0.9, 0.999)
    assert torch.equal(mc.codes, me.codes) and torch.equal(vc.codes, ve.codes)
    torch.testing.assert_close(mc.scale, me.scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(upd_c, upd_e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_block_size_beyond_the_int32_range_raises_before_any_allocation(fmt):
    """block_size=2**40 used to pad each row to 4 TiB; the bound is BlockFormat.max_block_size."""
    x = torch.randn(3, 5)
    for make in (lambda: qstate.quantize(x, fmt, block_size=2**40), lambda: qstate.zeros_like(x, fmt, block_size=2**40)):
        assert _err(make) == (f"ValueError: format '{fmt}': block_size must be at most 2147483647 (the int32 range; "
                              "a block larger than a row only pads it), got 1099511627776")
    # a block size above the row length stores what the row length stores
    even = 6 if FORMATS[fmt].bits == 4 else 5
    assert torch.equal(qstate.quantize(x, fmt, block_size=2**20).dequantize(),
                       qstate.quantize(x, fmt, block_size=even).dequantize())


@pytest.mark.parametrize("fmt, rounding", [("8bit", "nearest"), ("4bit", "stochastic"), ("fp8", "nearest")])
@pytest.mark.parametrize("shape", [(4, 300), (7,), (2, 3, 5)])
def test_quantize_and_zeros_like_under_fake_tensor_mode(fmt, rounding, shape):
    """Fake inputs give states whose parts are all fake, with a real input's shapes and dtypes."""
    from torch._subclasses import FakeTensorMode
    from torch._subclasses.fake_tensor import is_fake

    real = qstate.quantize(torch.randn(shape), fmt, rounding=rounding)
    zeros = qstate.zeros_like(torch.randn(shape), fmt, block_size=64)
    with FakeTensorMode():
        x = torch.randn(shape)
        for q, want in ((qstate.quantize(x, fmt, rounding=rounding), real),
                        (qstate.zeros_like(x, fmt, block_size=64), zeros)):
            assert type(q) is qstate.QuantizedState and q.shape == x.shape and q.dtype == x.dtype
            parts = [q.codes, q.scale] + ([q.qmap] if q.qmap is not None else [])
            assert all(is_fake(t) for t in parts)
            assert len(parts) == 2 + (want.qmap is not None)
            for t, w in zip(parts, [want.codes, want.scale, want.qmap]):
                assert (t.shape, t.dtype) == (w.shape, w.dtype)
            back = q.dequantize()
            assert is_fake(back) and back.shape == x.shape


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_writes_into_a_one_dim_state_of_several_padded_rows(fmt):
    # torch.cat of 1-D states gives rows of the first's length, the last one padded
    state = torch.cat([qstate.quantize(torch.randn(512), fmt), qstate.quantize(torch.randn(300), fmt)])
    assert (state.rows, state.row_len, state.numel()) == (2, 512, 812)

    def encoded_in_those_rows(x):
        return qstate.quantize(torch.nn.functional.pad(x, (0, 212)).view(2, 512), fmt).dequantize().view(-1)[:812]

    x = torch.randn(812)
    state.copy_(x)
    assert torch.equal(state.dequantize(), encoded_in_those_rows(x))
    before = state.dequantize()
    state.mul_(0.5)
    assert torch.equal(state.dequantize(), encoded_in_those_rows(before * 0.5))
