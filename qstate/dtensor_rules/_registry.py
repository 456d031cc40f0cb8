"""A listable, undoable set of overrides of DTensor's dispatch tables.

DTensor picks the rule for an op overload from ``OpDispatcher._custom_op_handlers`` (bypassing
propagation), then ``ShardingPropagator.op_single_dim_strategy_funcs``, ``op_strategy_funcs``
(where ``register_sharding`` writes) and ``op_to_rules``, then decomposition (torch 2.13,
``propagate_op_sharding_non_cached``). So replacing an op strategy also takes the op out of the
single-dim table, and every change clears the sharding caches (the Python LRU, which is
thread-local: install before starting threads that run DTensor; the C++ fast-path cache; the
tensor-meta cache).

Invariants kept by :class:`Registry`:

* ``install()`` is idempotent and ``uninstall()`` its exact inverse: every entry it wrote goes
  back to what was there (or is removed), unless someone replaced it meanwhile (then the foreign
  entry stays and a warning names it);
* a rule whose ``needed`` check says this torch has the fix is not written (:meth:`Registry.not_needed`);
* a handler rule with a ``device_type`` acts on meshes of that type only (:class:`DeviceHandlers`
  runs torch's own entry or path for every other mesh);
* the registry's only state (``_saved``, ``_written``, ``_report``, ``_not_needed``) is empty
  whenever nothing is installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch._ops import OpOverload

from qstate.dtensor_rules import _compat


__all__ = ["DeviceHandlers", "InstalledOverride", "Registry", "Rule"]

RuleForm = Literal["strategy", "single_dim", "handler", "function"]

# table names, as attributes of ShardingPropagator (or OpDispatcher for handlers)
_STRATEGY = "op_strategy_funcs"
_SCHEMA_INFO = "op_to_schema_info"
_SINGLE_DIM = "op_single_dim_strategy_funcs"
_SINGLE_DIM_SCHEMA_INFO = "op_to_schema_info_for_single_dim_strategy"
_HANDLERS = "_custom_op_handlers"

_MISSING = object()


def _always() -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Rule:
    """One override for one op overload.

    ``form`` says which table ``impl`` goes to:

    * ``"strategy"``: ``impl(op_schema) -> OpStrategy`` into ``op_strategy_funcs``
      (and the op is removed from the single-dim table, which would win);
    * ``"single_dim"``: ``impl(original_info) -> _SingleDimStrategyInfo`` wraps
      torch's single-dim strategy (``install()`` raises if torch has none);
    * ``"handler"``: ``impl(op_call, args, kwargs)`` into
      ``OpDispatcher._custom_op_handlers`` (runs instead of propagation + local op); with a
      ``device_type``, only for DTensors on meshes of that device type (:class:`DeviceHandlers`);
    * ``"function"``: ``impl(original) -> function`` replaces the attribute ``op`` (a name) of
      ``module`` (a DTensor module or class, by its dotted path), where the series changes a
      function rather than a table.
    """

    op: Any  # OpOverload; a function's name for ``"function"`` rules
    form: RuleForm
    impl: Callable[..., Any]
    reason: str
    schema_info: Any = None  # RuntimeSchemaInfo | None
    #: whether this torch still lacks the fix (a check of torch's own rule, :mod:`._probe`);
    #: :meth:`Registry.install` skips the rule when it answers False
    needed: Callable[[], bool] = _always
    #: the mesh device type the fix is for (None: every mesh); handler rules route by it, function
    #: rules hold it in ``impl``
    device_type: str | None = None
    #: function rules: the dotted path of the module or class whose attribute ``op`` is replaced
    module: str | None = None


class _Attributes:
    """An object's own attributes as the mapping :class:`Registry` writes tables through."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner

    def get(self, name: str, default: Any = None) -> Any:
        return vars(self.owner).get(name, default)

    def __getitem__(self, name: str) -> Any:
        return vars(self.owner)[name]

    def __setitem__(self, name: str, value: Any) -> None:
        setattr(self.owner, name, value)

    def __delitem__(self, name: str) -> None:
        delattr(self.owner, name)

    def pop(self, name: str, default: Any = None) -> Any:
        value = self.get(name, default)
        if name in vars(self.owner):
            delattr(self.owner, name)
        return value


def _owner(path: str) -> Any:
    """The module or class at the dotted ``path``."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _mesh_device_type(args: tuple, kwargs: dict) -> str | None:
    from torch.distributed.tensor import DTensor

    for arg in (*args, *kwargs.values()):
        for t in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(t, DTensor):
                return t.device_mesh.device_type
    return None


class DeviceHandlers:
    """A ``_custom_op_handlers`` entry keyed by mesh device type: ``handlers[device_type]`` for a
    call whose first DTensor lives on a mesh of that type, ``fallback`` (torch's own entry) for any
    other call; without a fallback, torch's path (:func:`_compat.dispatch_as_torch`)."""

    def __init__(self, handlers: dict[str, Callable[..., Any]], fallback: Callable[..., Any] | None) -> None:
        self.handlers = handlers
        self.fallback = fallback

    def __call__(self, op: OpOverload, args: tuple, kwargs: dict) -> Any:
        handler = self.handlers.get(_mesh_device_type(args, kwargs))  # type: ignore[arg-type]
        if handler is not None:
            return handler(op, args, kwargs)
        if self.fallback is not None:
            return self.fallback(op, args, kwargs)
        return _compat.dispatch_as_torch(op, args, kwargs)


@dataclasses.dataclass(frozen=True)
class InstalledOverride:
    """What :func:`installed` reports for one table entry we own."""

    op: str
    table: str
    action: Literal["added", "replaced", "removed"]
    reason: str
    #: the mesh device type the entry acts on (None: every mesh)
    device_type: str | None = None


class Registry:
    """Applies a fixed sequence of :class:`Rule` s to DTensor's tables, and undoes it."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules: tuple[Rule, ...] = tuple(rules)
        self._lock = threading.Lock()
        # (table, op) -> object that was there before install (or _MISSING)
        self._saved: dict[tuple[str, OpOverload], object] = {}
        # (table, op) -> object we wrote (or _MISSING when we removed the entry)
        self._written: dict[tuple[str, OpOverload], object] = {}
        self._report: list[InstalledOverride] = []
        self._not_needed: list[Rule] = []
        self._installed = False

    # ------------------------------------------------------------------ tables
    @staticmethod
    def _table(name: str) -> dict[OpOverload, Any] | None:
        if name.startswith("torch."):  # a module's or class's attributes (function rules)
            return _Attributes(_owner(name))  # type: ignore[return-value]
        owner = _compat.dispatcher() if name == _HANDLERS else _compat.propagator()
        table = getattr(owner, name, None)
        return table if isinstance(table, dict) else None

    def _write(self, name: str, op: OpOverload, value: object, rule: Rule) -> None:
        table = self._table(name)
        if table is None:  # this torch has no such table: nothing to override
            return
        key = (name, op)
        before = table.get(op, _MISSING)
        if key not in self._saved:
            self._saved[key] = before
        if value is _MISSING:
            if before is _MISSING:
                return
            del table[op]
            action = "removed"
        else:
            table[op] = value
            action = "added" if self._saved[key] is _MISSING else "replaced"
        self._written[key] = value
        self._report.append(InstalledOverride(str(op), name, action, rule.reason, rule.device_type))

    def _apply(self, rule: Rule) -> None:
        op = rule.op
        if rule.form == "strategy":
            # single-dim strategies take precedence over op strategies
            self._write(_SINGLE_DIM, op, _MISSING, rule)
            self._write(_SINGLE_DIM_SCHEMA_INFO, op, _MISSING, rule)
            self._write(_STRATEGY, op, rule.impl, rule)
            if rule.schema_info is not None:
                self._write(_SCHEMA_INFO, op, rule.schema_info, rule)
        elif rule.form == "single_dim":
            table = self._table(_SINGLE_DIM)
            original = None if table is None else table.get(op)
            if original is None:  # the check said torch lacks the fix, but there is no rule to amend
                raise RuntimeError(f"qstate.dtensor_rules: torch {torch.__version__} has no single-dim strategy "
                                   f"for {op} to amend ({rule.reason}); nothing installed")
            self._write(_SINGLE_DIM, op, rule.impl(original), rule)
            if rule.schema_info is not None:
                self._write(_SINGLE_DIM_SCHEMA_INFO, op, rule.schema_info, rule)
        elif rule.form == "handler" and rule.device_type is None:
            self._write(_HANDLERS, op, rule.impl, rule)
        elif rule.form == "handler":
            table = self._table(_HANDLERS)
            current = None if table is None else table.get(op)
            if isinstance(current, DeviceHandlers) and self._written.get((_HANDLERS, op)) is current:
                current.handlers[rule.device_type] = rule.impl
                self._report.append(InstalledOverride(str(op), _HANDLERS, "replaced", rule.reason, rule.device_type))
            else:
                self._write(_HANDLERS, op, DeviceHandlers({rule.device_type: rule.impl}, current), rule)
        elif rule.form == "function":
            self._write(rule.module, op, rule.impl(self._table(rule.module)[op]), rule)
        else:  # pragma: no cover - guarded by the Literal type
            raise ValueError(f"unknown rule form {rule.form!r}")

    def _restore_all(self) -> None:
        for (name, op), ours in reversed(list(self._written.items())):
            table = self._table(name)
            if table is None:
                continue
            current = table.get(op, _MISSING)
            if current is not ours:
                warnings.warn(
                    f"qstate.dtensor_rules: {name}[{op}] was changed by someone else "
                    "after install(); leaving their entry in place",
                    stacklevel=3,
                )
                continue
            before = self._saved[(name, op)]
            if before is _MISSING:
                table.pop(op, None)
            else:
                table[op] = before
        self._saved.clear()
        self._written.clear()
        self._report.clear()
        self._not_needed.clear()

    # --------------------------------------------------------------- public API
    def install(self) -> None:
        """Apply every rule this torch needs (:attr:`Rule.needed`) once; a second call is a no-op."""
        with self._lock:
            if self._installed:
                return
            try:
                # ask every check first: a check reads torch's rules, not ours
                needed = [rule.needed() for rule in self.rules]
                for rule, need in zip(self.rules, needed):
                    if need:
                        self._apply(rule)
                    else:
                        self._not_needed.append(rule)
                self._installed = True
            except BaseException:
                self._restore_all()
                raise
            finally:
                _compat.clear_sharding_caches()

    def uninstall(self) -> None:
        """Put back every table entry ``install`` changed; a no-op if not installed."""
        with self._lock:
            if not self._installed:
                return
            try:
                self._restore_all()
            finally:
                self._installed = False
                _compat.clear_sharding_caches()

    def is_installed(self) -> bool:
        return self._installed

    def installed(self) -> list[InstalledOverride]:
        """One record per table entry currently owned by this registry."""
        return list(self._report)

    def not_needed(self) -> list[Rule]:
        """The rules the last ``install`` skipped because torch's own rule already gives the fix."""
        return list(self._not_needed)
