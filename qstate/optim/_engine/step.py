"""The engine's door: :func:`apply_update` of a registered :class:`~qstate.optim.rules.UpdateRule`
over caller-owned parameters, gradients, states and step counts (the functional forms and the
optimizer classes call it), updating them in place as ``torch.optim``'s functional API does.

States are plain float32/bfloat16 tensors, :class:`~qstate.QuantizedState` s (second moments
unsigned) or DTensors over either; each quantized state is written with its own rounding mode.
Each parameter's path is chosen by :func:`.path.choose_path`; the op's calls are batched per
(DTensor mesh, variant, step, device, bf16 stochastic rounding). A parameter whose layouts
DTensor's strategy for the op rejects (``LayoutMismatch``, before any write) runs op by op.
Stochastic rounding draws by each element's place in the full tensor under one key per
parameter and step (:class:`qstate._random.ParamKeys`), so every path and layout gives the same
bits. AMP: ``grad_scale``/``found_inf`` follow torch's fused-optimizer protocol.

Checked, then written: :func:`prepare_update` checks everything that can be checked without
writing (each gradient against its parameter: layout, dtype, shape, device, mesh; each step count:
a finite non-negative integer) and writes nothing; :meth:`PendingUpdate.run` writes parameters and
states, then the step counts once every write returned. An error of the first phase leaves every
tensor as it was; one inside a kernel leaves the step counts as they were.
"""

from __future__ import annotations

import array
import math
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from ... import _random
from ..._dtensor import is_dtensor, rounds_stochastically
from ...dtensor_rules._fused_ops import LayoutMismatch, flat_starts, update_mismatch
from .op import UpdateVariant, fused_update
from .path import Path, choose_path
from ..rules import RULES, UpdateRule
from .eager import update_eagerly

__all__ = ["PendingUpdate", "apply_update", "check_grad", "check_lists", "next_step", "prepare_update",
           "skip_step", "unscale_factor"]

Scalar = Union[float, Tensor]


class _Scalars:
    """Per-call cache of the rule's scalars in their two forms: the rule's floats (:meth:`eager`:
    ``rule.scalars`` with ``lr`` and ``grad_unscale`` as given) and the op's ``hyper`` vector
    (:meth:`hyper`: the same values in ``scalar_names`` order, float64).

    ``lr`` and ``grad_unscale`` may be tensors on any device: each is converted once per
    device (``.to(device, float32)``), so a tensor on the accelerator never meets an
    offloaded CPU parameter in one op.
    """

    _CALLER = ("lr", "grad_unscale")

    def __init__(self, rule: UpdateRule, group: dict, lr: Scalar, grad_unscale: Scalar = 1.0):
        self.rule, self.group = rule, group
        self.given = {"lr": lr, "grad_unscale": grad_unscale}
        self._tensors = bool(self.tensor_names())
        self._floats: dict[int, dict] = {}
        self._on: dict[tuple, Tensor] = {}
        self._hyper: dict[tuple, Tensor] = {}

    def tensor_names(self) -> tuple[str, ...]:
        """The names of ``lr`` and ``grad_unscale`` where given as tensors."""
        return tuple(n for n in self._CALLER if isinstance(self.given[n], Tensor))

    def given_on(self, name: str, device: torch.device) -> Scalar:
        """``lr`` / ``grad_unscale`` as given (a float) or as a float32 tensor on ``device``."""
        value = self.given[name]
        if not isinstance(value, Tensor):
            return value
        key = (name, device)
        if key not in self._on:
            self._on[key] = value.detach().to(device=device, dtype=torch.float32).reshape(())
        return self._on[key]

    def eager(self, step: int, device: torch.device) -> dict:
        """The rule's scalars of ``step`` (computed and checked once), ``lr`` and ``grad_unscale`` as given."""
        if step not in self._floats:
            self._floats[step] = self.rule.scalars(self.group, step)
        h = dict(self._floats[step])
        h.update({n: self.given_on(n, device) for n in self._CALLER})
        return h

    def hyper(self, step: int, device: torch.device, eager: bool) -> Tensor:
        """The scalars as the op's float64 vector: on ``device`` for the fused variant, on the CPU for the
        eager one (whose kernel reads them on the host)."""
        key = (step, device, eager)
        hyper = self._hyper.get(key)
        if hyper is not None:
            return hyper
        h = self.eager(step, device)
        values = [h[n] for n in self.rule.scalar_names]
        if eager or (device.type == "cpu" and not self._tensors):  # one op instead of five
            hyper = torch.frombuffer(array.array("d", [float(v) for v in values]), dtype=torch.float64)
        else:  # a tensor lr / grad_unscale joins on ``device`` (never read on the host)
            n = len(self._CALLER)
            parts = [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(1) for v in values[:n]]
            parts.append(torch.tensor(values[n:], dtype=torch.float64).to(device, non_blocking=True))
            hyper = torch.cat(parts)
        self._hyper[key] = hyper
        return hyper


#: step-count dtypes that hold every integer below 2**24 exactly
_EXACT_COUNTS = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})


def next_step(s: Union[int, Tensor], what: str) -> int:
    """The step a count ``s`` takes now: a tensor count (its value, checked: a finite non-negative
    integer) plus one, as the count's dtype stores it; a Python int as it is. Writes nothing."""
    if not isinstance(s, Tensor):
        return int(s)
    value = s.item()
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(f"{what}: its step count must be a finite non-negative integer, got {value}")
    step = int(value) + 1
    # a count the dtype holds exactly stores ``step`` (others round, as the add would)
    return step if step < 2**24 and s.dtype in _EXACT_COUNTS else int(s.new_full((), step).item())


def check_grad(what: str, p: Tensor, g: Tensor) -> None:
    """Raise unless ``g`` is a gradient the update takes for ``p``: a strided (dense) real floating-point
    tensor of ``p``'s shape and device, a DTensor on ``p``'s mesh exactly when ``p`` is one. ``what``
    (the parameter's name) begins the message."""
    if g.layout != torch.strided:
        raise TypeError(f"{what}: sparse gradients are not supported" if g.is_sparse else
                        f"{what}: expected a strided (dense) gradient, got layout {g.layout}")
    if not g.is_floating_point():
        raise TypeError(f"{what}: expected a real floating-point gradient, got {g.dtype}")
    if g.shape != p.shape:
        raise ValueError(f"{what}: expected a gradient of shape {tuple(p.shape)}, got {tuple(g.shape)}")
    if g.device != p.device:
        raise ValueError(f"{what}: expected a gradient on {p.device}, got {g.device}")
    if is_dtensor(p) != is_dtensor(g):
        raise TypeError(f"{what}: expected a {'DTensor' if is_dtensor(p) else 'plain tensor'} gradient as the "
                        f"parameter, got a {'DTensor' if is_dtensor(g) else 'plain tensor'}")
    if is_dtensor(p) and g.device_mesh != p.device_mesh:
        raise ValueError(f"{what}: expected a gradient on the parameter's mesh {p.device_mesh}, "
                         f"got {g.device_mesh}")


@torch.compiler.disable  # runs its own kernels; traced from a caller's torch.compile it is only graph breaks
def apply_update(rule: UpdateRule, flags: dict, params: Sequence[Tensor], grads: Sequence[Tensor],
                 states: Sequence[Sequence[Tensor]], state_steps: Sequence[Union[int, Tensor]],
                 group: dict, *, lr: Scalar, compile: bool = False, stochastic_round: bool = False,
                 grad_scale: Optional[Tensor] = None, found_inf: Optional[Tensor] = None,
                 foreach: bool = False) -> None:
    """Update each ``params[i]`` with ``grads[i]`` and its states ``states[i]`` (in ``rule.states`` order).

    ``compile``: the fused kernels; ``foreach`` (``compile`` is then not read): the op with its eager
    variant, the math op by op in one call over the list; neither: the math op by op, tensor by tensor
    (the paths of torch.optim's ``fused``/``foreach``, ``qstate/optim/_arguments.py``).

    ``grad_scale``/``found_inf`` follow torch's fused-optimizer AMP protocol: the gradients are
    scaled by ``grad_scale`` (unscaled inside the update, never written), and a nonzero
    ``found_inf`` (already reduced across ranks by the scaler) skips the whole call: parameters,
    states and step counts stay bit-identical.

    ``rule`` must be registered (:func:`~qstate.optim.register_rule`): the fused kernels find it
    by name.
    """
    _check_registered(rule)
    if skip_step(found_inf):
        return
    prepare_update(rule, flags, params, grads, states, state_steps, group, lr=lr, compile=compile,
                   foreach=foreach, stochastic_round=stochastic_round, grad_scale=grad_scale).run()


def prepare_update(rule: UpdateRule, flags: dict, params: Sequence[Tensor], grads: Sequence[Tensor],
                   states: Sequence[Sequence[Tensor]], state_steps: Sequence[Union[int, Tensor]],
                   group: dict, *, lr: Scalar, compile: bool = False, foreach: bool = False,
                   stochastic_round: bool = False, grad_scale: Optional[Tensor] = None, owner: Optional[str] = None,
                   indices: Optional[Sequence[int]] = None) -> "PendingUpdate":
    """Check the update :func:`apply_update` describes and lay out its calls, writing nothing (module
    docstring: "Checked, then written"); :meth:`PendingUpdate.run` writes it.

    Raises naming a parameter as ``"<owner>: param <index> (shape, dtype)"`` (``owner``: the rule's
    name by default; ``indices``: each parameter's index, its position in ``params`` by default).
    """
    _check_registered(rule)
    check_lists(rule.name, params=params, grads=grads, states=states, state_steps=state_steps)
    owner = rule.name if owner is None else owner
    steps = []
    for i, (p, g, s) in enumerate(zip(params, grads, state_steps)):
        what = f"{owner}: param {i if indices is None else indices[i]} (shape {tuple(p.shape)}, {p.dtype})"
        check_grad(what, p, g)
        steps.append(next_step(s, what))
    with torch.no_grad():
        return _prepare(rule, flags, params, grads, states, state_steps, steps, group, lr, compile,
                        stochastic_round, 1.0 if grad_scale is None else unscale_factor(grad_scale), foreach)


def _check_registered(rule: UpdateRule) -> None:
    if RULES.get(rule.name) is not rule:
        raise ValueError(f"apply_update: the update rule {rule.name!r} is not registered; register it once "
                         f"with qstate.optim.register_rule(rule)")


def skip_step(found_inf: Optional[Tensor]) -> bool:
    """Whether a gradient scaler's ``found_inf`` asks to skip this step (one host sync)."""
    return found_inf is not None and bool(found_inf.detach().ne(0).any().item())


def unscale_factor(grad_scale: Tensor) -> Tensor:
    """``1 / grad_scale`` as ``torch.amp.GradScaler.unscale_`` computes it (reciprocal in float64)."""
    return grad_scale.detach().double().reciprocal().float()


def _prepare(rule, flags, params, grads, states, state_steps, steps, group, lr, compile, stochastic_round,
             grad_unscale, foreach=False) -> "PendingUpdate":
    scalars = _Scalars(rule, group, lr, grad_unscale)
    static = tuple(sorted(flags.items()))
    pending = PendingUpdate(rule, flags, scalars, stochastic_round)
    # one qstate::fused_update call per (DTensor mesh or None, eager math?, step, device, sr): its lists
    batches = pending.batches
    for i, (p, g, st, step) in enumerate(zip(params, grads, states, steps)):
        sr = bool(stochastic_round) and p.dtype == torch.bfloat16
        st = list(st)
        # draws by position under a key: a bf16 parameter rounding stochastically, or a state; the
        # keys are drawn when the update runs (in its rounding stream), by position in ``params``
        position = i if sr or any(rounds_stochastically(x) for x in st) else None
        path = choose_path(rule.name, static, p, g, st, sr, compile=compile, foreach=foreach)
        if path is Path.OP_BY_OP:
            scalars.eager(step, p.device)  # the rule's scalars of this step: computed (and checked) now
            pending.eager.append(_Member(p, g, st, position, step))
            continue
        eager = path is Path.EAGER
        dtensor = is_dtensor(p)
        mesh = p.device_mesh if dtensor else None
        call = (mesh, eager, step, p.device, sr)
        batch = batches.get(call)
        if batch is None:
            batch = batches[call] = _Batch(rule, static, sr, scalars, step, p.device, eager, mesh)
        batch.add(_Member(p, g, st, position, step))
    pending.counts = [(s, step) for s, step in zip(state_steps, steps) if isinstance(s, Tensor)]
    return pending


class _Member(NamedTuple):
    """One parameter of an update: its gradient, states, position in the call's lists if it draws by
    position under a key (:class:`qstate._random.ParamKeys`), and the step it takes."""

    param: Tensor
    grad: Tensor
    states: list
    position: Optional[int]
    step: int


class PendingUpdate:
    """An update :func:`prepare_update` checked and laid out: :meth:`run` writes it.

    ``eager``: the members updated op by op; ``batches``: the ``qstate::fused_update`` calls; ``counts``:
    each tensor step count and the value it takes once every write returned.
    """

    def __init__(self, rule: UpdateRule, flags: dict, scalars: _Scalars, stochastic_round: bool):
        self.rule, self.flags, self.scalars, self.stochastic_round = rule, flags, scalars, stochastic_round
        self.eager: list[_Member] = []
        self.batches: dict[tuple, _Batch] = {}
        self.counts: list[tuple[Tensor, int]] = []

    def run(self) -> None:
        """Write the parameters and states, then the step counts (module docstring: an error while
        writing leaves the counts as they were). The stochastic-rounding keys are drawn here, from the
        CPU generator, as the first key is needed."""
        drawn: list = []

        def keys(position: int) -> int:  # the stream's keys, drawn on first use (an update that draws)
            if not drawn:
                drawn.append(_random.ParamKeys())
            return drawn[0](position)

        with torch.no_grad():
            for m in self.eager:
                self._eagerly(m, self.stochastic_round, keys)
            for batch in self.batches.values():
                try:
                    batch.run(keys)
                except (LayoutMismatch, RuntimeError) as error:
                    if not _layout_mismatch(error):
                        raise
                    # raised by DTensor's strategy for the op before anything was written: the op takes the
                    # others
                    keyed = batch.keyed  # the call's: the strategy checked every member's layout for its draws
                    for m in batch.drop(lambda m: update_mismatch(m.param, m.grad, m.states, keyed) is not None):
                        self._eagerly(m, batch.sr, keys)
                    batch.run(keys)
            for count, step in self.counts:
                count.fill_(step)  # s += 1 as a fill (cheaper than an add's dispatch), the same value

    def _eagerly(self, m: _Member, sr: bool, keys) -> None:
        key = None if m.position is None else keys(m.position)
        update_eagerly(self.rule, self.flags, m.param, m.grad, m.states, self.scalars.eager(m.step, m.param.device),
                       sr, key)


def _replicated(t: Tensor, mesh) -> Tensor:
    """``t`` as a DTensor replicated on ``mesh`` (every rank holds it already: no collectives)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    return distribute_tensor(t, mesh, [Replicate()] * mesh.ndim, src_data_rank=None)


def _layout_mismatch(error: BaseException) -> bool:
    """Whether ``error`` is, or was raised from, a :class:`LayoutMismatch` (DTensor re-raises a
    strategy's error as a ``RuntimeError`` from it)."""
    while error is not None:
        if isinstance(error, LayoutMismatch):
            return True
        error = error.__cause__
    return False


class _Batch:
    """The parameters of one ``qstate::fused_update`` call: its lists, scalars and variant."""

    def __init__(self, rule, static, sr, scalars: _Scalars, step: int, device: torch.device, eager: bool,
                 mesh=None):
        self.step, self.sr, self.mesh = step, sr, mesh
        hyper = scalars.hyper(step, device, eager)
        tensors = scalars.tensor_names() if eager else ()
        self.variant = UpdateVariant(rule.name, static, sr, eager, tensors).name
        #: on DTensors every tensor argument is a DTensor: the scalars replicated on the parameters' mesh
        self.hyper = hyper if mesh is None else _replicated(hyper, mesh)
        self.members: list[_Member] = []

    @property
    def keyed(self) -> bool:
        """Whether the call passes ``sr_keys`` (some member draws; the others' keys, 0, are not read)."""
        return any(m.position is not None for m in self.members)

    def add(self, member: _Member) -> None:
        self.members.append(member)

    def drop(self, which) -> list[_Member]:
        """Remove the members for which ``which`` holds, and return them."""
        members, self.members, dropped = self.members, [], []
        for m in members:
            (dropped if which(m) else self.members).append(m)
        return dropped

    def run(self, keys) -> None:
        """Run the call; ``keys`` (:class:`qstate._random.ParamKeys`) gives each member's key by position."""
        if not self.members:
            return
        params = [m.param for m in self.members]
        grads = [m.grad for m in self.members]
        states = [x for m in self.members for x in m.states]
        if not self.keyed:
            fused_update(params, grads, states, self.hyper, self.variant)
            return
        sr_keys = [_random.as_int64(0 if m.position is None else keys(m.position)) for m in self.members]
        # on DTensors each shard draws by its place in the full parameter: its own start
        starts = [_FIRST] * len(params) if self.mesh is None else [flat_starts(p) for p in params]
        fused_update(params, grads, states, self.hyper, self.variant, sr_keys=sr_keys, starts=starts)


#: the ``starts`` of a plain parameter: its first element is the full tensor's
_FIRST = torch.zeros(1, dtype=torch.int64)


def check_lists(what: str, **lists: Optional[Sequence]) -> None:
    sizes = {k: len(v) for k, v in lists.items() if v is not None}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{what}: expected lists of one length, got lengths {sizes}")
