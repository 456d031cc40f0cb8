"""``QuantizedState``: a tensor subclass holding blockwise-quantized values.

Storage rules (invariants every op keeps): the logical tensor (``shape``, appearance ``dtype``)
is ``R`` rows of ``row_len`` (``L``) elements, each row quantized on its own by ``format``
(:mod:`qstate.formats`), so **blocks never cross rows**.

* ``codes``: ``uint8 [R, format.packed_width(L)]``; ``scale``: ``float32 [R, ceil(L / block_size)]``;
  ``qmap``: ``float32 [2**bits]`` for formats with a code map, else absent.
* The flat tensor is the rows concatenated, cut to ``numel``: ``0 <= R * L - numel < L`` padding.
* ``ndim >= 2``: ``R == shape[0]`` and no padding, so slicing, concatenating, padding and
  gathering along dim 0 at any row boundary moves whole rows and never requantizes (DTensor
  ``Shard(0)``, FSDP2, even and uneven). A 1-D tensor starts as one row; a 1-D slice must start
  on a block (``R == 1``) or row (``R > 1``) boundary.
* ``block_size``, ``format``, ``signed``, ``rounding`` and the appearance ``dtype`` (``float32``
  or ``bfloat16``) are fixed at construction and kept by every op that returns a state.
* ``rounding`` governs every write; writes drawing by position give a sharded state the codes of
  the unsharded one. Scales are ``>= 0``, ``+inf`` or NaN (a block that held an inf or a NaN).

States entering from outside (unpickling, DCP reads, copies, ``load_state_dict``) are checked
by :func:`check_parts`; qstate's ops keep the rules by construction.
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
from ._state_kernels import kernels_for, traced_codec
from .formats import FORMATS, ROUNDINGS, BlockFormat, get_format
from .formats.map_formats import legacy_map_name

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
        # structure only: under tracing the parts are fake tensors, whose values cannot be read
        check_parts(inner["codes"], inner["scale"], inner.get("qmap"), format=fmt, signed=signed,
                    block_size=block_size, row_len=row_len, shape=outer_size, dtype=dtype, rounding=rounding,
                    values=False)
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

    def check(self, name: Optional[str] = None, *, values: bool = True) -> None:
        """Raise ``ValueError`` unless this state keeps the storage rules (:func:`check_parts`; ``name``:
        how errors name it, default its ``state_name``; ``values``: its scales and map too)."""
        check_parts(self.codes, self.scale, self.qmap, format=self.format, signed=self.signed,
                    block_size=self.block_size, row_len=self.row_len, shape=tuple(self.shape), dtype=self.dtype,
                    rounding=self.rounding, name=name or self.state_name, values=values)

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
        kernels = kernels_for(self)
        if kernels is not None and kernels.decodes(self):  # the same values
            flat = kernels.decode(self)
        elif traced_codec(self):  # compiled code calls qstate::decode's kernels (qstate._library): the same values
            flat = torch.ops.qstate.decode.default(self.codes, self.scale, self.qmap, self.format, self.signed,
                                                   self.block_size, self.row_len)
        else:
            flat = self.fmt.decode(self.codes, self.scale, self.row_len, self.block_size, self.qmap).reshape(-1)
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
        if VIEW_TYPES and any(issubclass(t, VIEW_TYPES[0]) for t in types):
            return NotImplemented  # a view's rule runs first: it hands this op the view's values
        return dispatch(func, types, args, kwargs or {})


#: the type of a state's strided views (:class:`~qstate.QuantizedStateView`, which adds itself): when an
#: op has both a state and a view among its arguments, the view's rule runs first
VIEW_TYPES: list[type] = []


def quantized_kind(format: str, signed: bool, block_size: int, rounding: str) -> str:
    """:meth:`QuantizedState.kind` of a state with these properties (e.g. an expected one)."""
    signedness = "signed" if signed else "unsigned"
    suffix = "" if rounding == "nearest" else f" rounding={rounding}"
    return f"{format} {signedness} block_size={block_size}{suffix}"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)




def _readable(t: Tensor) -> bool:
    """Whether ``t``'s values can be read here: a plain eager tensor off the meta device, not under tracing."""
    return type(t) is Tensor and t.device.type != "meta" and not torch.compiler.is_compiling()


def _spec(t: Any) -> str:
    if not isinstance(t, Tensor):
        return type(t).__name__
    return f"{t.dtype} {list(t.shape)}" + ("" if type(t) in (Tensor, torch.nn.Parameter) else f" ({type(t).__name__})")


def check_parts(
    codes: Any, scale: Any, qmap: Any, *, format: Any, signed: Any, block_size: Any, row_len: Any,
    shape: Sequence[Any], dtype: Any, rounding: Any, name: Optional[str] = None, values: bool = True,
) -> None:
    """Raise ``ValueError`` unless these are the parts and properties of a state that keeps the storage
    rules (module docstring), naming the state (``name``: its ``state_name`` or key, else its kind and
    shape), the expected and the actual.

    Checks: ``format`` registered, ``signed`` a bool, ``rounding`` implemented by the format for that
    signedness, ``block_size`` an int the format takes (``BlockFormat.check_block_size``), ``dtype``
    an appearance dtype (:data:`APPEARANCE_DTYPES`), ``shape`` and ``row_len`` ints >= 0; ``codes`` plain
    ``uint8 [R, format.packed_width(row_len)]`` with ``R`` and ``row_len`` the layout of ``shape``
    (``R == shape[0]`` and no padding for ``ndim >= 2``, else less than a row of padding), ``scale``
    ``float32 [R, ceil(row_len / block_size)]``, ``qmap`` present exactly for formats with a map,
    ``float32`` of the map's shape, every part on one device. With ``values`` (and where the parts can be
    read: not fake, meta or traced tensors) also the values: no scale below 0 (NaN and ``+inf`` are
    allowed, module docstring) and the map equal to the format's (``fmt.make_qmap(signed)``).

    Where a state saved with an earlier map of its format would be accepted and converted, this is the
    place: the map comparison (:func:`_check_qmap`).

    Callers: unpickling (``torch.load``, DCP's reads), copies from another state, the optimizers'
    ``load_state_dict`` and :func:`qstate.checkpoint.load`; ``__tensor_unflatten__`` passes
    ``values=False`` (it runs under tracing). NaN and ``+inf`` scales are how a block that held a NaN
    or an infinity is stored, which a step with a non-finite gradient writes unless the optimizer has
    ``skip_nonfinite=True``; every kernel reads them safely.
    """
    def fail(what: str) -> None:
        if name:
            who = f"QuantizedState {name!r}"
        elif isinstance(format, str) and isinstance(signed, bool) and _is_int(block_size) and isinstance(rounding, str):
            who = f"QuantizedState ({quantized_kind(format, signed, block_size, rounding)}, shape {tuple(shape)})"
        else:
            who = f"QuantizedState (shape {tuple(shape)})"
        raise ValueError(f"{who}: {what}")

    if not isinstance(shape, (tuple, list, torch.Size)) or not all(_is_int(n) or isinstance(n, torch.SymInt)
                                                                   for n in shape):
        raise ValueError(f"QuantizedState: shape: expected a sequence of ints, got {shape!r}")
    if not isinstance(format, str) or format not in FORMATS:
        fail(f"format: expected one of {sorted(FORMATS)}, got {format!r}")
    fmt = FORMATS[format]
    if not isinstance(signed, bool):
        fail(f"signed: expected a bool, got {signed!r}")
    if not isinstance(rounding, str):
        fail(f"rounding: expected a str, got {rounding!r}")
    try:
        fmt.check_rounding(rounding, signed)
    except ValueError as e:
        fail(f"rounding: {e}")
    try:
        fmt.check_block_size(block_size)
    except ValueError as e:
        fail(f"block_size: {e}")
    if dtype not in APPEARANCE_DTYPES:
        fail(f"dtype: expected one of {list(APPEARANCE_DTYPES)} (the appearance dtype), got {dtype!r}")
    parts = {"codes": codes, "scale": scale}
    if qmap is not None:
        parts["qmap"] = qmap
    for part, t in parts.items():
        if not isinstance(t, Tensor) or isinstance(t, QuantizedState):
            fail(f"{part}: expected a plain tensor, got {_spec(t)}")
    has_map = fmt.make_qmap(signed) is not None
    if has_map and qmap is None:
        fail(f"qmap: expected the format's map (float32 [{2 ** fmt.bits}]), got none")
    if not has_map and qmap is not None:
        fail(f"qmap: expected none (format {format!r} has no map), got {_spec(qmap)}")
    devices = {part: t.device for part, t in parts.items()}
    if len(set(devices.values())) > 1:
        fail(f"expected every part on one device, got {', '.join(f'{k} on {v}' for k, v in devices.items())}")
    if codes.dtype != torch.uint8:
        fail(f"codes: expected dtype torch.uint8, got {_spec(codes)}")
    if scale.dtype != torch.float32:
        fail(f"scale: expected dtype torch.float32, got {_spec(scale)}")
    if qmap is not None and (qmap.dtype != torch.float32 or tuple(qmap.shape) != (2 ** fmt.bits,)):
        fail(f"qmap: expected torch.float32 [{2 ** fmt.bits}], got {_spec(qmap)}")
    if codes.dim() != 2 or scale.dim() != 2:
        fail(f"expected 2-D codes and scale, got codes {_spec(codes)}, scale {_spec(scale)}")
    if not (_is_int(row_len) or isinstance(row_len, torch.SymInt)):
        fail(f"row_len: expected an int, got {row_len!r}")
    sizes = [*shape, row_len, *codes.shape, *scale.shape]
    if not all(_is_int(n) for n in sizes):  # a tracer's symbolic sizes: a comparison would guard on them
        return
    if any(n < 0 for n in sizes):
        fail(f"expected sizes >= 0, got shape {tuple(shape)}, row_len={row_len}")
    _check_layout(fail, fmt, codes, scale, tuple(shape), row_len, block_size)
    if values:
        _check_values(fail, fmt, scale, qmap, signed)


def _check_layout(fail, fmt: BlockFormat, codes: Tensor, scale: Tensor, shape: tuple, row_len: int,
                  block_size: int) -> None:
    rows, numel = codes.shape[0], math.prod(shape)
    if len(shape) >= 2:
        layout_ok = rows == shape[0] and row_len == math.prod(shape[1:])
        rule = f"{shape[0]} rows of {math.prod(shape[1:])} (one per index of dim 0)"
    else:
        layout_ok = rows * row_len == 0 if numel == 0 else row_len > 0 and 0 <= rows * row_len - numel < row_len
        rule = f"rows of row_len holding {numel} elements with less than a row of padding"
    if not layout_ok:
        fail(f"layout: expected {rule}, got {rows} rows of {row_len}")
    want_codes = (rows, fmt.packed_width(row_len))
    if tuple(codes.shape) != want_codes:
        fail(f"codes: expected torch.uint8 {list(want_codes)} ({rows} rows of {row_len} {fmt.bits}-bit codes), "
             f"got {_spec(codes)}")
    want_scale = (rows, -(-row_len // block_size))
    if tuple(scale.shape) != want_scale:
        fail(f"scale: expected torch.float32 {list(want_scale)} ({rows} rows of blocks of {block_size}), "
             f"got {_spec(scale)}")


def _check_values(fail, fmt: BlockFormat, scale: Tensor, qmap: Optional[Tensor], signed: bool) -> None:
    if _readable(scale) and scale.numel() and bool((scale < 0).any()):
        fail(f"scale: expected scales >= 0 (or NaN, +inf), got {float(scale[scale < 0][0])}")
    if qmap is not None and _readable(qmap):
        _check_qmap(fail, fmt, qmap, signed)


def _check_qmap(fail, fmt: BlockFormat, qmap: Tensor, signed: bool) -> None:
    """Raise unless ``qmap`` is the format's map for ``signed`` states (codes mean their entries, and
    every kernel encodes with the format's own tables) or a legacy map of it
    (:func:`~qstate.formats.map_formats.legacy_map_name`): such a state loads only to be converted
    (``qstate.optim.convert_state_dict``); the optimizers and a state-to-state ``copy_`` refuse it."""
    expected = fmt.make_qmap(signed, qmap.device)
    if not torch.equal(qmap, expected) and legacy_map_name(qmap) is None:
        diff = (qmap != expected).nonzero()
        first = int(diff[0, 0]) if diff.numel() else 0
        kind = "signed" if signed else "unsigned"
        fail(f"qmap: expected format {fmt.name!r}'s map for {kind} states, got another map (entry {first}: "
             f"expected {float(expected[first])!r}, got {float(qmap[first])!r}); a state saved with an earlier "
             "map converts with qstate.optim.convert_state_dict")


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
    Every part is checked first (:func:`check_parts`): a file never builds a state the kernels would
    read past.
    """
    check_parts(codes, scale, qmap, format=format, signed=signed, block_size=block_size, row_len=row_len,
                shape=shape, dtype=dtype, rounding=rounding)
    return QuantizedState(
        codes, scale, qmap, format=format, signed=signed, block_size=block_size,
        row_len=row_len, shape=shape, dtype=dtype, rounding=rounding,
    )
