"""Every optimizer of the table (``optim_db.py``) against its plain-PyTorch reference, and under FSDP2.

* Single process: each entry x each of its inputs x every state format steps small seeded parameters
  (uneven rows and blocks, a 1-D bias) next to the entry's reference, op by op (``compile=False``;
  with the fused kernels, ``compile=True``, in the exhaustive run), and ends within the entry's
  tolerance for that format; its states have the reference's names, and the quantized ones are
  where the policy says.
* FSDP2: each entry's first input x {8bit, 4bit, fp8, fp32} states on a ``fully_shard``-ed model in
  2 and 3 gloo processes equals the unsharded run of the same optimizer and format bit for bit
  (``test_optim_fsdp.py``'s parity run, whose module docstring says why it is exact); one spawn per
  world size runs every entry.
* The table covers every public optimizer class and every state format.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch

import qstate
import qstate.optim
from qstate.formats import FORMATS

from dist_utils import run_distributed
from optim_db import STEPS, OptimizerInfo, OptimizerInput, optim_db
from test_optim_cases import clone_params, grads, params
from test_optim_fsdp import Config, parity_body

#: a matrix with rows that are not whole blocks, a taller one, a bias (plain states at any size)
SHAPES = [(33, 71), (129, 64), (7,)]
MIN_QUANTIZE_NUMEL = 64
FSDP_FORMATS = ["8bit", "4bit", "fp8", "fp32"]


def _reference_cases():
    for info in optim_db:
        for inp in info.inputs:
            for fmt in qstate.optim.STATE_FORMATS():
                yield pytest.param(info, inp, fmt, id=f"{info.name}-{inp.desc}-{fmt}")


def _readable(state: torch.Tensor) -> torch.Tensor:
    return state.dequantize() if isinstance(state, qstate.QuantizedState) else state.float()


@pytest.mark.filterwarnings("ignore:.*is a weak combination")  # Lion with 4-bit states warns, as documented
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.exhaustive)],
                         ids=["eager", "fused"])
@pytest.mark.parametrize("info, inp, fmt", list(_reference_cases()))
def test_matches_reference(info: OptimizerInfo, inp: OptimizerInput, fmt: str, compile: bool):
    ref_params = params(SHAPES)
    ours = clone_params(ref_params)
    ref = info.reference(ref_params, **inp.kwargs)
    opt = info.optim_cls(ours, **inp.kwargs, state_format=fmt, min_quantize_numel=MIN_QUANTIZE_NUMEL,
                         compile=compile)
    for step in range(STEPS):
        for p, q, g in zip(ref_params, ours, grads(ref_params, step, mixed=False)):
            p.grad, q.grad = g, g.clone()
        ref.step()
        opt.step()

    tol = (info.fused_tolerances if compile else info.tolerances)[fmt]
    unit = inp.kwargs["lr"] * STEPS
    quantized = 0
    for shape, p, q in zip(SHAPES, ref_params, ours):
        what = f"{info.name}({inp.desc}, {fmt}{', compiled' if compile else ''}) param {shape}"
        diff = (q.detach() - p.detach()).abs()
        if tol.exact:
            assert torch.equal(q, p), f"{what}: max |diff| {diff.max().item():.3g}, expected equal"
        assert diff.max() <= tol.param_max * unit, \
            f"{what}: max |diff| {diff.max().item() / unit:.3g} lr*steps > {tol.param_max}"
        assert diff.mean() <= tol.param_mean * unit, \
            f"{what}: mean |diff| {diff.mean().item() / unit:.3g} lr*steps > {tol.param_mean}"
        ref_state, state = ref.state[p], opt.state[q]
        names = sorted(k for k in ref_state if k != "step")
        assert sorted(k for k in state if k != "step") == names, f"{what}: states {sorted(state)}, reference {names}"
        for name in names:
            want, got = ref_state[name], _readable(state[name])
            error = ((got - want).abs().max() / want.abs().max().clamp(min=torch.finfo(want.dtype).tiny)).item()
            assert error <= tol.state, f"{what} state {name!r}: max |diff| {error:.3g} of max |ref| > {tol.state}"
            quantized += isinstance(state[name], qstate.QuantizedState)
    matrices = sum(qstate.wants_quantized(p, MIN_QUANTIZE_NUMEL) for p in ref_params)
    want = inp.matrix_states * matrices if fmt in FORMATS else 0
    assert quantized == want, f"{info.name}({inp.desc}, {fmt}): {quantized} quantized states, expected {want}"


def fsdp_body(rank: int, world_size: int, configs: list[Config]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*is a weak combination")  # Lion with 4-bit states warns, as documented
        parity_body(rank, world_size, configs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_matches_unsharded_run(world_size):
    configs = [Config(info.name, fmt) for info in optim_db for fmt in FSDP_FORMATS]
    run_distributed(fsdp_body, world_size, configs)


# ------------------------------------------------------------------ the table itself
def test_table_covers_every_public_optimizer():
    public = {obj for name in qstate.optim.__all__ if inspect.isclass(obj := getattr(qstate.optim, name))
              and issubclass(obj, torch.optim.Optimizer) and obj is not qstate.optim.QuantizedOptimizer}
    covered = [info.optim_cls for info in optim_db]
    assert len(covered) == len(set(covered)), f"optim_db: an optimizer has two entries: {covered}"
    missing = sorted(cls.__name__ for cls in public - set(covered))
    assert not missing, f"optim_db: no entry for {missing}"


@pytest.mark.parametrize("info", optim_db, ids=lambda info: info.name)
def test_entry_is_complete(info: OptimizerInfo):
    for tolerances in (info.tolerances, info.fused_tolerances):
        assert sorted(tolerances) == sorted(qstate.optim.STATE_FORMATS()), \
            f"{info.name}: tolerances for {sorted(tolerances)}, state formats {qstate.optim.STATE_FORMATS()}"
    assert info.inputs, f"{info.name}: no inputs"
    # its own arguments and the state policy's keywords (test_optim_policy.py: every optimizer takes them)
    accepted = {*inspect.signature(info.optim_cls).parameters,
                *(f.name for f in dataclasses.fields(qstate.optim.StatePolicy))}
    for inp in info.inputs:
        unknown = sorted(set(inp.kwargs) - set(accepted))
        assert not unknown, f"{info.name}({inp.desc}): {unknown} are not arguments of {info.name}"
        assert "lr" in inp.kwargs, f"{info.name}({inp.desc}): tolerances are in units of lr: give one"
