"""Building quantized states: :func:`quantize`, :func:`zeros_like` and the row layout."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from ._dtensor import is_dtensor, shard_of, wrap_local_state
from ._library import encode_into_
from ._state_codec import rows_of
from ._state_kernels import kernels_for, traced_codec
from ._state import APPEARANCE_DTYPES, QuantizedState
from ._state_view import QuantizedStateView
from .formats import BlockFormat, get_format

__all__ = ["quantize", "dequantize", "zeros_like", "row_layout", "encode_into", "encode_like", "zero_parts", "check_nonnegative"]


def row_layout(shape: Sequence[int]) -> tuple[int, int]:
    """``(rows, row_len)`` of a new state: one row per dim-0 index if ``ndim >= 2``, else one row."""
    shape = tuple(shape)
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:])
    return 1, math.prod(shape)


def _resolve(fmt: str, block_size: Optional[int], signed: bool, rounding: str) -> tuple[BlockFormat, int]:
    f = get_format(fmt)
    bs = f.default_block_size if block_size is None else block_size
    f.check_block_size(bs)
    f.check_rounding(rounding, signed)
    return f, bs


def _make_qmap(f: BlockFormat, signed: bool, like: Tensor) -> Optional[Tensor]:
    """``f``'s map for a state of ``like``: on its device, and a fake tensor of ``like``'s
    ``FakeTensorMode`` when ``like`` is fake (tracing with fake tensors: every part of the state fake,
    shapes and dtypes exact, no values)."""
    from torch._subclasses.fake_tensor import maybe_get_fake_mode

    qmap = f.make_qmap(signed, like.device)
    mode = maybe_get_fake_mode(like)
    if qmap is not None and mode is not None and maybe_get_fake_mode(qmap) is None:
        qmap = mode.from_tensor(qmap, static_shapes=True)
    return qmap


def _check_appearance(dtype: torch.dtype, what: str) -> None:
    if dtype not in APPEARANCE_DTYPES:
        raise TypeError(
            f"{what}: a quantized state appears as torch.float32 or torch.bfloat16, got {dtype}"
        )


def _encode_rows(f: BlockFormat, x: Tensor, rows: int, row_len: int, block_size: int,
                 signed: bool, qmap: Optional[Tensor], rounding: str) -> tuple[Tensor, Tensor]:
    return f.encode(rows_of(x, rows, row_len), block_size, signed, qmap, rounding)


def check_nonnegative(x: Tensor, what: str) -> None:
    """Raise ``ValueError`` naming ``what`` if ``x`` holds a negative value: an unsigned state's codes
    hold none, and rounding one to zero would change it silently (fake and meta ``x``: not checked)."""
    if x.is_meta or torch._subclasses.fake_tensor.is_fake(x) or x.numel() == 0:
        return
    low = x.min()
    if bool(low < 0):
        raise ValueError(f"{what}: an unsigned state holds values >= 0, got {int((x < 0).sum())} negative "
                         f"value(s) (the lowest {float(low):.6g}); use signed=True, or clamp_min(0) explicitly")


def quantize(x: Tensor, fmt: str, *, signed: bool = True, block_size: Optional[int] = None,
             rounding: str = "nearest") -> Tensor:
    """Quantize ``x`` into a :class:`QuantizedState` of format ``fmt``.

    The appearance dtype is ``x.dtype`` (float32 or bfloat16). ``x`` may be a
    DTensor: the result is then a DTensor over quantized local shards.
    ``rounding`` (``"nearest"`` or ``"stochastic"``, which the map formats
    implement for signed states) is the state's rounding mode, used for ``x``
    and for every later write; a mode the format does not implement raises
    ``ValueError``. ``block_size`` is at most ``2**31 - 1``
    (:meth:`~qstate.formats.BlockFormat.check_block_size`). ``signed=False``
    (for values that are never negative, such as second moments) raises
    ``ValueError`` on a negative value.

    A fake ``x`` (``torch._subclasses.FakeTensorMode``) gives a state whose parts
    (``codes``, ``scale``, ``qmap``) are fake tensors of the same mode, with the
    shapes and dtypes a real ``x`` gives.
    """
    if is_dtensor(x):
        return _on_shards(x, "quantize", lambda t: quantize(
            t, fmt, signed=signed, block_size=block_size, rounding=rounding))
    if isinstance(x, QuantizedState):
        raise TypeError(f"quantize: input is already a QuantizedState ({x.describe()})")
    _check_appearance(x.dtype, "quantize")
    f, bs = _resolve(fmt, block_size, signed, rounding)
    if not signed:
        check_nonnegative(x.detach(), "quantize(signed=False)")
    rows, row_len = row_layout(x.shape)
    qmap = _make_qmap(f, signed, x)

    def state(codes: Tensor, scale: Tensor) -> QuantizedState:
        return QuantizedState(codes, scale, qmap, format=f.name, signed=signed, block_size=bs,
                              row_len=row_len, shape=x.shape, dtype=x.dtype, rounding=rounding)

    if not torch._subclasses.fake_tensor.is_fake(x):  # (a meta x gives meta parts, which no kernel takes)
        q = state(*zero_parts(f, rows, row_len, bs, signed, x.device))
        kernels = kernels_for(q)
        if kernels is not None and kernels.encodes(q, x):  # the same codes and scales
            kernels.encode_into(q, x.detach())
            return q
        if rounding == "nearest" and traced_codec(q):  # compiled code calls the op's kernels: the same bits
            encode_into(q, x.detach())
            return q
    return state(*_encode_rows(f, x.detach(), rows, row_len, bs, signed, qmap, rounding))


def zero_parts(f: BlockFormat, rows: int, row_len: int, block_size: int, signed: bool,
               device: torch.device) -> tuple[Tensor, Tensor]:
    """``(codes, scale)`` of ``rows x row_len`` exact zeros."""
    z = f.zero_code(signed)
    byte = z | (z << 4) if f.bits == 4 else z
    codes = torch.full((rows, f.packed_width(row_len)), byte, dtype=torch.uint8, device=device)
    scale = torch.zeros((rows, -(-row_len // block_size)), dtype=torch.float32, device=device)
    return codes, scale


def zeros_like(p: Tensor, fmt: str, *, signed: bool = True, block_size: Optional[int] = None,
               dtype: Optional[torch.dtype] = None, rounding: str = "nearest") -> Tensor:
    """A zero :class:`QuantizedState` with ``p``'s shape, device and (appearance) dtype.

    ``p`` may be a DTensor: the result is a DTensor with the same mesh and placements.
    ``rounding``: the state's rounding mode, as in :func:`quantize`.
    """
    if is_dtensor(p):
        return _on_shards(p, "zeros_like", lambda t: zeros_like(
            t, fmt, signed=signed, block_size=block_size, dtype=dtype, rounding=rounding))
    dtype = dtype or p.dtype
    _check_appearance(dtype, "zeros_like")
    f, bs = _resolve(fmt, block_size, signed, rounding)
    rows, row_len = row_layout(p.shape)
    codes, scale = zero_parts(f, rows, row_len, bs, signed, p.device)
    return QuantizedState(codes, scale, _make_qmap(f, signed, p), format=f.name, signed=signed,
                          block_size=bs, row_len=row_len, shape=p.shape, dtype=dtype, rounding=rounding)


def encode_into(q: QuantizedState, x: Tensor) -> None:
    """Write values ``x`` (``q``'s shape) into ``q``'s codes and scales in place, rounded to nearest, by
    ``qstate::encode_into_`` (float32 or bfloat16 values as they are, other float dtypes as float32, as the
    formats' encode reads them)."""
    if x.dtype not in APPEARANCE_DTYPES:
        x = x.float()
    encode_into_(q.codes, q.scale, x.detach().to(q.codes.device), q.qmap, q.format, q.signed, q.block_size, q.row_len)


def encode_like(q: QuantizedState, x: Tensor, draws: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Quantize values ``x`` (``q``'s shape) into ``q``'s exact layout and rounding -> ``(codes, scale)``
    (``draws``: stochastic rounding's 32-bit draws by position, ``x``'s shape; see
    :mod:`qstate.formats._rounding`)."""
    device = q.codes.device
    if draws is not None:
        draws = rows_of(draws.to(device), q.rows, q.row_len)
    return q.fmt.encode(rows_of(x.to(device), q.rows, q.row_len), q.block_size, q.signed, q.qmap, q.rounding,
                        draws)


# ----------------------------------------------------------------------------- DTensor states

def _map_local(local: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn`` of this rank's shard (of every simulated rank's under LocalTensorMode)."""
    try:
        from torch.distributed._local_tensor import LocalTensor, tensor_map
    except ImportError:  # torch without simulated ranks
        return fn(local)
    if isinstance(local, LocalTensor):
        return tensor_map(local, lambda rank, shard: fn(shard))
    return fn(local)


def _check_placements(x: Tensor, what: str) -> None:
    """Raise unless every placement of ``x`` is one a quantized DTensor state may have:
    ``Replicate()`` or ``Shard(0)``."""
    from torch.distributed.tensor import Replicate, Shard

    for p in x.placements:
        if not (type(p) is Replicate or (type(p) is Shard and p.dim == 0)):
            raise NotImplementedError(
                f"{what}: a quantized DTensor state must be Replicate() or Shard(0) on every mesh dim, "
                f"got placements {tuple(x.placements)} for shape {tuple(x.shape)}"
            )


def dequantize(x: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``x``'s values as a plain tensor of ``dtype`` (default: ``x``'s appearance dtype).

    A :class:`QuantizedState` or :class:`QuantizedStateView` gives its ``dequantize()``; a DTensor over one, the DTensor
    of the same mesh, placements and shape over each shard's values (no communication); any other
    tensor (plain, or a DTensor of plain shards) is returned as it is, cast where ``dtype`` differs.
    (``x.float()`` of a state is the state itself: torch sees a float32 tensor.)
    """
    if is_dtensor(x) and isinstance(shard_of(x), (QuantizedState, QuantizedStateView)):
        return wrap_local_state(_map_local(x.to_local(), lambda t: t.dequantize(dtype)), x)
    if isinstance(x, (QuantizedState, QuantizedStateView)):
        return x.dequantize(dtype)
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def _on_shards(x: Tensor, what: str, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """The DTensor with ``x``'s mesh, placements, shape and stride over ``fn`` of ``x``'s local tensor
    (of every simulated rank's): a quantized state made shard by shard. Raises ``NotImplementedError``
    naming ``what`` unless every placement of ``x`` is ``Replicate()`` or ``Shard(0)``."""
    _check_placements(x, what)
    return wrap_local_state(_map_local(x.to_local(), fn), x)
