"""``qstate::encode_into_`` and ``qstate::decode`` (schemas: :mod:`qstate._library`): their argument
checks and their ``CompositeExplicitAutograd`` kernels, the formats' torch ops.

A state's parts reach these ops from anywhere (a user's call, a compiled graph), so every call is
checked before any write: ``codes`` ``uint8 [R, packed_width(row_len)]``, ``scale``
``float32 [R, ceil(row_len / block_size)]``, ``qmap`` present exactly for formats with a map
(``float32 [2**bits]``), every tensor on one device, ``values`` floating point with the elements of
``R`` rows of ``row_len`` less under a row of padding (:func:`check_codec_args`). The device kernels
registered for these ops (:mod:`qstate.optim._engine.cpu.state_kernels`) run the same check, and give
the codes, scales and values these kernels give, bit for bit.

A state's ``dequantize``, ``copy_`` of values and in-place math call the ops while
``torch.compile`` traces them on devices with registered kernels
(:func:`qstate._state_kernels.traced_codec`), so that the
compiled code calls the device kernels rather than inlining the formats' torch ops.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ._library import LIBRARY
from .formats import FORMATS, get_format

__all__ = ["check_codec_args", "encode_rows_into", "decode_rows", "rows_of"]


def rows_of(x: Tensor, rows: int, row_len: int) -> Tensor:
    """``x`` flattened into ``[rows, row_len]`` (zero-padded at the end)."""
    flat = x.reshape(-1)
    pad = rows * row_len - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(rows, row_len)


def _spec(t: Any) -> str:
    if not isinstance(t, Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)} on {t.device}" + ("" if type(t) is Tensor else f" ({type(t).__name__})")


def check_codec_args(op: str, codes: Tensor, scale: Tensor, qmap: Optional[Tensor], format: str, signed: bool,
                     block_size: int, row_len: int, values: Optional[Tensor] = None) -> None:
    """Raise ``ValueError`` naming ``op``'s argument, the expected and the actual, unless the arguments are
    a state's parts (module docstring) and ``values`` (an encode's) fit them. Shapes and dtypes only."""
    def fail(what: str) -> None:
        raise ValueError(f"{op}: {what}")

    if format not in FORMATS:
        fail(f"format: expected one of {sorted(FORMATS)}, got {format!r}")
    fmt = FORMATS[format]
    try:
        fmt.check_block_size(block_size)
    except ValueError as e:
        fail(f"block_size: {e}")
    if row_len < 0:
        fail(f"row_len: expected an int >= 0, got {row_len}")
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        fail(f"codes: expected a 2-D torch.uint8 tensor, got {_spec(codes)}")
    rows = codes.shape[0]
    if tuple(codes.shape) != (rows, fmt.packed_width(row_len)):
        fail(f"codes: expected torch.uint8 {[rows, fmt.packed_width(row_len)]} ({rows} rows of {row_len} "
             f"{fmt.bits}-bit codes), got {_spec(codes)}")
    want_scale = (rows, -(-row_len // block_size))
    if scale.dtype != torch.float32 or tuple(scale.shape) != want_scale:
        fail(f"scale: expected torch.float32 {list(want_scale)} ({rows} rows of blocks of {block_size}), "
             f"got {_spec(scale)}")
    has_map = fmt.make_qmap(signed) is not None
    if has_map and (qmap is None or qmap.dtype != torch.float32 or tuple(qmap.shape) != (2 ** fmt.bits,)):
        fail(f"qmap: expected format {format!r}'s map, torch.float32 [{2 ** fmt.bits}], got {_spec(qmap)}")
    if not has_map and qmap is not None:
        fail(f"qmap: expected none (format {format!r} has no map), got {_spec(qmap)}")
    tensors = {"codes": codes, "scale": scale, "qmap": qmap, "values": values}
    devices = {k: t.device for k, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        fail(f"expected every tensor on one device, got {', '.join(f'{k} on {v}' for k, v in devices.items())}")
    if values is not None:
        if values.dtype not in (torch.float32, torch.bfloat16):
            fail(f"values: expected torch.float32 or torch.bfloat16, got {_spec(values)}")
        numel, held = values.numel(), rows * row_len
        if not (held - row_len < numel <= held or numel == held):
            fail(f"values: expected the elements of {rows} rows of {row_len} (less under a row of padding), "
                 f"got {_spec(values)}")


def encode_rows_into(codes: Tensor, scale: Tensor, values: Tensor, qmap: Optional[Tensor], format: str,
                     signed: bool, block_size: int, row_len: int) -> None:
    """``qstate::encode_into_`` by the formats' torch ops (:meth:`~qstate.formats.BlockFormat.encode`)."""
    check_codec_args("qstate::encode_into_", codes, scale, qmap, format, signed, block_size, row_len, values)
    new_codes, new_scale = get_format(format).encode(rows_of(values, codes.shape[0], row_len), block_size, signed,
                                                     qmap)
    codes.copy_(new_codes)
    scale.copy_(new_scale)


def decode_rows(codes: Tensor, scale: Tensor, qmap: Optional[Tensor], format: str, signed: bool, block_size: int,
                row_len: int) -> Tensor:
    """``qstate::decode`` by the formats' torch ops (:meth:`~qstate.formats.BlockFormat.decode`)."""
    check_codec_args("qstate::decode", codes, scale, qmap, format, signed, block_size, row_len)
    return get_format(format).decode(codes, scale, row_len, block_size, qmap).reshape(-1)


LIBRARY.impl("encode_into_", encode_rows_into, "CompositeExplicitAutograd")
LIBRARY.impl("decode", decode_rows, "CompositeExplicitAutograd")
