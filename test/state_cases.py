"""Hypothesis strategies and helpers shared by the QuantizedState tests."""

from __future__ import annotations

import itertools
import math

import torch
from hypothesis import strategies as st

import qstate
from qstate.formats import FORMATS
from rounding_keys import param_keys

#: every (format, signed, appearance dtype) the contract suite covers
KINDS = list(itertools.product(sorted(FORMATS), (True, False), (torch.float32, torch.bfloat16)))
KIND_IDS = [f"{f}-{'signed' if s else 'unsigned'}-{str(d).split('.')[-1]}" for f, s, d in KINDS]


@st.composite
def shapes(draw, max_numel: int = 100_000) -> tuple[int, ...]:
    """1-D to 4-D shapes with 1 <= numel <= max_numel (mostly not multiples of a block)."""
    ndim = draw(st.integers(1, 4))
    if ndim == 1:
        return (draw(st.integers(1, max_numel)),)
    dims = [draw(st.integers(1, 300 if ndim == 2 else 40)) for _ in range(ndim)]
    while math.prod(dims) > max_numel:
        dims[dims.index(max(dims))] //= 2
    return tuple(dims)


def block_sizes(fmt: str):
    opts = [None, 32, 64] + ([250] if FORMATS[fmt].bits == 8 else [])
    return st.sampled_from(opts)


def values(shape, seed: int, signed: bool, dtype: torch.dtype) -> torch.Tensor:
    """Random values mixing magnitudes 1e-6 .. 1e3 inside blocks (>= 0 when unsigned)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10 ** (torch.rand(shape, generator=g) * 9 - 6)
    if not signed:
        x = x.abs()
    return x.to(dtype)


def scale_per_element(q: qstate.QuantizedState) -> torch.Tensor:
    """Each element's block scale, in q's logical shape."""
    per_row = q.scale.repeat_interleave(q.block_size, dim=1)[:, : q.row_len]
    return per_row.reshape(-1)[: q.numel()].view(q.shape)


def written_by_update(values: torch.Tensor, fmt: str, *, seed: int, position: int = 0, rounding: str = "nearest",
                      block_size=None, signed: bool = True) -> "qstate.QuantizedState":
    """A fresh state holding ``values`` as an update of the functional optimizers writes the first state
    of the parameter at ``position`` in its call, after ``torch.manual_seed(seed)``: stochastic rounding
    draws by position (``qstate/formats/_rounding.py``) under the parameter's key (:func:`param_keys`),
    hashed with each element's flat index."""
    from qstate.formats import position_hash32, state_key

    torch.manual_seed(seed)
    key = state_key(param_keys(position + 1)[position], 0)
    out = qstate.zeros_like(values, fmt, signed=signed, block_size=block_size, rounding=rounding,
                            dtype=torch.float32)
    draws = position_hash32(key, torch.arange(values.numel()).view(values.shape))
    torch.ops.qstate.copy_with_draws_(out, values, draws)
    return out
