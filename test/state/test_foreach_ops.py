"""torch's ``_foreach_*`` ops over lists of states equal the same ops on the dequantized values.

In place, each state ends holding what ``qstate.quantize`` of the plain result gives (round to
nearest: values and scales exact); out of place, the plain results are exact. And
``torch.optim.AdamW(foreach=True)``, ``Adam`` and ``SGD`` keep stepping with swapped-in 8bit
states, close to the fp32 run.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qstate
from state_cases import values

S = torch.tensor(0.3)  # a 0-dim tensor argument
#: (name, call): ``call(xs, ys, zs)`` runs one foreach op on the list ``xs`` (states, or their plain values
#: for the reference) with plain lists ``ys``, ``zs`` (``zs`` > 0)
CASES: list[tuple[str, Callable]] = [
    ("lerp_.Scalar", lambda x, y, z: torch._foreach_lerp_(x, y, 0.1)),
    ("lerp_.List", lambda x, y, z: torch._foreach_lerp_(x, y, [t.clamp(0, 1) for t in z])),
    ("lerp_.ScalarList", lambda x, y, z: torch._foreach_lerp_(x, y, [0.1 * (i + 1) for i in range(len(x))])),
    ("mul_.Scalar", lambda x, y, z: torch._foreach_mul_(x, 0.9)),
    ("mul_.List", lambda x, y, z: torch._foreach_mul_(x, y)),
    ("mul_.ScalarList", lambda x, y, z: torch._foreach_mul_(x, [0.5 + i for i in range(len(x))])),
    ("mul_.Tensor", lambda x, y, z: torch._foreach_mul_(x, S)),
    ("add_.List alpha", lambda x, y, z: torch._foreach_add_(x, y, alpha=-0.5)),
    ("add_.Scalar", lambda x, y, z: torch._foreach_add_(x, 1e-3)),
    ("sub_.List", lambda x, y, z: torch._foreach_sub_(x, y)),
    ("div_.List", lambda x, y, z: torch._foreach_div_(x, z)),
    ("div_.Scalar", lambda x, y, z: torch._foreach_div_(x, 3.0)),
    ("addcmul_.Scalar", lambda x, y, z: torch._foreach_addcmul_(x, y, z, value=0.1)),
    ("addcmul_.ScalarList", lambda x, y, z: torch._foreach_addcmul_(x, y, z, [0.1 * (i + 1) for i in range(len(x))])),
    ("addcdiv_.Scalar", lambda x, y, z: torch._foreach_addcdiv_(x, y, z, value=-0.2)),
    ("addcdiv_.Tensor", lambda x, y, z: torch._foreach_addcdiv_(x, y, z, torch.tensor([0.1 * (i + 1)
                                                                                         for i in range(len(x))]))),
    ("maximum_.List", lambda x, y, z: torch._foreach_maximum_(x, y)),
    ("clamp_min_.Scalar", lambda x, y, z: torch._foreach_clamp_min_(x, -0.1)),
    ("clamp_max_.Scalar", lambda x, y, z: torch._foreach_clamp_max_(x, 0.1)),
    ("neg_", lambda x, y, z: torch._foreach_neg_(x)),
    ("zero_", lambda x, y, z: torch._foreach_zero_(x)),
    ("copy_", lambda x, y, z: torch._foreach_copy_(x, y)),
    ("sqrt", lambda x, y, z: torch._foreach_sqrt(x)),  # of unsigned states
    ("mul.Scalar", lambda x, y, z: torch._foreach_mul(x, 2.0)),
    ("add.List", lambda x, y, z: torch._foreach_add(x, y, alpha=2.0)),
    ("neg", lambda x, y, z: torch._foreach_neg(x)),
]


@pytest.mark.parametrize("name, call", CASES, ids=[name for name, _ in CASES])
@settings(max_examples=8)
@given(fmt=st.sampled_from(["8bit", "4bit", "fp8"]), rows=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       cols=st.sampled_from([7, 300, 512]), seed=st.integers(0, 2**16))
def test_foreach_on_states_equals_the_op_on_dequantized_values(name, call, fmt, rows, cols, seed):
    signed = name != "sqrt"
    states = [qstate.quantize(values((r, cols), seed + i, signed, torch.float32), fmt, signed=signed)
              for i, r in enumerate(rows)]
    plain = [s.dequantize() for s in states]
    ys = [values((r, cols), seed + 100 + i, True, torch.float32) for i, r in enumerate(rows)]
    zs = [values((r, cols), seed + 200 + i, False, torch.float32) + 0.5 for i, r in enumerate(rows)]
    got = call(states, ys, zs)
    want = call(plain, ys, zs)
    if name.split(".")[0].endswith("_"):  # in place: each state holds its kind's encoding of the plain result
        for i, (s, v) in enumerate(zip(states, plain)):
            ref = qstate.quantize(v, fmt, signed=signed, block_size=s.block_size)
            assert isinstance(s, qstate.QuantizedState), (name, i)
            # values and scales (a 4-bit row's padding half byte may differ where zero_ wrote it)
            assert torch.equal(s.dequantize(), ref.dequantize()) and torch.equal(s.scale, ref.scale), (name, i)
    else:
        assert all(type(g) is torch.Tensor for g in got), name
        assert all(torch.equal(g, w) for g, w in zip(got, want)), name


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
                                  lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True, amsgrad=True),
                                  lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True)],
                         ids=["AdamW", "Adam-amsgrad", "SGD"])
def test_torch_foreach_optimizers_step_with_swapped_in_8bit_states(make):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 300)), torch.nn.Parameter(torch.randn(40, 256))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref_opt = make(ps), make(ref)
    for step in range(4):
        for p, r in zip(ps, ref):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.clone()
        if step == 1:  # states exist after one step: swap in 8bit ones holding the same values
            for p in ps:
                st = opt.state[p]
                for key in [k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() == 2]:
                    st[key] = qstate.quantize(st[key], "8bit", signed=key not in ("exp_avg_sq", "max_exp_avg_sq"))
        opt.step()
        ref_opt.step()
    for p, r in zip(ps, ref):
        assert all(isinstance(v, qstate.QuantizedState) for v in opt.state[p].values() if v.dim() == 2)
        # three steps on 8bit states: the parameters stay within a few lr of the fp32 run's
        torch.testing.assert_close(p.detach(), r.detach(), atol=3e-2, rtol=0)


def test_dequantize_gives_plain_values_of_plain_and_dtensor_states():
    import warnings

    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    full = values((129, 300), 0, True, torch.float32)
    q = qstate.quantize(full, "8bit")
    assert type(qstate.dequantize(q)) is torch.Tensor and torch.equal(qstate.dequantize(q), q.dequantize())
    assert qstate.dequantize(q, torch.bfloat16).dtype == torch.bfloat16
    assert qstate.dequantize(full) is full
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("fake", rank=0, world_size=3)
    try:
        with LocalTensorMode(3), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            d = qstate.distributed.quantize_dtensor(distribute_tensor(full, init_device_mesh("cpu", (3,)),
                                                                      [Shard(0)]), "8bit")
            with CommDebugMode() as comms:
                plain = qstate.dequantize(d)
            assert comms.get_total_counts() == 0
            assert isinstance(plain, DTensor) and plain.placements == d.placements and plain.shape == d.shape
            assert not isinstance(plain.to_local()._local_tensors[0], qstate.QuantizedState)
            assert torch.equal(plain.full_tensor(), q.dequantize())
    finally:
        if started:
            dist.destroy_process_group()
