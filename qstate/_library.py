"""The ``qstate`` operator namespace (``torch.ops.qstate``): schemas and fake kernels.

This module defines each op's schema and its fake kernel (shapes and dtypes, for tracing); the
module that owns an op's math registers its kernels and its rule for
:class:`~qstate.QuantizedState` arguments, and :mod:`qstate.dtensor_rules` its DTensor strategy,
so the strategies can name the ops without importing the optimizers. The ops (each alias below
states its contract):

* ``fused_update``: one optimizer update of a list of parameters and their states, in place,
  one call per step and param group (as torch's ``_fused_adamw_``);
* ``flat_index_like``: each element's row-major index in the full tensor, no collectives;
* ``copy_with_draws_``: ``copy_`` whose stochastic rounding draws by position;
* ``stochastic_round_bf16``: float32 to bfloat16 with given draws;
* ``encode_into_``, ``decode``: a state's encode (rounded to nearest) and decode, on its parts.

Invariant: stochastic decisions depend on each element's place in the full tensor, never on the
layout, so every path and every number of ranks draws alike.
"""

from __future__ import annotations

import torch

from typing import Sequence

__all__ = ["LIBRARY", "copy_with_draws_", "decode", "encode_into_", "flat_index_like", "fused_update",
           "states_per_param", "stochastic_round_bf16"]

#: the ``qstate`` namespace; lives as long as the process (torch has no way to drop a namespace)
LIBRARY = torch.library.Library("qstate", "DEF")
LIBRARY.define("fused_update(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] states, Tensor hyper, str variant, "
               "int[]? sr_keys=None, Tensor[]? starts=None) -> ()")

LIBRARY.define("flat_index_like(Tensor self) -> Tensor")
LIBRARY.define("copy_with_draws_(Tensor(a!) self, Tensor src, Tensor draws) -> ()")
LIBRARY.define("stochastic_round_bf16(Tensor x, Tensor draws) -> Tensor")
LIBRARY.define("encode_into_(Tensor(a!) codes, Tensor(b!) scale, Tensor values, Tensor? qmap, str format, "
               "bool signed, int block_size, int row_len) -> ()")
LIBRARY.define("decode(Tensor codes, Tensor scale, Tensor? qmap, str format, bool signed, int block_size, "
               "int row_len) -> Tensor")


# fake (meta) kernels, for tracing and FakeTensorMode: shapes and dtypes only
@torch.library.register_fake("qstate::fused_update", lib=LIBRARY)
def _fused_update_fake(params, grads, states, hyper, variant, sr_keys=None, starts=None) -> None:
    states_per_param(params, grads, states)


@torch.library.register_fake("qstate::flat_index_like", lib=LIBRARY)
def _flat_index_like_fake(self):
    return torch.empty_like(self, dtype=torch.int64, memory_format=torch.contiguous_format)


@torch.library.register_fake("qstate::copy_with_draws_", lib=LIBRARY)
def _copy_with_draws_fake(self, src, draws) -> None:
    return None


@torch.library.register_fake("qstate::stochastic_round_bf16", lib=LIBRARY)
def _stochastic_round_bf16_fake(x, draws):
    return torch.empty_like(x, dtype=torch.bfloat16)

@torch.library.register_fake("qstate::encode_into_", lib=LIBRARY)
def _encode_into_fake(codes, scale, values, qmap, format, signed, block_size, row_len) -> None:
    return None


@torch.library.register_fake("qstate::decode", lib=LIBRARY)
def _decode_fake(codes, scale, qmap, format, signed, block_size, row_len):
    return codes.new_empty((codes.shape[0] * row_len,), dtype=torch.float32)

#: ``fused_update(params, grads, states, hyper, variant, sr_keys=None, starts=None)``: one optimizer
#: update of each ``params[i]`` and its states in place. ``states`` is flat, the same number per
#: parameter (:func:`states_per_param`): ``params[i]``'s are ``states[i * n:(i + 1) * n]``. ``hyper``
#: is the update rule's scalar vector (shared: one step count); ``variant`` names the rule, its static
#: flags, stochastic rounding and compilation. With stochastic rounding (of a bf16 parameter or of a
#: state), ``sr_keys`` gives each parameter's rounding key (int64, the 64-bit key's two's complement)
#: and ``starts`` the flat index of each parameter's first element in its full tensor, one int64
#: element each (on DTensors, an int64 DTensor sharded as its parameter with one element per shard,
#: so each shard gets its own), so each element's draw depends on its place in the full tensor;
#: they come together, and ``None`` draws keys in the kernel. On DTensors every tensor argument is
#: a DTensor (``hyper`` replicated).
fused_update = torch.ops.qstate.fused_update.default
#: ``flat_index_like(self)``: int64 in ``self``'s shape, each element's row-major index in ``self``
#: (for a DTensor: in the full tensor, computed on each rank from its shard's place, no collectives).
#: Stochastic rounding hashes it with a key, so every path and layout draws alike.
flat_index_like = torch.ops.qstate.flat_index_like.default
#: ``copy_with_draws_(self, src, draws)``: ``self.copy_(src)``, where a quantized ``self`` that rounds
#: stochastically draws by position: ``draws`` holds each element's 32-bit draw (int64 in
#: ``[0, 2**32)``, ``self``'s shape), which other states and plain tensors ignore. The optimizers'
#: updates write their states with it op by op, so every path draws alike.
copy_with_draws_ = torch.ops.qstate.copy_with_draws_.default
#: ``stochastic_round_bf16(x, draws)``: float32 ``x`` rounded stochastically to bfloat16 with the
#: integer ``draws`` in ``[0, 2**16)`` of ``x``'s shape. Its kernel reinterprets bits with
#: ``view(dtype)``; as one op, a DTensor runs it shard by shard under qstate's own rule, whatever
#: torch's rule for ``view(dtype)`` is.
stochastic_round_bf16 = torch.ops.qstate.stochastic_round_bf16.default
#: ``encode_into_(codes, scale, values, qmap, format, signed, block_size, row_len)``: ``values`` (float32
#: or bfloat16, any shape, the elements of ``codes.shape[0]`` rows of ``row_len`` less under a row of
#: padding) encoded into a state's ``codes`` and ``scale`` in place, rounded to nearest, as
#: ``qstate.formats.get_format(format).encode`` encodes them. The parts are a state's
#: (:class:`~qstate.QuantizedState`'s storage rules); anything else raises ``ValueError`` before any
#: write. Its kernels: the formats' torch ops (``CompositeExplicitAutograd``) and the device kernels of
#: :mod:`qstate._state_kernels` (the same bits), so compiled code calls them as one op.
encode_into_ = torch.ops.qstate.encode_into_.default
#: ``decode(codes, scale, qmap, format, signed, block_size, row_len)``: a state's values from its parts, a
#: new float32 tensor of ``codes.shape[0] * row_len`` elements (padding included), as
#: ``qstate.formats.get_format(format).decode`` reads them; kernels and checks as ``encode_into_``'s.
decode = torch.ops.qstate.decode.default


def states_per_param(params: Sequence, grads: Sequence, states: Sequence) -> int:
    """``n``, the states of each parameter in a ``fused_update`` call; raises if the lists disagree."""
    if len(grads) != len(params) or (len(states) % len(params) if params else len(states)):
        raise ValueError(f"qstate::fused_update: expected one grad per param and the same number of states per "
                         f"param, got {len(params)} params, {len(grads)} grads, {len(states)} states")
    return len(states) // len(params) if params else 0
