"""The C kernel writes only inside its buffers: every buffer it is given (parameter, gradient, codes,
scales, plain states, decode output) lies inside a larger allocation filled with canary bytes, which
must be unchanged after the call; the results must be those of the same call on ordinary tensors, bit
for bit. Sizes: tiny, odd (4-bit rows of odd length), partial last blocks, empty rows and shards.

A guard that runs without a sanitizer (an out-of-bounds write in an -O3 build, which an ASan build at
another optimization level may not reproduce)."""

from __future__ import annotations

import pytest
import torch

import qstate
from qstate._state import QuantizedState
from qstate.optim._engine.cpu import kernel as _cpu_kernel
from qstate.optim._engine.cpu.state_kernels import CPUStateKernels
from qstate.optim._engine.spec import KernelSpec
from qstate.optim.rules import RULES

pytestmark = pytest.mark.skipif(_cpu_kernel._compiler() is None, reason="no C compiler: the C kernel never runs")

#: (rows, row_len): empty, tiny, odd, one past a vector width or a block, several rows
LAYOUTS = [(1, 0), (0, 5), (1, 1), (1, 3), (1, 63), (1, 65), (1, 257), (3, 129), (5, 7), (2, 1025)]
CANARY = 0xA5
#: canary bytes on each side of a buffer
PAD = 128


class Canaries:
    """Buffers carved out of canary-filled allocations (:meth:`tensor`), checked by :meth:`check`."""

    def __init__(self):
        self.allocations: list[tuple[torch.Tensor, int, int]] = []

    def tensor(self, values: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``values`` with ``PAD`` canary bytes on each side."""
        nbytes = values.numel() * values.element_size()
        raw = torch.full((nbytes + 2 * PAD,), CANARY, dtype=torch.uint8)
        self.allocations.append((raw, PAD, nbytes))
        out = raw[PAD:PAD + nbytes].view(values.dtype).view(values.shape)
        out.copy_(values)
        return out

    def state(self, q: QuantizedState) -> QuantizedState:
        """``q`` with its codes and scales in canary-guarded buffers."""
        return QuantizedState(self.tensor(q.codes), self.tensor(q.scale), q.qmap, format=q.format, signed=q.signed,
                              block_size=q.block_size, row_len=q.row_len, shape=q.shape, dtype=q.dtype,
                              rounding=q.rounding)

    def check(self, what: str) -> None:
        for raw, start, nbytes in self.allocations:
            outside = torch.cat([raw[:start], raw[start + nbytes:]])
            changed = torch.nonzero(outside != CANARY).flatten()
            assert changed.numel() == 0, (f"{what}: the C kernel wrote {changed.numel()} bytes outside a buffer of "
                                          f"{nbytes} bytes (offsets from its canaries' start: {changed[:8].tolist()})")


def _values(rows: int, row_len: int, dtype: torch.dtype, signed: bool, seed: int) -> torch.Tensor:
    x = torch.randn(rows, row_len, generator=torch.Generator().manual_seed(seed))
    return (x if signed else x.abs()).to(dtype)


def _assert_same_state(got: QuantizedState, want: QuantizedState, what: str) -> None:
    assert torch.equal(got.codes, want.codes), f"{what}: codes differ"
    assert torch.equal(got.scale, want.scale), f"{what}: scales differ"


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8"])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_and_decode_write_only_their_buffers(fmt, signed, dtype):
    kernels = CPUStateKernels()
    for block_size in (64, 2048):
        for rows, row_len in LAYOUTS:
            what = f"{fmt} signed={signed} block_size={block_size} {dtype} {rows}x{row_len}"
            values = _values(rows, row_len, dtype, signed, seed=rows * 7 + row_len)
            want = qstate.quantize(values, fmt, signed=signed, block_size=block_size)
            canaries = Canaries()
            q = canaries.state(qstate.quantize(torch.zeros_like(values), fmt, signed=signed, block_size=block_size))
            guarded = canaries.tensor(values)
            assert kernels.encodes(q, guarded) and kernels.decodes(q), what
            kernels.encode_into(q, guarded)
            decoded = kernels.decode(q)
            canaries.check(what)
            _assert_same_state(q, want, what)
            assert torch.equal(guarded, values), f"{what}: the encode wrote its source values"
            torch.testing.assert_close(decoded.view(rows, row_len), want.dequantize(torch.float32), rtol=0, atol=0,
                                       equal_nan=True)


#: AdamW (decoupled weight decay, no amsgrad): two states, the first signed, the second unsigned
_FLAGS = (("amsgrad", False), ("decoupled", True), ("maximize", False))
#: its scalars, in ``scalar_names`` order (lr, grad_unscale, beta1, beta2, eps, weight_decay, bias_correction1,
#: bias_correction2_sqrt, m_bound)
_HYPER = [1e-2, 1.0, 0.9, 0.999, 1e-8, 1e-2, 0.1, 0.0316, 1e30]


def _adam_states(fmt: str, p: torch.Tensor) -> list[torch.Tensor]:
    if fmt == "plain":
        return [torch.zeros_like(p), torch.zeros_like(p)]
    return [qstate.quantize(torch.zeros_like(p), fmt, signed=s.signed, block_size=64)
            for s in RULES["adam"].states(dict(_FLAGS))]


@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_writes_only_its_buffers(fmt, dtype):
    assert len(_HYPER) == len(RULES["adam"].scalar_names)
    hyper = _HYPER
    for rows, row_len in LAYOUTS:
        what = f"adam {fmt} {dtype} {rows}x{row_len}"
        p0 = _values(rows, row_len, dtype, True, seed=1)
        grads = [_values(rows, row_len, dtype, True, seed=2 + k) for k in range(2)]
        ref_p, ref_states = p0.clone(), _adam_states(fmt, p0)
        canaries = Canaries()
        p = canaries.tensor(p0)
        states = [canaries.tensor(s) if fmt == "plain" else canaries.state(s) for s in _adam_states(fmt, p0)]
        spec = KernelSpec.of("adam", _FLAGS, p, states, False)
        assert _cpu_kernel.supports(spec, dtype), what
        for g in grads:
            _cpu_kernel.run(spec, ref_p, g, ref_states, hyper)
            _cpu_kernel.run(spec, p, canaries.tensor(g), states, hyper)
        canaries.check(what)
        assert torch.equal(p, ref_p), f"{what}: param differs"
        for k, (got, want) in enumerate(zip(states, ref_states)):
            if fmt == "plain":
                assert torch.equal(got, want), f"{what}: state {k} differs"
            else:
                _assert_same_state(got, want, f"{what}: state {k}")
