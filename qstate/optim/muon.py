"""Muon with a quantized momentum buffer: the rule, :class:`Muon` and its functional form :func:`muon`.

Muon (Jordan et al., 2024) updates a 2-D parameter with the orthogonalized momentum of its gradient;
Newton-Schulz needs the whole matrix, so the update runs op by op, outside the elementwise rules.
Semantics are ``torch.optim.Muon``'s: ``B <- lerp(B, g, 1 - momentum)``; ``U <- lerp(g, B, momentum)``
with ``nesterov``, else ``B``; ``O <- NS(U)`` (``ns_steps`` quintic iterations with ``ns_coefficients``
in bfloat16, on the transpose of a tall matrix, after dividing by ``max(||U||_F, eps)``); ``p <- p * (1
- lr * weight_decay)``, then ``p <- p - adjust_lr(lr, shape) * O``.

Storage rules and invariants: the momentum buffer is a state of the optimizer's policy (a signed
:class:`~qstate.QuantizedState`, a DTensor over one, or a plain tensor); the momentum is computed in
float32 from it and stored with ``copy_`` (requantized in its own layout and rounding), so with
float32 states and parameters the results are ``torch.optim.Muon``'s. DTensor parameters stay
DTensors: the update matrix is redistributed to ``Replicate()`` in bfloat16 (one all-gather per
parameter and step), orthogonalized locally and redistributed back, so a sharded step equals the
unsharded one. A buffer that rounds stochastically draws by each element's place in the full matrix
under one key per parameter and step (the optimizer's rounding stream): the same bits on any number
of ranks.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from .._dtensor import is_dtensor, rounds_stochastically
from ._base import PolicyOptimizer
from ._engine import step as _step
from ._arguments import check_betas, check_lr, check_non_negative
from .._random import ParamKeys
from .rules import RULES, StateSpec
from ._engine.eager import write_states

__all__ = ["Muon", "muon", "zeropower_via_newtonschulz", "adjust_lr", "ADJUST_LR_FNS"]

#: torch.optim.Muon's defaults (Keller Jordan's Newton-Schulz coefficients)
EPS = 1e-7
DEFAULT_A = 3.4445
DEFAULT_B = -4.7750
DEFAULT_C = 2.0315
DEFAULT_NS_STEPS = 5
#: accepted ``adjust_lr_fn`` values besides None (which means "original")
ADJUST_LR_FNS = ("original", "match_rms_adamw", "spectral_unclamped")

_LR = Union[float, Tensor]


# ---------------------------------------------------------------- the rule's math
def zeropower_via_newtonschulz(update: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                               eps: float) -> Tensor:
    """Orthogonalize a 2-D ``update`` by ``ns_steps`` quintic Newton-Schulz iterations, in bfloat16.

    The ops of ``torch.optim.Muon`` in its order, so the bits are its bits. ``update`` may be a
    replicated DTensor (each rank runs the iteration locally on the whole matrix). Returns a new
    bfloat16 tensor; ``update`` is not modified.
    """
    if ns_steps >= 100:
        raise ValueError(f"Muon: ns_steps must be less than 100, got {ns_steps}")
    if update.ndim != 2:
        raise ValueError(f"Muon: Newton-Schulz takes a 2-D matrix, got shape {tuple(update.shape)}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"Muon: ns_coefficients must be three values (a, b, c), got {tuple(ns_coefficients)}")
    a, b, c = ns_coefficients
    x = update.bfloat16()
    if update.size(0) > update.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    if update.size(0) > update.size(1):
        x = x.T
    return x


def adjust_lr(lr: float, adjust_lr_fn: Optional[str], shape: Sequence[int]) -> float:
    """The learning rate of the orthogonalized update of a ``shape`` (``A x B``) parameter.

    ``None``/``"original"``: ``lr * sqrt(max(1, A / B))`` (Keller Jordan's); ``"match_rms_adamw"``:
    ``lr * 0.2 * sqrt(max(A, B))`` (Moonshot's, to reuse AdamW's lr and weight decay);
    ``"spectral_unclamped"``: ``lr * sqrt(A / B)`` (Bernstein's).
    """
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif adjust_lr_fn == "spectral_unclamped":
        ratio = math.sqrt(rows / cols)
    else:
        raise ValueError(f"Muon: adjust_lr_fn must be None or one of {list(ADJUST_LR_FNS)}, got {adjust_lr_fn!r}")
    return lr * ratio


def _orthogonalize(update: Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                   eps: float) -> Tensor:
    """:func:`zeropower_via_newtonschulz` of ``update``; a DTensor is gathered whole (in bfloat16, the
    iteration's dtype: the same values in half the bytes), orthogonalized and resharded like it."""
    if not is_dtensor(update):
        return zeropower_via_newtonschulz(update, ns_coefficients, ns_steps, eps)
    from torch.distributed.tensor import Replicate

    mesh, placements = update.device_mesh, update.placements
    whole = update.bfloat16().redistribute(mesh, [Replicate()] * mesh.ndim)
    return zeropower_via_newtonschulz(whole, ns_coefficients, ns_steps, eps).redistribute(mesh, placements)


def muon(params: Sequence[Tensor], grads: Sequence[Tensor], muon_momentum_bufs: Sequence[Tensor], *,
         foreach: Optional[bool] = None, lr: _LR, weight_decay: float, momentum: float, nesterov: bool,
         ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float, adjust_lr_fn: Optional[str],
         has_complex: bool = False) -> None:
    """Functional Muon (``torch.optim._muon.muon``'s arguments): update ``params`` and their buffers in place.

    ``muon_momentum_bufs[i]`` is ``params[i]``'s momentum: a plain tensor, a signed
    :class:`~qstate.QuantizedState` (``qstate.zeros_like(p, fmt, dtype=torch.float32)``), or a
    DTensor over either with the parameter's placements. Parameters, gradients and buffers
    are 2-D; everything is checked before anything is written (:func:`_prepare_muon`). ``lr`` may be
    a one-element tensor (read once on the host).
    """
    if foreach:
        raise RuntimeError("Muon: foreach=True is not supported; Muon updates one matrix at a time")
    if has_complex:
        raise ValueError("Muon: complex parameters are not supported")
    _prepare_muon(params, grads, muon_momentum_bufs, [], lr=lr, weight_decay=weight_decay, momentum=momentum,
                  nesterov=nesterov, ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps,
                  adjust_lr_fn=adjust_lr_fn).run()


class _MuonUpdate(NamedTuple):
    """A Muon update checked by :func:`_prepare_muon`, not yet written: :meth:`run` writes it."""

    params: list
    grads: list
    bufs: list
    #: each parameter's Newton-Schulz update lr (:func:`adjust_lr`)
    adjusted_lrs: list
    #: each tensor step count and the value it takes once every write returned
    counts: list
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple
    ns_steps: int
    eps: float

    def run(self) -> None:
        """Write every parameter and buffer, then the step counts (an error while writing, an
        out-of-memory or a failed collective of a DTensor's redistribution, leaves the counts as they
        were and what was written so far written)."""
        keys = ParamKeys()  # stochastically rounded buffers draw by place under a key per parameter
        for i, (p, g, buf, alpha) in enumerate(zip(self.params, self.grads, self.bufs, self.adjusted_lrs)):
            g32 = g if g.dtype == torch.float32 else g.float()
            readable = buf if buf.dtype == torch.float32 else buf.float()  # a quantized state reads as float32
            new_buf = readable.lerp(g32, 1 - self.momentum)
            update = g32.lerp(new_buf, self.momentum) if self.nesterov else new_buf
            write_states(p, [buf], [new_buf], keys(i) if rounds_stochastically(buf) else None)
            update = _orthogonalize(update, self.ns_coefficients, self.ns_steps, self.eps)
            p.mul_(1 - self.lr * self.weight_decay)
            p.add_(update, alpha=-alpha)
        for count, step in self.counts:
            count.fill_(step)


def _prepare_muon(params: Sequence[Tensor], grads: Sequence[Tensor], bufs: Sequence[Tensor],
                  state_steps: Sequence[Tensor], *, lr: _LR, weight_decay: float, momentum: float, nesterov: bool,
                  ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float,
                  adjust_lr_fn: Optional[str], owner: str = "muon",
                  indices: Optional[Sequence[int]] = None) -> _MuonUpdate:
    """Check a Muon update (lists, each gradient and buffer against its parameter, each step count
    of ``state_steps``, which may be empty, the arguments) and return it unwritten; ``owner`` and
    ``indices`` name a parameter in messages as in :func:`~qstate.optim._engine.step.prepare_update`."""
    if not len(params) == len(grads) == len(bufs):
        raise ValueError(f"muon: expected as many grads and buffers as params, got {len(params)} params, "
                         f"{len(grads)} grads, {len(bufs)} buffers")
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(f"Muon: ns_steps must be an int in [0, 100), got {ns_steps!r}")
    if len(ns_coefficients) != 3:
        raise ValueError(f"Muon: ns_coefficients must be three values (a, b, c), got {tuple(ns_coefficients)}")
    lr = float(lr)
    counts = []
    for i, (p, g, buf) in enumerate(zip(params, grads, bufs)):
        what = f"{owner}: param {i if indices is None else indices[i]} (shape {tuple(p.shape)}, {p.dtype})"
        _step.check_grad(what, p, g)
        if tuple(buf.shape) != tuple(p.shape):
            raise ValueError(f"{what}: expected a momentum buffer of its shape, got {tuple(buf.shape)}")
        if p.ndim != 2:
            raise ValueError(f"{what}: Muon updates 2-D parameters, got shape {tuple(p.shape)}")
        if i < len(state_steps):
            counts.append((state_steps[i], _step.next_step(state_steps[i], what)))
    adjusted = [adjust_lr(lr, adjust_lr_fn, p.shape) for p in params]
    return _MuonUpdate(list(params), list(grads), list(bufs), adjusted, counts, lr, float(weight_decay),
                       float(momentum), bool(nesterov), tuple(ns_coefficients), ns_steps, float(eps))


# ---------------------------------------------------------------- the optimizer
#: the static flags of an AdamW group: exactly ``qstate.optim.AdamW``'s (its kernels, its states)
_ADAMW_FLAGS = {"amsgrad": False, "maximize": False, "decoupled": True}
#: options of the AdamW groups, given to :class:`Muon` as ``adamw_<name>``
_ADAMW_OPTIONS = ("lr", "betas", "eps", "weight_decay")


class Muon(PolicyOptimizer):
    r"""Muon with a quantized momentum buffer (``torch.optim.Muon`` arguments and semantics), and
    qstate's AdamW for the parameters Muon does not take.

    Which parameters Muon updates: a param group's ``use_muon`` says it (``True``: Muon, every
    parameter must be 2-D; ``False``: AdamW). A group that does not say is split in two: its 2-D
    parameters form a Muon group, its other parameters (biases, norms' weights: any non-2-D
    tensor) an AdamW group right after it. Embeddings and output heads are 2-D: pass them in a
    ``use_muon=False`` group to give them AdamW, as Muon's authors do.

    An AdamW group runs ``qstate.optim.AdamW``'s update (same states, kernels and results) with
    the group's ``lr``, ``betas``, ``eps`` and ``weight_decay``; a split group's AdamW half takes
    them from the group's ``adamw_lr``, ``adamw_betas``, ``adamw_eps`` and
    ``adamw_weight_decay`` entries if present, else from the arguments of the same names (so a
    ``lr_scheduler`` scales both halves' ``lr``). Muon's hyperparameters are ignored in AdamW
    groups and AdamW's in Muon groups.

    Args (as ``torch.optim.Muon``):
        params: parameters or param groups (see above).
        lr (float or Tensor): learning rate of Muon groups (default: 1e-3).
        weight_decay (float): decoupled weight decay of Muon groups (default: 0.1).
        momentum (float): momentum factor (default: 0.95).
        nesterov (bool): Nesterov momentum (default: True).
        ns_coefficients (tuple of three floats): Newton-Schulz coefficients ``(a, b, c)``.
        eps (float): lower bound of the norm the update is divided by (default: 1e-7).
        ns_steps (int): Newton-Schulz iterations, less than 100 (default: 5).
        adjust_lr_fn (str or None): ``None``/``"original"``, ``"match_rms_adamw"`` or
            ``"spectral_unclamped"`` (see :func:`adjust_lr`).

    Keyword-only (qstate):
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW groups' defaults
            (``qstate.optim.AdamW``'s: 1e-3, (0.9, 0.999), 1e-8, 1e-2).
        **policy: the state policy (:class:`~qstate.optim.StatePolicy`), for Muon's momentum
            buffers and AdamW's moments alike. Momentum buffers are signed states: ``4bit`` ones
            round stochastically unless ``state_rounding`` says otherwise. ``compile`` is AdamW
            groups' (Muon groups always run op by op); ``seed`` defaults to 0 (every rank draws
            alike with no broadcast); ``bf16_stochastic_round`` must stay False (Muon writes
            parameters op by op, to nearest).

    State: each parameter keeps ``step`` (a float32 CPU tensor) and ``momentum_buffer`` (Muon)
    or ``exp_avg``/``exp_avg_sq`` (AdamW). ``state_dict()``/``load_state_dict()`` keep quantized
    states as they are and check a loaded state dict against the optimizer's policy and each
    group's ``use_muon`` before changing anything. Gradients are read as they are: with a
    ``GradScaler`` the scaler unscales them first (``_step_supports_amp_scaling`` is False), and
    ``step(grad_scale=...)`` raises.
    """

    _step_supports_amp_scaling = False
    #: a Muon group redistributes DTensor matrices: every rank learns of a failed check first
    _step_communicates = True

    def __init__(self, params: Iterable, lr: _LR = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                 eps: float = EPS, ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: Optional[str] = None, *,
                 adamw_lr: _LR = 1e-3, adamw_betas: tuple[float, float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 1e-2, **policy: Any):
        #: the AdamW groups' defaults (read by add_param_group, also after construction)
        self._adamw_defaults = {"lr": adamw_lr, "betas": tuple(adamw_betas), "eps": adamw_eps,
                                "weight_decay": adamw_weight_decay}
        _check_adamw_group("Muon (adamw_ arguments)", self._adamw_defaults)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn)
        _check_muon_group(defaults)
        # seed 0: every rank's stream is the same without a broadcast (Muon has no bf16 stochastic rounding)
        super().__init__(params, defaults, **{"seed": 0, **policy})

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        """Add ``param_group`` (split by ``use_muon`` as the class documents); on any error raise and
        leave the optimizer's groups as they were."""
        group = dict(param_group)
        params = group["params"]
        if isinstance(params, set):
            raise TypeError("Muon: optimizer parameters need to be organized in ordered collections, but the "
                            "ordering of tensors in sets will change between runs; use a list instead")
        params = [params] if isinstance(params, Tensor) else list(params)
        adamw = {k: group.pop(f"adamw_{k}", self._adamw_defaults[k]) for k in _ADAMW_OPTIONS}
        use_muon = group.pop("use_muon", None)
        if use_muon is None:
            matrices = [p for p in params if _tensor_of(p).ndim == 2]
            others = [p for p in params if _tensor_of(p).ndim != 2]
            parts = [(True, matrices, {}), (False, others, adamw)]
            parts = [part for part in parts if part[1]] or [(True, params, {})]
        elif isinstance(use_muon, bool):
            parts = [(use_muon, params, {} if use_muon else {k: group.get(k, v) for k, v in adamw.items()})]
        else:
            raise TypeError(f"Muon: use_muon must be a bool, got {use_muon!r}")
        first_group, first_param = len(self.param_groups), self._n_params
        try:
            for is_muon, part, options in parts:
                if is_muon:
                    for i, p in enumerate(part):
                        if _tensor_of(p).ndim != 2:
                            raise ValueError(
                                f"{self._describe(self._n_params + i, _tensor_of(p))}: a Muon group (use_muon=True) "
                                f"takes 2-D parameters, got {_tensor_of(p).ndim}-D; give it use_muon=False "
                                "(AdamW), or leave use_muon unset to route non-2-D parameters to AdamW")
                super().add_param_group({**group, **options, "params": part, "use_muon": is_muon})
        except BaseException:
            del self.param_groups[first_group:]
            self._n_params = first_param
            raise

    def _check_group(self, group: dict) -> None:
        if group["bf16_stochastic_round"]:
            raise ValueError("Muon: bf16_stochastic_round must be False: Muon writes parameters op by op, "
                             "rounding to nearest")
        if group["use_muon"]:
            _check_muon_group(group)
        else:
            _check_adamw_group("Muon (AdamW group)", group)

    def _state_specs(self, group: dict) -> tuple[StateSpec, ...]:
        """A Muon group's signed ``momentum_buffer``; an AdamW group's qstate AdamW states."""
        if group["use_muon"]:
            return (StateSpec("momentum_buffer", True),)
        return RULES["adam"].states(_ADAMW_FLAGS)

    def _check_loaded(self, state_dict: dict) -> None:
        for gi, (saved, current) in enumerate(zip(state_dict["param_groups"], self.param_groups)):
            if saved.get("use_muon") != current["use_muon"]:
                raise ValueError(f"Muon: param group {gi}, option 'use_muon': expected {current['use_muon']!r} "
                                 f"(the optimizer's), the state dict has {saved.get('use_muon')!r}")
        super()._check_loaded(state_dict)

    # ------------------------------------------------------------------ step
    def _prepare_group(self, group: dict, params: list[Tensor], states: list[list[Tensor]], steps: list[Tensor],
                       grad_scale: Optional[Tensor], indices: list[int]) -> Any:
        """A Muon group's update by :func:`muon`'s math, an AdamW group's by ``qstate.optim.AdamW``'s."""
        if grad_scale is not None:
            raise ValueError("Muon: step(grad_scale=...) is not supported: unscale the gradients first "
                             "(GradScaler.unscale_)")
        grads = [p.grad for p in params]
        if group["use_muon"]:
            return _prepare_muon(params, grads, [s[0] for s in states], steps, lr=group["lr"],
                                 weight_decay=group["weight_decay"], momentum=group["momentum"],
                                 nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"],
                                 ns_steps=group["ns_steps"], eps=group["eps"], adjust_lr_fn=group["adjust_lr_fn"],
                                 owner="Muon", indices=indices)
        return _step.prepare_update(RULES["adam"], dict(_ADAMW_FLAGS), params, grads, states, steps, group,
                                    lr=group["lr"], compile=self.compile, owner="Muon", indices=indices)


def _tensor_of(p: Any) -> Tensor:
    """The tensor of a params entry (``named_parameters`` gives ``(name, tensor)`` pairs)."""
    return p[1] if isinstance(p, tuple) else p


def _check_muon_group(group: dict) -> None:
    """torch.optim.Muon's checks, plus the Newton-Schulz arguments' (torch checks those at the step)."""
    check_lr("Muon", group["lr"])
    check_non_negative("Muon", "momentum value", group["momentum"])
    check_non_negative("Muon", "weight_decay value", group["weight_decay"])
    fn = group["adjust_lr_fn"]
    if fn is not None and fn not in ADJUST_LR_FNS:
        raise ValueError(f"Muon: adjust_lr_fn must be None or one of {list(ADJUST_LR_FNS)}, got {fn!r}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"Muon: ns_steps must be an int in [0, 100), got {steps!r}")
    if len(group["ns_coefficients"]) != 3:
        raise ValueError(f"Muon: ns_coefficients must be three values (a, b, c), got {group['ns_coefficients']!r}")


def _check_adamw_group(name: str, group: dict) -> None:
    """``qstate.optim.AdamW``'s checks of ``lr``, ``betas``, ``eps`` and ``weight_decay``."""
    check_lr(name, group["lr"])
    check_betas(name, group["betas"])
    check_non_negative(name, "epsilon value", group["eps"])
    check_non_negative(name, "weight_decay value", group["weight_decay"])
