"""The bases of qstate's optimizers: :class:`PolicyOptimizer` (the state policy's plumbing and the one
step every optimizer shares) and :class:`QuantizedOptimizer` (the elementwise rules' base).

A :class:`PolicyOptimizer` subclass names the states a group keeps (``_state_specs``), lays out a
group's update (``_prepare_group``: checks, nothing written; ``run()`` writes) and checks its
hyperparameters (``_check_group``); it assumes no elementwise rule (Muon is one). A
:class:`QuantizedOptimizer` subclass names its :class:`~qstate.optim.rules.UpdateRule` and the rule's
static flags (``rule_flags``); a group's update is the engine's ``prepare_update`` of the rule, on the
path the group's ``fused``/``foreach`` choose (:func:`~._engine.path.group_path`).

Invariants: the policy (:class:`~._policy.StatePolicy`) alone decides each state's kind, and nothing
else changes a format; a step checks everything before its first write and advances a group's step
counts after all its writes; a nonzero ``found_inf`` skips a step before anything is created or
written; the stochastic-rounding stream is a function of ``(seed, group index, step)`` only, the same
on every rank, and leaves torch's global generators as they were; ``state_dict()`` gives copies of
the states, and ``load_state_dict`` checks the whole state dict (layout, every state's kind and
parts, the policy options) before it changes anything. :class:`PolicyOptimizer` states each rule.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from .._api import zeros_like as q_zeros_like
from .._dtensor import is_dtensor, local_of, state_kind, rounds_stochastically as rounds_state_stochastically
from .._state import QuantizedState, quantized_kind
from ..amp import found_non_finite
from ..distributed import wants_quantized
from ..formats import get_format
from ..formats.map_formats import legacy_map_name
from ._engine import step as _step
from ._arguments import check_path
from ._engine.path import Path, group_path
from ._policy import (PLAIN_FORMATS, POLICY_OPTIONS, StatePolicy, check_group_options, rounds_stochastically,
                      state_rounding)
from ._report import LOGGER, StateNbytes, count_nbytes, policy_summary, warn_at_caller, weak_combination
from .rules import StateSpec, UpdateRule
from ._engine.spec import StateKind

__all__ = ["PolicyOptimizer", "QuantizedOptimizer", "check_layout"]

_CONVERT_HINT = ("; a state dict of another policy loads after qstate.optim.convert_state_dict(state_dict, "
                 "optimizer)")
#: parameter dtypes a quantized or bf16 state can serve (the math runs in float32)
_LOW_PRECISION_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_CPU = torch.device("cpu")


def _private_seed() -> int:
    """A seed for ``seed=None``, drawn from a private generator seeded with ``torch.initial_seed()`` (what
    ``torch.manual_seed`` set, read without a draw): never a draw from torch's global generators, which
    the caller's own random numbers (dropout, data order) come from. Ranks and reruns that seed torch
    alike draw alike, with no collective. Host data: read from the default CPU generator itself and
    drawn outside any mode (under LocalTensorMode ``torch.initial_seed()`` is a per-rank SymInt)."""
    with _disable_current_modes():
        generator = torch.Generator().manual_seed(torch.default_generator.initial_seed())
        return int(torch.randint(0, 2**62, (1,), generator=generator).item())


class _Keep:
    """Carries a state tensor through ``Optimizer.load_state_dict`` without its dtype cast."""

    __slots__ = ("value",)

    def __init__(self, value: Tensor):
        self.value = value


class _GroupStep(NamedTuple):
    """One group's part of a step, checked and laid out (``PolicyOptimizer._prepare_step``): the states
    created for its parameters (installed when it runs), its rounding stream and its pending update
    (:meth:`PolicyOptimizer._prepare_group`'s)."""

    new_states: dict
    stream: Any
    update: Any


class PolicyOptimizer(torch.optim.Optimizer):
    """Base of qstate's optimizers: states of a :class:`~._policy.StatePolicy`, one step skeleton.

    A subclass passes its hyperparameters as ``defaults`` and the policy keywords it was given
    (``**policy``) to ``__init__``, and implements :meth:`_state_specs` (the states a group keeps)
    and :meth:`_prepare_group` (a group's update, checked and laid out, written by its ``run()``);
    :meth:`_check_group` checks its hyperparameters. :meth:`step` runs the rest: the closure, the
    AMP and ``skip_nonfinite`` protocol, missing states, every check before the first write, the
    rounding stream of each group.

    * **policy**: :class:`~._policy.StatePolicy` (its docstring: the options, which parameter gets which
      state kind, the rounding of each state), checked at construction and for every group added or
      loaded; :meth:`PolicyOptimizer.plan` gives each parameter's state kind from it. Nothing else ever
      changes the format: a block size the format rejects, a parameter dtype it cannot hold, a loaded
      state of another kind all raise, naming the parameter (index in ``state_dict`` order and shape),
      the expected and the actual.
    * **states**: created at the first step with ``qstate.zeros_like(p, fmt,
      signed=..., block_size=..., dtype=float32, rounding=...)`` (DTensor
      parameters get DTensor states) or ``torch.zeros_like(p, dtype=...)``;
      ``state["step"]`` is a float32 CPU tensor as in ``torch.optim``.
    * **step**: each group's update laid out (:meth:`PolicyOptimizer._prepare_group`), then
      each group's update runs; ``lr`` may be a float or a tensor on any device
      (converted once per step and device). All or nothing: every check (each
      gradient, step count, missing state, the op's calls) runs before the first
      write, so a step that raises there leaves parameters, states and counts as
      they were, and a group's counts advance after all its writes (see
      :meth:`PolicyOptimizer.step`). Groups are checked when added or loaded
      (``add_param_group`` keeps a group only if it is valid; ``load_state_dict``
      checks loaded groups as constructor arguments and step counts as finite
      non-negative integers).
    * **AMP** (torch's fused-optimizer protocol, ``_step_supports_amp_scaling``):
      ``torch.amp.GradScaler.step`` sets ``optimizer.grad_scale``/``found_inf``
      instead of unscaling (``step(grad_scale=, found_inf=)`` does the same); the
      update unscales the gradient as it reads it, and a nonzero ``found_inf``
      skips the step before anything (states, step counts) is created or written.
    * **non-finite gradients**: by default a step applies them as they are (an
      inf or NaN reaches its quantized blocks and the parameter, see
      ``qstate/formats/_base.py``). ``skip_nonfinite=True`` (optimizer-wide: a
      step is taken or skipped as a whole, as with ``found_inf``) computes
      ``found_inf`` when no scaler gave one (:func:`qstate.amp.found_non_finite`:
      one read of the gradients, one all-reduce per mesh), so such a step is
      skipped on every rank.
    * **stochastic rounding** of bfloat16 parameters and of states (signed
      ``4bit`` states by default): the random stream is the
      optimizer's own, a function of ``(seed, param group index, step)`` only: the
      generators of the CPU (which draws each parameter's key) and of each
      parameter's device are seeded from them for the group's update (and the
      global ones restored afterwards). ``seed`` (given, or drawn at construction
      from a private generator seeded with ``torch.initial_seed()``: building or
      stepping an optimizer never draws from torch's global generators, so a run's
      dropout masks and other draws are those of the same run with ``torch.optim``)
      is a param-group entry and the step is a state,
      so any checkpoint path that keeps param groups and states
      (``state_dict()``, ``get_optimizer_state_dict``/DCP) resumes the same stream.
      Every rank draws the same stream: with ``seed=None`` and ``torch.distributed``
      initialized with more than one rank, the first step of an optimizer that
      rounds (a group with ``bf16_stochastic_round`` or stochastic states) broadcasts rank 0's drawn seed
      over the default process group (:meth:`_agree_seed`: one collective, once,
      on every rank, so every rank must step its optimizers alike; constructing one
      issues none) and every group that took the drawn seed takes rank 0's. A given
      ``seed``, or one a loaded checkpoint set, is used as is.
    * **torch.optim's implementation arguments** (``fused``, ``foreach``,
      ``capturable``, ``differentiable``) are param-group entries as in torch
      (checked by the subclasses: only the values qstate honours); ``fused`` and
      ``foreach`` choose each group's path at every step as they choose torch's
      (:func:`~._engine.path.group_path`: fused, foreach or for-loop). Step counts stay
      CPU tensors after loading a checkpoint whose groups say ``fused=True`` (where
      torch would move them to the parameter's device).
    * **state_dict**: copies of the states (:meth:`_states_as_copies`), quantized ones
      as :class:`~qstate.QuantizedState` (``torch.load(weights_only=True)`` works after
      ``import qstate``), so that a DCP load reading into them never writes a live state; loading
      keeps their format and dtype (``torch.optim`` would cast states to the
      parameter's dtype, which dequantizes) and moves them to the parameter's
      device. ``load_state_dict`` checks all of the state dict before it changes
      anything: its layout (``state``/``param_groups``, group and parameter
      counts), every parameter's states (each its group keeps,
      :meth:`PolicyOptimizer._state_specs`, plus ``step``, of exactly the kind
      this optimizer would create: format, signedness, block size, rounding,
      dtype (a quantized state's appearance dtype included), shape; a quantized
      state's parts as well: :meth:`~qstate.QuantizedState.check`)
      and the policy options
      (:data:`POLICY_OPTIONS`: ``state_format``, ``block_size``,
      ``state_rounding``, ``min_quantize_numel``), which stay the optimizer's. A
      mismatch raises ``ValueError`` naming the parameter (or group and option),
      the expected and the found, and leaves the optimizer as it was. Other
      options are hyperparameters and, as in ``torch.optim``, the checkpoint's
      win; an option the checkpoint predates (``state_rounding``) keeps the
      optimizer's value. States of another policy, or ``torch.optim``'s, load
      only after :func:`qstate.optim.convert_state_dict`.
    """

    #: torch.amp.GradScaler passes grad_scale/found_inf instead of unscaling the gradients
    _step_supports_amp_scaling = True
    #: whether a group's update issues collectives (then every rank learns of a failed check first:
    #: :meth:`_agree_checks`)
    _step_communicates = False
    #: whether this rank drew the seed (``seed=None``) and rank 0's has yet to replace it (:meth:`_agree_seed`)
    _seed_drawn = False

    def __init__(self, params: Iterable, defaults: dict, **policy: Any):
        """``defaults``: the subclass's hyperparameters; ``policy``: :class:`~._policy.StatePolicy`'s
        keywords (an unknown one raises ``TypeError`` naming it, as Python's own call would)."""
        name = type(self).__name__
        options = StatePolicy.of(name, policy)
        defaults = {**defaults, **options.group_options(_private_seed() if options.seed is None else options.seed)}
        self._seed_drawn = options.seed is None
        self.compile = options.compile
        #: skip a step whose gradients hold an inf or a NaN on any rank (see step)
        self.skip_nonfinite = options.skip_nonfinite
        self._n_params = 0
        super().__init__(params, defaults)
        #: the first step that creates states logs what they are (:meth:`_report_states`), once
        self._report_handle = self.register_step_post_hook(type(self)._report_states)
        self.register_load_state_dict_pre_hook(type(self)._load_pre)
        self.register_load_state_dict_pre_hook(type(self)._check_loaded_steps)  # after _load_pre's checks
        self.register_load_state_dict_post_hook(type(self)._load_post)
        self.register_load_state_dict_post_hook(type(self)._steps_on_host)
        self.register_state_dict_post_hook(type(self)._states_as_copies)

    # ------------------------------------------------------------------ what the states hold
    def state_nbytes(self) -> StateNbytes:
        """This rank's state bytes per format against float32, of the states created so far.

        Returns a :class:`~qstate.optim._report.StateNbytes`: ``formats`` maps each state format
        (``"8bit"``, ``"4bit"``, ``"fp8"``, ``"fp32"``, ``"bf16"``) to its ``states``, ``elements``,
        ``storage_nbytes`` (codes, scales and code maps of quantized states; ``numel * element_size``
        of plain ones) and ``fp32_nbytes`` (``4 * elements``); ``storage_nbytes``/``fp32_nbytes`` are
        the totals. Counts the states its groups keep (not ``step``), local to this rank: a DTensor state
        (FSDP2) counts its local shard. No collective: sum over ranks with ``all_reduce`` if needed.
        (A :class:`~qstate.QuantizedState`'s ``nbytes`` is torch's logical size, ``numel * 4``: read
        :meth:`~qstate.QuantizedState.storage_nbytes` or this.)
        """
        return count_nbytes(v for state in self.state.values() for n, v in state.items()
                            if n != "step" and isinstance(v, Tensor))

    def _planned(self):
        """Per parameter: the format of its states, why they stayed fp32 though its group asked for a
        quantized format (None if they did not), and how many states it keeps."""
        index = 0
        for group in self.param_groups:
            n_states = len(self._state_specs(group))
            fmt = group["state_format"]
            for p in group["params"]:
                kind = self.plan(p, group, index)
                index += 1
                if kind.quantized:
                    yield kind.format, None, n_states
                elif fmt in PLAIN_FORMATS:
                    yield fmt, None, n_states
                elif p.numel() < group["min_quantize_numel"]:
                    yield "fp32", f"fewer than min_quantize_numel={group['min_quantize_numel']} elements", n_states
                else:
                    yield "fp32", f"{p.ndim}-D (quantized states need 2 or more dims)", n_states

    def _report_states(self, args: tuple, kwargs: dict) -> None:
        """Step post-hook: after the first step that created states, one INFO record on the ``qstate``
        logger saying how many states got which format, why some stayed fp32, and this rank's bytes
        against fp32 (:func:`~._report.policy_summary`); then the hook leaves."""
        if not self.state:  # a skipped step created nothing
            return
        self._report_handle.remove()
        if LOGGER.isEnabledFor(logging.INFO):
            LOGGER.info(policy_summary(type(self).__name__, self._planned(), self.state_nbytes()))

    def _states_as_copies(self, state_dict: dict) -> dict:
        """Give ``state_dict()`` a copy of every state tensor, named after its key, so that a load
        never writes the live states before :meth:`load_state_dict` has checked the whole state dict.

        ``torch.distributed.checkpoint.load`` (whoever calls it: torchtitan's ``CheckpointManager``,
        ``set_optimizer_state_dict`` flows, a ``Stateful``) reads a checkpoint into the tensors of
        ``state_dict()`` and only then calls ``load_state_dict``. Into the live states (as
        ``torch.optim`` gives them), a checkpoint of another state kind would be written up to the
        first mismatch. Into copies, a mismatch raises while reading (a quantized state's ``copy_``
        refuses another kind, naming the state ``state.<param name or index>.<state>``) or in
        ``load_state_dict``'s checks (policy options, plain where quantized is expected), and the
        optimizer keeps every state; a load that passes installs the copies (no further copy).
        Costs one copy of the states while the state dict lives (quantized states at their storage
        size)."""
        names: dict[Any, str] = {}
        for group in state_dict["param_groups"]:
            param_names = group.get("param_names") or []
            for i, pid in enumerate(group["params"]):
                names[pid] = str(param_names[i]) if i < len(param_names) else str(pid)
        copies = {}
        for pid, entry in state_dict["state"].items():
            copies[pid] = {}
            for key, value in entry.items():
                if isinstance(value, Tensor):
                    value = value.detach().clone()
                    local = local_of(value)
                    if isinstance(local, QuantizedState):
                        local.state_name = f"state.{names.get(pid, pid)}.{key}"
                copies[pid][key] = value
        state_dict["state"] = copies
        return state_dict

    def _steps_on_host(self) -> None:
        """Keep every step count a CPU tensor after loading, as the step reads it on the host
        (torch.optim moves it to the parameter's device where the loaded group says ``fused=True``)."""
        for state in self.state.values():
            step = state.get("step")
            if isinstance(step, Tensor) and step.device.type != "cpu":
                state["step"] = step.to("cpu", torch.float32)

    def _agree_seed(self) -> None:
        """Give every rank rank 0's drawn seed, once, before the first step that rounds.

        Runs only for a seed drawn at construction (``seed=None``), with ``torch.distributed``
        initialized with more than one rank, and when some group rounds bfloat16 parameters or states
        stochastically (the only use of the seed): then every rank broadcasts, once, one int64 from
        rank 0 over the default process group, whatever its parameters or gradients, and each group
        whose seed is this rank's drawn one (not given per group, not loaded) takes rank 0's.
        Invariant afterwards: groups that took the default seed have the same seed on every rank.
        """
        if not self._seed_drawn or not any(rounds_stochastically(g) for g in self.param_groups):
            return
        self._seed_drawn = False
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        drawn = self.defaults["seed"]
        agreed = torch.tensor([drawn], dtype=torch.int64, device=_collective_device())
        dist.broadcast(agreed, src=0)
        agreed = int(agreed.item())
        self.defaults["seed"] = agreed
        for group in self.param_groups:
            if group["seed"] == drawn:
                group["seed"] = agreed

    # ------------------------------------------------------------------ subclass hooks
    def _state_specs(self, group: dict) -> Sequence[StateSpec]:
        """The states each parameter of ``group`` keeps besides ``step``, in order."""
        raise NotImplementedError(f"{type(self).__name__} does not say which states a group keeps")

    def _prepare_group(self, group: dict, params: list[Tensor], states: list[list[Tensor]], steps: list[Tensor],
                       grad_scale: Optional[Tensor], indices: list[int]) -> Any:
        """``group``'s update of ``params`` (those with a gradient) and their ``states`` (in
        :meth:`_state_specs` order) and step counts ``steps``, checked and laid out: an object whose
        ``run()`` writes the parameters and states, then advances the counts. Writes nothing itself;
        raises naming the parameter by its index in ``indices`` on a bad gradient or step count."""
        raise NotImplementedError(f"{type(self).__name__} does not lay out a group's update")

    def _check_group(self, group: dict) -> None:
        """Subclasses validate their hyperparameters here (called for every group)."""

    # ------------------------------------------------------------------ policy
    def _describe(self, index: int, p: Tensor) -> str:
        return f"{type(self).__name__}: param {index} (shape {tuple(p.shape)}, {p.dtype})"

    def plan(self, p: Tensor, group: dict, index: int) -> StateKind:
        """The kind of one parameter's states (plain, or quantized without ``signed``/``rounding``,
        which each state sets); raises if impossible."""
        what = self._describe(index, p)
        if not p.is_floating_point() or p.is_complex():
            raise TypeError(f"{what}: expected a floating-point parameter")
        if p.is_sparse:
            raise TypeError(f"{what}: sparse parameters are not supported")
        fmt = group["state_format"]
        if fmt == "fp32" or p.numel() < group["min_quantize_numel"]:
            return StateKind.plain(torch.float32)
        if p.dtype not in _LOW_PRECISION_PARAM_DTYPES:
            raise TypeError(f"{what}: state_format={fmt!r} serves float32/bfloat16/float16 parameters, got {p.dtype}")
        if fmt in PLAIN_FORMATS:
            return StateKind.plain(PLAIN_FORMATS[fmt])
        if not wants_quantized(p, group["min_quantize_numel"]):
            return StateKind.plain(torch.float32)
        f = get_format(fmt)
        bs = f.default_block_size if group["block_size"] is None else group["block_size"]
        try:
            f.check_block_size(bs)
        except ValueError as e:
            raise ValueError(f"{what}: state_format={fmt!r} cannot use block_size={bs!r}: {e}") from None
        return StateKind.quantized_as(fmt, bs)

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``, kept only if the group is valid: its options
        (:func:`~._policy.check_group_options`, :meth:`_check_group`) and every parameter's state kind
        (:meth:`plan`); otherwise raise and leave ``param_groups`` as they were."""
        n_groups = len(self.param_groups)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_group_options(group, type(self).__name__)
            self._check_group(group)
            check_path(type(self).__name__, group, self.compile)
            first = self._n_params
            for i, p in enumerate(group["params"]):
                self.plan(p, group, first + i)
        except BaseException:
            del self.param_groups[n_groups:]
            raise
        self._n_params += len(group["params"])

    def _param_index(self) -> dict[Tensor, int]:
        return {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    # ------------------------------------------------------------------ states
    def _new_states(self, p: Tensor, group: dict, index: int) -> dict:
        kind = self.plan(p, group, index)
        state: dict[str, Any] = {"step": torch.tensor(0.0, dtype=torch.float32)}
        for spec in self._state_specs(group):
            state[spec.name] = self._zero_state(p.detach(), kind, spec.signed, group)
        return state

    @staticmethod
    def _zero_state(like: Tensor, kind: StateKind, signed: bool, group: dict) -> Tensor:
        """A zero state of ``kind`` (:meth:`plan`) with ``like``'s shape, device (and DTensor layout); a
        quantized one has ``signed`` and the rounding :func:`state_rounding` gives it in ``group``."""
        if kind.quantized:
            rounding = state_rounding(kind.format, signed, group["state_rounding"])
            return q_zeros_like(like, kind.format, signed=signed, block_size=kind.block_size, dtype=torch.float32,
                                rounding=rounding)
        return torch.zeros_like(like, dtype=kind.dtype, memory_format=torch.preserve_format)

    def _check_state(self, p: Tensor, group: dict, index: int, name: str, value: Any) -> None:
        """Raise unless ``value`` is the state ``name`` of ``p`` that ``group``'s policy creates: its kind,
        shape and appearance dtype, and for a quantized state (or a DTensor's local one) its parts
        (:meth:`~qstate.QuantizedState.check`: codes, scales and map of its layout, scales >= 0, the
        format's map), so that no kernel reads a state past its buffers."""
        kind = self.plan(p, group, index)
        what = f"{self._describe(index, p)}, state {name!r}"
        specs = {s.name: s for s in self._state_specs(group)}
        if name not in specs:
            raise ValueError(f"{what}: unexpected state; {type(self).__name__} keeps {sorted(specs)}")
        if not isinstance(value, Tensor):
            raise ValueError(f"{what}: expected a tensor, got {type(value).__name__}")
        got = state_kind(value)
        signed = specs[name].signed
        rounding = state_rounding(kind.format, signed, group["state_rounding"]) if kind.quantized else None
        want = (quantized_kind(kind.format, signed, kind.block_size, rounding) if kind.quantized
                else f"plain {kind.dtype}")
        if got != want:
            # the rounding option is named where it decides (set, or a stochastic state on either side)
            got_rounding = getattr(local_of(value), "rounding", None)
            options = f"state_format={group['state_format']!r}, "
            if group["state_rounding"] is not None or "stochastic" in (rounding, got_rounding):
                options += f"state_rounding={group['state_rounding']!r}, "
            raise ValueError(f"{what}: expected a {want} state ({options}"
                             f"min_quantize_numel={group['min_quantize_numel']}), got {got}{_CONVERT_HINT}")
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"{what}: expected shape {tuple(p.shape)}, got {tuple(value.shape)}")
        local = local_of(value)
        legacy = legacy_map_name(getattr(local, "qmap", None))
        if legacy is not None:
            raise ValueError(f"{what}: stored with {legacy}, a map states no longer use; "
                             f"qstate.optim.convert_state_dict(state_dict, optimizer) re-encodes it")
        if isinstance(local, QuantizedState):
            if value.dtype != torch.float32:  # the appearance dtype of the states it creates (_zero_state)
                raise ValueError(f"{what}: expected a state that appears as torch.float32 (the optimizer's), "
                                 f"got {value.dtype}{_CONVERT_HINT}")
            try:  # its parts: a kernel reads exactly what the layout says
                local.check()
            except ValueError as e:
                raise ValueError(f"{what}: {e}") from None

    def _loaded_group(self, saved: dict, current: dict) -> dict:
        """The group a load gives: the checkpoint's hyperparameters, the optimizer's policy options;
        checked as a constructor's arguments are (:func:`~._policy.check_group_options`: ``seed``,
        ``bf16_stochastic_round``...; :meth:`_check_group`: ``lr``, ``betas``...), naming the group."""
        group = {**saved, "params": current["params"], **{k: current[k] for k in POLICY_OPTIONS}}
        name = type(self).__name__
        try:
            check_group_options(group, name)
            self._check_group(group)
        except (TypeError, ValueError) as e:
            gi = next(i for i, g in enumerate(self.param_groups) if g is current)
            message = str(e).removeprefix(f"{name}: ")
            raise type(e)(f"{name}: the state dict's param group {gi}: {message}") from None
        return group

    def _check_loaded_steps(self, state_dict: dict) -> None:
        """Raise unless every step count of ``state_dict`` (checked by :meth:`_load_pre`) is a finite
        non-negative integer, as a step needs it (:func:`~qstate.optim._engine.step.next_step`); before
        ``load_state_dict`` changes anything."""
        index = 0
        for saved, current in zip(state_dict["param_groups"], self.param_groups):
            for pid, p in zip(saved["params"], current["params"]):
                step = (state_dict["state"].get(pid) or {}).get("step")
                if isinstance(step, Tensor):
                    value = step.reshape(()).item()
                    if not (math.isfinite(value) and value >= 0 and value == int(value)):
                        raise ValueError(f"{self._describe(index, p)}, state 'step': expected a finite non-negative "
                                         f"integer count, got {value}")
                index += 1

    def _check_loaded(self, state_dict: dict) -> None:
        """Check every state of ``state_dict`` against this optimizer's state policy.

        ``state_dict`` has passed :func:`check_layout` and has every option (:meth:`_with_missing_options`).
        A parameter's entry is empty (no step yet) or holds exactly its group's states
        (:meth:`_state_specs`), of the kinds the optimizer creates (:meth:`_check_state`), and a one-element ``step`` tensor; then the policy
        options (:data:`POLICY_OPTIONS`) must equal the optimizer's. Runs before ``load_state_dict``
        changes anything, so a rejected checkpoint leaves the optimizer as it was.
        """
        name = type(self).__name__
        index = 0
        for saved, current in zip(state_dict["param_groups"], self.param_groups):
            group = self._loaded_group(saved, current)
            self._check_group(group)
            check_path(name, group, self.compile)
            names = [s.name for s in self._state_specs(group)]
            for pid, p in zip(saved["params"], current["params"]):
                entry = state_dict["state"].get(pid) or {}
                what = self._describe(index, p)
                for n in (names + ["step"] if entry else []):
                    if n not in entry:
                        raise ValueError(f"{what}: the state dict lacks its state {n!r} (it has {sorted(entry)}; "
                                         f"{name} keeps {names + ['step']}){_CONVERT_HINT}")
                for n, value in entry.items():
                    if n == "step":
                        if not isinstance(value, Tensor) or value.numel() != 1:
                            got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
                            raise ValueError(f"{what}, state 'step': expected a one-element tensor, got {got}")
                    else:
                        self._check_state(p, group, index, n, value)
                index += 1
        for gi, (saved, current) in enumerate(zip(state_dict["param_groups"], self.param_groups)):
            for option in POLICY_OPTIONS:
                if saved[option] != current[option]:
                    raise ValueError(f"{name}: param group {gi}, option {option!r}: expected {current[option]!r} "
                                     f"(the optimizer's), the state dict has {saved[option]!r}{_CONVERT_HINT}")

    # ------------------------------------------------------------------ step
    @staticmethod
    @contextlib.contextmanager
    def _stream(devices: set[torch.device], seed: int, group_index: int, step: int):
        """Run with the rounding stream of ``(seed, group_index, step)`` on ``devices``, then restore."""
        saved = [(d, _get_rng(d)) for d in sorted(devices, key=str)]
        key = ((seed * 1_000_003 + group_index) * 1_000_003 + step) % 2**63
        try:
            for d, _ in saved:
                _set_rng(d, torch.Generator(device=d).manual_seed(key).get_state())
            yield
        finally:
            for d, state in saved:
                _set_rng(d, state)

    @torch.compiler.disable  # as the engine's apply_update: a caller's torch.compile skips the step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, *, grad_scale: Optional[Tensor] = None,
             found_inf: Optional[Tensor] = None) -> Optional[float]:
        """One step. ``grad_scale``/``found_inf`` default to the attributes a ``GradScaler`` sets.

        A nonzero ``found_inf`` skips the step before anything is created or written: parameters,
        states and step counts keep their bits. With ``skip_nonfinite`` and no ``found_inf`` (a
        scaler's, already checked, is used as it is), the step computes it first: a step whose
        gradients hold an inf or a NaN on any rank is skipped on every rank.

        Checked, then written: every gradient (:func:`~qstate.optim._engine.step.check_grad`), step count
        and missing state is checked or built, and every group's calls laid out, before the first
        write (:meth:`_prepare_step`); a failure there raises and leaves parameters, states and step
        counts as they were (with DTensor parameters on the rank that failed, or on every rank where the
        step communicates: :meth:`_agree_checks`).
        While writing, a group's step counts advance only after all its writes returned;
        an error inside a kernel part way (out of memory) leaves the counts and states it had not
        created as they were, and the tensors written so far written.
        """
        self._agree_seed()  # first, on every rank: before anything that may skip the step on some rank
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None) if grad_scale is None else grad_scale
        found_inf = getattr(self, "found_inf", None) if found_inf is None else found_inf
        # every check, before any write (_agree_checks: which steps tell every rank of a failure)
        agree = found_inf is None and self.skip_nonfinite  # found_non_finite communicates: agree before it
        if agree or self._step_communicates:
            error: Optional[Exception] = None
            try:
                work = self._prepare_step(grad_scale)
            except Exception as e:
                error = e
            self._agree_checks(error)
        else:
            work = self._prepare_step(grad_scale)
        if agree:
            found_inf = found_non_finite(self)
        if _step.skip_step(found_inf):
            return loss
        for w in work:
            with w.stream:
                self._run_group(w)
        return loss

    def _prepare_step(self, grad_scale: Optional[Tensor]) -> list["_GroupStep"]:
        """Check every group's update and lay out its calls, creating missing states aside; writes nothing."""
        index = None
        work = []
        for gi, group in enumerate(self.param_groups):
            sr_devices: set[torch.device] = set()
            params, states, steps = [], [], []
            new: dict[Tensor, dict] = {}
            names = [s.name for s in self._state_specs(group)]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p)
                if not state:
                    index = index or self._param_index()
                    state = new[p] = self._new_states(p, group, index[p])
                params.append(p)
                states.append([state[n] for n in names])
                steps.append(state["step"])
                if (group["bf16_stochastic_round"] and p.dtype == torch.bfloat16) \
                        or any(rounds_state_stochastically(x) for x in states[-1]):
                    # keys come from the CPU generator, a device's own draws from its generator
                    sr_devices.update((p.device, _CPU))
            if not params:
                continue
            index = index or self._param_index()
            update = self._prepare_group(group, params, states, steps, grad_scale, [index[p] for p in params])
            # the step being taken (the counts are CPU tensors) keys the rounding stream
            stream = (self._stream(sr_devices, group["seed"], gi, 1 + max(int(s) for s in steps)) if sr_devices
                      else contextlib.nullcontext())
            work.append(_GroupStep(new, stream, update))
        return work

    def _run_group(self, w: "_GroupStep") -> None:
        """Install ``w``'s new states and write its update; on an error remove the states it installed."""
        self.state.update(w.new_states)
        try:
            w.update.run()
        except BaseException:
            for p in w.new_states:
                del self.state[p]
            raise

    def _agree_checks(self, error: Optional[Exception]) -> None:
        """Raise ``error`` (this rank's failure to check a step, or None) and, on every rank of a mesh
        of a DTensor parameter, raise when any rank of it failed, before anything is written.

        For a step that communicates (Muon's redistributions, ``skip_nonfinite``'s all-reduce): a rank
        that failed alone would leave the others waiting in its collectives. One all-reduce (MAX) of one flag per mesh dimension
        of each mesh with more than one rank (the meshes of all parameters, with or without gradients,
        first seen first: the same on every rank). Where no parameter is a DTensor, only ``error`` is
        raised. The step calls it where :attr:`_step_communicates` or with ``skip_nonfinite``: the
        elementwise optimizers' update issues no collectives
        (``test_optim_fsdp.py`` pins it), so a rank that fails its checks raises having written nothing
        and no rank waits on it; what they check of a DTensor (its dtype, shape, mesh; the step counts,
        which every rank advances alike) is the same on every rank of a program DTensor accepts.
        """
        meshes: dict = {}
        for group in self.param_groups:
            for p in group["params"]:
                if is_dtensor(p) and p.device_mesh.size() > 1:
                    meshes.setdefault(p.device_mesh)
        if meshes:
            failed = torch.tensor(float(error is not None))
            for mesh in meshes:
                failed = failed.to(mesh.device_type)
                for dim in range(mesh.ndim):
                    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
            if error is None and bool(failed.item()):
                raise RuntimeError(f"{type(self).__name__}: the step failed its checks on another rank before any "
                                   "write; this rank's parameters, states and step counts are unchanged")
        if error is not None:
            raise error

    # ------------------------------------------------------------------ state_dict
    def _load_pre(self, state_dict: dict) -> dict:
        """Validate all of ``state_dict`` (layout, states, policy options) before ``load_state_dict``
        changes anything, and carry its states through it uncast."""
        check_layout(state_dict, self.param_groups, type(self).__name__)
        state_dict = dict(state_dict)
        state_dict["param_groups"] = self._with_missing_options(state_dict["param_groups"])
        self._check_loaded(state_dict)
        state_dict["state"] = {
            k: {n: (_Keep(v) if isinstance(v, Tensor) and n != "step" else v) for n, v in s.items()}
            for k, s in state_dict["state"].items()
        }
        return state_dict

    def _with_missing_options(self, saved_groups: list) -> list:
        """``saved_groups`` with every option a group lacks (a checkpoint older than the option) set
        to the current group's value, so loading never drops an option."""
        return [{**{k: v for k, v in current.items() if k not in saved}, **saved}
                for saved, current in zip(saved_groups, self.param_groups)]

    def _load_post(self) -> None:
        for p, state in self.state.items():
            for n, v in list(state.items()):
                if isinstance(v, _Keep):
                    state[n] = v.value.to(p.device)
                    local = local_of(state[n])
                    if isinstance(local, QuantizedState):
                        local.state_name = None  # a state dict's label (_states_as_copies), not a live state's


def _collective_device() -> torch.device:
    """A device the default process group's backend broadcasts on: the CPU where one of its
    backends supports it (gloo, mpi, ucc, ``"cpu:gloo,cuda:nccl"``), else the current accelerator
    device (nccl: the current CUDA device)."""
    backends = [part.split(":")[-1] for part in str(dist.get_backend()).split(",")]
    if any("cpu" in dist.Backend.backend_capability.get(b, []) for b in backends):
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def check_layout(state_dict: Any, param_groups: list, name: str) -> None:
    """Raise ``ValueError`` unless ``state_dict`` has the layout of a state dict of an optimizer
    with ``param_groups``: keys ``state`` and ``param_groups``, as many groups, as many parameters
    in each, and a dict of named values for each parameter with a state (and for no other key).
    ``name`` (the optimizer's) begins each message."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= set(state_dict):
        keys = sorted(map(str, state_dict)) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"{name}: expected a state dict with keys 'param_groups' and 'state', got {keys}")
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    if not isinstance(saved_groups, (list, tuple)) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)) for g in saved_groups):
        raise ValueError(f"{name}: 'param_groups' must be a list of dicts, each with a 'params' list")
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"{name}: expected {len(param_groups)} param groups, the state dict has {len(saved_groups)}")
    for gi, (saved, current) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(current["params"]):
            raise ValueError(f"{name}: param group {gi}: expected {len(current['params'])} params, "
                             f"the state dict has {len(saved['params'])}")
    if not isinstance(state, dict):
        raise ValueError(f"{name}: 'state' must be a dict of each param's states, got {type(state).__name__}")
    keys = {pid for g in saved_groups for pid in g["params"]}
    for pid, entry in state.items():
        if pid not in keys:
            raise ValueError(f"{name}: 'state' has an entry for {pid!r}, which no param group lists")
        if not isinstance(entry, dict):
            raise ValueError(f"{name}: the state of {pid!r} must be a dict, got {type(entry).__name__}")


def _get_rng(device: torch.device) -> Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device.index or 0)


def _set_rng(device: torch.device, state: Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device.index or 0)


class QuantizedOptimizer(PolicyOptimizer):
    """Base of qstate's elementwise optimizers. A subclass sets :attr:`rule` (a registered
    :class:`~qstate.optim.rules.UpdateRule`), passes its hyperparameters as ``defaults`` and the
    policy keywords (:class:`~qstate.optim.StatePolicy`) to ``__init__``, and overrides
    :meth:`rule_flags` where its rule has static flags beyond ``maximize``."""

    rule: UpdateRule
    #: whether the optimizer warned of a weak combination (:meth:`_warn_weak`)
    _warned_weak = False

    def rule_flags(self, group: dict) -> dict:
        """The rule's static flags for ``group``: Python values that choose its math (each set of them is
        traced and compiled apart, so never a per-step value). Default: ``{"maximize": group["maximize"]}``
        (False where the group has no ``maximize``)."""
        return {"maximize": bool(group.get("maximize", False))}

    def add_param_group(self, param_group: dict) -> None:
        """:meth:`PolicyOptimizer.add_param_group`, then a warning if the group's format is weak for the rule."""
        super().add_param_group(param_group)
        self._warn_weak(self.param_groups[-1])

    def _warn_weak(self, group: dict) -> None:
        """Warn, once per optimizer, if ``group``'s format is documented weak for this optimizer's rule
        (:data:`~._report.WEAK_COMBINATIONS`)."""
        message = weak_combination(type(self).__name__, self.rule.name, group["state_format"])
        if message is not None and not self._warned_weak:
            self._warned_weak = True
            warn_at_caller(message)

    def _state_specs(self, group: dict) -> Sequence[StateSpec]:
        return self.rule.states(self.rule_flags(group))

    def _prepare_group(self, group: dict, params: list[Tensor], states: list[list[Tensor]], steps: list[Tensor],
                       grad_scale: Optional[Tensor], indices: list[int]) -> _step.PendingUpdate:
        path = group_path(group, self.compile)
        return _step.prepare_update(self.rule, self.rule_flags(group), params, [p.grad for p in params], states,
                                    steps, group, lr=group["lr"], compile=path is Path.FUSED, foreach=path is Path.EAGER,
                                    stochastic_round=group["bf16_stochastic_round"], grad_scale=grad_scale,
                                    owner=type(self).__name__, indices=indices)
