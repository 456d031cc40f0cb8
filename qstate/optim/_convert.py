"""``convert_state_dict``: an optimizer state dict rewritten in another optimizer's state policy.

Loading never converts: :meth:`PolicyOptimizer.load_state_dict` raises on
any state of another kind. This is the one explicit conversion, between
qstate's formats (``8bit``, ``4bit``, ``fp8``, ``bf16``, ``fp32``, block
sizes, roundings) and from and to ``torch.optim``'s own state dicts
(``AdamW``, ``Adam``, ``SGD``; qstate keeps torch's state names).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._dtensor import is_quantized_state
from ._policy import POLICY_OPTIONS
from ._base import PolicyOptimizer, QuantizedOptimizer, check_layout
from ._arguments import IMPLEMENTATION_OPTIONS

__all__ = ["convert_state_dict"]

#: group options only qstate's optimizers have; a state dict for another optimizer drops them
_QSTATE_OPTIONS = POLICY_OPTIONS + ("bf16_stochastic_round", "seed")
#: group options only torch.optim's optimizers have (how its step runs); qstate's drop them
_TORCH_OPTIONS = IMPLEMENTATION_OPTIONS


def convert_state_dict(state_dict: dict, optimizer: torch.optim.Optimizer) -> dict:
    """``state_dict`` with its states rewritten for ``optimizer``: what ``optimizer.load_state_dict`` takes.

    ``state_dict`` is a state dict of one of qstate's optimizers or of ``torch.optim``'s
    ``AdamW``/``Adam``/``SGD`` (keyed by parameter ids, or by names as
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` gives it; states
    may be DTensors). Its param groups and their parameters are matched with
    ``optimizer``'s by position, as ``load_state_dict`` matches them.

    * For a qstate optimizer each parameter's states become exactly the states
      ``optimizer`` would create for it (its policy, :meth:`PolicyOptimizer.plan`: the
      format, or float32 where the policy keeps float32; block size; per state signedness and
      rounding, :func:`~qstate.optim._policy.state_rounding`), holding the checkpoint's values:
      read as float32 (dequantized), then encoded. ``torch.optim.SGD`` keeps no step count: a
      momentum buffer comes with ``step`` 1, which only says that the buffer exists.
    * For any other ``torch.optim.Optimizer`` every state becomes a plain float32 tensor
      under its own name (qstate uses torch's: ``exp_avg``, ``exp_avg_sq``,
      ``max_exp_avg_sq``, ``momentum_buffer``, ``step``), and ``step`` a float32 CPU scalar
      tensor; for ``torch.optim.SGD``, which counts no steps, ``step`` is dropped.

    Param groups keep the checkpoint's hyperparameters (``lr``, ``betas``, ...), as a load
    would; options the checkpoint lacks take ``optimizer``'s values; qstate's policy options
    (``state_format``, ``block_size``, ``state_rounding``, ``min_quantize_numel``) are
    ``optimizer``'s. Options of the other library are dropped (torch's ``foreach``, ``fused``,
    ``capturable``, ``differentiable``; qstate's policy, ``bf16_stochastic_round``, ``seed``)
    unless ``optimizer``'s groups have them.

    Returns a new dict whose tensors are all new (the result never aliases ``state_dict``,
    which is left unchanged), on the devices of ``state_dict``'s. Raises ``ValueError``
    naming the parameter and state for a malformed ``state_dict``, a state ``optimizer``
    does not keep, a missing one, or a shape other than the parameter's.
    """
    name = type(optimizer).__name__
    check_layout(state_dict, optimizer.param_groups, name)
    quantized = isinstance(optimizer, PolicyOptimizer)
    groups, state = [], {}
    index = 0
    for saved, current in zip(state_dict["param_groups"], optimizer.param_groups):
        group = _converted_group(saved, current, quantized)
        groups.append(group)
        for pid, p in zip(saved["params"], current["params"]):
            entry = state_dict["state"].get(pid)
            if entry:
                what = f"{name}: param {index} (shape {tuple(p.shape)}, {p.dtype})"
                if quantized:
                    state[pid] = _to_policy(optimizer, p, {**group, "params": current["params"]}, index, entry, what)
                else:
                    state[pid] = _to_torch(optimizer, p, entry, what)
            index += 1
    return {"state": state, "param_groups": groups}


def _converted_group(saved: dict, current: dict, quantized: bool) -> dict:
    """The checkpoint's group with ``current``'s values for options it lacks and, for a qstate optimizer,
    ``current``'s policy options; the other library's options dropped unless ``current`` has them."""
    foreign = _TORCH_OPTIONS if quantized else _QSTATE_OPTIONS
    group = {k: v for k, v in current.items() if k != "params"}
    group.update((k, _copied(v)) for k, v in saved.items() if k not in foreign or k in current)
    if quantized:
        group.update((k, current[k]) for k in POLICY_OPTIONS)
    return group


def _copied(value: Any) -> Any:
    """A group value the result does not share with the input (lists of params, tensor lrs)."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    return list(value) if isinstance(value, list) else value


def _float32_values(value: Tensor) -> Tensor:
    """``value``'s numbers as a new plain float32 tensor (a DTensor stays one, with its placements)."""
    if is_quantized_state(value):
        # out-of-place math on a state reads its dequantized values as a plain tensor (qstate.ops.math,
        # DTensor shard by shard); multiplying by 1 is exact
        return value.mul(1.0).to(torch.float32)
    return value.detach().to(torch.float32, copy=True)


def _step(entry: dict, what: str) -> Tensor:
    step = entry["step"]
    if isinstance(step, Tensor):
        if step.numel() != 1:
            raise ValueError(f"{what}, state 'step': expected a one-element tensor, got shape {tuple(step.shape)}")
        step = step.item()
    elif isinstance(step, bool) or not isinstance(step, (int, float)):
        raise ValueError(f"{what}, state 'step': expected a number or a one-element tensor, "
                         f"got {type(step).__name__}")
    return torch.tensor(float(step), dtype=torch.float32)


def _tensor_states(entry: dict, what: str) -> dict[str, Tensor]:
    """The entry's states other than ``step``; a ``None`` (torch.optim.SGD without momentum) is no state."""
    out = {}
    for n, v in entry.items():
        if n == "step" or v is None:
            continue
        if not isinstance(v, Tensor):
            raise ValueError(f"{what}, state {n!r}: expected a tensor, got {type(v).__name__}")
        out[n] = v
    return out


def _check_shape(p: Tensor, n: str, value: Tensor, what: str) -> None:
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"{what}, state {n!r}: expected shape {tuple(p.shape)}, got {tuple(value.shape)}")


def _to_policy(optimizer: PolicyOptimizer, p: Tensor, group: dict, index: int, entry: dict,
               what: str) -> dict:
    """One parameter's states as ``optimizer`` creates them for ``group`` (see ``_new_states``)."""
    kind = optimizer.plan(p, group, index)
    specs = optimizer._state_specs(group)
    values = _tensor_states(entry, what)
    keeps = [s.name for s in specs] + ["step"]
    for n in values:
        if n not in keeps:
            raise ValueError(f"{what}, state {n!r}: {type(optimizer).__name__} does not keep it (it keeps {keeps})")
    if "step" in entry:
        step = _step(entry, what)
    elif isinstance(optimizer, QuantizedOptimizer) and optimizer.rule.name == "sgd" and values:
        step = torch.tensor(1.0)  # torch.optim.SGD counts no steps; 1: the buffer exists
    else:
        raise ValueError(f"{what}: the state dict lacks its state 'step' (it has {sorted(entry)})")
    out: dict[str, Any] = {"step": step}
    for spec in specs:
        if spec.name not in values:
            raise ValueError(f"{what}: the state dict lacks its state {spec.name!r} (it has {sorted(entry)})")
        value = values[spec.name]
        _check_shape(p, spec.name, value, what)
        plain = _float32_values(value)
        # the state the optimizer's first step would create, written with the checkpoint's values
        out[spec.name] = optimizer._zero_state(plain, kind, spec.signed, group).copy_(plain)
    return out


def _to_torch(optimizer: torch.optim.Optimizer, p: Tensor, entry: dict, what: str) -> dict:
    """One parameter's states as plain float32 tensors under their names, for a ``torch.optim`` optimizer."""
    out: dict[str, Any] = {}
    if "step" in entry and not isinstance(optimizer, torch.optim.SGD):  # SGD counts no steps
        out["step"] = _step(entry, what)
    for n, value in _tensor_states(entry, what).items():
        _check_shape(p, n, value, what)
        out[n] = _float32_values(value)
    return out
