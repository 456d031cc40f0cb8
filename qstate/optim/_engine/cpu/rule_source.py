"""An update rule's C body for the C kernel, generated from the rule's ``math``.

:func:`rule_source` traces ``rule.math`` once per (rule, static flags) on 0-dim float32 tensors with
``make_fx`` and writes one C statement per aten op: what inductor's CPU code computes for the same
graph, bit for bit (built with ``-ffp-contract=off``; inductor's lowerings where they differ from
eager, e.g. ``lerp``, ``addcmul``, integer powers, NaN-propagating ``maximum``/``minimum``). Python
numbers are float32 constants.

It writes ``RULE_KEEPS_PARAM`` (1 where the math returns ``p`` as it is: the kernel never writes the
parameter buffer), ``rule_consts_t``/``rule_consts(h)`` (values of the scalars alone) and
``rule(p, g, s, h, c)`` for one element. It takes the pointwise float32 ops of :data:`SUPPORTED`; any
other op or dtype, or math that does not trace, raises :class:`UnsupportedRule` naming the rule, its
flags and the op, and that rule runs inductor's kernel.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor
from torch.fx import GraphModule, Node

from ...rules import UpdateRule

__all__ = ["RuleSource", "SUPPORTED", "UnsupportedRule", "rule_source"]

aten = torch.ops.aten


class UnsupportedRule(NotImplementedError):
    """A rule whose math the C generator does not take (the message names the rule, flags and op)."""


@dataclass(frozen=True)
class RuleSource:
    """A rule's generated C (module docstring) for one set of static flags."""

    rule: str
    flags: tuple
    nstates: int
    code: str


def _float32(value: float) -> float:
    return torch.tensor(float(value), dtype=torch.float32).item()


def _literal(value) -> str:
    """A C float literal of ``value`` rounded to float32 (exact: hexadecimal)."""
    v = _float32(value)
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    mantissa, exponent = v.hex().split("p")
    text = mantissa.rstrip("0").rstrip(".") + "p" + exponent + "f"
    return f"({text})" if text.startswith("-") else text


class _Emitter:
    """C expressions of the graph's values: each a variable name or a literal."""

    def __init__(self, rule: str, flags: tuple):
        self.rule, self.flags = rule, flags

    def unsupported(self, what: str) -> UnsupportedRule:
        return UnsupportedRule(
            f"qstate CPU kernel: the update rule {self.rule!r} (flags {dict(self.flags)}) uses {what}, which "
            f"the C generator does not take (pointwise float32 ops of qstate.optim._engine.cpu.rule_source.SUPPORTED); "
            f"it runs inductor's kernel on CPU")


def _arg(args: Sequence, kwargs: dict, i: int, name: str, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _scaled(x: str, alpha) -> str:
    """``x * alpha`` as inductor's ``allow_alpha`` lowerings write it (no multiply for ``alpha == 1``)."""
    return x if alpha == 1 else f"({x} * {alpha})"


def _pow(x: str, exponent) -> str:
    """``x ** exponent`` as inductor's ``pow`` lowering: repeated squaring (``pow_recursive``) for integer
    exponents in (-32, 32), ``sqrt`` for 0.5."""
    if isinstance(exponent, float) and exponent.is_integer():
        exponent = int(exponent)
    if exponent == 0.5 and not isinstance(exponent, int):
        return f"sqrtf({x})"
    if not isinstance(exponent, int) or not -32 < exponent < 32:
        raise ValueError(exponent)

    def recursive(base: str, n: int) -> str:
        if n < 0:
            return recursive(f"(1.0f / {base})", -n)
        if n == 0:
            return "1.0f"
        if n == 1:
            return base
        half = recursive(base, n // 2)
        result = f"({half} * {half})"
        return f"({result} * {base})" if n % 2 else result

    return recursive(x, exponent)


def _lerp_tensor(start: str, end: str, weight: str) -> str:
    """inductor's ``lerp.Tensor`` decomposition: ``where(|w| >= 0.5, end, start) + where(|w| >= 0.5,
    -(1 - w), w) * (end - start)``."""
    high = f"(fabsf({weight}) >= 0.5f)"
    return (f"(({high} ? {end} : {start}) + (({high} ? (-(1.0f - {weight})) : {weight}) * ({end} - {start})))")


def _lerp_scalar(start: str, end: str, weight: float) -> str:
    """inductor's ``lerp.Scalar`` decomposition: ``end + (end - start) * -(1 - w)`` for ``|w| >= 0.5``
    (``-(1 - w)`` in double, then a float32 constant), else ``start + (end - start) * w``."""
    if weight >= 0.5 or weight <= -0.5:
        return f"({end} + (({end} - {start}) * {_literal(-(1.0 - weight))}))"
    return f"({start} + (({end} - {start}) * {_literal(weight)}))"


#: aten op -> C of its (already C) arguments; numbers among the arguments are float32 literals, except
#: the parameters named in the lambdas' Python code (``alpha``, ``value``, exponents, lerp weights)
_OPS: dict = {
    aten.add.Tensor: lambda a, b, alpha=1: f"({a} + {_scaled(b, alpha)})",
    aten.add.Scalar: lambda a, b, alpha=1: f"({a} + {_scaled(b, alpha)})",
    aten.sub.Tensor: lambda a, b, alpha=1: f"({a} - {_scaled(b, alpha)})",
    aten.sub.Scalar: lambda a, b, alpha=1: f"({a} - {_scaled(b, alpha)})",
    aten.rsub.Tensor: lambda a, b, alpha=1: f"({b} - {_scaled(a, alpha)})",
    aten.rsub.Scalar: lambda a, b, alpha=1: f"({b} - {_scaled(a, alpha)})",
    aten.mul.Tensor: lambda a, b: f"({a} * {b})",
    aten.mul.Scalar: lambda a, b: f"({a} * {b})",
    aten.div.Tensor: lambda a, b: f"({a} / {b})",
    aten.div.Scalar: lambda a, b: f"({a} / {b})",
    aten.neg.default: lambda a: f"(-{a})",
    aten.abs.default: lambda a: f"fabsf({a})",
    aten.sign.default: lambda a: f"((float)(({a} > 0.0f) - ({a} < 0.0f)))",
    aten.sqrt.default: lambda a: f"sqrtf({a})",
    aten.rsqrt.default: lambda a: f"(1.0f / sqrtf({a}))",
    aten.reciprocal.default: lambda a: f"(1.0f / {a})",
    aten.square.default: lambda a: f"({a} * {a})",
    aten.maximum.default: lambda a, b: f"qstate_rule_max({a}, {b})",
    aten.minimum.default: lambda a, b: f"qstate_rule_min({a}, {b})",
    aten.clamp_min.default: lambda a, b: f"qstate_rule_max({a}, {b})",
    aten.clamp_min.Tensor: lambda a, b: f"qstate_rule_max({a}, {b})",
    aten.clamp_max.default: lambda a, b: f"qstate_rule_min({a}, {b})",
    aten.clamp_max.Tensor: lambda a, b: f"qstate_rule_min({a}, {b})",
    aten.where.self: lambda c, a, b: f"({c} ? {a} : {b})",
    aten.where.ScalarSelf: lambda c, a, b: f"({c} ? {a} : {b})",
    aten.where.ScalarOther: lambda c, a, b: f"({c} ? {a} : {b})",
    aten.where.Scalar: lambda c, a, b: f"({c} ? {a} : {b})",
    aten.lerp.Tensor: _lerp_tensor,
    aten.addcmul.default: lambda x, a, b, value=1: f"({x} + ({_literal(value)} * ({a} * {b})))",
    aten.addcdiv.default: lambda x, a, b, value=1: (f"({x} + ({a} / {b}))" if value == 1 else
                                                    f"({x} + ({_literal(value)} * ({a} / {b})))"),
}
for _name, _c in (("gt", ">"), ("lt", "<"), ("ge", ">="), ("le", "<="), ("eq", "=="), ("ne", "!=")):
    for _overload in ("Tensor", "Scalar"):
        _OPS[getattr(getattr(aten, _name), _overload)] = (lambda c: lambda a, b: f"({a} {c} {b})")(_c)
#: ops that return their (float32) input
_IDENTITY = (aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default)
#: parameters passed to the lambdas as Python numbers (not C literals)
_NUMERIC = {"alpha", "value"}

#: the aten ops the generator takes (module docstring)
SUPPORTED: frozenset = frozenset(
    [*_OPS, *_IDENTITY, aten.pow.Tensor_Scalar, aten.lerp.Scalar, aten.clamp.default, aten._to_copy.default,
     aten.scalar_tensor.default, aten.full.default, aten.zeros_like.default, aten.ones_like.default,
     aten.full_like.default])


def _trace(rule: UpdateRule, flags: tuple, nstates: int) -> GraphModule:
    """``rule.math`` as an aten graph of ``(p, g, *states, *scalars) -> (p_new, *new_states)``."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import _disable_current_modes

    names, static = rule.scalar_names, dict(flags)

    def math_of(p: Tensor, g: Tensor, *rest: Tensor):
        h = dict(zip(names, rest[nstates:]))
        p_new, new = rule.math(p, g, list(rest[:nstates]), h, static)
        return (p_new, *new)

    example = [torch.zeros((), dtype=torch.float32) for _ in range(2 + nstates + len(names))]
    with _disable_current_modes(), torch.no_grad():
        return make_fx(math_of, decomposition_table=_inductor_decompositions(), tracing_mode="fake")(*example)


@functools.lru_cache(maxsize=None)
def _inductor_decompositions() -> dict:
    """inductor's decompositions of the ops whose CPU results depend on them (``lerp``): the graph then
    holds the ops inductor lowers, in this torch's version of them."""
    from torch._inductor.decomposition import decompositions

    return {op: decompositions[op] for op in (aten.lerp.Scalar, aten.lerp.Tensor) if op in decompositions}


def _c_type(node: Node, emitter: _Emitter) -> str:
    val = node.meta.get("val")
    if not isinstance(val, Tensor) or val.dim() != 0:
        raise emitter.unsupported(f"{node.target}, which gives a non-scalar value per element")
    if val.dtype == torch.float32:
        return "float"
    if val.dtype == torch.bool:
        return "int"
    raise emitter.unsupported(f"{node.target} computing in {val.dtype} (the kernel computes in float32)")


def _expression(node: Node, c_of: Callable, emitter: _Emitter) -> str:
    """The C expression of ``node`` (an aten op of 0-dim values) from its arguments' (``c_of``)."""
    op, args, kwargs = node.target, node.args, dict(node.kwargs)

    def value(x) -> str:
        if isinstance(x, Node):
            return c_of(x)
        if isinstance(x, bool):
            return str(int(x))
        if isinstance(x, (int, float)):
            return _literal(x)
        raise emitter.unsupported(f"{op} with an argument {x!r}")

    if op in _IDENTITY:
        return value(args[0])
    if op in _OPS:
        fn = _OPS[op]
        names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        given = list(args) + [kwargs.pop(n) for n in names[len(args):] if n in kwargs]
        if kwargs or len(given) > len(names):
            raise emitter.unsupported(f"{op} with arguments {kwargs or args}")
        c_args = [x if n in _NUMERIC else value(x) for n, x in zip(names, given)]
        for n, x in zip(names, given):
            if n in _NUMERIC and not isinstance(x, (int, float)):
                raise emitter.unsupported(f"{op} with a tensor {n}")
        if any(n == "alpha" and x != 1 for n, x in zip(names, given)):
            c_args = [(_literal(x) if n == "alpha" else x) for n, x in zip(names, c_args)]
        return fn(*c_args)
    if op is aten.pow.Tensor_Scalar:
        try:
            return _pow(value(args[0]), args[1])
        except ValueError:
            raise emitter.unsupported(f"{op} with the exponent {args[1]!r} (integers in (-32, 32) and 0.5 only)")
    if op is aten.lerp.Scalar:
        return _lerp_scalar(value(args[0]), value(args[1]), float(args[2]))
    if op is aten.clamp.default:
        low, high = _arg(args, kwargs, 1, "min"), _arg(args, kwargs, 2, "max")
        x = value(args[0])
        if low is not None:
            x = f"qstate_rule_max({x}, {value(low)})"
        if high is not None:
            x = f"qstate_rule_min({x}, {value(high)})"
        return x
    if op is aten._to_copy.default:
        source = args[0].meta["val"].dtype if isinstance(args[0], Node) else None
        target = kwargs.get("dtype", source)
        extra = {k for k, v in kwargs.items() if k not in ("dtype", "device", "layout", "pin_memory") and v}
        if extra or source not in (torch.float32, torch.bool) or target not in (torch.float32, torch.bool):
            raise emitter.unsupported(f"{op} from {source} to {target}")
        if source == target:
            return value(args[0])
        return f"((float){value(args[0])})" if target == torch.float32 else f"({value(args[0])} != 0.0f)"
    if op in (aten.scalar_tensor.default, aten.full.default):
        fill = args[0] if op is aten.scalar_tensor.default else args[1]
        return value(fill)
    if op in (aten.zeros_like.default, aten.ones_like.default):
        return "0.0f" if op is aten.zeros_like.default else "1.0f"
    if op is aten.full_like.default:
        return value(args[1])
    raise emitter.unsupported(f"the op {op}")


_HELPERS = """\
#include <math.h>
/* inductor's max_propagate_nan / min_propagate_nan (a NaN a, else a > b ? a : b: a NaN b gives b), in the
 * form gcc vectorizes (a NaN test joined to the compare with || or | keeps the loop scalar) */
static inline float qstate_rule_max(float a, float b) {
    const float m = a > b ? a : b;
    return a != a ? a : m;
}
static inline float qstate_rule_min(float a, float b) {
    const float m = a < b ? a : b;
    return a != a ? a : m;
}
"""


def _generate(rule: UpdateRule, flags: tuple) -> RuleSource:
    emitter = _Emitter(rule.name, flags)
    try:
        nstates = len(rule.states(dict(flags)))
        gm = _trace(rule, flags, nstates)
    except UnsupportedRule:
        raise
    except Exception as error:  # noqa: BLE001 - any failure to trace is the rule's: named, chained
        raise UnsupportedRule(
            f"qstate CPU kernel: the update rule {rule.name!r} (flags {dict(flags)}) did not trace into aten ops "
            f"on 0-dim float32 tensors ({type(error).__name__}: {error}); it runs inductor's kernel on CPU") from error
    names = rule.scalar_names
    inputs = ["p", "g"] + [f"s{i}" for i in range(nstates)] + [f"h{j}" for j in range(len(names))]
    scalar: dict[Node, bool] = {}  # node -> whether it depends on the scalars (and constants) alone
    c_name: dict[Node, str] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, inputs):
        c_name[node] = name
        scalar[node] = name.startswith("h")
    const_lines: list[str] = []
    elem_lines: list[str] = []
    fields: dict[Node, str] = {}  # scalar nodes the element function reads: their rule_consts_t field

    def elem_ref(n: Node) -> str:
        if not scalar[n]:
            return c_name[n]
        if n not in fields:
            fields[n] = f"k{len(fields)}"
        return f"c->{fields[n]}"

    outputs: list = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            outputs = list(node.args[0])
            break
        if node.op != "call_function":
            raise emitter.unsupported(f"a graph node {node.op} {node.target}")
        ctype = _c_type(node, emitter)
        scalar[node] = all(scalar[d] for d in node.all_input_nodes)
        ref = (lambda n: c_name[n]) if scalar[node] else elem_ref
        expr = _expression(node, ref, emitter)
        c_name[node] = f"v{len(c_name)}"
        (const_lines if scalar[node] else elem_lines).append(
            f"    const {ctype} {c_name[node]} = {expr}; /* {node.target} */")
    if len(outputs) != 1 + nstates:
        raise emitter.unsupported(f"math returning {len(outputs) - 1} new states for {nstates} states")
    results = []
    for out in outputs:
        if not isinstance(out, Node):
            raise emitter.unsupported(f"math returning {out!r}")
        if out.meta.get("val") is not None and (out.meta["val"].dtype != torch.float32 or out.meta["val"].dim()):
            raise emitter.unsupported(f"math returning a {out.meta['val'].dtype} value")
        results.append(elem_ref(out))

    field_types = {n: ("int" if n.meta.get("val") is not None and n.meta["val"].dtype == torch.bool else "float")
                   for n in fields}
    lines = [f"/* the update rule {rule.name!r}, flags {dict(flags)}: generated from its math by "
             f"qstate/optim/_engine/cpu/rule_source.py */", _HELPERS]
    # math returning its ``p`` as it is: the kernel never writes the parameter buffer (which may be read-only)
    lines.append(f"#define RULE_KEEPS_PARAM {int(c_name.get(outputs[0]) == 'p')}")
    lines.append("typedef struct {")
    lines += [f"    {field_types[n]} {f}; /* {c_name[n]} */" for n, f in fields.items()]
    lines.append("    int unused_;")
    lines.append("} rule_consts_t;")
    lines.append("static inline rule_consts_t rule_consts(const float *restrict h) {")
    lines += [f"    const float h{j} = h[{j}]; /* {name} */" for j, name in enumerate(names)]
    lines += const_lines
    lines.append("    rule_consts_t c;")
    lines += [f"    c.{f} = {c_name[n]};" for n, f in fields.items()]
    lines.append("    c.unused_ = 0;")
    lines.append("    return c;")
    lines.append("}")
    lines.append("static inline float rule(float p, float g, float *restrict s, const float *restrict h, "
                 "const rule_consts_t *restrict c) {")
    lines.append("    (void)p, (void)g, (void)h, (void)c;")
    lines += [f"    const float s{i} = s[{i}];" for i in range(nstates)]
    lines += [f"    (void)s{i};" for i in range(nstates)]
    lines += elem_lines
    lines += [f"    s[{i}] = {r};" for i, r in enumerate(results[1:])]
    lines.append(f"    return {results[0]};")
    lines.append("}")
    return RuleSource(rule.name, flags, nstates, "\n".join(lines) + "\n")


@functools.lru_cache(maxsize=None)
def rule_source(rule: UpdateRule, flags: tuple) -> RuleSource:
    """``rule``'s generated C for the static ``flags`` (sorted ``(name, value)`` pairs), traced once per
    rule object and flags. Raises :class:`UnsupportedRule` where the math uses what the generator does not
    take (module docstring)."""
    return _generate(rule, flags)
