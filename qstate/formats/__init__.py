"""Quantization formats: name -> :class:`BlockFormat`.

``FORMATS`` is the registry; :func:`register_format` adds one (see
CONTRIBUTING.md, "Adding a format") and :func:`unregister_format` removes it.
"""

from __future__ import annotations

from ._base import BlockFormat, block_absmax
from .._random import lowbias32, lowbias32_int, position_hash32, state_key
from ._rounding import ROUNDINGS, stochastic_code
from .fp8 import FP8, Float8Format
from .map_formats import EIGHT_BIT, FOUR_BIT, MapFormat, dynamic_map, nearest_code, normal_map

__all__ = [
    "BlockFormat",
    "block_absmax",
    "MapFormat",
    "Float8Format",
    "FORMATS",
    "get_format",
    "register_format",
    "unregister_format",
    "dynamic_map",
    "normal_map",
    "nearest_code",
    "ROUNDINGS",
    "lowbias32",
    "lowbias32_int",
    "position_hash32",
    "state_key",
    "stochastic_code",
]

FORMATS: dict[str, BlockFormat] = {f.name: f for f in (EIGHT_BIT, FOUR_BIT, FP8)}


def get_format(name: str) -> BlockFormat:
    """The registered format called ``name``; a ValueError lists the known ones."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown state format {name!r}; expected one of {sorted(FORMATS)}") from None


def register_format(fmt: BlockFormat) -> None:
    if fmt.name in FORMATS:
        raise ValueError(f"format {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt


def unregister_format(name: str) -> None:
    del FORMATS[name]
