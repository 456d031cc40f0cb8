"""Counter-based random ops for DTensor (``randint_like``, ``rand_like``, ``random_``).

torch runs a DTensor random op as the plain op on every local shard.  On a
mesh without DTensor RNG support (CPU) all ranks then draw the *same* numbers
(W11), so stochastic rounding rounds every shard identically.  Here the value
of element ``i`` (its row-major index in the *global* tensor) is::

    bits(i) = splitmix64(key + (i + 1) * 0x9E3779B97F4A7C15)

with one 63-bit ``key`` drawn per call from the generator (the ``generator=``
argument, else the default generator of the mesh's device) as ``torch.empty((),
dtype=torch.int64).random_(generator=generator)`` draws it.  Hence:

* shards are independent (distinct ``i``), and a shard equals the same slice of
  the full tensor produced by :func:`positional_randint_like` & co. on a plain
  tensor with the same generator state (layout-invariant);
* ``Replicate`` mesh dims agree (same ``i``, same key: SPMD ranks seeded alike
  draw the same key, as DTensor already requires for its own RNG);
* no collective is issued, and the generator advances by one draw per call.

The placement rule is :func:`random_like_strategy` (values never depend on the
input's values: ``Partial -> Replicate``, shards stay); the values come from the
handlers registered in ``OpDispatcher._custom_op_handlers``. The same index
arithmetic serves ``qstate::flat_index_like`` (:func:`flat_index_like_handler`):
each shard's elements' row-major indices in the full tensor, with no key and no
draw, which the optimizers' stochastic rounding hashes with its own keys.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    StrategyType,
)
from torch.distributed.tensor._ops.utils import generate_redistribute_costs
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
)

from qstate import _random
from qstate._library import flat_index_like
from qstate.dtensor_rules import _compat, _probe
from qstate.dtensor_rules._placements import mesh_dims_sharding
from qstate.dtensor_rules._registry import Rule


__all__ = [
    "QSTATE_OP_RULES",
    "RULES",
    "mix64",
    "positional_rand_like",
    "positional_randint_like",
    "positional_random_",
    "random_like_placements",
    "random_like_strategy",
]

aten = torch.ops.aten
Sampler = Callable[[torch.Tensor], torch.Tensor]

# ----------------------------------------------------------------- the stream
# splitmix64's constants as int64 (tensor multiplies wrap mod 2**64 as the words' do)
_GOLDEN = _random.as_int64(_random.GAMMA)
_MIX1 = _random.as_int64(_random.MIX1)
_MIX2 = _random.as_int64(_random.MIX2)
_MASK63 = (1 << 63) - 1


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (z >> s).bitwise_and_((1 << (64 - s)) - 1)


def _xor_lsr_(z: torch.Tensor, s: int) -> torch.Tensor:
    return z.bitwise_xor_(_lsr(z, s))


def mix64(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """splitmix64 output ``index`` of the stream seeded with ``key`` (int64, wraps): :mod:`qstate._random`'s
    ``mix(key + (index + 1) * GAMMA)``, as int64.

    Peak memory is two int64 tensors of ``index``'s shape.
    """
    z = index + 1
    z.mul_(_GOLDEN).add_(key)
    _xor_lsr_(z, 30).mul_(_MIX1)
    _xor_lsr_(z, 27).mul_(_MIX2)
    return _xor_lsr_(z, 31)


def _draw_key(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """One 63-bit key per call; advances ``generator`` (or the default one) once."""
    if generator is not None:
        # a user generator is one object shared by all simulated ranks: draw once
        with _compat.local_tensor_mode_disabled():
            key = torch.empty((), dtype=torch.int64, device=generator.device)
            key.random_(generator=generator)
        return key.to(device)
    # the default generator is per rank (per simulated rank under LocalTensorMode)
    return torch.empty((), dtype=torch.int64, device=device).random_()


# ------------------------------------------------------------------ samplers
def _dtype_range(dtype: torch.dtype) -> tuple[int, int]:
    if dtype == torch.bool:
        return 0, 1
    if dtype.is_floating_point:
        top = int(torch.finfo(dtype).max)
        return -top, top
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


def _randint_sampler(low: int, high: int, dtype: torch.dtype) -> Sampler:
    """Uniform integers in ``[low, high)``, checked against ``dtype`` like torch does."""
    span = high - low
    if span <= 0:
        raise RuntimeError(
            f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}"
        )
    lowest, highest = _dtype_range(dtype)
    if not lowest <= low <= highest:
        raise RuntimeError(f"from is out of bounds for {dtype}")
    if not lowest <= high - 1 <= highest:
        raise RuntimeError(f"to - 1 is out of bounds for {dtype}")
    if (1 << 63) < span < (1 << 64) or span > (1 << 64):
        raise NotImplementedError(f"random range [{low}, {high}) of more than 2**63 values")

    def sample(bits: torch.Tensor) -> torch.Tensor:
        if span == 1 << 64:  # the whole int64 range: the raw bits are uniform
            return bits + low
        if span == 1 << 63:
            return (bits & _MASK63) + low
        return (bits & _MASK63) % span + low  # modulo bias < span / 2**63

    return sample


def _mantissa_bits(dtype: torch.dtype) -> int:
    """Significand digits (implicit bit included): 24 for float32, 8 for bfloat16."""
    if not dtype.is_floating_point:
        raise RuntimeError(f'"check_uniform_bounds" not implemented for {dtype}')
    return round(-math.log2(torch.finfo(dtype).eps)) + 1


def _uniform_sampler(dtype: torch.dtype) -> Sampler:
    m = _mantissa_bits(dtype)

    def sample(bits: torch.Tensor) -> torch.Tensor:
        # k * 2**-m, k < 2**m: exact in dtype and strictly below 1
        return _lsr(bits, 64 - m).to(torch.float64) * (2.0**-m)

    return sample


def _random_default_max(dtype: torch.dtype) -> int:
    """Inclusive upper bound of ``random_()`` / ``random_(from, None)`` for ``dtype``."""
    if dtype == torch.bool:
        return 1
    if dtype.is_floating_point:
        return 1 << _mantissa_bits(dtype)
    return int(torch.iinfo(dtype).max)


# ----------------------------------------------------------- index arithmetic
def _split_1d(vec: torch.Tensor, p: Placement, num_chunks: int, index: int) -> torch.Tensor:
    """The part of a 1-D index vector that ``p`` gives to chunk ``index``."""
    one_d = Shard(0) if isinstance(p, Shard) else _retarget(p)
    chunks, _ = one_d._split_tensor(vec, num_chunks, with_padding=False, contiguous=True)
    return chunks[index]


def _retarget(p: Placement) -> Placement:
    split_factor = getattr(p, "split_factor", None)
    if split_factor is None:
        raise NotImplementedError(f"positional random values for placement {p}")
    return type(p)(0, split_factor=split_factor)


def _local_global_index(
    global_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    orders: Sequence[Sequence[int]],
    device: torch.device,
) -> torch.Tensor:
    """Row-major global index of every element of this rank's shard (int64, local shape)."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    ndim = len(global_shape)
    for d in reversed(range(ndim)):
        vec = torch.arange(global_shape[d], dtype=torch.int64, device=device)
        for m in orders[d]:
            vec = _split_1d(vec, placements[m], mesh_shape[m], coordinate[m])
        view = [1] * ndim
        view[d] = -1
        index = index + vec.view(view) * stride
        stride *= global_shape[d]
    return index


def _shard_index(
    local: torch.Tensor,
    global_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    orders: Sequence[Sequence[int]],
) -> torch.Tensor:
    """:func:`_local_global_index` for the shard ``local``, checked against its shape."""
    index = _local_global_index(
        global_shape, placements, mesh_shape, coordinate, orders, local.device
    )
    if tuple(index.shape) != tuple(local.shape):
        raise AssertionError(
            f"local shard {tuple(local.shape)} does not match its placements "
            f"{tuple(placements)} (expected {tuple(index.shape)})"
        )
    return index


def _fill_local(
    local: torch.Tensor,
    key: torch.Tensor,
    sampler: Sampler,
    *layout: Any,
) -> torch.Tensor:
    """Per rank: ``local`` (already allocated, output dtype) filled with its values
    (``layout``: :func:`_shard_index`'s arguments after ``local``)."""
    return local.copy_(sampler(mix64(key, _shard_index(local, *layout))))


def _fill_index(local: torch.Tensor, *layout: Any) -> torch.Tensor:
    """Per rank: ``local`` (int64) filled with its elements' row-major indices in the full tensor."""
    return local.copy_(_shard_index(local, *layout))


_fill_local_per_rank = _compat.run_per_rank(_fill_local)
_fill_index_per_rank = _compat.run_per_rank(_fill_index)


# ------------------------------------------------------------ placement rule
# values never read the input's values: Partial -> Replicate (one draw, not a
# reduction of draws); Shard/Replicate stay, so no communication is needed.
def random_like_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def random_like_strategy(op_schema: OpSchema) -> StrategyType:
    self_strategy = op_schema.args_schema[0]
    if not isinstance(self_strategy, OpStrategy):
        raise AssertionError(f"Expected OpStrategy, got {type(self_strategy)}")
    strategies = []
    for arg_strategy in self_strategy.strategies:
        arg_spec = arg_strategy.output_spec
        out = DTensorSpec(arg_spec.mesh, random_like_placements(arg_spec.placements))
        strategies.append(
            OpSpec(
                output_specs=out,
                input_specs=(arg_spec,),
                redistribute_cost=[generate_redistribute_costs(self_strategy, arg_spec)],
            )
        )
    return OpStrategy(strategies)


# ----------------------------------------------------------------- execution
def _sample_dtensor(
    self: Any,
    sampler: Sampler,
    generator: torch.Generator | None,
    dtype: torch.dtype,
    *,
    out: Any | None = None,
    memory_format: torch.memory_format | None = None,
) -> Any:
    """Fill a new DTensor like ``self`` (or ``out``, in place) with positional values."""
    key = _draw_key(generator, torch.device(self._spec.mesh.device_type))
    return _positional_dtensor(self, dtype, _fill_local_per_rank, (key, sampler), out=out,
                               memory_format=memory_format)


def _positional_dtensor(
    self: Any,
    dtype: torch.dtype,
    fill: Callable[..., torch.Tensor],
    fill_args: tuple,
    *,
    out: Any | None = None,
    memory_format: torch.memory_format | None = None,
) -> Any:
    """A new DTensor like ``self`` (or ``out``, in place) whose shards ``fill(local, *fill_args,
    *layout)`` computes from their place (``Partial`` mesh dims become ``Replicate``)."""
    from torch.distributed.tensor import DTensor

    spec: DTensorSpec = self._spec
    mesh = spec.mesh
    placements = random_like_placements(spec.placements)
    orders = [mesh_dims_sharding(spec, d) for d in range(self.ndim)]
    coordinate = mesh.get_coordinate()
    if out is None:
        local = torch.empty_like(
            self._local_tensor,
            dtype=dtype,
            memory_format=memory_format or torch.preserve_format,
        )
    else:
        local = out._local_tensor
    if coordinate is not None:  # ranks outside the mesh hold an empty shard
        # fills ``local`` in place (per simulated rank under LocalTensorMode)
        local = fill(
            local, *fill_args, tuple(self.shape), placements,
            tuple(mesh.shape), coordinate, orders,
        )
    if out is not None:
        if tuple(out._spec.placements) != placements:
            out._spec = DTensorSpec(mesh, placements, tensor_meta=out._spec.tensor_meta)
        return out
    meta = TensorMeta(self.shape, _like_stride(self, dtype, memory_format), dtype)
    return DTensor(local, DTensorSpec(mesh, placements, tensor_meta=meta), requires_grad=False)


def _like_stride(
    self: Any, dtype: torch.dtype, memory_format: torch.memory_format | None
) -> tuple[int, ...]:
    """Global stride of ``empty_like(self, dtype, memory_format)`` (computed on meta)."""
    with _compat.local_tensor_mode_disabled():
        meta = torch.empty_strided(
            tuple(self.shape), tuple(self.stride()), dtype=dtype, device="meta"
        )
        like = torch.empty_like(meta, memory_format=memory_format or torch.preserve_format)
    return tuple(like.stride())


def _sample_plain(
    x: torch.Tensor,
    sampler: Sampler,
    generator: torch.Generator | None,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    key = _draw_key(generator, x.device)
    index = torch.arange(x.numel(), dtype=torch.int64, device=x.device).view(x.shape)
    values = sampler(mix64(key, index))
    if out is not None:
        return out.copy_(values)
    return torch.empty_like(x, dtype=dtype).copy_(values)


def _sample(x: Any, sampler: Sampler, generator: Any, dtype: Any, out: Any = None) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return _sample_dtensor(x, sampler, generator, dtype, out=out)
    return _sample_plain(x, sampler, generator, dtype, out=out)


# --------------------------------------------------------------- public API
def positional_randint_like(
    input: torch.Tensor,
    low: int = 0,
    high: int | None = None,
    *,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``torch.randint_like`` from the positional stream (plain tensor or DTensor).

    ``positional_randint_like(x, hi)`` draws from ``[0, hi)`` like torch does.
    """
    if high is None:
        low, high = 0, low
    dtype = dtype or input.dtype
    return _sample(input, _randint_sampler(low, high, dtype), generator, dtype)


def positional_rand_like(
    input: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``torch.rand_like`` from the positional stream: ``k * 2**-m``, ``m`` mantissa bits."""
    dtype = dtype or input.dtype
    return _sample(input, _uniform_sampler(dtype), generator, dtype)


def positional_random_(
    input: torch.Tensor,
    from_: int = 0,
    to: int | None = None,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``Tensor.random_(from_, to)`` from the positional stream (in place)."""
    to_inclusive = _random_default_max(input.dtype) if to is None else to - 1
    sampler = _randint_sampler(from_, to_inclusive + 1, input.dtype)
    return _sample(input, sampler, generator, input.dtype, out=input)


# ------------------------------------------------------------------ handlers
def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    bound.update({a.name: v for a, v in zip(op._schema.arguments, args)})
    bound.update(kwargs)
    return bound


def _check_like_kwargs(a: dict[str, Any], self: Any) -> None:
    device = a.get("device")
    if device is not None and torch.device(device).type != self.device.type:
        raise NotImplementedError("DTensor random *_like ops cannot change the device")


def randint_like_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    a = _bind(op, args, kwargs)
    _check_like_kwargs(a, a["self"])
    dtype = a.get("dtype") or a["self"].dtype
    sampler = _randint_sampler(int(a.get("low", 0)), int(a["high"]), dtype)
    return _sample_dtensor(
        a["self"], sampler, a.get("generator"), dtype, memory_format=a.get("memory_format")
    )


def rand_like_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    a = _bind(op, args, kwargs)
    _check_like_kwargs(a, a["self"])
    dtype = a.get("dtype") or a["self"].dtype
    return _sample_dtensor(
        a["self"], _uniform_sampler(dtype), a.get("generator"), dtype,
        memory_format=a.get("memory_format"),
    )


def random__handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    a = _bind(op, args, kwargs)
    self = a["self"]
    low = int(a.get("from", 0))
    to = a.get("to")
    high = _random_default_max(self.dtype) + 1 if to is None else int(to)
    return _sample_dtensor(
        self, _randint_sampler(low, high, self.dtype), a.get("generator"), self.dtype, out=self
    )


def flat_index_like_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    self = _bind(op, args, kwargs)["self"]
    return _positional_dtensor(self, torch.int64, _fill_index_per_rank, (),
                               memory_format=torch.contiguous_format)


randint_like_ops = [
    aten.randint_like.default,
    aten.randint_like.low_dtype,
    aten.randint_like.generator,
    aten.randint_like.low_generator_dtype,
]
rand_like_ops = [aten.rand_like.default, aten.rand_like.generator]
random__ops = [aten.random_.default, getattr(aten.random_, "from"), aten.random_.to]

_HANDLERS: list[tuple[list[torch._ops.OpOverload], Callable[..., Any]]] = [
    (randint_like_ops, randint_like_handler),
    (rand_like_ops, rand_like_handler),
    (random__ops, random__handler),
]


@_probe.checked
def _draws_identical_shards_on_cpu() -> bool:
    """Whether torch's RNG tracker leaves CPU meshes out (every shard draws the same numbers)."""
    from torch.distributed.tensor._random import is_rng_supported_mesh

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return not is_rng_supported_mesh(_probe.mesh())


_REASON_VALUES = (
    "values = splitmix64(seed, global index): independent shards, Replicate agrees, "
    "reproducible from the generator (torch draws identical shards on CPU meshes)"
)
_REASON_PLACEMENT = "random op had no strategy: Partial -> Replicate, shards stay"

#: torch's random ops on DTensors (opt-in: :func:`qstate.dtensor_rules.install`)
RULES: tuple[Rule, ...] = tuple(
    Rule(op=op, form="handler", impl=handler, reason=_REASON_VALUES,
         needed=_draws_identical_shards_on_cpu)
    for ops, handler in _HANDLERS
    for op in ops
) + tuple(
    Rule(
        op=op,
        form="strategy",
        impl=random_like_strategy,
        schema_info=RuntimeSchemaInfo(static_kwargkey=["dtype"]) if "like" in str(op) else None,
        reason=_REASON_PLACEMENT,
        # with the handler only: a strategy alone lets every rank draw the same numbers (torch's
        # dispatcher does not treat these ops as random), so where torch's RNG makes the handler
        # unneeded and torch has no rule, the op stays torch's error
        needed=_probe.checked(lambda op=op: _draws_identical_shards_on_cpu() and not _probe.has_rule(op)),
    )
    for ops, _ in _HANDLERS
    for op in ops
)

#: qstate's own op (registered by ``import qstate``)
QSTATE_OP_RULES: tuple[Rule, ...] = (
    Rule(
        op=flat_index_like,
        form="handler",
        impl=flat_index_like_handler,
        reason="qstate's flat_index_like: each shard's indices in the full tensor, from its place "
               "(stochastic rounding's draws on any layout; no collectives)",
    ),
)
