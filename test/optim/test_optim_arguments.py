"""torch.optim's arguments: every one the torch.optim namesake takes is accepted, stored as torch stores it,
and honoured or refused with a ValueError; optimizers built as torchtitan's and HF Trainer's builders do."""

from __future__ import annotations

import inspect
import io

import pytest
import torch
from torch import nn

import qstate.optim
from qstate.optim import SGD, Adam, AdamW, Lion

NAMESAKES = [(torch.optim.Adam, Adam), (torch.optim.AdamW, AdamW), (torch.optim.SGD, SGD)]
_IDS = [cls.__name__ for _, cls in NAMESAKES]


def _params():
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(64, 96, generator=g)), nn.Parameter(torch.randn(96, generator=g))]


def _torch_arguments(torch_cls) -> dict[str, inspect.Parameter]:
    return {n: p for n, p in inspect.signature(torch_cls).parameters.items() if n != "params"}


# ------------------------------------------------------------------ torch's signature
@pytest.mark.parametrize("torch_cls, cls", NAMESAKES, ids=_IDS)
def test_every_torch_argument_is_accepted_with_torchs_default(torch_cls, cls):
    torch_args = _torch_arguments(torch_cls)
    ours = inspect.signature(cls).parameters
    assert set(torch_args) <= set(ours), f"{cls.__name__} lacks {sorted(set(torch_args) - set(ours))}"
    positional = [n for n, p in ours.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    torch_positional = [n for n, p in torch_args.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == ["params", *torch_positional]
    for n, p in torch_args.items():
        assert ours[n].kind is p.kind, n
    # every argument passed at torch's default: the groups hold what torch's hold
    kwargs = {n: p.default for n, p in torch_args.items()}
    theirs = torch_cls(_params(), **kwargs).param_groups[0]
    group = cls(_params(), **kwargs).param_groups[0]
    assert {k: group[k] for k in theirs if k != "params"} == {k: v for k, v in theirs.items() if k != "params"}


@pytest.mark.parametrize("torch_cls, cls", NAMESAKES, ids=_IDS)
def test_torch_positional_arguments_mean_the_same(torch_cls, cls):
    names = [n for n, p in _torch_arguments(torch_cls).items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    values = {"lr": 0.05, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.25, "amsgrad": True,
              "momentum": 0.5, "dampening": 0.0, "nesterov": True}
    args = [values[n] for n in names]
    theirs, ours = torch_cls(_params(), *args).param_groups[0], cls(_params(), *args).param_groups[0]
    assert [ours[n] for n in names] == [theirs[n] for n in names] == args


REFUSED = [
    (dict(capturable=True), "capturable must be False, got True: qstate's step reads its step counts"),
    (dict(differentiable=True), "differentiable must be False, got True: qstate's update runs without autograd"),
    (dict(foreach="yes"), "foreach must be None, False or True, got 'yes'"),
    (dict(fused=1), "fused must be None, False or True, got 1"),
]


@pytest.mark.parametrize("cls", [Adam, AdamW, SGD, Lion], ids=lambda c: c.__name__)
@pytest.mark.parametrize("kwargs, message", REFUSED, ids=[str(k) for k, _ in REFUSED])
def test_values_qstate_cannot_honour_raise(cls, kwargs, message):
    if "capturable" in kwargs and cls is SGD:  # torch's SGD has no capturable
        with pytest.raises(TypeError, match="capturable"):
            cls(_params(), **kwargs)
        return
    with pytest.raises(ValueError) as info:
        cls(_params(), **kwargs)
    assert str(info.value).startswith(f"{cls.__name__}: {message}")
    # a param group of its own is checked alike
    with pytest.raises(ValueError, match=message.split(":")[0]):
        cls([{"params": _params()[:1]}, {"params": _params()[1:], **kwargs}])


@pytest.mark.parametrize("cls", [Adam, AdamW, SGD, Lion], ids=lambda c: c.__name__)
@pytest.mark.parametrize("kwargs", [dict(fused=True), dict(fused=None, foreach=False), dict(foreach=None),
                                    dict(fused=True, foreach=False, differentiable=False)], ids=str)
def test_honoured_values_change_nothing(cls, kwargs):
    # the update is the same bit for bit as without the arguments, and the groups record them
    def run(**kw):
        ps = _params()
        opt = cls(ps, lr=torch.tensor(1e-2), state_format="8bit", min_quantize_numel=0, **kw)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        return ps, opt

    ps, opt = run(**kwargs)
    ref, _ = run()
    assert all(torch.equal(a, b) for a, b in zip(ps, ref))
    assert all(opt.param_groups[0][k] == v for k, v in kwargs.items())


def test_fused_groups_keep_step_counts_on_the_host_through_state_dict():
    # torch.optim moves a loaded step count to the parameter's device when the group says fused=True;
    # qstate's stay float32 CPU tensors
    ps = _params()
    opt = AdamW(ps, lr=1e-2, fused=True, foreach=False)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    assert sd["param_groups"][0]["fused"] is True and sd["param_groups"][0]["foreach"] is False
    again = AdamW(ps, lr=1e-2, fused=True, foreach=False)
    again.load_state_dict(sd)
    for p in ps:
        step = again.state[p]["step"]
        assert step.device.type == "cpu" and step.dtype == torch.float32 and float(step) == 1.0
    assert again.param_groups[0]["fused"] is True


def test_a_checkpoint_without_the_arguments_loads_with_the_optimizers_values():
    ps = _params()
    opt = AdamW(ps, lr=1e-2)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    for group in sd["param_groups"]:  # as saved before qstate took them
        for k in ("foreach", "fused", "capturable", "differentiable"):
            del group[k]
    again = AdamW(ps, lr=1e-2, fused=True)
    again.load_state_dict(sd)
    group = again.param_groups[0]
    assert (group["fused"], group["foreach"], group["capturable"], group["differentiable"]) == (True, None, False,
                                                                                              False)


# ------------------------------------------------------------------ as trainers build optimizers
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.ReLU(), nn.Linear(128, 64))
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _train(model: nn.Module, optimizers: list, steps: int = 3) -> list[float]:
    losses = []
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)  # one batch: the loss falls
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def _through_a_file(state_dict: dict) -> dict:
    """``state_dict`` saved and loaded back: its tensors no longer alias the optimizer's."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _torchtitan_kwargs(implementation: str) -> dict:
    """torchtitan's build_optimizers (torchtitan/components/optimizer.py): Adam/AdamW with these kwargs."""
    return {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
            "fused": implementation == "fused", "foreach": implementation == "foreach"}


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_built_as_torchtitan_builds_optimizers(name):
    # one optimizer per model part (OptimizersContainer): optimizer_cls(params, **optimizer_kwargs)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    optimizer_cls = {"Adam": qstate.optim.Adam, "AdamW": qstate.optim.AdamW}[name]
    kwargs = _torchtitan_kwargs("fused")

    def build(model):
        parts = [model.body, model.head]
        return [optimizer_cls([p for p in part.parameters() if p.requires_grad], **kwargs) for part in parts]

    model = _Net()
    optimizers = build(model)
    losses = _train(model, optimizers)
    assert losses[-1] < losses[0]
    # the same run as the optimizer built without torch's implementation arguments
    ref_model = _Net()
    plain = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}
    ref_opts = [optimizer_cls(list(part.parameters()), **plain) for part in (ref_model.body, ref_model.head)]
    assert _train(ref_model, ref_opts) == losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    # torchtitan checkpoints each part through get/set_optimizer_state_dict: a resumed run continues
    saved = [_through_a_file(get_optimizer_state_dict(part, opt))
             for part, opt in zip([model.body, model.head], optimizers)]
    resumed_model = _Net()
    resumed_model.load_state_dict(model.state_dict())
    resumed = build(resumed_model)
    for part, opt, sd in zip([resumed_model.body, resumed_model.head], resumed, saved):
        set_optimizer_state_dict(part, opt, sd)
    assert _train(resumed_model, resumed) == _train(model, optimizers)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


def _hf_grouped_parameters(model: nn.Module, weight_decay: float) -> list[dict]:
    """HF Trainer.create_optimizer: decay and no-decay groups (biases and norms), then
    ``optimizer_cls(optimizer_grouped_parameters, **optimizer_kwargs)``."""
    no_decay = {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}
    decay = [n for n, _ in model.named_parameters() if not n.endswith("bias") and n.rsplit(".", 1)[0] not in no_decay]
    return [{"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0}]


def test_built_as_hf_trainer_builds_optimizers():
    # Trainer(optimizer_cls_and_kwargs=(qstate.optim.AdamW, kwargs)); the kwargs as get_optimizer_cls_and_kwargs
    # makes them for optim="adamw_torch_fused" ({"lr"} + adam_kwargs + {"fused": True}), plus qstate's own
    optimizer_cls_and_kwargs = (qstate.optim.AdamW, {"lr": 5e-4, "betas": (0.9, 0.999), "eps": 1e-8,
                                                     "fused": True, "state_format": "4bit", "seed": 0})
    optimizer_cls, optimizer_kwargs = optimizer_cls_and_kwargs
    model = _Net()
    optimizer = optimizer_cls(_hf_grouped_parameters(model, 0.01), **optimizer_kwargs)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    assert all(g["fused"] is True and g["state_format"] == "4bit" for g in optimizer.param_groups)
    losses = _train(model, [optimizer])
    assert losses[-1] < losses[0]
    ref_model = _Net()
    ref = qstate.optim.AdamW(_hf_grouped_parameters(ref_model, 0.01), lr=5e-4, state_format="4bit", seed=0)
    assert _train(ref_model, [ref]) == losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
