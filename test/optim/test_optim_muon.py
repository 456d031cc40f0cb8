"""``qstate.optim.Muon``: torch.optim.Muon's results with float32 states, quantized momentum, routing of
non-matrix parameters to AdamW, bad input, state_dict resumption, and FSDP2 on 2 and 3 gloo ranks.

What is exact, and why:

* float32 states and float32 parameters: every op is ``torch.optim.Muon``'s, in its order, so
  the parameters equal its parameters (compared with ``assert_close``'s float tolerance);
* quantized momentum: the optimizer equals a plain-PyTorch Muon whose momentum buffer is
  replaced each step by ``qstate.quantize(buffer, fmt, rounding=...).dequantize()`` and whose
  Newton-Schulz step is torch's own function: writing into a state encodes as ``quantize`` does,
  and stochastic rounding is a function of each value, so bit for bit;
* AdamW groups run ``qstate.optim.AdamW``'s update: bit for bit that optimizer's results;
* FSDP2: every rank computes the same full update matrix from the same values, so parameters
  and states (codes and scales) equal the unsharded run's bit for bit (the gradient of the
  unsharded run reproduces gloo's average, as in ``test_optim_fsdp.py``). Each Muon parameter
  costs one all-gather per step, AdamW parameters none, and no step after the first calls
  ``DTensor.to_local``/``from_local``; ``torch.distributed.checkpoint``'s optimizer state dict
  resumes the sharded run bit for bit.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch
import torch.nn as nn

import qstate
import qstate.optim
from qstate.optim.muon import Muon, adjust_lr, muon

from dist_utils import run_distributed
from state_cases import written_by_update
from test_optim_fsdp import _assert_equal, _batch, _full, _loss, _model, _no_local_tensor_access

QUANTIZED = ["8bit", "4bit", "fp8"]
SHAPES = [(8, 5), (4, 12), (6, 6)]  # tall (Newton-Schulz on the transpose), wide, square


def _params(shapes=SHAPES, seed=0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _grads(params, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


def _clone(params) -> list[nn.Parameter]:
    return [nn.Parameter(p.detach().clone()) for p in params]


def _adjust_lr_fns() -> list:
    fns = [None, "original", "match_rms_adamw"]
    try:  # torch 2.14 added "spectral_unclamped"
        torch.optim.Muon([nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn="spectral_unclamped")
        fns.append("spectral_unclamped")
    except ValueError:
        pass
    return fns


# ------------------------------------------------------------------ float32 states: torch.optim.Muon
@pytest.mark.parametrize("adjust_lr_fn", _adjust_lr_fns())
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fp32_states_match_torch_muon(nesterov, weight_decay, adjust_lr_fn):
    ref_params = _params()
    params = _clone(ref_params)
    kwargs = dict(lr=0.02, weight_decay=weight_decay, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    ref = torch.optim.Muon(ref_params, **kwargs)
    opt = Muon(params, **kwargs, state_format="fp32")
    for step in range(4):
        for p, q, g in zip(params, ref_params, _grads(params, step)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
        assert int(opt.state[p]["step"]) == 4


def test_defaults_are_torch_muons():
    import inspect

    ours = inspect.signature(Muon).parameters
    for name, param in inspect.signature(torch.optim.Muon).parameters.items():
        assert name in ours, name
        assert ours[name].default == param.default, f"{name}: {ours[name].default} != {param.default}"


def test_adjust_lr_values():
    assert adjust_lr(0.1, None, (8, 2)) == adjust_lr(0.1, "original", (8, 2)) == 0.1 * 2.0
    assert adjust_lr(0.1, "original", (2, 8)) == 0.1
    assert adjust_lr(0.1, "match_rms_adamw", (2, 8)) == 0.1 * 0.2 * math.sqrt(8)
    assert adjust_lr(0.1, "spectral_unclamped", (2, 8)) == 0.1 * 0.5


# ------------------------------------------------------------------ quantized momentum
def _reference_muon(params, steps: int, fmt: str, rounding: str, block_size: int, *, lr=0.02, weight_decay=0.1,
                    momentum=0.95, nesterov=True) -> list[torch.Tensor]:
    """Muon in plain PyTorch, the buffer replaced by its quantization each step; torch's Newton-Schulz.

    Stochastic rounding draws as the functional form's update writes (``written_by_update``, the CPU
    generator seeded ``100 + step`` here)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    params = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        for i, (p, g) in enumerate(zip(params, _grads(params, step))):
            buf = bufs[i].lerp(g, 1 - momentum)
            update = g.lerp(buf, momentum) if nesterov else buf
            bufs[i] = written_by_update(buf, fmt, seed=100 + step, position=i, rounding=rounding,
                                        block_size=block_size).dequantize()
            update = _zeropower_via_newtonschulz(update, (3.4445, -4.775, 2.0315), 5, 1e-7)
            p.mul_(1 - lr * weight_decay)
            p.add_(update, alpha=-lr * math.sqrt(max(1, p.shape[0] / p.shape[1])))
    return params + bufs


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantized_momentum_matches_reference(fmt, rounding, nesterov):
    # the functional form (its keys from the default CPU generator, seeded per step as the reference does)
    # against plain PyTorch; Muon's class form against the functional one below
    if rounding == "stochastic" and fmt == "fp8":
        pytest.skip("fp8 states round to nearest only")
    block_size = 32 if fmt == "4bit" else 64
    params = _params([(8, 40), (40, 8), (6, 70)])
    want = _reference_muon(params, 4, fmt, rounding, block_size, nesterov=nesterov)
    bufs = [qstate.zeros_like(p, fmt, block_size=block_size, rounding=rounding, dtype=torch.float32) for p in params]
    with torch.no_grad():
        for step in range(4):
            torch.manual_seed(100 + step)
            muon(params, _grads(params, step), bufs, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov,
                 ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7, adjust_lr_fn=None)
    for got, ref in zip(list(params) + [b.dequantize() for b in bufs], want):
        assert torch.equal(got.detach(), ref), f"max |diff| {(got.detach() - ref).abs().max().item()}"


@pytest.mark.parametrize("fmt,rounding", [("4bit", None), ("8bit", "nearest")])
def test_muon_class_keeps_the_policy_and_matches_the_functional_form(fmt, rounding):
    # round to nearest: the class and the functional form agree bit for bit (stochastic draws differ in
    # their keys' stream: the class's is its own, seeded by seed, group and step)
    block_size = 32
    params = _params([(8, 40), (40, 8), (6, 70)])
    ref = _clone(params)
    opt = Muon(params, lr=0.02, state_format=fmt, block_size=block_size, state_rounding=rounding,
               min_quantize_numel=0)
    ref_bufs = [qstate.zeros_like(p, fmt, block_size=block_size, rounding="nearest", dtype=torch.float32)
                for p in ref]
    for step in range(3):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
        if rounding == "nearest":
            with torch.no_grad():
                muon(ref, _grads(ref, step), ref_bufs, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                     ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7, adjust_lr_fn=None)
    for p in params:
        b = opt.state[p]["momentum_buffer"]
        assert isinstance(b, qstate.QuantizedState)
        assert (b.format, b.signed, b.block_size, b.rounding) == (fmt, True, block_size, rounding or "stochastic")
    if rounding == "nearest":
        for p, q, qb in zip(params, ref, ref_bufs):
            assert torch.equal(p.detach(), q.detach())
            assert torch.equal(opt.state[p]["momentum_buffer"].codes, qb.codes)


def test_4bit_momentum_rounds_stochastically_by_default():
    p = _params([(8, 64)])[0]
    p.grad = torch.randn_like(p)
    opt = Muon([p], state_format="4bit", min_quantize_numel=0)
    opt.step()
    assert opt.state[p]["momentum_buffer"].rounding == "stochastic"
    small = nn.Parameter(torch.randn(4, 4))
    small.grad = torch.randn_like(small)
    opt = Muon([small], state_format="4bit")  # under min_quantize_numel: a float32 buffer
    opt.step()
    assert type(opt.state[small]["momentum_buffer"]) is torch.Tensor
    assert opt.state[small]["momentum_buffer"].dtype == torch.float32


@pytest.mark.parametrize("fmt", ["fp32", "bf16"] + QUANTIZED)
def test_least_squares_converges(fmt):
    """min ||W X - Y||^2 over a 16 x 32 W, lr decaying: every format gets close to the float32 run's loss."""
    g = torch.Generator().manual_seed(0)
    x, w_true = torch.randn(32, 128, generator=g), torch.randn(16, 32, generator=g)
    y = w_true @ x

    def train(state_format):
        w = nn.Parameter(torch.zeros(16, 32))
        opt = Muon([w], lr=0.5, weight_decay=0.0, state_format=state_format, min_quantize_numel=0)
        schedule = torch.optim.lr_scheduler.ExponentialLR(opt, 0.93)
        losses = []
        for _ in range(60):
            loss = (w @ x - y).square().mean()
            w.grad = torch.autograd.grad(loss, w)[0]
            opt.step()
            schedule.step()
            losses.append(loss.item())
        return losses

    losses, ref = train(fmt), train("fp32")
    assert losses[-1] < 0.05 * losses[0], f"{fmt}: loss {losses[0]:.3g} -> {losses[-1]:.3g}"
    assert losses[-1] < 1.5 * ref[-1], f"{fmt}: final loss {losses[-1]:.3g}, fp32 states {ref[-1]:.3g}"


def test_tensor_lr_bf16_params_and_named_parameters():
    params = _params([(8, 40), (40, 8)])
    ref = _clone(params)
    opt = Muon(params, lr=torch.tensor(2.0**-6), state_format="8bit", min_quantize_numel=0)
    ref_opt = Muon(ref, lr=2.0**-6, state_format="8bit", min_quantize_numel=0)
    _train(opt, params, 2)
    _train(ref_opt, ref, 2)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
    model = nn.Sequential(nn.Linear(40, 8)).bfloat16()
    opt = Muon(model.named_parameters(), lr=0.02, state_format="4bit", min_quantize_numel=0)
    assert [g["param_names"] for g in opt.param_groups] == [["0.weight"], ["0.bias"]]
    before = model[0].weight.detach().clone()
    _loss(model(torch.randn(3, 40).bfloat16())).backward()
    opt.step()
    assert model[0].weight.dtype == torch.bfloat16 and not torch.equal(model[0].weight, before)
    assert opt.state[model[0].weight]["momentum_buffer"].format == "4bit"


def test_grad_scaler_unscales_for_muon():
    params, ref = _params(), _params()
    opt = Muon(params, state_format="8bit", min_quantize_numel=0)
    ref_opt = Muon(ref, state_format="8bit", min_quantize_numel=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step in range(2):
        scaler.scale(torch.ones(()))  # the scaler's scale exists from the first scale() on
        for p, q, g in zip(params, ref, _grads(params, step)):
            p.grad, q.grad = g * 2.0**10, g.clone()
        if step == 1:
            params[0].grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        if step == 0:
            ref_opt.step()
    for p, q in zip(params, ref):  # the second step, with an inf, was skipped
        assert torch.equal(p, q)


# ------------------------------------------------------------------ routing to AdamW
def _mixed_params(seed=0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(16, 40), (16,), (40, 16), (3, 4, 10), ()]
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("fmt", ["fp32", "8bit", "4bit"])
def test_non_matrix_params_take_adamw(fmt, compile):
    params = _mixed_params()
    matrices = _clone([p for p in params if p.ndim == 2])
    others = _clone([p for p in params if p.ndim != 2])
    adamw = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    policy = dict(state_format=fmt, min_quantize_numel=0, compile=compile)
    opt = Muon(params, lr=0.02, **{f"adamw_{k}": v for k, v in adamw.items()}, **policy)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert [len(g["params"]) for g in opt.param_groups] == [2, 3]
    assert opt.param_groups[1]["lr"] == 3e-3 and opt.param_groups[1]["betas"] == (0.8, 0.95)
    ref_muon = Muon(matrices, lr=0.02, **policy)
    # Muon's AdamW parameters are its second group (seed 0): the same rounding stream as this one's second
    ref_adamw = qstate.optim.AdamW([{"params": [nn.Parameter(torch.zeros(1))]}, {"params": others}], **adamw,
                                   **policy, seed=0)
    ours = [p for p in params if p.ndim == 2] + [p for p in params if p.ndim != 2]
    for step in range(3):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        for p, q in zip(ours, matrices + others):
            q.grad = p.grad.clone()
        opt.step()
        ref_muon.step()
        ref_adamw.step()
    for p, q in zip(ours, matrices + others):
        assert torch.equal(p, q)
        ref_state = (ref_muon if q.ndim == 2 else ref_adamw).state[q]
        assert sorted(opt.state[p]) == sorted(ref_state)
        for key in ref_state:
            _assert_equal(opt.state[p][key], ref_state[key], f"{tuple(p.shape)} {key}")


def test_use_muon_groups_and_adamw_group_options():
    emb, hidden, bias = nn.Parameter(torch.randn(10, 8)), nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))
    opt = Muon([{"params": [hidden, bias], "lr": 0.05, "adamw_lr": 1e-4},
                {"params": [emb], "use_muon": False, "betas": (0.9, 0.95)}],
               adamw_lr=2e-3, adamw_weight_decay=0.0, state_format="fp32")
    groups = [(g["use_muon"], len(g["params"]), g["lr"]) for g in opt.param_groups]
    assert groups == [(True, 1, 0.05), (False, 1, 1e-4), (False, 1, 2e-3)]
    assert opt.param_groups[2]["betas"] == (0.9, 0.95) and opt.param_groups[2]["weight_decay"] == 0.0
    schedule = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for p in (emb, hidden, bias):
        p.grad = torch.ones_like(p)
    opt.step()
    assert sorted(opt.state[emb]) == ["exp_avg", "exp_avg_sq", "step"]
    assert sorted(opt.state[hidden]) == ["momentum_buffer", "step"]
    # an lr_scheduler scales every group, AdamW's included
    schedule.step()
    assert [g["lr"] for g in opt.param_groups] == [0.025, 5e-5, 1e-3]


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, match", [
    (dict(state_format="3bit"), r"unknown state_format '3bit'; expected one of \["),
    (dict(adjust_lr_fn="sqrt"), r"adjust_lr_fn must be None or one of .*got 'sqrt'"),
    (dict(ns_steps=100), r"ns_steps must be an int in \[0, 100\), got 100"),
    (dict(ns_coefficients=(1.0, 2.0)), r"ns_coefficients must be three values"),
    (dict(lr=-1.0), r"invalid learning rate: -1.0"),
    (dict(momentum=-0.5), r"invalid momentum value: -0.5"),
    (dict(adamw_betas=(0.9, 1.0)), r"invalid betas \(0.9, 1.0\)"),
    (dict(state_format="fp8", state_rounding="stochastic"), r"cannot use state_rounding='stochastic'"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon([nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_non_matrix_param_in_a_muon_group_raises_naming_it():
    params = [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(3, 4, 5))]
    with pytest.raises(ValueError, match=r"Muon: param 1 \(shape \(3, 4, 5\), torch.float32\): a Muon group "
                                         r"\(use_muon=True\) takes 2-D parameters, got 3-D"):
        Muon([{"params": params, "use_muon": True}])
    opt = Muon([params[0]], state_format="fp32")
    with pytest.raises(ValueError, match=r"param 1 \(shape \(3, 4, 5\)"):
        opt.add_param_group({"params": [params[1]], "use_muon": True})
    with pytest.raises(ValueError, match=r"invalid betas"):  # the Muon half is not kept either
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))],
                             "adamw_betas": (2.0, 0.9)})
    with pytest.raises(TypeError, match="use_muon must be a bool"):
        opt.add_param_group({"params": [params[1]], "use_muon": "yes"})
    assert len(opt.param_groups) == 1 and opt._n_params == 1


def test_bad_gradients_raise_before_any_write():
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    opt = Muon([a, b], state_format="fp32")
    a.grad = torch.randn(4, 4)
    b.grad = torch.randn(4, 4).to_sparse()
    before = a.detach().clone()
    with pytest.raises(TypeError, match=r"param 1 \(shape \(4, 4\), torch.float32\): sparse gradients"):
        opt.step()
    assert torch.equal(a, before)
    with pytest.raises(ValueError, match=r"param 0 \(shape \(4, 4\), torch.float32\): expected a gradient of shape \(4, 4\), got \(4, 3\)"):
        muon([a], [torch.zeros(4, 3)], [torch.zeros(4, 4)], lr=0.1, weight_decay=0.0, momentum=0.9, nesterov=True,
             ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, eps=1e-7, adjust_lr_fn=None)
    assert torch.equal(a, before)


# ------------------------------------------------------------------ state_dict
def _train(opt, params, steps, first=0):
    for step in range(first, first + steps):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()


@pytest.mark.parametrize("fmt", ["fp32", "bf16"] + QUANTIZED)
def test_state_dict_resume_is_bit_identical(fmt):
    policy = dict(state_format=fmt, min_quantize_numel=0, compile=False)
    whole = _mixed_params()
    opt = Muon(whole, lr=0.02, **policy)
    _train(opt, whole, 6)

    first = _mixed_params()
    opt1 = Muon(first, lr=0.02, **policy)
    _train(opt1, first, 3)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": opt1.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [nn.Parameter(p.clone()) for p in saved["params"]]
    opt2 = Muon(resumed, lr=0.02, **policy)
    opt2.load_state_dict(saved["opt"])
    _train(opt2, resumed, 3, first=3)
    for p, q in zip(resumed, whole):
        assert torch.equal(p, q)
        assert sorted(opt2.state[p]) == sorted(opt.state[q])
        for key in opt.state[q]:
            _assert_equal(opt2.state[p][key], opt.state[q][key], f"{tuple(p.shape)} {key}")


def test_load_state_dict_checks_before_changing_anything():
    params = _mixed_params()
    opt = Muon(params, state_format="8bit", min_quantize_numel=0, compile=False)
    _train(opt, params, 1)
    saved = opt.state_dict()
    other = Muon(params, state_format="4bit", min_quantize_numel=0, compile=False)
    _train(other, params, 1)
    before = {k: v.clone() for k, v in other.state[params[0]].items()}
    with pytest.raises(ValueError, match=r"Muon: param 0 \(shape \(16, 40\), torch.float32\), state "
                                         r"'momentum_buffer': expected a 4bit signed"):
        other.load_state_dict(saved)
    for k, v in before.items():
        _assert_equal(other.state[params[0]][k], v, k)
    flipped = opt.state_dict()
    flipped["param_groups"][1]["use_muon"] = True
    with pytest.raises(ValueError, match=r"param group 1, option 'use_muon': expected False"):
        opt.load_state_dict(flipped)


def test_convert_state_dict_between_policies():
    params = _mixed_params()
    opt = Muon(params, state_format="8bit", min_quantize_numel=0, compile=False)
    _train(opt, params, 2)
    fp32 = Muon(params, state_format="fp32", compile=False)
    fp32.load_state_dict(qstate.optim.convert_state_dict(opt.state_dict(), fp32))
    for p in params:
        for key, value in opt.state[p].items():
            got = fp32.state[p][key]
            assert type(got) is torch.Tensor and got.dtype == torch.float32, key
            want = value.dequantize() if isinstance(value, qstate.QuantizedState) else value
            assert torch.equal(got, want), key


# ------------------------------------------------------------------ FSDP2
#: besides ``test_optim_db.py``'s FSDP2 run (``optim_db``'s Muon input, nesterov, in 8bit, 4bit, fp8 and fp32
#: states, against the unsharded run): the collectives of a step, the resume, and Muon without nesterov
FSDP_CONFIGS = [("4bit", True), ("fp8", False), ("4bit", False)]
FSDP_STEPS = 3


def _fsdp_optimizer(params, fmt: str, nesterov: bool) -> Muon:
    return Muon(params, lr=0.02, nesterov=nesterov, adamw_lr=1e-2, state_format=fmt, min_quantize_numel=100,
                compile=False)


def fsdp_body(rank: int, world_size: int, configs) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    torch.set_num_threads(1)
    for fmt, nesterov in configs:
        what = f"{fmt}, nesterov={nesterov}, {world_size} ranks"
        model, ref = _model(torch.float32), _model(torch.float32)  # layers 129 -> 65 -> 16 -> 7, with biases
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt, ref_opt = _fsdp_optimizer(model.parameters(), fmt, nesterov), _fsdp_optimizer(ref.parameters(), fmt,
                                                                                         nesterov)
        for step in range(FSDP_STEPS):
            _loss(model(_batch(step))).backward()
            with _no_local_tensor_access() if step else contextlib.nullcontext(), CommDebugMode() as comm:
                opt.step()
            # one all-gather per Muon parameter (the three weights), and the all-reduce by which every
            # rank learns whether any failed the step's checks (1-D mesh: one)
            counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
            assert counts == {"allreduce_": 1, "all_gather_into_tensor": 3}, f"{what}: {counts}"
            opt.zero_grad()
            _loss(ref(_batch(step))).backward()
            for p in ref.parameters():  # gloo's average of world_size equal gradients
                p.grad = (p.grad * world_size) / world_size
            ref_opt.step()
            ref_opt.zero_grad()
        quantized = 0
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            _assert_equal(p.detach(), q.detach(), f"{what}: param {name}")
            for key, value in ref_opt.state[q].items():
                quantized += _assert_equal(opt.state[p][key], value, f"{what}: param {name} state {key!r}")
        assert quantized == (0 if fmt == "fp32" else 3), f"{what}: {quantized} quantized states"
        if fmt == "4bit" and nesterov:
            _check_distributed_resume(model, opt, fmt, what)


def _check_distributed_resume(model: nn.Module, opt: Muon, fmt: str, what: str) -> None:
    """torch.distributed.checkpoint's optimizer state dict of a sharded Muon resumes it bit for bit."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))  # a copy: loading keeps the tensors it gets
    resumed = _model(torch.float32)
    for layer in resumed:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(resumed)
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), model.parameters()):
            p.copy_(q)
    resumed_opt = _fsdp_optimizer(resumed.parameters(), fmt, True)
    set_optimizer_state_dict(resumed, resumed_opt, saved)
    for step in range(FSDP_STEPS, FSDP_STEPS + 2):
        for m, o in ((model, opt), (resumed, resumed_opt)):
            _loss(m(_batch(step))).backward()
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        _assert_equal(q.detach(), p.detach(), f"{what}, resumed: param {name}")
        for key, value in opt.state[p].items():
            _assert_equal(resumed_opt.state[q][key], value, f"{what}, resumed: param {name} state {key!r}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_matches_unsharded_run(world_size):
    run_distributed(fsdp_body, world_size, FSDP_CONFIGS)
