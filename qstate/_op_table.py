"""The ``__torch_dispatch__`` table of :class:`~qstate.QuantizedState`.

Each entry is one function per aten / c10d op overload, added with
:func:`register` by the handler modules of :mod:`qstate.ops`;
:class:`~qstate.QuantizedState` reads it and this module imports nothing of
qstate. qstate's own ops (``qstate::*``) are not in it: each registers its
rule for the subclass with ``torch.library.register_torch_dispatch`` next
to its kernels, and the dispatcher runs that rule in place of
``__torch_dispatch__``. An op with no entry raises
``NotImplementedError`` naming the op and its argument types: there is no
silent dequantize fallback. Ops that *read* a state as numbers (``mul``,
``sqrt``, ...) are registered explicitly, or as a family torch tags
(:func:`register_by_tag`: every ``pointwise`` and ``reduction`` op), and
return plain tensors.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._ops import OpOverload
from torch.utils._pytree import tree_flatten

__all__ = ["DISPATCH_TABLE", "DISPATCH_BY_NAME", "DISPATCH_BY_TAG", "register", "register_by_name",
           "register_by_tag", "dispatch", "registered_ops"]

Handler = Callable[[OpOverload, tuple, dict], Any]

#: op overload -> handler(func, args, kwargs)
DISPATCH_TABLE: dict[OpOverload, Handler] = {}
#: overload name (``OpOverload.name()``, e.g. ``"prims::fma"``) -> handler, for ops that exist only once
#: another module defines them (inductor's prims, which ``torch.compile`` emits): asked after the table
DISPATCH_BY_NAME: dict[str, Handler] = {}
#: op family (a ``torch.Tag`` torch gives its ops, e.g. ``pointwise``) -> handler, for the family's
#: overloads with no entry of their own: asked last, in insertion order
DISPATCH_BY_TAG: dict[torch.Tag, Handler] = {}


def _registrar(table: dict, keys: tuple) -> Callable[[Handler], Handler]:
    """A decorator making the function ``table``'s handler of every key in ``keys`` (each once)."""

    def deco(fn: Handler) -> Handler:
        for key in keys:
            if key in table:
                raise RuntimeError(f"{key} already has a QuantizedState handler ({table[key].__name__})")
            table[key] = fn
        return fn

    return deco


def register(*ops: OpOverload) -> Callable[[Handler], Handler]:
    """Decorator: make the function the handler of every overload in ``ops``."""
    return _registrar(DISPATCH_TABLE, ops)


def register_by_name(*names: str) -> Callable[[Handler], Handler]:
    """Decorator: make the function the handler of the overloads named ``names`` (``OpOverload.name()``),
    whenever their op comes to exist."""
    return _registrar(DISPATCH_BY_NAME, names)


def register_by_tag(*tags: torch.Tag) -> Callable[[Handler], Handler]:
    """Decorator: make the function the handler of every overload tagged with one of ``tags`` that has
    no handler of its own."""
    return _registrar(DISPATCH_BY_TAG, tags)


def registered_ops() -> list[str]:
    """Names of all ops a QuantizedState handles, sorted (an op family as ``tag:<name>``)."""
    return sorted([str(op) for op in DISPATCH_TABLE] + list(DISPATCH_BY_NAME)
                  + [f"tag:{tag.name}" for tag in DISPATCH_BY_TAG])


def _type_names(args: tuple, kwargs: dict) -> str:
    leaves, _ = tree_flatten((args, kwargs))
    return ", ".join(type(x).__name__ for x in leaves if isinstance(x, torch.Tensor))


def dispatch(func: OpOverload, types: tuple, args: tuple, kwargs: dict) -> Any:
    handler = DISPATCH_TABLE.get(func)
    if handler is None:
        handler = DISPATCH_BY_NAME.get(func.name())
    if handler is None:
        handler = next((h for tag, h in DISPATCH_BY_TAG.items() if tag in func.tags), None)
    if handler is None:
        raise NotImplementedError(
            f"QuantizedState does not support {func} (tensor arguments: {_type_names(args, kwargs)}); "
            "dequantize() first, or register a handler for it with qstate.ops.register"
        )
    return handler(func, args, kwargs)
