"""The engine of every optimizer step: :func:`apply_update` of an :class:`~.rules.UpdateRule` over
caller-owned states.

The functional forms (``qstate.optim.functional``) and the optimizer classes call it;
it updates ``params`` and their states in place, like ``torch.optim``'s functional API. States may be plain tensors (float32 or
bfloat16), :class:`~qstate.QuantizedState` (build them with
``qstate.zeros_like(p, fmt, signed=..., dtype=torch.float32)``; second
moments unsigned; the optimizers give ``4bit`` first moments
``rounding="stochastic"``) or DTensors over either. Each quantized state
is written with its own rounding mode. Other optimizer libraries can
call these with their own state tensors.

Paths
-----
The path is chosen once per parameter, in :func:`prepare_update`:

* ``compile=True``: the operator ``qstate::fused_update``, one call per step,
  device, variant and DTensor mesh (plain tensors: none) over lists of
  parameters, gradients and states, as torch's fused AdamW calls
  ``_fused_adamw_``. Its kernels (``_fused_op.py``, one per dispatch key) run each parameter's
  prepared call where it has a valid one (``_prepared.py``: the C or
  inductor kernel and its arguments from an earlier step, after identity and
  pointer checks; a step's prepared calls of one C kernel run as one C
  call), else the fused kernel (decode -> update -> encode in one pass; on
  CPU the C kernel, ``_cpu_kernel.py``, for the kernel specs it takes; otherwise
  inductor's, one graph per kernel spec, ``_kernels.py``), else, for tensors
  the fused kernels cannot run (views, mixed devices), the same math op by
  op. Parameters with plain states and fewer than :data:`SMALL_PLAIN_NUMEL`
  elements (biases, norms) of kernel specs the C kernel does not take are a call of
  the op's eager variant (the math op by op with the eager scalars): faster
  than a compiled kernel's call for them, and nothing to compile.
  On DTensors, DTensor's sharding strategy for the op checks that each gradient
  and state shares its parameter's shape, mesh and (non-Partial) placements, and
  DTensor runs the op on the shards (no collectives); a parameter it rejects
  (``LayoutMismatch``, before any write) takes the path below. With
  stochastic rounding (of a bf16 parameter, or of a state: 4-bit first
  moments by default) the op's ``sr_keys`` are the keys a plain parameter at
  that position gets, and every kernel draws by each element's place in the
  full parameter (each shard one range of it: ``Shard(0)``/``Replicate``; its
  start passed as ``starts``, :func:`~qstate.dtensor_rules.flat_starts`), so
  the sharded update is the unsharded one on any number of ranks.
* ``foreach=True`` (torch.optim's ``foreach``): the op as above, every parameter in its eager
  variant (the math op by op inside one call per device, variant and mesh, as the small plain
  states'); tensors the op's kernels do not take run as below.
* otherwise (``compile=False``, tensors the op's kernels do not take,
  layouts DTensor's strategy rejects): the same math eagerly, op by op. A bf16
  parameter and the states round stochastically with the fused kernels' draws
  (its key, each element's index in the full parameter:
  ``qstate::flat_index_like``, which DTensor computes shard by shard for any
  layout; states written with ``qstate::copy_with_draws_``), so every path
  draws alike. States are read with out-of-place math (plain results) and written
  back with ``state.copy_(new)``, which requantizes a quantized state in
  place into its own layout. Nothing here touches a state's inner tensors or
  a DTensor's local tensor, so each op dispatches through DTensor to the
  local ``QuantizedState``.

AMP: every function takes ``grad_scale``/``found_inf`` (torch's fused-optimizer
protocol, see :func:`apply_update`).

Scalars: ``lr`` may be a Python float or a tensor on any device; a tensor is
converted once per call and device (``lr.to(param.device, float32)``), never
mixed across devices. Step counts (``state_steps``) are 0-dim tensors,
incremented in place as in ``torch.optim``'s functional API, or Python ints
(the 1-based index of this step, left as is).

Checked, then written
---------------------
A call is two phases: :func:`prepare_update` checks everything that can be
checked without writing (each gradient against its parameter: layout, dtype,
shape, device, DTensor mesh; each step count: a finite non-negative integer)
and lays out the calls of the op, writing nothing; :meth:`PendingUpdate.run`
writes the parameters and states, and only after every write returned the
step counts. So an error of the first phase leaves every tensor as it was,
and an error inside a kernel while writing (out of memory, a kernel's own
failure part way through the lists) leaves the step counts as they were, while
parameters and states already written keep their new values (the op writes
many tensors in place and cannot undo them).
"""

from __future__ import annotations

import array
import math
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from .. import _random
from .._dtensor import is_dtensor, is_quantized_state, rounds_stochastically
from .._state import QuantizedState
from ..dtensor_rules._fused_ops import LayoutMismatch, flat_starts, update_mismatch
from . import _cpu_kernel
from ._fused_op import eager_variant, fused_update, fused_variant, variant_name
from ._kernels import KernelSpec
from .rules import RULES, UpdateRule
from ._update import update_eagerly

__all__ = ["SMALL_PLAIN_NUMEL", "PendingUpdate", "apply_update", "check_grad", "check_lists", "next_step", "prepare_update",
           "skip_step", "unscale_factor"]

Scalar = Union[float, Tensor]


class _Scalars:
    """Per-call cache of the rule's scalars in their two forms: the eager math's (Python floats, ``lr``
    and ``grad_unscale`` as given) and the op's ``hyper`` vector (float32, per device and step).

    ``lr`` and ``grad_unscale`` may be tensors on any device: each is converted once per
    device (``.to(device, float32)``), so a tensor on the accelerator never meets an
    offloaded CPU parameter in one op.
    """

    _CALLER = ("lr", "grad_unscale")

    def __init__(self, rule: UpdateRule, group: dict, lr: Scalar, grad_unscale: Scalar = 1.0):
        self.rule, self.group = rule, group
        self.given = {"lr": lr, "grad_unscale": grad_unscale}
        self._tensors = any(isinstance(v, Tensor) for v in self.given.values())
        self._floats: dict[int, dict] = {}
        self._on: dict[tuple, Tensor] = {}
        self._hyper: dict[tuple, Tensor] = {}

    def floats(self, step: int) -> dict:
        if step not in self._floats:
            self._floats[step] = self.rule.scalars(self.group, step)
        return self._floats[step]

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
        h = dict(self.floats(step))
        h.update({n: self.given_on(n, device) for n in self._CALLER})
        return h

    def hyper(self, step: int, device: torch.device) -> Tensor:
        """The scalars as one float32 vector on ``device`` (the compiled kernels' input)."""
        key = (step, device)
        hyper = self._hyper.get(key)
        if hyper is not None:
            return hyper
        if device.type == "cpu" and not self._tensors:  # one op instead of five
            f = self.floats(step)
            values = [self.given[n] for n in self._CALLER] + [f[n] for n in self.rule.scalar_names[len(self._CALLER):]]
            hyper = torch.frombuffer(array.array("f", values), dtype=torch.float32)
        else:  # a tensor lr / grad_unscale joins on ``device`` (never read on the host)
            f = self.floats(step)
            parts = [torch.as_tensor(self.given_on(n, device), dtype=torch.float32, device=device).reshape(1)
                     for n in self._CALLER]
            rest = [f[n] for n in self.rule.scalar_names[len(self._CALLER):]]
            parts.append(torch.tensor(rest, dtype=torch.float32).to(device, non_blocking=True))
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
        dtensor = is_dtensor(p)
        # op by op (stochastic rounding draws as the fused kernels would, on any layout): compile=False,
        # a DTensor whose gradient or states are not all DTensors, and a plain parameter whose tensors
        # are not all of the types the op's kernels take
        if not (compile or foreach) or not (_all_dtensors(g, st) if dtensor else _kernel_types(p, g, st)):
            scalars.eager(step, p.device)  # the rule's scalars of this step: computed (and checked) now
            pending.eager.append(_Member(p, g, st, position, step))
            continue
        # foreach: the op's eager variant; else from the global size: the same on every rank
        eager = foreach or _small_eager(rule, static, p, g, st, sr)
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
        keys = _random.ParamKeys()
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


def _all_dtensors(g: Tensor, st: list[Tensor]) -> bool:
    return is_dtensor(g) and all(is_dtensor(x) for x in st)


def _kernel_types(p: Tensor, g: Tensor, st: list[Tensor]) -> bool:
    """Whether the op's kernels take these tensors as they are: a plain parameter and gradient, plain
    or :class:`~qstate.QuantizedState` states (they run the update op by op where the fused kernels
    cannot: views, mixed devices)."""
    return (type(p) in _PLAIN_TYPES and type(g) is Tensor
            and all(type(x) is Tensor or type(x) is QuantizedState for x in st))


_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


class _Batch:
    """The parameters of one ``qstate::fused_update`` call: its lists, scalars and variant."""

    def __init__(self, rule, static, sr, scalars: _Scalars, step: int, device: torch.device, eager: bool,
                 mesh=None):
        self.step, self.sr, self.mesh = step, sr, mesh
        if eager:
            hyper, variant = eager_variant(rule, static, sr, scalars.eager(step, device))
            self.variant = variant_name(variant)
        else:
            hyper, self.variant = scalars.hyper(step, device), fused_variant(rule.name, static, sr)
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


#: plain-state parameters below this size run the eager math even with ``compile=True``: measured
#: on CPU, 0.05 ms per parameter eagerly vs 0.15 ms through a compiled kernel's call overhead at
#: 4096 elements (even at 65536), and no kernel to compile for them. Kinds the C kernel takes
#: (``_cpu_kernel.supports``: on CPU, float32/bfloat16 states) run it at every size: about 0.01 ms
SMALL_PLAIN_NUMEL = 65536


def _small_eager(rule: UpdateRule, static: tuple, p: Tensor, g: Tensor, states: Sequence[Tensor],
                 sr: bool) -> bool:
    """Whether ``p``'s update runs the eager math as a small one with plain states (unless the C kernel
    takes its kernel spec; for a DTensor: its shards')."""
    if not _small_and_plain(p, states):
        return False
    if p.device.type != "cpu" or not _cpu_kernel.enabled():
        return True
    key = (rule.name, static, p.dtype, g.dtype, sr, tuple(s.dtype for s in states))
    eager = _SMALL_EAGER.get(key)
    if eager is None:  # the C kernel's verdict is a function of the kernel spec: one per key
        spec = KernelSpec.of(rule.name, static, p, states, sr)
        eager = _SMALL_EAGER[key] = not _cpu_kernel.supports(spec, p.device, g.dtype)
    return eager


#: (rule, flags, param, grad and state dtypes, sr) of small plain-state updates on CPU -> whether they
#: run eagerly: asked every step
_SMALL_EAGER: dict[tuple, bool] = {}


def _small_and_plain(p: Tensor, states: Sequence[Tensor]) -> bool:
    # numel() of a DTensor is global: the same choice on every rank and world size
    return p.numel() < SMALL_PLAIN_NUMEL and not any(is_quantized_state(s) for s in states)


def check_lists(what: str, **lists: Optional[Sequence]) -> None:
    sizes = {k: len(v) for k, v in lists.items() if v is not None}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{what}: expected lists of one length, got lengths {sizes}")
