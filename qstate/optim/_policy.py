"""The state policy: what every qstate optimizer's states are, as one object, :class:`StatePolicy`.

Its eight options are keyword arguments of every optimizer (``AdamW(params, lr=1e-3,
state_format="4bit", seed=0)``); no constructor restates them: each takes its own hyperparameters
and ``**policy``, which :meth:`StatePolicy.of` checks in the optimizer's name. The options that
decide what each state is (:data:`POLICY_OPTIONS`) stay the optimizer's when a state dict loads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch

from ..formats import FORMATS, ROUNDINGS, get_format

__all__ = ["StatePolicy", "STATE_FORMATS", "PLAIN_FORMATS", "POLICY_OPTIONS", "GROUP_OPTIONS",
           "STOCHASTIC_BY_DEFAULT", "UNSIGNED_STOCHASTIC", "state_rounding", "check_group_options",
           "rounds_stochastically", "rounds_states_stochastically"]

#: state formats that are plain tensors of a dtype
PLAIN_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: group options that decide what each state is; a loaded state dict's must equal the optimizer's
#: (states are converted only by :func:`qstate.optim.convert_state_dict`)
POLICY_OPTIONS = ("state_format", "block_size", "state_rounding", "min_quantize_numel")
#: the options a param group holds (and may set for itself); ``compile`` and ``skip_nonfinite``
#: are the optimizer's
GROUP_OPTIONS = POLICY_OPTIONS + ("bf16_stochastic_round", "seed")

#: formats whose signed states round stochastically when ``state_rounding`` is None: 4-bit
#: round-to-nearest stalls small EMA increments (digits MLP, AdamW: +12.7% final loss vs fp32)
STOCHASTIC_BY_DEFAULT = frozenset({"4bit"})

#: formats whose unsigned states (second moments) round stochastically, whatever ``state_rounding``
#: says: fp8's 3 mantissa bits hold an EMA's 0.1% steps (beta2 = 0.999) still under round-to-nearest
#: (qstate.formats.fp8); its stochastic rounding never takes a positive value to 0
UNSIGNED_STOCHASTIC = frozenset({"fp8"})


def STATE_FORMATS() -> list[str]:
    """Every accepted ``state_format``: the registered quantized formats plus ``fp32``/``bf16``."""
    return sorted(set(FORMATS) | set(PLAIN_FORMATS))


@dataclasses.dataclass(frozen=True)
class StatePolicy:
    """What an optimizer's states are and how its step writes them: the keyword arguments every
    qstate optimizer takes besides its hyperparameters (``AdamW(params, lr=1e-3, state_format="4bit",
    seed=0)``; a policy object goes in as ``AdamW(params, **dataclasses.asdict(policy))``). Checked
    when built: a bad value raises ``TypeError``/``ValueError`` naming the option.

    Args:
        state_format (str): ``"8bit"``, ``"4bit"``, ``"fp8"`` (quantized states,
            :class:`~qstate.QuantizedState`; any registered format), ``"bf16"`` or ``"fp32"``
            (plain states) (default: ``"8bit"``). Decided once per parameter, the same on every rank,
            from its *global* shape (a DTensor's ``numel()`` is global): a parameter with at least
            ``min_quantize_numel`` elements and 2 or more dims (:func:`qstate.wants_quantized`: 1-D
            shards would not start on block boundaries) gets ``state_format`` states, others float32
            ones. Nothing else ever changes the format: a block size the format rejects, a parameter
            dtype it cannot hold (quantized and bf16 states serve float32/bfloat16/float16
            parameters), a loaded state of another kind all raise, naming the parameter.
        block_size (int or None): quantization block size (default: None, the format's); only for
            quantized formats.
        min_quantize_numel (int): parameters with fewer elements keep float32 states (default: 4096).
        bf16_stochastic_round (bool): write bfloat16 parameters with unbiased stochastic rounding
            drawn from the optimizer's own, saved, random stream (default: False).
        compile (bool): the fused path's compiled kernels, one per kernel spec (default: True);
            ``False`` runs the same math eagerly, op by op and tensor by tensor (the for-loop path of
            ``_arguments.py``'s table), and a group saying ``fused=True`` then raises.
        seed (int or None): seed of the stochastic-rounding stream, a function of ``(seed, param
            group index, step)`` only (default: None: drawn at construction from a private generator
            seeded with ``torch.initial_seed()``, and, when ``torch.distributed`` runs more than one
            rank, replaced by rank 0's at the first step that rounds, so every rank draws the same
            stream). Building and stepping an optimizer leave torch's global generators as they
            were: a run draws the same dropout masks as with ``torch.optim``. Optimizers built under
            the same ``torch.manual_seed`` get the same default seed: pass ``seed=`` to give each a
            stream of its own. A param-group entry, so a checkpoint keeps it.
        state_rounding (str or None): how new values round into the *signed* quantized states (first
            moments, momentum buffers): ``"nearest"`` or ``"stochastic"`` (unbiased; drawn by each
            element's place under a key per parameter and step, the same on every rank and path; the
            map formats implement it) (default: None: stochastic for :data:`STOCHASTIC_BY_DEFAULT`
            formats, ``4bit``, whose round-to-nearest stalls an EMA ``m <- m + 0.1 (g - m)`` while
            the increment is under half a map step; nearest otherwise). Unsigned states (second
            moments) round stochastically in :data:`UNSIGNED_STOCHASTIC` formats (``fp8``, whose 3
            mantissa bits hold an EMA's 0.1% steps still under round-to-nearest; never to 0) and to
            nearest in the others, whatever this says (:func:`state_rounding`). Each state keeps its
            rounding (``QuantizedState.rounding``); loading a checkpoint whose states round
            otherwise raises. Only for quantized formats.
        skip_nonfinite (bool): skip a step whose gradients hold an inf or a NaN on any rank, leaving
            parameters, states and step counts bit-identical (torch's AMP ``found_inf`` protocol: a
            ``GradScaler``'s ``found_inf`` is used as it is, otherwise the step checks the gradients,
            :func:`qstate.amp.found_non_finite`); optimizer-wide, a step is taken or skipped as a
            whole (default: False). With False a gradient is applied as it is: an inf or NaN makes
            that element's update non-finite, as in ``torch.optim``, and in a quantized state the
            whole block of each state it reaches (``qstate/formats/_base.py``).

    The optimizer writes every option but ``compile`` and ``skip_nonfinite`` into its param
    groups' defaults (:data:`GROUP_OPTIONS`; a group may set its own, checked as these); of them,
    :data:`POLICY_OPTIONS` decide what each state is and must match in a state dict it loads.
    """

    state_format: str = "8bit"
    block_size: Optional[int] = None
    min_quantize_numel: int = 4096
    bf16_stochastic_round: bool = False
    compile: bool = True
    seed: Optional[int] = None
    state_rounding: Optional[str] = None
    skip_nonfinite: bool = False

    def __post_init__(self) -> None:
        _check_options(self._options(), type(self).__name__)

    @classmethod
    def of(cls, owner: str, options: Mapping[str, Any]) -> "StatePolicy":
        """The policy of the keywords ``options`` an optimizer ``owner`` (its class name) was given,
        checked in its name: an unknown keyword raises ``TypeError`` as Python's own call would, a bad
        value as :class:`StatePolicy` does, both naming ``owner``."""
        names = {f.name for f in dataclasses.fields(cls)}
        for key in options:
            if key not in names:
                raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {key!r}")
        _check_options({**{f.name: f.default for f in dataclasses.fields(cls)}, **options}, owner)
        return cls(**options)

    def group_options(self, seed: int) -> dict[str, Any]:
        """The param-group entries of this policy (:data:`GROUP_OPTIONS`) with ``seed`` for its seed."""
        return {**{k: getattr(self, k) for k in GROUP_OPTIONS}, "seed": seed}

    def _options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _check_options(options: Mapping[str, Any], name: str) -> None:
    """Check every option of a :class:`StatePolicy` (``seed`` may be None), ``name`` beginning each message."""
    check_group_options({**options, "seed": 0 if options["seed"] is None else options["seed"]}, name)
    for option in ("compile", "skip_nonfinite"):
        if not isinstance(options[option], bool):
            raise TypeError(f"{name}: {option} must be a bool, got {options[option]!r}")


def check_group_options(group: Mapping[str, Any], name: str) -> None:
    """Raise unless ``group``'s :data:`GROUP_OPTIONS` are valid (its ``seed`` an int), ``name`` (the
    optimizer's) beginning each message; checked for every group added or loaded."""
    fmt = group["state_format"]
    if fmt not in FORMATS and fmt not in PLAIN_FORMATS:
        raise ValueError(f"{name}: unknown state_format {fmt!r}; expected one of {STATE_FORMATS()}")
    bs = group["block_size"]
    if bs is not None and (isinstance(bs, bool) or not isinstance(bs, int)):
        raise TypeError(f"{name}: block_size must be an int or None, got {bs!r}")
    if bs is not None and fmt in PLAIN_FORMATS:
        raise ValueError(f"{name}: block_size={bs} has no meaning for state_format={fmt!r} (plain states)")
    if bs is not None:  # checked here too: a group none of whose parameters is quantized yet keeps it
        try:
            get_format(fmt).check_block_size(bs)
        except ValueError as e:
            raise ValueError(f"{name}: state_format={fmt!r} cannot use block_size={bs!r}: {e}") from None
    _check_rounding_option(fmt, group["state_rounding"], name)
    n = group["min_quantize_numel"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name}: min_quantize_numel must be an int >= 0, got {n!r}")
    if isinstance(group.get("seed"), bool) or not isinstance(group.get("seed"), int):
        raise TypeError(f"{name}: seed must be an int or None, got {group.get('seed')!r}")
    if not isinstance(group["bf16_stochastic_round"], bool):
        raise TypeError(f"{name}: bf16_stochastic_round must be a bool, got {group['bf16_stochastic_round']!r}")


def _check_rounding_option(fmt: str, rounding: Optional[str], name: str) -> None:
    if rounding is None:
        return
    if rounding not in ROUNDINGS:
        raise ValueError(f"{name}: state_rounding must be None or one of {list(ROUNDINGS)}, got {rounding!r}")
    if fmt in PLAIN_FORMATS:
        raise ValueError(f"{name}: state_rounding={rounding!r} has no meaning for state_format={fmt!r} "
                         "(plain states)")
    try:  # it applies to the signed states
        get_format(fmt).check_rounding(rounding, signed=True)
    except ValueError as e:
        raise ValueError(f"{name}: state_format={fmt!r} cannot use state_rounding={rounding!r}: {e}") from None


def state_rounding(fmt: str, signed: bool, option: Optional[str]) -> str:
    """The rounding of a quantized ``fmt`` state given the group's ``state_rounding`` ``option``.

    Unsigned states (second moments) round stochastically for :data:`UNSIGNED_STOCHASTIC` formats
    and to nearest for the others (their stochastic rounding could take a positive value down to 0),
    whatever ``option`` says. Signed states take ``option``, or when it is None ``"stochastic"``
    for :data:`STOCHASTIC_BY_DEFAULT` formats and ``"nearest"`` for the others.
    """
    if not signed:
        return "stochastic" if fmt in UNSIGNED_STOCHASTIC else "nearest"
    if option is None:
        return "stochastic" if fmt in STOCHASTIC_BY_DEFAULT else "nearest"
    return option


def rounds_states_stochastically(group: Mapping[str, Any]) -> bool:
    """Whether ``group``'s quantized signed or unsigned states round stochastically (:func:`state_rounding`)."""
    fmt = group["state_format"]
    return fmt not in PLAIN_FORMATS and "stochastic" in (state_rounding(fmt, True, group["state_rounding"]),
                                                         state_rounding(fmt, False, group["state_rounding"]))


def rounds_stochastically(group: Mapping[str, Any]) -> bool:
    """Whether ``group``'s step draws from its rounding stream: bf16 parameters or states rounding
    stochastically."""
    return group["bf16_stochastic_round"] or rounds_states_stochastically(group)
