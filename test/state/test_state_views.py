"""Views of a state along dims other than 0 (``QuantizedStateView``), against the same views of the
dequantized values: reads give those values exactly; an in-place op through a view gives the state the
requantized result, and no block it does not touch changes a bit."""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase
from hypothesis import given, settings
from hypothesis import strategies as st

import qstate

FORMATS = ["8bit", "4bit", "fp8"]

#: name -> view of a 2-D (or more) tensor
VIEWS = {
    "t": lambda t: t.t(),
    "transpose": lambda t: t.transpose(0, 1),
    "permute": lambda t: t.permute(1, 0),
    "select(1)": lambda t: t.select(1, 3),
    "select(0)": lambda t: t.select(0, 1),
    "slice(1)": lambda t: t[:, 2:9],
    "slice(1, step)": lambda t: t[:, 1::3],
    "slice(0, step)": lambda t: t[::2],
    "narrow(1)": lambda t: t.narrow(1, 4, 5),
    "diagonal": lambda t: t.diagonal(),
    "unsqueeze": lambda t: t.unsqueeze(1),
    "chunk(1)": lambda t: t.chunk(3, dim=1)[1],
    "unbind(1)": lambda t: t.unbind(1)[2],
    "t.slice": lambda t: t.t()[3:7],
    "view(cols, rows)": lambda t: t.view(t.shape[1], t.shape[0]),
    "slice.t.select": lambda t: t[:, 1:].t().select(1, 0),
}
#: name -> in-place op on a tensor ``v`` (``x``: plain values of the same shape)
WRITES = {
    "mul_": lambda v, x: v.mul_(0.5),
    "add_": lambda v, x: v.add_(x),
    "copy_": lambda v, x: v.copy_(x),
    "lerp_": lambda v, x: v.lerp_(x, 0.25),
    "addcmul_": lambda v, x: v.addcmul_(x, x, value=0.5),
    "zero_": lambda v, x: v.zero_(),
    "fill_": lambda v, x: v.fill_(0.75),
    "clamp_min_": lambda v, x: v.clamp_min_(0),
    "_foreach_mul_": lambda v, x: torch._foreach_mul_([v], 2.0),
}


def _state(rows: int, cols: int, fmt: str, seed: int) -> qstate.QuantizedState:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    return qstate.quantize(x, fmt, signed=True)


@settings(max_examples=12)
@given(fmt=st.sampled_from(FORMATS), view=st.sampled_from(sorted(VIEWS)), rows=st.integers(2, 7),
       cols=st.sampled_from([9, 12, 300, 520]), seed=st.integers(0, 2**16))
def test_a_view_reads_the_values_of_the_same_view(fmt, view, rows, cols, seed):
    q = _state(rows, cols, fmt, seed)
    want = VIEWS[view](q.dequantize())
    got = VIEWS[view](q)
    assert isinstance(got, qstate.QuantizedStateView) and got.base is q
    assert (tuple(got.shape), got.stride(), got.storage_offset()) == (tuple(want.shape), want.stride(),
                                                                        want.storage_offset())
    assert torch.equal(qstate.dequantize(got), want)
    assert torch.equal(got * 1, want * 1) and torch.equal(got.sum(), want.sum())  # reads give plain values
    w = torch.randn(want.shape[-1], 2, generator=torch.Generator().manual_seed(seed)) if want.dim() == 2 else None
    if w is not None:
        assert torch.equal(got @ w, want @ w)


@settings(max_examples=16)
@given(fmt=st.sampled_from(FORMATS), view=st.sampled_from(sorted(VIEWS)), write=st.sampled_from(sorted(WRITES)),
       rows=st.integers(2, 7), cols=st.sampled_from([9, 300, 520]), seed=st.integers(0, 2**16))
def test_a_write_through_a_view_requantizes_only_the_blocks_it_touches(fmt, view, write, rows, cols, seed):
    q = _state(rows, cols, fmt, seed)
    codes, scale = q.codes.clone(), q.scale.clone()
    plain = q.dequantize()
    x = torch.randn(VIEWS[view](plain).shape, generator=torch.Generator().manual_seed(seed + 1))
    v = VIEWS[view](q)
    result = WRITES[write](v, x)
    WRITES[write](VIEWS[view](plain), x)
    assert result is v or result == [v] or result is None
    assert torch.equal(q.dequantize(), qstate.quantize(plain, fmt).dequantize())  # the requantized values
    # blocks with no written element keep their bits
    touched = torch.zeros(rows, cols, dtype=torch.bool)
    VIEWS[view](touched).fill_(True)
    nb = q.scale.shape[1]
    blocks = torch.nn.functional.pad(touched, (0, nb * q.block_size - cols)).view(rows, nb, -1).any(-1)
    assert torch.equal(q.scale[~blocks], scale[~blocks])
    per_byte = blocks.repeat_interleave(q.block_size * q.fmt.bits // 8, 1)[:, :q.codes.shape[1]]
    assert torch.equal(q.codes[~per_byte], codes[~per_byte])


@pytest.mark.parametrize("fmt", FORMATS)
def test_views_of_one_dim_and_of_more_dims(fmt):
    v = qstate.quantize(torch.randn(1000), fmt)
    assert torch.equal(qstate.dequantize(v[3:900:7]), v.dequantize()[3:900:7])
    assert torch.equal(qstate.dequantize(v.select(0, 999)), v.dequantize()[999])
    c = qstate.quantize(torch.randn(3, 4, 50), fmt)
    assert torch.equal(qstate.dequantize(c.permute(2, 0, 1)[7]), c.dequantize().permute(2, 0, 1)[7])
    c.transpose(1, 2)[:, 5].mul_(0)
    assert c.dequantize()[:, :, 5].abs().sum() == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_clone_and_contiguous_copy_the_viewed_values_exactly(fmt):
    q = _state(4, 300, fmt, 0)
    for copy in (q.t().clone(), q.t().contiguous(), q[:, 5:9].clone()):
        assert isinstance(copy, qstate.QuantizedStateView) and copy.base is not q
    c = q.t().clone()
    assert torch.equal(qstate.dequantize(c), q.dequantize().t())
    c.mul_(0)  # the copy's writes leave the state alone
    assert torch.equal(qstate.dequantize(q.t()), q.dequantize().t()) and q.dequantize().abs().sum() > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_states_and_views_mix_in_one_op(fmt):
    q = _state(4, 300, fmt, 0)
    p = _state(300, 4, fmt, 1)
    want = p.dequantize() + q.dequantize().t()
    assert torch.equal(p + q.t(), want) and torch.equal(q.t() + p, want)
    p.copy_(q.t())  # a state's copy_ from a view encodes the view's values
    assert torch.equal(p.dequantize(), qstate.quantize(q.dequantize().t().contiguous(), fmt).dequantize())


class TestViewErrors(TestCase):
    def test_a_view_that_cannot_be_taken_raises_as_torch_does(self):
        q = _state(4, 300, "8bit", 0)
        with self.assertRaisesRegex(RuntimeError, "view size is not compatible"):
            q.t().view(-1)
        with self.assertRaisesRegex(IndexError, "out of range"):
            q.select(1, 300)

    def test_repr(self):
        q = _state(4, 300, "8bit", 0)
        self.assertExpectedInline(
            repr(q[:, 2:5]),
            """QuantizedStateView(shape=(4, 3), stride=(300, 1), storage_offset=2, base=QuantizedState(format='8bit', signed, block_size=256, shape=(4, 300), dtype=torch.float32, device='cpu'))""",
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_reads_and_writes_through_views_match_eager(fmt):
    q, e = _state(8, 300, fmt, 0), _state(8, 300, fmt, 0)
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    read = torch.compile(lambda m, x: m.t() @ x, fullgraph=True)
    assert torch.equal(read(q, x), e.dequantize().t() @ x)
    write = torch.compile(lambda m: m[:, 1:5].mul_(2), fullgraph=True)
    write(q)
    e[:, 1:5].mul_(2)
    assert torch.equal(q.codes, e.codes) and torch.equal(q.scale, e.scale)


def test_writes_where_elements_share_a_location_raise_and_change_nothing():
    q = _state(8, 300, "8bit", 0)
    codes = q.codes.clone()
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        q[:, :1].expand(8, 5).mul_(2)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        q.select(0, 0).unfold(0, 4, 2).zero_()
    assert torch.equal(q.codes, codes)


def test_deepcopy_copies_and_saving_names_what_to_save(tmp_path):
    import copy

    q = _state(4, 300, "8bit", 0)
    v = q[:, 3:9]
    c = copy.deepcopy(v)
    assert c.base is not q and torch.equal(qstate.dequantize(c), qstate.dequantize(v))
    with pytest.raises(TypeError, match=r"QuantizedStateView is not saved .* save the state it views \(view\.base\)"):
        torch.save(v, tmp_path / "view.pt")


def test_to_a_device_moves_the_view_and_to_a_dtype_reads_values():
    q = _state(4, 300, "8bit", 0)
    v = q.t()
    moved = v.to("cpu", copy=True)
    assert isinstance(moved, qstate.QuantizedStateView) and moved.base is not q
    assert torch.equal(qstate.dequantize(moved), q.dequantize().t())
    moved.mul_(0)  # a copy: the state keeps its values
    assert torch.equal(qstate.dequantize(v), q.dequantize().t()) and q.dequantize().abs().sum() > 0
    as_bf16 = v.to(torch.bfloat16)
    assert type(as_bf16) is torch.Tensor and torch.equal(as_bf16, q.dequantize().t().to(torch.bfloat16))


def test_update_states_writes_a_view_once():
    q = _state(4, 300, "8bit", 0)
    plain = q.dequantize()
    with qstate.update_states([q[:, 10:20]]) as (m,):
        assert type(m) is torch.Tensor
        m.mul_(0.5).add_(1.0)
    plain[:, 10:20].mul_(0.5).add_(1.0)
    assert torch.equal(q.dequantize(), qstate.quantize(plain, "8bit").dequantize())


def test_in_place_view_ops_raise_and_keep_the_view():
    v = _state(4, 300, "8bit", 0)[:, :5]
    with pytest.raises(NotImplementedError, match=r"aten\.t_\.default on a QuantizedStateView: use its out-of-place"):
        v.t_()
    assert tuple(v.shape) == (4, 5)
