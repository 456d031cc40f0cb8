"""The C kernel: the fused update of quantized or plain states on CPU, one shared object per kernel spec.

``csrc/update_kernel.c`` computes inductor's kernel's function bit for bit (its header states the
contract) in two passes over each row segment held in L1: decode and update into a float buffer,
then absmax and encode per block. The rule's C is generated from its math (:mod:`.rule_source`) and
placed before the source with the spec's ``#define`` block (:func:`kernel_source`); the build and its
cache are :mod:`.build`'s. A missing compiler or a failing build raises; a rule the generator does
not take keeps inductor's kernel, which the ``qstate`` logger says once per rule and flags.

Which specs it takes (:func:`supports`): a float32 or bfloat16 parameter and gradient, and every
state a ``QuantizedState`` of a map format or ``fp8`` with a rounding its codec implements and block
sizes whose lcm is at most :data:`~..spec.MAX_UNIT`, or every state a plain float32/bfloat16 tensor.

Stochastic rounding hashes a key per parameter and update (:class:`qstate._random.ParamKeys`) with
each element's flat index in the full tensor (``start`` for a shard), as the other paths do. Each
call leaves a :class:`PreparedCall` (the loaded kernel and the states' ``qstate_t`` slots); valid
prepared calls of one kernel in a step run as one C call (:func:`run_prepared`). Buffers are checked
against the spec before any pointer reaches C (:func:`check_buffers`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import re
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ...._random import param_key
from ....formats import MapFormat, get_format, nearest_code
from ....formats.fp8 import Float8Format
from ...._state import QuantizedState
from ....formats._codec import _code_thresholds, _floats, get_codec
from .build import compiler as _compiler, load as _load_library
from .rule_source import UnsupportedRule, rule_source
from ..prepared import PreparedUpdate
from ...rules import RULES
from ..spec import MAX_UNIT, StateKind

__all__ = ["C_KERNEL", "supports", "run", "built_specs", "PreparedCall", "run_prepared"]

_SOURCE = Path(__file__).with_name("csrc") / "update_kernel.c"
_LOGGER = logging.getLogger("qstate")
#: the row segment (work item) of a spec whose states are all plain
_PLAIN_UNIT = 256
#: the row segment of a spec with an ``encode8_64`` state: the smallest multiple of the block sizes'
#: lcm at least this long, so that the encode runs over 1024 values per state in a row: 0.9x the
#: kernel's time with 256-value segments (bench_kernel_ab, 8bit AdamW; 4bit and fp8 specs, whose
#: encodes were scalar then, were 1.00-1.03x with longer segments and keep the lcm)
_MIN_ENC8_UNIT = 1024
#: parameter / gradient elements a spec with an ``encode8_64`` state prefetches ahead of the group it
#: updates (rows are contiguous: they lie ahead in memory; a prefetch past the end is dropped). Beyond
#: the caches the hardware prefetcher alone falls behind while a segment encodes: 0.90-0.94x the
#: kernel's time at 16M-64M elements, neutral at 1M (bench_kernel_ab, 8bit AdamW). Other specs take
#: none: fp8 was 1.13x and 4bit 1.02x with it; prefetching the codes too, or a whole segment at
#: once, did not help.
_ENC8_PREFETCH_AHEAD = 8192


class _QState(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("qmap", ctypes.c_void_p),
                ("table", ctypes.c_void_p), ("code_stride", ctypes.c_int64), ("scale_stride", ctypes.c_int64),
                ("binade", ctypes.c_void_p), ("bucket", ctypes.c_void_p), ("threshold", ctypes.c_void_p)]


#: exponents of |y| below this share the in-register encode's first binade (csrc: encode8_64)
_E_LOW = 96


def _encode_thresholds(fmt: str, signed: bool) -> Tensor:
    """The thresholds ``t_c`` the in-register encodes compare with (the code of ``y`` is the lower
    code ``c`` of its bucket plus ``y > t_c``): the map's (:func:`~qstate.formats._codec._code_thresholds`),
    except that an unsigned state's ``t_zero`` is ``+0``. That keeps its positive values off the zero
    code, as Codec.encode does, with the same compare: zero + (y > 0); ``y <= 0`` (or NaN) keeps it."""
    codec = get_codec(fmt, signed, "cpu")
    thresholds = _code_thresholds(codec.qmap).contiguous()
    if not codec.signed:
        thresholds[codec.zero_code] = 0.0
    return thresholds


@functools.lru_cache(maxsize=None)
def _binade_tables(fmt: str, signed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The in-register 8-bit encode's tables (``encode8_64`` in the C source): per sign and binade
    ``first bucket | (8 - m) << 9`` (``int16 [64]``), each bucket's lower code (``uint8 [512]``)
    and the code thresholds ``t_c`` (``float32 [256]``, :func:`_encode_thresholds`).

    Binade ``j`` holds ``|y|`` with exponent ``_E_LOW + j`` (clamped to ``0..31``: smaller values
    share binade 0, NaN falls in 1.0's) and splits into ``2**m`` buckets of its top ``m <= 8``
    mantissa bits, the fewest that keep every bucket within two adjacent codes: with ``w`` the
    bits 30..15 of ``y`` (exponent, then the top 8 mantissa bits), its bucket is
    ``first + (w & 0xff) >> (8 - m)``. The code of ``y`` is then its bucket's lower code ``c`` plus
    ``y > t_c``: the packed table's code, exactly (the C kernel's tests compare every code with
    inductor's).
    """
    qmap = get_codec(fmt, signed, "cpu").qmap
    binade = torch.zeros(64, dtype=torch.int16)
    lower: list[int] = []
    for neg in (False, True):
        for j in range(32):
            e = _E_LOW + j
            for m in range(0, 9 if 0 < j < 31 else 1):
                shift = 23 - m
                lo = (e << 23) + (torch.arange(1 << m, dtype=torch.int64) << shift)
                hi = lo + (1 << shift) - 1
                if j == 0:
                    lo[0] = 0
                if j == 31:
                    hi[0] = lo[0]
                y_lo, y_hi = _floats(lo), _floats(hi)
                if neg:
                    y_lo, y_hi = -y_hi, -y_lo
                c_lo, c_hi = nearest_code(y_lo, qmap), nearest_code(y_hi, qmap)
                if int((c_hi - c_lo).max()) <= 1:
                    break
            else:
                raise ValueError(f"{fmt} map: a binade needs buckets finer than 8 mantissa bits")
            binade[32 * neg + j] = len(lower) | ((8 - m) << 9)
            lower += c_lo.tolist()
    if len(lower) > 512:  # also keeps each binade's first bucket below 2**9
        raise ValueError(f"{fmt} map: {len(lower)} encode buckets, more than 512")
    bucket = torch.tensor(lower + [0] * (512 - len(lower)), dtype=torch.uint8)
    return binade, bucket, _encode_thresholds(fmt, signed)


@functools.lru_cache(maxsize=None)
def _in_register_encode(kind: StateKind) -> bool:
    """Whether a quantized state of ``kind`` encodes with ``encode8_64``: an 8-bit map rounded to
    nearest whose map fits :func:`_binade_tables` (one that does not keeps the table's encode)."""
    codec = get_codec(kind.format, kind.signed, "cpu")
    if not (codec.lookup and codec.fmt.bits == 8 and kind.rounding == "nearest" and codec.qmap.numel() == 256):
        return False
    try:
        _binade_tables(kind.format, kind.signed)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _map16_thresholds(fmt: str, signed: bool) -> Optional[Tensor]:
    """The code thresholds ``t_c`` (``float32 [16]``, :func:`_encode_thresholds`) of a 16-entry map,
    which ``map4_code16`` (C source) searches for a 4-bit state's codes, or ``None`` for other formats."""
    codec = get_codec(fmt, signed, "cpu")
    if not (codec.lookup and codec.fmt.bits == 4 and codec.qmap.numel() == 16):
        return None
    return _encode_thresholds(fmt, signed)


#: float8_e4m3fn's value of each code (NaN for 0x7f / 0xff): an fp8 state's decode table
_FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()

_DTYPES = (torch.float32, torch.bfloat16)


def supports(spec, grad_dtype: torch.dtype) -> bool:
    """Whether the C kernel runs ``spec`` with gradients of ``grad_dtype`` (module docstring)."""
    key = (spec, grad_dtype)
    verdict = _SUPPORTED.get(key)
    if verdict is None:
        verdict = _SUPPORTED[key] = _supports_spec(spec, grad_dtype)
    return verdict


#: (kernel spec, gradient dtype) -> whether the C kernel takes it (a function of the spec: asked every step)
_SUPPORTED: dict = {}


def _supports_spec(spec, grad_dtype: torch.dtype) -> bool:
    if not spec.states or not _has_c_rule(spec):
        return False
    if spec.param_dtype not in _DTYPES or grad_dtype not in _DTYPES:
        return False
    if not any(s.quantized for s in spec.states):
        return all(s.dtype in _DTYPES for s in spec.states) and _compiler() is not None
    for s in spec.states:
        if not s.quantized or not isinstance(get_format(s.format), (MapFormat, Float8Format)):
            return False
        if not get_codec(s.format, s.signed, "cpu").supports(s.rounding):
            return False
    sizes = [s.block_size for s in spec.states]
    group = math.gcd(*sizes)
    if any(get_format(s.format).bits == 4 for s in spec.states) and group % 2:
        return False
    return math.lcm(*sizes) <= MAX_UNIT and _compiler() is not None


#: (rule object, flags) -> whether the C kernel has the rule's C (hand-written or generated)
_C_RULES: dict = {}


def _has_c_rule(spec) -> bool:
    """Whether the C kernel has ``spec``'s rule in C, generated from its math (:func:`.rule_source.rule_source`).
    A rule the generator does not take keeps inductor's kernel, which the ``qstate`` logger says once per rule
    and flags, with the generator's reason."""
    rule = RULES.get(spec.rule)
    if rule is None:
        return False
    key = (rule, spec.flags)
    verdict = _C_RULES.get(key)
    if verdict is None:
        try:
            rule_source(rule, spec.flags)
            verdict = True
            _LOGGER.info("qstate CPU kernel: the update rule %r (flags %s) runs the C kernel, its C generated "
                         "from its math", spec.rule, dict(spec.flags))
        except UnsupportedRule as error:
            verdict = False
            _LOGGER.warning("%s", error)
        _C_RULES[key] = verdict
    return verdict




def _config(spec, grad_dtype: torch.dtype) -> str:
    """The ``#define`` block that configures ``update_kernel.c`` for ``spec``."""
    lines = [f"#define PARAM_BF16 {int(spec.param_dtype == torch.bfloat16)}"]
    lines.append(f"#define GRAD_BF16 {int(grad_dtype == torch.bfloat16)}")
    lines.append(f"#define PARAM_SR {int(spec.param_sr)}")
    lines.append(f"#define NSTATES {len(spec.states)}")
    sizes = [s.block_size if s.quantized else _PLAIN_UNIT for s in spec.states]
    lines.append(f"#define GROUP {math.gcd(*sizes)}")
    unit = math.lcm(*sizes)
    enc8 = any(s.quantized and _in_register_encode(s) for s in spec.states)
    if enc8:
        unit *= -(-_MIN_ENC8_UNIT // unit)
    lines.append(f"#define UNIT {unit}")
    lines.append(f"#define PREFETCH_AHEAD {_ENC8_PREFETCH_AHEAD if enc8 else 0}")
    lines.append(f"#define ENC8_E_LOW {_E_LOW}")
    for i, s in enumerate(spec.states):
        if not s.quantized:
            consts = {"PLAIN": 1, "BF16": int(s.dtype == torch.bfloat16), "ENC8": 0, "ENC4": 0, "BITS": 32,
                      "BS": _PLAIN_UNIT, "SIGNED": 1, "SHIFT": 0, "BASE": 0, "K": 1, "ZERO": 0, "SR": 0, "N": 1,
                      "FP8": 0, "MAXCODE": "1.0f"}
            lines += [f"#define S{i}_{k} {v}" for k, v in consts.items()]
            continue
        codec = get_codec(s.format, s.signed, "cpu")
        fp8 = not codec.lookup
        consts = {"PLAIN": 0, "BF16": 0, "ENC8": int(_in_register_encode(s)),
                  "ENC4": int(_map16_thresholds(s.format, s.signed) is not None),
                  "BITS": codec.fmt.bits, "BS": s.block_size, "SIGNED": int(codec.signed),
                  "SHIFT": 0 if fp8 else 23 - codec.m_bits, "BASE": 0 if fp8 else codec.base,
                  "K": 1 if fp8 else codec.k, "ZERO": codec.zero_code, "SR": int(s.rounding == "stochastic"),
                  "N": 256 if fp8 else codec.qmap.numel(), "FP8": int(fp8), "MAXCODE": f"{codec.fmt.max_code!r}f"}
        lines += [f"#define S{i}_{k} {v}" for k, v in consts.items()]
    lines.append("#define FOR_STATES(X) " + " ".join(f"X({i})" for i in range(len(spec.states))))
    return "\n".join(lines) + "\n"


def kernel_source(spec, grad_dtype: torch.dtype) -> str:
    """The C source of ``spec``'s kernel: the ``#define`` block (:func:`_config`), the rule's generated C
    (:mod:`.rule_source`), then ``csrc/update_kernel.c``. All of it keys the build cache (:func:`.build.load`)."""
    return _config(spec, grad_dtype) + rule_source(RULES[spec.rule], spec.flags).code + _SOURCE.read_text()


def _build(spec, grad_dtype: torch.dtype) -> ctypes.CDLL:
    tag = _tag(spec, grad_dtype)
    dll = _load_library(kernel_source(spec, grad_dtype), "qstate_update_" + re.sub(r"[^A-Za-z0-9_]", "_", tag),
                        f"the CPU update kernel {tag}")
    dll.qstate_update.restype = None
    dll.qstate_update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_QState), ctypes.c_void_p,
                                  ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64]
    dll.qstate_decode.restype = None
    dll.qstate_decode.argtypes = [ctypes.c_void_p, ctypes.POINTER(_QState), ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_int]
    dll.qstate_update_many.restype = None
    dll.qstate_update_many.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_QState),
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_void_p, ctypes.c_void_p]
    return dll


def _tag(spec, grad_dtype: torch.dtype) -> str:
    """The spec's tag, plus the gradient dtype where it is not the parameter's."""
    return spec.tag() + (f"_grad_{str(grad_dtype).split('.')[-1]}" if grad_dtype != spec.param_dtype else "")


#: (kernel spec, gradient dtype) -> (loaded library, each state's table pointers)
_LIBS: dict = {}


def built_specs() -> list[str]:
    """Tags of the C kernels loaded in this process."""
    return sorted(_tag(*key) for key in _LIBS)


def _table_pointers(kind: StateKind) -> tuple[int, int, int, int, int]:
    """The kernel's tables for a state of ``kind`` (its codec's, cached for the process):
    ``qmap``, ``table``, ``binade``, ``bucket``, ``threshold`` (0 where the kind has none)."""
    if not kind.quantized:
        return (0, 0, 0, 0, 0)
    codec = get_codec(kind.format, kind.signed, "cpu")
    if not codec.lookup:  # fp8: the values of the 256 codes (decode); no encode table
        return (_FP8_VALUES.data_ptr(), 0, 0, 0, 0)
    pointers = [t.data_ptr() for t in codec.tables[:2]]
    if _in_register_encode(kind):
        pointers += [t.data_ptr() for t in _binade_tables(kind.format, kind.signed)]
    elif (thresholds := _map16_thresholds(kind.format, kind.signed)) is not None:  # no binade and bucket tables
        pointers += [0, 0, thresholds.data_ptr()]
    return tuple(pointers + [0] * (5 - len(pointers)))


def _buffer_error(what: str, expected: str, t: Tensor) -> ValueError:
    got = f"{t.dtype} {list(t.shape)} on {t.device}" + ("" if t.is_contiguous() else ", not contiguous")
    return ValueError(f"qstate CPU kernel: {what}: expected {expected}, got {got}")


def check_buffers(spec, p: Tensor, g: Tensor, states: Sequence[Tensor]) -> None:
    """Raise ``ValueError`` unless every buffer the kernel of ``spec`` reads or writes is what it takes: a
    contiguous CPU parameter and gradient of ``spec``'s dtypes and one size; plain states of their entry's
    dtype and the parameter's size; quantized states of their entry's format, block size and signedness
    over ``uint8 [rows, packed_width(row_len)]`` codes and ``float32 [rows, ceil(row_len / block_size)]``
    scales, contiguous, in one row layout that holds exactly the parameter's elements. The kernel trusts
    these sizes (the strides it is given are the codes' and scales' widths): this is what keeps it inside
    its buffers, whatever state reached it. Run when a call is prepared (:func:`run`); a prepared call
    runs again only while its buffers are unchanged (:meth:`..prepared.PreparedUpdate.valid`)."""
    numel = p.numel()
    if len(states) != len(spec.states):
        raise ValueError(f"qstate CPU kernel: expected {len(spec.states)} states, got {len(states)}")
    if type(p) not in (Tensor, torch.nn.Parameter) or p.dtype != spec.param_dtype or p.device.type != "cpu" \
            or not p.is_contiguous():
        raise _buffer_error("param", f"a contiguous CPU {spec.param_dtype} tensor", p)
    if type(g) is not Tensor or g.dtype not in _DTYPES or g.device.type != "cpu" or not g.is_contiguous() \
            or g.numel() != numel:
        raise _buffer_error("grad", f"a contiguous CPU float32 or bfloat16 tensor of {numel} elements", g)
    layout = None
    for i, (kind, s) in enumerate(zip(spec.states, states)):
        what = f"state {i}" + (f" ({s.state_name!r})" if getattr(s, "state_name", None) else "")
        if not kind.quantized:
            if type(s) is not Tensor or s.dtype != kind.dtype or s.device.type != "cpu" or not s.is_contiguous() \
                    or s.numel() != numel:
                raise _buffer_error(what, f"a contiguous CPU {kind.dtype} tensor of {numel} elements", s)
            continue
        if type(s) is not QuantizedState or StateKind.of(s) != kind:
            got = s.kind() if isinstance(s, QuantizedState) else f"a {type(s).__name__}"
            raise ValueError(f"qstate CPU kernel: {what}: expected a {kind.format} state, signed={kind.signed}, "
                             f"block_size={kind.block_size}, rounding={kind.rounding} (the kernel's), got {got}")
        rows, row_len = s.codes.shape[0] if s.codes.dim() == 2 else -1, s.row_len
        layout = (rows, row_len) if layout is None else layout
        if (rows, row_len) != layout or rows * row_len != numel:
            raise ValueError(f"qstate CPU kernel: {what}: expected {layout[0]} rows of {layout[1]} holding the "
                             f"param's {numel} elements, got {rows} rows of {row_len}")
        fmt = get_format(kind.format)
        codes = (rows, fmt.packed_width(row_len))
        if s.codes.dtype != torch.uint8 or tuple(s.codes.shape) != codes or s.codes.device.type != "cpu" \
                or not s.codes.is_contiguous():
            raise _buffer_error(f"{what} codes", f"contiguous CPU torch.uint8 {list(codes)}", s.codes)
        scale = (rows, -(-row_len // kind.block_size))
        if s.scale.dtype != torch.float32 or tuple(s.scale.shape) != scale or s.scale.device.type != "cpu" \
                or not s.scale.is_contiguous():
            raise _buffer_error(f"{what} scale", f"contiguous CPU torch.float32 {list(scale)}", s.scale)


def state_slots(spec, p: Tensor, states: Sequence[Tensor], tables: Sequence[tuple]) -> tuple[ctypes.Array, int, int]:
    """The kernel's ``qstate_t`` array for ``states`` (``tables``: :func:`_table_pointers` of each
    entry of ``spec``), and the ``rows`` / ``row_len`` it runs over."""
    arr = (_QState * len(states))()
    if not spec.states[0].quantized:  # one row of values, read and written in place
        for slot, s in zip(arr, states):
            slot.codes, slot.code_stride = s.data_ptr(), p.numel()
        return arr, 1, p.numel()
    for slot, s, pointers in zip(arr, states, tables):
        slot.codes, slot.scale = s.codes.data_ptr(), s.scale.data_ptr()
        slot.code_stride, slot.scale_stride = s.codes.shape[1], s.scale.shape[1]
        slot.qmap, slot.table, slot.binade, slot.bucket, slot.threshold = pointers
    return arr, states[0].rows, states[0].row_len


def _hyper_arg(hyper: Union[Tensor, Sequence[float]]) -> Union[int, ctypes.Array]:
    """The kernel's ``h`` argument: a contiguous float32 CPU tensor's pointer, else the values as a
    float32 array (Python floats, or a tensor of another dtype, layout or device)."""
    if isinstance(hyper, Tensor):
        if hyper.dtype == torch.float32 and hyper.is_contiguous() and hyper.device.type == "cpu":
            return hyper.data_ptr()
        hyper = hyper.detach().to("cpu", torch.float32).tolist()
    return (ctypes.c_float * len(hyper))(*hyper)


def _threads(numel: int) -> int:
    return torch.get_num_threads() if numel >= 65536 else 1


def _library(spec, grad_dtype: torch.dtype) -> tuple[ctypes.CDLL, list]:
    """``spec``'s loaded kernel (built on first use) and each state's table pointers."""
    loaded = _LIBS.get((spec, grad_dtype))
    if loaded is None:
        loaded = _LIBS[spec, grad_dtype] = (_build(spec, grad_dtype), [_table_pointers(e) for e in spec.states])
    return loaded


def run_once(spec, p: Tensor, g: Tensor, states: Sequence[Tensor], hyper: Sequence[float]) -> None:
    """One update with no stochastic rounding, prepared for no later call (the state writers' encode,
    :mod:`.state_kernels`); the buffers are checked first (:func:`check_buffers`)."""
    dll, tables = _library(spec, g.dtype)
    check_buffers(spec, p, g, states)
    arr, rows, row_len = state_slots(spec, p, states, tables)
    dll.qstate_update(p.data_ptr(), g.data_ptr(), arr, _hyper_arg(hyper), rows, row_len, _threads(p.numel()), 0, 0)


def decode_once(spec, state: QuantizedState) -> Tensor:
    """The values of ``state`` (``spec``'s one quantized state; float32 parameters): a new float32 tensor of ``rows * row_len``
    elements, decoded as the update decodes it; the state's buffers are checked first (:func:`check_buffers`)."""
    dll, tables = _library(spec, torch.float32)
    out = torch.empty(state.rows * state.row_len, dtype=torch.float32)
    check_buffers(spec, out, out, [state])
    arr, rows, row_len = state_slots(spec, out, [state], tables)
    dll.qstate_decode(out.data_ptr(), arr, rows, row_len, _threads(out.numel()))
    return out


def run(spec, p: Tensor, g: Tensor, states: Sequence[Tensor], hyper: Union[Tensor, Sequence[float]],
        key: Optional[int] = None, start: int = 0) -> None:
    """One fused update of ``p`` and its ``states``, quantized or plain (the caller checked :func:`supports`
    and layouts), and the :class:`PreparedCall` of this update for the next steps.

    ``hyper``: the rule's scalars, a float32 tensor on the CPU or Python floats (converted to float32).
    ``key``: the stochastic-rounding key of a spec that draws (``KernelSpec.keyed``: ``PARAM_SR`` or a state
    rounded stochastically; :class:`qstate._random.ParamKeys`; None: a :func:`param_key` drawn now). ``start``: the flat
    index of ``p``'s first element in the full tensor it is a shard of (0: ``p`` is whole); such a spec's
    draws depend on each element's index in the full tensor, so shards of one parameter draw as the whole
    parameter would. The prepared call keeps it
    (a shard's place is fixed with its local tensor).
    """
    dll, tables = _library(spec, g.dtype)
    check_buffers(spec, p, g, states)
    arr, rows, row_len = state_slots(spec, p, states, tables)
    call = PreparedCall(spec, p, g, states, dll, arr, rows, row_len, start)
    call(p, g, hyper, (param_key() if key is None else key) if call.sr else 0)
    call.register()


class PreparedCall(PreparedUpdate):
    """One parameter's C-kernel update, ready to run again (:mod:`..prepared`): the kernel function and
    the states' ``qstate_t`` slots (raw pointers into the states' buffers, which :meth:`valid` checks)."""

    __slots__ = ("fn", "many", "kernel", "slots", "rows", "row_len", "numel")

    def __init__(self, spec, p: Tensor, g: Tensor, states: Sequence[Tensor], dll: ctypes.CDLL, slots: ctypes.Array,
                 rows: int, row_len: int, start: int = 0):
        super().__init__(spec, p, g, states, start)
        #: the kernel for this parameter alone, and for several calls of its spec at once (run_prepared)
        self.fn, self.many = dll.qstate_update, dll.qstate_update_many
        #: the kernel's address: calls with equal ``kernel`` run together (run_prepared)
        self.kernel = ctypes.cast(self.many, ctypes.c_void_p).value
        self.slots, self.rows, self.row_len, self.numel = slots, rows, row_len, p.numel()

    @property
    def group(self) -> tuple:
        return ("c", self.kernel)

    def __call__(self, p: Tensor, g: Tensor, hyper: Union[Tensor, Sequence[float]], key: int = 0) -> None:
        """Run the update (``key``: the parameter's stochastic-rounding key, read if :attr:`sr`)."""
        self.fn(self.p_ptr, g.data_ptr(), self.slots, _hyper_arg(hyper), self.rows, self.row_len,
                _threads(self.numel), key, self.start)
        torch.autograd.graph.increment_version(p)

    @classmethod
    def run_group(cls, calls, params, grads, hyper, keys) -> None:
        run_prepared(calls, params, grads, hyper, keys)


def run_prepared(calls: Sequence[PreparedCall], params: Sequence[Tensor], grads: Sequence[Tensor],
                 hyper: Union[Tensor, Sequence[float]], keys: Sequence[int]) -> None:
    """Valid prepared calls of one kernel (the same ``kernel``), each with its parameter, gradient and
    stochastic-rounding key, as one C call: one parallel region over all their work items (a parameter may
    appear once)."""
    if len(calls) == 1:
        calls[0](params[0], grads[0], hyper, keys[0])
        return
    n, per = len(calls), len(calls[0].slots)
    slots = (_QState * (n * per))()  # parameter k's states at slots[k * per:(k + 1) * per]
    size = ctypes.sizeof(_QState) * per
    for k, call in enumerate(calls):
        ctypes.memmove(ctypes.addressof(slots) + k * size, call.slots, size)
    p_ptrs = (ctypes.c_void_p * n)(*[c.p_ptr for c in calls])
    g_ptrs = (ctypes.c_void_p * n)(*[g.data_ptr() for g in grads])
    rows = (ctypes.c_int64 * n)(*[c.rows for c in calls])
    row_len = (ctypes.c_int64 * n)(*[c.row_len for c in calls])
    first = (ctypes.c_int64 * (n + 1))()  # the kernel's scratch: each parameter's first work item
    calls[0].many(n, p_ptrs, g_ptrs, slots, _hyper_arg(hyper), rows, row_len, first,
                  _threads(sum(c.numel for c in calls)), (ctypes.c_uint64 * n)(*keys),
                  (ctypes.c_int64 * n)(*[c.start for c in calls]))
    torch.autograd.graph.increment_version(params)


class CKernel:
    """The C kernel as the CPU's fused backend (:mod:`..backends`), named ``"c"``: this module's
    :func:`supports` and :func:`run`."""

    name = "c"

    @staticmethod
    def supports(spec, grad_dtype: torch.dtype) -> bool:
        return supports(spec, grad_dtype)

    @staticmethod
    def run(spec, p: Tensor, g: Tensor, states: Sequence[Tensor], hyper: Union[Tensor, Sequence[float]],
            key: Optional[int] = None, start: int = 0) -> None:
        run(spec, p, g, states, hyper, key, start)


C_KERNEL = CKernel()
