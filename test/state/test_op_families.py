"""Torch's pointwise and reduction ops (the ops it tags ``pointwise``/``reduction``), the ops that index,
sort or scan values, and matrix products on states, against the same op on the dequantized values: reads give plain tensors of exactly those
values; in-place forms give the state the requantized result."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qstate

#: name -> read of a [rows, cols] tensor ``t`` (``x``: plain values of its shape)
READS = {
    "exp": lambda t, x: t.exp(),
    "tanh": lambda t, x: torch.tanh(t),
    "sigmoid": lambda t, x: t.sigmoid(),
    "erf": lambda t, x: torch.erf(t),
    "atan2": lambda t, x: torch.atan2(t, x),
    "masked_fill": lambda t, x: t.masked_fill(x > 0, 0.5),
    "std": lambda t, x: t.std(),
    "var(dim=1)": lambda t, x: t.var(dim=1),
    "max(dim=0)": lambda t, x: t.max(dim=0).values,
    "argmax": lambda t, x: t.argmax(),
    "logsumexp": lambda t, x: t.logsumexp(1),
    "prod(dim=1)": lambda t, x: t.prod(dim=1),
    "index": lambda t, x: t[:, [0, 2]],
    "index_select": lambda t, x: t.index_select(1, torch.tensor([2, 0])),
    "gather": lambda t, x: t.gather(1, torch.zeros(t.shape[0], 2, dtype=torch.int64)),
    "sort": lambda t, x: t.sort(dim=1).values,
    "topk": lambda t, x: t.topk(2).values,
    "cumsum": lambda t, x: t.cumsum(1),
    "flip": lambda t, x: t.flip(1),
    "tril": lambda t, x: t.tril(),
    "softmax": lambda t, x: t.softmax(1),
    "median(dim=1)": lambda t, x: t.median(dim=1).values,
    "mv": lambda t, x: t @ x[0],
    "dot": lambda t, x: torch.dot(t.select(0, 0), x[0]),
    "addmm": lambda t, x: torch.addmm(x[:, :1], t, x.t()),
    "bmm": lambda t, x: torch.bmm(t.unsqueeze(0), x.t().unsqueeze(0)),
}
#: name -> in-place op on ``t``
WRITES = {
    "exp_": lambda t, x: t.exp_(),
    "tanh_": lambda t, x: t.tanh_(),
    "sigmoid_": lambda t, x: t.sigmoid_(),
    "masked_fill_": lambda t, x: t.masked_fill_(x > 0, 0.5),
    "hypot_": lambda t, x: t.hypot_(x),
    "index_put_": lambda t, x: t.index_put_((torch.tensor([0]),), x[0]),
    "scatter_": lambda t, x: t.scatter_(1, torch.zeros(t.shape[0], 1, dtype=torch.int64), 2.0),
    "index_add_": lambda t, x: t.index_add_(1, torch.tensor([1, 2]), x[:, :2]),
}


#: a state of every format and a few shapes (rows of 3: one partial block; of 300: a whole and a partial)
STATES = dict(fmt=st.sampled_from(["8bit", "4bit", "fp8"]), rows=st.integers(1, 5), cols=st.sampled_from([3, 300]),
              seed=st.integers(0, 2**16))


def _operands(fmt: str, rows: int, cols: int, seed: int) -> tuple[qstate.QuantizedState, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return qstate.quantize(torch.randn(rows, cols, generator=gen), fmt), torch.randn(rows, cols, generator=gen)


@settings(max_examples=16)
@given(op=st.sampled_from(sorted(READS)), **STATES)
def test_reads_give_the_values_of_the_same_op(op, fmt, rows, cols, seed):
    q, x = _operands(fmt, rows, cols, seed)
    got, want = READS[op](q, x), READS[op](q.dequantize(), x)
    assert type(got) is torch.Tensor and torch.equal(got, want)


@settings(max_examples=12)
@given(op=st.sampled_from(sorted(WRITES)), **STATES)
def test_in_place_forms_requantize_the_result(op, fmt, rows, cols, seed):
    q, x = _operands(fmt, rows, cols, seed)
    plain = q.dequantize()
    assert WRITES[op](q, x) is q
    assert torch.equal(q.dequantize(), qstate.quantize(WRITES[op](plain, x), fmt).dequantize())


def test_an_out_state_raises_and_is_unchanged():
    q = qstate.quantize(torch.randn(4, 300), "8bit")
    codes = q.codes.clone()
    with pytest.raises(NotImplementedError, match=r"aten\.exp\.out: out= takes plain tensors, got a state \[8bit"):
        torch.exp(torch.randn(4, 300), out=q)
    assert torch.equal(q.codes, codes)


@settings(max_examples=12)
@given(fmt=st.sampled_from(["8bit", "4bit", "fp8"]), rows=st.integers(1, 5), cols=st.integers(1, 300),
       extra_cols=st.integers(0, 300), extra_rows=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_zeros_padded_at_the_ends_keep_every_code(fmt, rows, cols, extra_cols, extra_rows, seed):
    q = qstate.quantize(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)), fmt)
    pad = [0, extra_cols, 0, extra_rows]
    padded = torch.nn.functional.pad(q, pad)
    assert isinstance(padded, qstate.QuantizedState)
    padded.check()
    want = torch.nn.functional.pad(q.dequantize(), pad)
    assert torch.equal(padded.dequantize(), want)
    assert torch.equal(padded.dequantize(), qstate.quantize(want, fmt).dequantize())  # as if encoded padded
