"""Gradient scaling: torch's fused-optimizer AMP protocol on quantized steps, FSDP2 on gloo.

References: the same optimizer stepped on gradients unscaled beforehand
(bit-identical: power-of-two scales), unscaled fp16-autocast training, and
states snapshotted before a skipped step.
"""

from __future__ import annotations

import json
import os

import expecttest
import pytest
import torch
import torch.nn as nn

import qstate
import qstate.amp
import qstate.optim
from dist_utils import run_distributed

SCALE = 2.0**16


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(65, 130, generator=g)), nn.Parameter(torch.randn(7, generator=g))]


def _set_grads(ps: list[nn.Parameter], step: int, scale: float = 1.0) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * scale


def _snapshot(opt: torch.optim.Optimizer, ps: list[nn.Parameter]) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in ps]
    for p in ps:
        for v in opt.state.get(p, {}).values():
            if isinstance(v, qstate.QuantizedState):
                out += [v.codes.clone(), v.scale.clone()]
            else:
                out.append(v.clone())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("fmt", ["8bit", "fp32"])
@pytest.mark.parametrize("compile", [False, True])
def test_fused_unscale_equals_unscaled_gradients(fmt, compile):
    make = lambda ps: qstate.optim.AdamW(ps, lr=1e-2, state_format=fmt, min_quantize_numel=0, compile=compile)
    scaled, plain = _params(), _params()
    opt_s, opt_p = make(scaled), make(plain)
    for step in range(3):
        _set_grads(scaled, step, SCALE)
        _set_grads(plain, step)
        opt_s.step(grad_scale=torch.tensor(SCALE), found_inf=torch.tensor(0.0))
        opt_p.step()
        assert _same(_snapshot(opt_s, scaled), _snapshot(opt_p, plain))
    # the gradient is read, never rewritten
    assert torch.equal(scaled[0].grad, plain[0].grad * SCALE)


@pytest.mark.parametrize("cls", [qstate.optim.AdamW, qstate.optim.Lion, qstate.optim.SGD])
def test_found_inf_leaves_params_states_and_steps_bit_identical(cls):
    kw = {"momentum": 0.9} if cls is qstate.optim.SGD else {}
    ps = _params()
    opt = cls(ps, lr=1e-2, state_format="8bit", min_quantize_numel=0, **kw)
    _set_grads(ps, 0)
    opt.step(found_inf=torch.tensor(1.0))  # skipped first step: no state is created
    assert not opt.state
    opt.step()
    before = _snapshot(opt, ps)
    _set_grads(ps, 1)
    ps[0].grad[3, 4] = float("inf")
    opt.found_inf, opt.grad_scale = torch.tensor(1.0), torch.tensor(SCALE)  # the attributes GradScaler sets
    opt.step()
    assert _same(_snapshot(opt, ps), before)


def test_torch_grad_scaler_uses_the_fused_protocol():
    ps, ref = _params(), _params()
    opt = qstate.optim.AdamW(ps, lr=1e-2, state_format="8bit", min_quantize_numel=0)
    opt_ref = qstate.optim.AdamW(ref, lr=1e-2, state_format="8bit", min_quantize_numel=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    for step in range(3):
        scaler.scale(torch.ones(()))  # as scaler.scale(loss).backward() would
        _set_grads(ps, step, scaler.get_scale())
        _set_grads(ref, step)
        scaler.step(opt)
        scaler.update()
        opt_ref.step()
    assert _same(_snapshot(opt, ps), _snapshot(opt_ref, ref))
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


def test_qstate_scaler_equals_torch_scaler_on_plain_tensors():
    # no DTensor: qstate.amp.GradScaler checks locally, as torch.amp.GradScaler does
    runs = {}
    for name, make in (("torch", torch.amp.GradScaler), ("qstate", qstate.amp.GradScaler)):
        ps = _params()
        opt = qstate.optim.AdamW(ps, lr=1e-2, state_format="8bit", min_quantize_numel=0)
        scaler = make("cpu", init_scale=SCALE, growth_interval=2)
        scales = []
        for step in range(5):
            scaler.scale(torch.ones(()))
            _set_grads(ps, step, scaler.get_scale())
            if step == 2:
                ps[1].grad[0] = float("nan")
            if step == 3:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs[name] = (_snapshot(opt, ps), scales)
    assert _same(runs["qstate"][0], runs["torch"][0])
    # grows every 2 clean steps, halves at the NaN
    assert runs["qstate"][1] == runs["torch"][1] == [SCALE, 2 * SCALE, SCALE, SCALE, 2 * SCALE]


# ------------------------------------------------------------------ FSDP2, gloo
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(33, 65), nn.ReLU(), nn.Linear(65, 7))


def _fsdp(model: nn.Module, offload: bool) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    return fully_shard(model, **kw)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 33, generator=g)
    return x, x[:, :7].argmax(dim=1)  # learnable labels


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    with torch.autocast("cpu", dtype=torch.float16):
        return nn.functional.cross_entropy(model(x).float(), y)


def _scaler(kind: str):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    make = {"torch": torch.amp.GradScaler, "sharded": ShardedGradScaler, "qstate": qstate.amp.GradScaler}[kind]
    return make("cpu", init_scale=2.0**10)


def _local_snapshot(model: nn.Module, opt) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(p.to_local().clone())
        for v in opt.state.get(p, {}).values():
            v = v.to_local() if hasattr(v, "to_local") else v
            out += [v.codes.clone(), v.scale.clone()] if isinstance(v, qstate.QuantizedState) else [v.clone()]
    return out


def _collectives(fn) -> str:
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        fn()
    return " ".join(f"{op}x{n}" for op, n in sorted(comm.get_comm_counts().items(), key=str)) or "none"


def _optimizer(model: nn.Module):
    return qstate.optim.AdamW(model.parameters(), lr=1e-2, state_format="8bit", min_quantize_numel=100,
                              compile=False)


def _train(model: nn.Module, opt, scaler, steps: int, clip: float | None = None) -> list[float]:
    losses = []
    for step in range(steps):
        loss = _loss(model, step)
        losses.append(loss.item())
        if scaler is None:
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        else:
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()
    return losses


def scaling_body(rank: int, world_size: int, out: str) -> None:
    report = {}
    for kind in ("torch", "sharded", "qstate"):
        for offload in (False, True):
            model = _fsdp(_model(), offload)
            opt = _optimizer(model)
            scaler = _scaler(kind)
            _train(model, opt, scaler, 3)
            # an inf in one rank's gradient skips the step on every rank
            scaler.scale(_loss(model, 3)).backward()
            if rank == world_size - 1:
                next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
            before, scale = _local_snapshot(model, opt), scaler.get_scale()
            n_check = _collectives(lambda: scaler.step(opt))
            scaler.update()
            opt.zero_grad()
            assert _same(_local_snapshot(model, opt), before), (kind, offload)
            assert scaler.get_scale() == scale * 0.5, (kind, offload, scaler.get_scale(), scale)
            # unscale_ before clipping (the check runs in unscale_, step only consumes found_inf)
            scaler.scale(_loss(model, 4)).backward()
            n_unscale = _collectives(lambda: scaler.unscale_(opt))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            n_step = _collectives(lambda: scaler.step(opt))
            scaler.update()
            opt.zero_grad()
            report[f"{kind} offload={offload}"] = [n_check, n_unscale, n_step]

    # 20 scaled steps match 20 unscaled steps within fp16 noise, with and without clipping
    for clip in (None, 0.5):
        ref_model = _fsdp(_model(), False)
        ref = _train(ref_model, _optimizer(ref_model), None, 20, clip)
        model = _fsdp(_model(), False)
        got = _train(model, _optimizer(model), qstate.amp.GradScaler("cpu", init_scale=2.0**10), 20, clip)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=2e-3, atol=2e-3)
        assert sum(got[-5:]) < 0.9 * sum(got[:5]), got  # it trains
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)


class TestFSDP2(expecttest.TestCase):
    def test_scalers_skip_halve_and_reduce_found_inf(self):
        out = os.path.join(self.tmp, "report.json")
        run_distributed(scaling_body, 2, out)
        with open(out) as f:
            report = json.load(f)
        # collectives of [step with its own check, unscale_, step after unscale_]
        self.assertExpectedInline("\n".join(f"{k}: {' | '.join(v)}" for k, v in report.items()), """\
torch offload=False: c10d_functional.all_reducex1 | c10d_functional.all_reducex1 | none
torch offload=True: c10d_functional.all_reducex1 | c10d_functional.all_reducex1 | none
sharded offload=False: c10d_functional.all_reducex1 | c10d.allreduce_x1 c10d_functional.all_reducex1 | none
sharded offload=True: c10d_functional.all_reducex1 | c10d.allreduce_x1 c10d_functional.all_reducex1 | none
qstate offload=False: c10d_functional.all_reducex1 | c10d_functional.all_reducex1 | none
qstate offload=True: c10d_functional.all_reducex1 | c10d_functional.all_reducex1 | none""")

    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path):
        self.tmp = str(tmp_path)
