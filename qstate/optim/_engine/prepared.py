"""Prepared calls: a parameter's fused update, kept between steps and rerun after a few checks.

Each backend leaves one per parameter (or DTensor shard) it updates: the kernel and its arguments
(the C kernel's ``qstate_t`` slots; inductor's compiled function and aliases of the tensors'
storage). A later call of the op finds it (:func:`registered_call`) and runs it while
:meth:`PreparedUpdate.valid` holds, instead of deriving the kernel spec and arguments again.

Validity: the parameter object, its storage, dtype and shape; the state objects, their buffers
(address and size) and maps (version); the gradient's dtype, shape, contiguity and device; the
rule, static flags and stochastic rounding; a shard's first flat index; and the backends'
registrations and switches (:data:`.backends.GENERATION`) are those the call was prepared with.
Anything else takes the full path, which prepares a new call.

Registry: keyed by the parameter and its first state, weakly held: an entry leaves with its
parameter or any of its states. Valid calls of one :attr:`~PreparedUpdate.group` may run together
(:meth:`PreparedUpdate.run_group`). This module holds the calls; it never runs one.
"""

from __future__ import annotations

import functools
import weakref
from typing import Optional, Sequence, Union

from torch import Tensor

from .backends import GENERATION

__all__ = ["PreparedUpdate", "registered_call", "prepared_calls", "clear_prepared_calls"]

Hyper = Union[Tensor, Sequence[float]]


def _buffers(states: Sequence[Tensor]) -> tuple[int, ...]:
    """The buffers a prepared call holds for ``states`` (codes and scales, or plain values): each one's
    data pointer and size in bytes, which the kernel was checked against when the call was prepared (a
    buffer replaced by one of another size at the same address is another buffer; the sizes cost about
    a third of the data pointers' time, against two thirds more for shapes and strides)."""
    out: list[int] = []
    for s in states:
        if type(s) is Tensor:
            out += (s.data_ptr(), s.nbytes)
        else:
            codes, scale = s.codes, s.scale
            out += (codes.data_ptr(), codes.nbytes, scale.data_ptr(), scale.nbytes)
    return tuple(out)


class PreparedUpdate:
    """One parameter's fused update, ready to run again (module docstring).

    Subclasses hold what their kernel needs and define :meth:`__call__`, :attr:`group` and, to run
    several calls of one group at once, :meth:`run_group`; this base holds what the update was derived
    from and checks a new call's tensors against it (:meth:`valid`).
    """

    __slots__ = ("spec", "generation", "rule_key", "sr", "start", "key", "param", "states", "p_ptr", "p_dtype", "device", "g_dtype", "g_shape",
                 "buffers", "maps", "__weakref__")

    def __init__(self, spec, p: Tensor, g: Tensor, states: Sequence[Tensor], start: int = 0):
        self.spec = spec
        #: the backends' registrations and switches it was built under (:data:`.backends.GENERATION`)
        self.generation = GENERATION[0]
        #: the update's (rule, static flags, stochastic rounding): what the caller checks it against
        self.rule_key = (spec.rule, spec.flags, spec.stochastic_round)
        #: whether each call takes a stochastic-rounding key (:class:`qstate._random.ParamKeys`)
        self.sr = spec.keyed
        #: the flat index of ``p``'s first element in its full tensor (0: ``p`` is whole)
        self.start = start
        #: the registry key (:func:`_key`)
        self.key = key = _key(p, states)
        # when the parameter or a state dies; the registry is bound, not looked up: at interpreter exit the
        # callback may run after this module's globals are gone. The callback holds this call weakly: no
        # reference cycle, so a call the registry drops is freed at once (with what it holds: an inductor
        # call's views keep its tensors' storage alive), not at a later garbage collection
        forget = functools.partial(_forget, _PREPARED, key, weakref.ref(self))
        self.param = weakref.ref(p, forget)
        self.states = tuple(weakref.ref(s, forget) for s in states)
        self.p_ptr, self.p_dtype, self.device = p.data_ptr(), p.dtype, p.device
        self.g_dtype, self.g_shape = g.dtype, g.shape
        self.buffers = _buffers(states)
        #: each quantized state's map and its version (an in-place write changes the decode)
        self.maps = tuple((s.qmap, s.qmap._version) for s in states if type(s) is not Tensor and s.qmap is not None)

    def register(self) -> None:
        """Enter this call in the registry (replacing its parameter's earlier one)."""
        _PREPARED[self.key] = self

    def valid(self, rule_key: tuple, p: Tensor, g: Tensor, states: Sequence[Tensor], start: int) -> bool:
        """Whether this call updates ``p`` from ``g`` and ``states`` as the full path would (``rule_key``: the
        rule's name, its sorted static flags and stochastic rounding; ``start``: ``p``'s first flat index
        in its full tensor)."""
        if rule_key != self.rule_key or start != self.start or len(states) != len(self.states):
            return False
        for ref, s in zip(self.states, states):
            if ref() is not s:
                return False
        if p.data_ptr() != self.p_ptr or p.dtype is not self.p_dtype or not p.is_contiguous():
            return False
        if p.shape != self.g_shape:  # the parameter's shape when the call was prepared (its gradient's)
            return False
        if type(g) is not Tensor or g.dtype is not self.g_dtype or g.shape != self.g_shape:
            return False
        if not g.is_contiguous() or g.device != self.device:
            return False
        for qmap, version in self.maps:
            if qmap._version != version:
                return False
        return _buffers(states) == self.buffers and self.generation == GENERATION[0]

    @property
    def group(self) -> tuple:
        """Calls with equal groups (and scalars) may run together (:meth:`run_group`)."""
        raise NotImplementedError

    def __call__(self, p: Tensor, g: Tensor, hyper: Hyper, key: int = 0) -> None:
        """Run the update (``key``: the parameter's stochastic-rounding key, read if :attr:`sr`)."""
        raise NotImplementedError

    @classmethod
    def run_group(cls, calls: Sequence["PreparedUpdate"], params: Sequence[Tensor], grads: Sequence[Tensor],
                  hyper: Hyper, keys: Sequence[int]) -> None:
        """Run valid calls of one :attr:`group`, each with its parameter, gradient and key (a parameter
        appears once): by default one after another."""
        for call, p, g, key in zip(calls, params, grads, keys):
            call(p, g, hyper, key)


#: (id(parameter), id(first state)) -> PreparedUpdate (weakly held tensors; an entry leaves with any of them)
_PREPARED: dict[tuple[int, int], PreparedUpdate] = {}


def _key(p: Tensor, states: Sequence[Tensor]) -> tuple[int, int]:
    """A prepared call's registry key: the parameter and its first state (several optimizers may
    update one parameter, each with its own states)."""
    return id(p), id(states[0]) if states else 0


def _forget(registry: dict, key: tuple[int, int], call: weakref.ref, _ref: weakref.ref) -> None:
    """The parameter or a state of ``call()`` died: drop its entry (unless a newer call owns the key)."""
    live = call()
    if live is not None and registry.get(key) is live:
        del registry[key]


def registered_call(p: Tensor, states: Sequence[Tensor]) -> Optional[PreparedUpdate]:
    """The call registered for ``p`` and its ``states``, valid or not (the caller asks
    :meth:`PreparedUpdate.valid` before running it), else ``None``."""
    call = _PREPARED.get(_key(p, states))
    return call if call is not None and call.param() is p else None


def prepared_calls() -> int:
    """How many prepared calls the registry holds."""
    return len(_PREPARED)


def clear_prepared_calls(params: Optional[Sequence[Tensor]] = None) -> None:
    """Forget the prepared calls of ``params`` (None: every call); the next update of each such parameter
    takes the full path."""
    if params is None:
        _PREPARED.clear()
        return
    ids = {id(p) for p in params}
    for key in [k for k in _PREPARED if k[0] in ids]:
        del _PREPARED[key]
