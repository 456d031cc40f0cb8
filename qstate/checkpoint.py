"""``torch.distributed.checkpoint`` loading that validates before it writes.

``dcp.load`` copies each stored piece into the destination as it reads it, so
a checkpoint with another format, block size, shape or signedness would fail
half way, with some states already overwritten. :func:`load` reads into a
staging copy first (errors name the state's key), then copies into the live
tensors only when every piece loaded. It costs one extra copy of the states
while loading.

Saving needs nothing special: ``dcp.save`` stores quantized DTensor states
shard by shard, and loading at another world size moves whole rows (see
:mod:`qstate.distributed`), so it is exact for ``ndim >= 2`` states.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.utils._pytree import tree_map_only

from ._state import QuantizedState

__all__ = ["load", "NamingLoadPlanner"]


class NamingLoadPlanner(DefaultLoadPlanner):
    """A ``DefaultLoadPlanner`` that names each quantized destination after its key,
    so a mismatch error says which state it is."""

    def resolve_tensor(self, read_item):
        tensor = super().resolve_tensor(read_item)
        if isinstance(tensor, QuantizedState):
            tensor.state_name = read_item.dest_index.fqn
        return tensor


def load(state_dict: dict[str, Any], *, checkpoint_id: Any = None, storage_reader: Any = None,
         process_group: Optional[Any] = None) -> None:
    """``dcp.load`` into ``state_dict`` in place, all or nothing.

    On any mismatch raises ``ValueError`` naming the state key, the expected
    and the actual kind, and leaves every tensor of ``state_dict`` unchanged.
    """
    staging = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), state_dict)
    try:
        dcp.load(staging, checkpoint_id=checkpoint_id, storage_reader=storage_reader,
                 planner=NamingLoadPlanner(), process_group=process_group)
    except CheckpointException as e:
        first = next(iter(e.failures.values()))[0]
        raise ValueError(f"checkpoint not loaded, states unchanged: {first}") from None
    _copy_tree(state_dict, staging)


def _copy_tree(dst: Any, src: Any) -> None:
    for key, value in src.items():
        if isinstance(value, torch.Tensor):
            dst[key].detach().copy_(value)
        elif isinstance(value, dict):
            _copy_tree(dst[key], value)
        else:
            dst[key] = value
