"""``QuantizedState``: a tensor subclass holding blockwise-quantized values.

Storage rules (invariants every op keeps)
-----------------------------------------
The logical tensor (``shape``, appearance ``dtype``) is stored as ``R`` rows of
``row_len`` (``L``) elements, each row quantized on its own by ``format``
(see :mod:`qstate.formats`), so **blocks never cross rows**:

* ``codes``: ``uint8 [R, format.packed_width(L)]``; ``scale``: ``float32
  [R, ceil(L / block_size)]``; ``qmap``: ``float32 [2**bits]`` for formats
  with a code map, else absent.
* The flattened logical tensor is the concatenation of the rows, cut to
  ``numel``: only the last row may hold padding, ``0 <= R * L - numel < L``
  (or ``numel == 0``).
* A tensor with ``ndim >= 2`` has ``R == shape[0]`` and no padding, so slicing,
  concatenating, padding and all-gathering along dim 0 at *any* row boundary
  moves whole rows and never requantizes (what DTensor ``Shard(0)`` and FSDP2
  need, even and uneven). A 1-D tensor starts as one row; gathering 1-D shards
  gives one row per shard (exact), and a 1-D slice must start on a block (row
  ``R == 1``) or row (``R > 1``) boundary.
* ``block_size``, ``format``, ``signed`` and ``rounding`` are fixed at
  construction and never recomputed; they and the appearance ``dtype``
  (``float32`` or ``bfloat16``) are kept by every op that returns a
  ``QuantizedState`` (views, slices, cat, pad, copies, moves, collectives).
* ``rounding`` (``"nearest"`` or ``"stochastic"``, see
  :mod:`qstate.formats._rounding`) governs every write of new values into the
  state (``copy_``, in-place math, the optimizers' kernels); stochastic
  decisions are a function of each normalized value and, where the writer
  gives them (the optimizers' updates, ``qstate::copy_with_draws_``), draws by
  each element's place in the full tensor, so a sharded state gets the codes
  of the unsharded one.
"""

from __future__ import annotations

import functools
import hashlib
import math
import pathlib
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from ._op_table import dispatch
from .formats import ROUNDINGS, BlockFormat, get_format

__all__ = ["QuantizedState", "APPEARANCE_DTYPES", "quantized_kind"]

APPEARANCE_DTYPES = (torch.float32, torch.bfloat16)


class QuantizedState(Tensor):
    """Blockwise-quantized tensor. Build with :func:`qstate.quantize` or :func:`qstate.zeros_like`."""

    codes: Tensor
    scale: Tensor
    qmap: Optional[Tensor]
    format: str
    signed: bool
    block_size: int
    row_len: int
    rounding: str

    @staticmethod
    def __new__(
        cls,
        codes: Tensor,
        scale: Tensor,
        qmap: Optional[Tensor],
        *,
        format: str,
        signed: bool,
        block_size: int,
        row_len: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        requires_grad: bool = False,
        rounding: str = "nearest",
    ) -> "QuantizedState":
        return Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=codes.device, requires_grad=requires_grad
        )

    def __init__(
        self,
        codes: Tensor,
        scale: Tensor,
        qmap: Optional[Tensor],
        *,
        format: str,
        signed: bool,
        block_size: int,
        row_len: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        requires_grad: bool = False,
        rounding: str = "nearest",
    ) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"QuantizedState: rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
        self.codes = codes
        self.scale = scale
        self.qmap = qmap
        self.format = format
        self.signed = bool(signed)
        self.block_size = int(block_size)
        self.row_len = int(row_len)
        self.rounding = rounding
        #: diagnostic only: the parameter/state this tensor holds, quoted in errors
        self.state_name: Optional[str] = None

    # -- structure --------------------------------------------------------
    @property
    def fmt(self) -> BlockFormat:
        return get_format(self.format)

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        names = ["codes", "scale"] if self.qmap is None else ["codes", "scale", "qmap"]
        return names, (self.format, self.signed, self.block_size, self.row_len, self.dtype, self.rounding)

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, ctx: tuple, outer_size, outer_stride) -> "QuantizedState":
        fmt, signed, block_size, row_len, dtype, rounding = ctx
        return cls(
            inner["codes"], inner["scale"], inner.get("qmap"),
            format=fmt, signed=signed, block_size=block_size, row_len=row_len,
            shape=outer_size, dtype=dtype, rounding=rounding,
        )

    def _stable_hash_for_caching(self) -> str:
        # AOT autograd cache key: the structure, not the values, and the code that encodes and decodes
        # (the graph a cached entry compiled from holds only the ops on the subclass, not what they run)
        parts = [self.codes, self.scale] + ([] if self.qmap is None else [self.qmap])
        inner = ";".join(f"{tuple(t.shape)}:{t.dtype}:{t.device.type}" for t in parts)
        return (f"QuantizedState({self.format},{self.signed},{self.block_size},{self.row_len},{self.dtype},"
                f"{self.rounding},{inner},{_implementation_digest()})")

    def with_parts(
        self,
        codes: Tensor,
        scale: Tensor,
        *,
        shape: Sequence[int],
        row_len: Optional[int] = None,
        qmap: Optional[Tensor] = None,
    ) -> "QuantizedState":
        """A state like ``self`` (format, signedness, block size, rounding, dtype, name) over new parts."""
        out = QuantizedState(
            codes, scale, self.qmap if qmap is None else qmap,
            format=self.format, signed=self.signed, block_size=self.block_size,
            row_len=self.row_len if row_len is None else row_len,
            shape=shape, dtype=self.dtype, rounding=self.rounding,
        )
        out.state_name = self.state_name
        return out

    def kind(self) -> str:
        """``"<format> <signed|unsigned> block_size=<n>"``, plus ``" rounding=stochastic"`` if so.

        What two states must share to be copied, concatenated or loaded into each other
        (with the appearance dtype). Round-to-nearest, the default, is not spelled out.
        """
        return quantized_kind(self.format, self.signed, self.block_size, self.rounding)

    def describe(self) -> str:
        """:meth:`kind`, dtype, shape and device (and the state's name) for error messages."""
        named = f"'{self.state_name}': " if self.state_name else ""
        return f"{named}{self.kind()} dtype={self.dtype} shape={tuple(self.shape)} device={self.device}"

    # -- public API -------------------------------------------------------
    def dequantize(self, dtype: Optional[torch.dtype] = None) -> Tensor:
        """The values as a plain tensor of ``dtype`` (default: the appearance dtype)."""
        values = self.fmt.decode(self.codes, self.scale, self.row_len, self.block_size, self.qmap)
        flat = values.reshape(-1)
        numel = math.prod(self.shape)
        if flat.numel() != numel:
            flat = flat[:numel]
        return flat.view(self.shape).to(dtype or self.dtype)

    def storage_nbytes(self) -> int:
        """Bytes held by the inner tensors (codes, scales, map): what the state costs.

        Not ``nbytes``: as for every tensor (a DTensor's included), ``nbytes`` is torch's logical size,
        ``numel * itemsize`` of the appearance dtype (a float32 state of 64,000 elements says 256,000
        however few bytes it holds), which torch's own code (DCP's loaders, dynamo) relies on. An
        optimizer's totals per format, local to the rank: ``optimizer.state_nbytes()``.
        """
        parts = [self.codes, self.scale] + ([] if self.qmap is None else [self.qmap])
        return sum(t.numel() * t.element_size() for t in parts)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        signedness = "signed" if self.signed else "unsigned"
        rounding = "" if self.rounding == "nearest" else f", rounding='{self.rounding}'"
        return (
            f"QuantizedState(format='{self.format}', {signedness}, block_size={self.block_size}{rounding}, "
            f"shape={tuple(self.shape)}, dtype={self.dtype}, device='{self.device}')"
        )

    def __reduce_ex__(self, protocol: int):
        # Rebuilt from its parts so that map_location moves the state too.
        return (
            _rebuild_quantized_state,
            (self.codes, self.scale, self.qmap, self.format, self.signed, self.block_size,
             self.row_len, tuple(self.shape), self.dtype, self.rounding),
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, types, args, kwargs or {})


def quantized_kind(format: str, signed: bool, block_size: int, rounding: str) -> str:
    """:meth:`QuantizedState.kind` of a state with these properties (e.g. an expected one)."""
    signedness = "signed" if signed else "unsigned"
    suffix = "" if rounding == "nearest" else f" rounding={rounding}"
    return f"{format} {signedness} block_size={block_size}{suffix}"


@functools.lru_cache(maxsize=None)
def _implementation_digest() -> str:
    """A digest of the sources behind a state's ops (the package's Python files), so that a warm
    compile cache never serves a graph compiled from another version of the encode or decode."""
    root = pathlib.Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _rebuild_quantized_state(
    codes: Tensor, scale: Tensor, qmap: Optional[Tensor], format: str, signed: bool,
    block_size: int, row_len: int, shape: tuple, dtype: torch.dtype, rounding: str = "nearest",
) -> QuantizedState:
    """Unpickling entry point (registered as a ``torch.load(weights_only=True)`` safe global).

    ``rounding`` is last and defaults to ``"nearest"``: states saved before it existed load as before.
    """
    if rounding != "nearest":  # a format implements it for some signedness only
        get_format(format).check_rounding(rounding, signed)
    return QuantizedState(
        codes, scale, qmap, format=format, signed=signed, block_size=block_size,
        row_len=row_len, shape=shape, dtype=dtype, rounding=rounding,
    )
