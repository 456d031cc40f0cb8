"""Malformed states at every entrance: a clear error naming the state, no crash, no tensor changed.

Hypothesis draws a malformation of a valid state (codes of another dtype, width or row count; scales
of another dtype or shape, empty or negative; a flipped, other, perturbed or missing map; another
appearance dtype; an unknown or another format, a rounding the format lacks, a bad block size, a
layout that does not hold the shape) and feeds it through each entrance: ``torch.load(weights_only=True)``
of a forged pickle, ``copy_``, ``qstate.checkpoint.load`` and plain ``torch.distributed.checkpoint.load``
of a forged checkpoint folder (one process, no process group), the optimizer's ``load_state_dict``
followed by ``step()``, and the C kernel (a malformed state put into an optimizer's state by hand).
The optimizer and kernel cases run in a child interpreter, so a crash there fails the test instead of
killing pytest. NaN and ``+inf`` scales are valid (they store blocks that held a NaN or an infinity,
``qstate/_state.py``), so the negative scales drawn are below 0 or ``-inf``.

The last tests check that loading a checkpoint runs no code: a saved ``lr`` or a ``.metadata`` holding a
pickled call that would write a marker file is refused, and the marker never appears.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import warnings
from typing import Any, NamedTuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qstate
import qstate.checkpoint
import qstate.optim
from qstate import QuantizedState
from qstate._state import _rebuild_quantized_state

#: one process, no process group: DCP says so on every call
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

FORMATS = ("8bit", "4bit", "fp8")
SHAPE = (4, 512)
_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FIELDS = ("codes", "scale", "qmap", "format", "signed", "block_size", "row_len", "shape", "dtype", "rounding")


class Malformation(NamedTuple):
    """What to change in a valid state's fields, and which checks refuse the result: ``"parts"`` (every
    entrance: :func:`qstate._state.check_parts`) or ``"kind"`` (valid parts of another kind than the
    destination's: copies and loads into a state refuse it, ``torch.load`` alone builds it)."""

    what: str
    arg: Any
    refused_by: str = "parts"


def fields_of(s: QuantizedState) -> dict:
    return dict(codes=s.codes, scale=s.scale, qmap=s.qmap, format=s.format, signed=s.signed,
                block_size=s.block_size, row_len=s.row_len, shape=tuple(s.shape), dtype=s.dtype, rounding=s.rounding)


def _resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if size <= t.shape[dim]:
        return t.narrow(dim, 0, size).clone()
    extra = list(t.shape)
    extra[dim] = size - t.shape[dim]
    return torch.cat([t, torch.zeros(extra, dtype=t.dtype)], dim)


def malformed(s: QuantizedState, m: Malformation) -> dict:
    """``s``'s fields with ``m`` applied (new tensors; ``s`` is never changed)."""
    f = fields_of(s)
    what, arg = m.what, m.arg
    if what == "codes_dtype":
        f["codes"] = s.codes.to(arg)
    elif what in ("codes_width", "codes_rows", "scale_width", "scale_rows"):
        part, dim = what.split("_")
        t = f[part]
        f[part] = _resized(t, 1 if dim == "width" else 0, (t.shape[1 if dim == "width" else 0] + arg) % 4096)
    elif what == "scale_dtype":
        f["scale"] = s.scale.to(arg)
    elif what == "scale_negative":
        index, value = arg
        scale = s.scale.clone()
        scale.view(-1)[index % scale.numel()] = value
        f["scale"] = scale
    elif what == "qmap":
        maps = {"flipped": lambda q: q.flip(0), "float64": lambda q: q.double(), "short": lambda q: q[:-1].clone(),
                "other_signedness": lambda q: s.fmt.make_qmap(not s.signed)}
        if arg == "missing":
            f["qmap"] = None if s.qmap is not None else torch.zeros(256)
        elif isinstance(arg, tuple):  # one entry moved
            if s.qmap is None:
                f["qmap"] = torch.zeros(256)
            else:
                qmap = s.qmap.clone()
                qmap[arg[0] % qmap.numel()] += arg[1]
                f["qmap"] = qmap
        else:
            f["qmap"] = torch.zeros(256) if s.qmap is None else maps[arg](s.qmap)
    elif what in ("format", "block_size", "dtype", "rounding", "signed", "row_len", "shape"):
        f[what] = arg(s) if callable(arg) else arg
    else:
        raise AssertionError(what)
    return f


def _other_format(s: QuantizedState) -> str:
    return {"8bit": "fp8", "4bit": "8bit", "fp8": "8bit"}[s.format]


def _odd_or_huge_block(s: QuantizedState):
    return s.block_size + 1 if s.fmt.bits == 4 else 2**21


def _unsupported_rounding(s: QuantizedState) -> str:
    return "stochastic" if s.format == "fp8" else "up"


def _drawn(what, args) -> st.SearchStrategy:
    """Malformations ``what`` (refused by the parts' checks) with an ``arg`` drawn from ``args``."""
    whats = what if isinstance(what, st.SearchStrategy) else st.just(what)
    return st.builds(lambda w, a: Malformation(w, a), whats, args)


MALFORMATIONS = st.one_of(
    _drawn(st.just("codes_dtype"), st.sampled_from([torch.int32, torch.int8, torch.float32])),
    _drawn(st.sampled_from(["codes_width", "codes_rows", "scale_width", "scale_rows"]),
              st.integers(-600, 8).filter(bool)),
    _drawn(st.just("scale_dtype"), st.sampled_from([torch.float16, torch.bfloat16, torch.float64])),
    _drawn(st.just("scale_negative"),
              st.tuples(st.integers(0, 63), st.sampled_from([-1e-30, -0.5, -3e38, -math.inf]))),
    _drawn(st.just("qmap"), st.sampled_from(["flipped", "float64", "short", "other_signedness",
                                                              "missing"])
              | st.tuples(st.integers(0, 255), st.sampled_from([1e-3, -0.25, 1e-7, math.nan]))),
    _drawn(st.just("dtype"), st.sampled_from([torch.float16, torch.float64, torch.int32])),
    st.just(Malformation("dtype", torch.bfloat16, "kind")),
    _drawn(st.just("format"), st.sampled_from(["9bit", None, _other_format])),
    _drawn(st.just("rounding"), st.sampled_from(["banana", None, _unsupported_rounding])),
    _drawn(st.just("block_size"),
              st.sampled_from([0, -256, 256.0, True, "256", _odd_or_huge_block])),
    _drawn(st.just("signed"), st.sampled_from([1, "yes", None])),
    _drawn(st.just("row_len"), st.sampled_from([lambda s: s.row_len + 1, lambda s: s.row_len - 1,
                                                                 0, -1, 2.5])),
    _drawn(st.just("shape"), st.sampled_from([(2, 1024), (8192,), (1000,), (2048, 1), (4, 511)])),
)


def _valid(fmt: str) -> QuantizedState:
    g = torch.Generator().manual_seed(0)
    return qstate.quantize(torch.randn(SHAPE, generator=g), fmt)


def _construct(fields: dict, name: str = "fuzzed"):
    """The malformed state, or the constructor's own error (a rounding no format has) as ``(None, err)``."""
    try:
        q = QuantizedState(fields["codes"], fields["scale"], fields["qmap"],
                           **{k: fields[k] for k in FIELDS[3:]})
    except (ValueError, TypeError) as e:
        return None, e
    q.state_name = name
    return q, None


def _still_valid(q: QuantizedState, base: QuantizedState) -> bool:
    """Whether the constructor's conversions (``int(block_size)``, ``bool(signed)``) gave back ``base``'s
    fields: no malformation left to refuse."""
    a, b = fields_of(q), fields_of(base)
    tensors_equal = all((a[k] is None and b[k] is None) or (a[k] is not None and b[k] is not None and
                        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]))
                        for k in FIELDS[:3])
    return tensors_equal and all(a[k] == b[k] and type(a[k]) is type(b[k]) for k in FIELDS[3:])


def _bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equality (a NaN equals itself: states that took a malformed step may hold NaNs)."""
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.reshape(-1).view(torch.uint8),
                                                                     y.reshape(-1).view(torch.uint8))


def _same(a: QuantizedState, b: QuantizedState) -> bool:
    return _bits_equal(a.codes, b.codes) and _bits_equal(a.scale, b.scale) and a.kind() == b.kind()


def _error_of(fn) -> BaseException:
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        fn()
    return info.value


# ------------------------------------------------------------------ torch.load(weights_only=True)
class _Forged:
    """Pickles as a call of the registered rebuild function with any arguments (what a crafted file holds)."""

    def __init__(self, fields: dict):
        self.args = tuple(fields[k] for k in FIELDS)

    def __reduce__(self):
        return _rebuild_quantized_state, self.args


def _forged_bytes(fields: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(_Forged(fields), buf)
    return buf.getvalue()


@settings(max_examples=60, **_SETTINGS)
@given(fmt=st.sampled_from(FORMATS), m=MALFORMATIONS)
def test_torch_load_refuses_malformed_states(fmt, m):
    fields = malformed(_valid(fmt), m)
    data = _forged_bytes(fields)
    if m.refused_by != "parts":
        assert isinstance(torch.load(io.BytesIO(data), weights_only=True), QuantizedState)
        return
    err = _error_of(lambda: torch.load(io.BytesIO(data), weights_only=True))
    assert isinstance(err, (ValueError, pickle.UnpicklingError)), repr(err)
    assert "QuantizedState" in str(err), str(err)


def test_torch_load_error_names_the_part_expected_and_actual():
    s = _valid("8bit")
    fields = malformed(s, Malformation("codes_width", -256))
    err = _error_of(lambda: torch.load(io.BytesIO(_forged_bytes(fields)), weights_only=True))
    assert str(err) == ("QuantizedState (8bit signed block_size=256, shape (4, 512)): codes: expected torch.uint8 "
                        "[4, 512] (4 rows of 512 8-bit codes), got torch.uint8 [4, 256]"), str(err)
    fields = malformed(s, Malformation("qmap", "flipped"))
    err = _error_of(lambda: torch.load(io.BytesIO(_forged_bytes(fields)), weights_only=True))
    assert "qmap: expected format '8bit''s map for signed states" in str(err)
    assert "qstate.optim.convert_state_dict" in str(err)


def test_nan_and_inf_scales_are_valid():
    # a NaN or an infinity among a block's values stores a NaN or +inf scale (qstate/formats/_base.py)
    x = torch.randn(SHAPE)
    x[0, 3], x[2, 300] = math.nan, math.inf
    for fmt in FORMATS:
        q = qstate.quantize(x, fmt)
        assert q.scale.isnan().any() and q.scale.isinf().any()
        buf = io.BytesIO()
        torch.save(q, buf)
        loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        assert torch.equal(loaded.codes, q.codes) and torch.equal(loaded.scale.isnan(), q.scale.isnan())


# ------------------------------------------------------------------ copy_
@settings(max_examples=60, **_SETTINGS)
@given(fmt=st.sampled_from(FORMATS), m=MALFORMATIONS)
def test_copy_refuses_malformed_sources(fmt, m):
    dst = _valid(fmt)
    dst.state_name = "dst"
    before = dst.clone()
    src, err = _construct(malformed(_valid(fmt), m))
    if src is not None and _still_valid(src, _valid(fmt)):
        return
    if src is not None:
        err = _error_of(lambda: dst.copy_(src))
        assert "'fuzzed'" in str(err), str(err)
    assert isinstance(err, (ValueError, TypeError)), repr(err)
    assert _same(dst, before)


def test_copy_never_broadcasts_narrow_codes():
    dst, src = _valid("4bit"), _valid("4bit")
    before = dst.clone()
    narrow = QuantizedState(src.codes[:, :1].clone(), src.scale, src.qmap, format="4bit", signed=True,
                            block_size=128, row_len=512, shape=SHAPE, dtype=torch.float32)
    err = _error_of(lambda: dst.copy_(narrow))
    assert "codes: expected torch.uint8 [4, 256]" in str(err) and "got torch.uint8 [4, 1]" in str(err), str(err)
    assert _same(dst, before)


# ------------------------------------------------------------------ DCP: qstate.checkpoint.load, dcp.load
_SAVED: dict[str, str] = {}


def _saved_folder(fmt: str) -> str:
    """A checkpoint folder holding ``{"s": _valid(fmt), "x": a plain tensor}`` (saved once per format)."""
    import torch.distributed.checkpoint as dcp

    if fmt not in _SAVED:
        path = tempfile.mkdtemp(prefix=f"qstate_malformed_{fmt}_")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: one process
            dcp.save({"s": _valid(fmt), "x": torch.arange(6.0)}, checkpoint_id=path)
        _SAVED[fmt] = path
    return _SAVED[fmt]


def _forged_folder(fmt: str, fields: dict, tmp: str) -> str:
    """A copy of :func:`_saved_folder` whose entry ``s`` holds the forged state's pickle instead."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    path = os.path.join(tmp, "forged")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(_saved_folder(fmt), path)
    metadata = dcp.FileSystemReader(path).read_metadata()
    data = _forged_bytes(fields)
    with open(os.path.join(path, "forged.distcp"), "wb") as f:
        f.write(data)
    for index in list(metadata.storage_data):
        if index.fqn == "s":
            metadata.storage_data[index] = _StorageInfo("forged.distcp", 0, len(data))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    return path


def _destination(fmt: str) -> dict:
    return {"s": qstate.zeros_like(torch.empty(SHAPE), fmt), "x": torch.zeros(6)}


def _unchanged(dst: dict, before: dict) -> bool:
    return _same(dst["s"], before["s"]) and torch.equal(dst["x"], before["x"])


@settings(max_examples=40, **_SETTINGS)
@given(fmt=st.sampled_from(FORMATS), m=MALFORMATIONS)
def test_checkpoint_loads_refuse_malformed_states(fmt, m, tmp_path):
    import torch.distributed.checkpoint as dcp

    path = _forged_folder(fmt, malformed(_valid(fmt), m), str(tmp_path))
    dst = _destination(fmt)
    before = {k: v.clone() for k, v in dst.items()}
    err = _error_of(lambda: qstate.checkpoint.load(dst, checkpoint_id=path))
    assert isinstance(err, ValueError), repr(err)
    assert str(err).startswith("checkpoint not loaded, states unchanged: 's': "), str(err)
    assert _unchanged(dst, before)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        err = _error_of(lambda: dcp.load(dst, checkpoint_id=path))
    assert "QuantizedState" in str(err) or "copy_: expected a state of kind" in str(err), str(err)
    assert _unchanged(dst, before)


def test_checkpoint_load_of_a_valid_folder_is_bit_exact():
    fmt = "4bit"
    dst = _destination(fmt)
    qstate.checkpoint.load(dst, checkpoint_id=_saved_folder(fmt))
    assert _same(dst["s"], _valid(fmt)) and torch.equal(dst["x"], torch.arange(6.0))


# ------------------------------------------------------------------ loading runs no code
class _Payload:
    """Pickles as a call that writes ``marker``: what a crafted checkpoint would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _trained_sgd():
    p = torch.nn.Parameter(torch.ones(4, 512))
    opt = qstate.optim.SGD([p], lr=0.1, momentum=0.9, state_format="8bit", min_quantize_numel=1, compile=False)
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    return p, opt


def test_a_payload_in_a_saved_lr_never_runs(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = str(tmp_path / "marker")
    _, opt = _trained_sgd()
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = _Payload(marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optim": sd}, checkpoint_id=str(tmp_path / "ckpt"))
    p, opt = _trained_sgd()
    dst = {"optim": opt.state_dict()}
    before = dst["optim"]["state"][0]["momentum_buffer"].clone()
    err = _error_of(lambda: qstate.checkpoint.load(dst, checkpoint_id=str(tmp_path / "ckpt")))
    assert str(err).startswith("checkpoint not loaded, states unchanged: 'optim.param_groups.0.lr': the checkpoint "
                               "stores something other than the plain values a state dict holds"), str(err)
    assert "posix.system" in str(err), str(err)
    assert not os.path.exists(marker)
    assert dst["optim"]["param_groups"][0]["lr"] == 0.1 and _same(dst["optim"]["state"][0]["momentum_buffer"], before)


def test_a_payload_in_the_metadata_never_runs(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = str(tmp_path / "marker")
    path = str(tmp_path / "ckpt")
    shutil.copytree(_saved_folder("8bit"), path)
    metadata = dcp.FileSystemReader(path).read_metadata()
    metadata.planner_data = _Payload(marker)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    dst = _destination("8bit")
    before = {k: v.clone() for k, v in dst.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        err = _error_of(lambda: qstate.checkpoint.load(dst, checkpoint_id=path))
    assert isinstance(err, ValueError) and "it names posix.system, which DCP's metadata never holds" in str(err), \
        str(err)
    assert not os.path.exists(marker) and _unchanged(dst, before)


def test_checkpoint_load_refuses_a_folder_it_cannot_read_safely():
    err = _error_of(lambda: qstate.checkpoint.load({}, checkpoint_id=None))
    assert "expected checkpoint_id to be a checkpoint folder" in str(err)


# ------------------------------------------------------------------ optimizer and C kernel (child interpreter)
def _trained(fmt: str):
    from qstate.optim import AdamW

    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(SHAPE, generator=g))
    opt = AdamW([p], lr=1e-2, state_format=fmt, min_quantize_numel=1, compile=True)
    p.grad = torch.randn(SHAPE, generator=g)
    opt.step()
    return p, opt


def _snapshot(p, opt, steps: bool = True) -> list[torch.Tensor]:
    out = [p.detach().clone()]
    for name, s in opt.state[p].items():
        if name != "step" or steps:
            out += [s.codes.clone(), s.scale.clone()] if isinstance(s, QuantizedState) else [s.clone()]
    return out


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(_bits_equal(x, y) for x, y in zip(a, b))


_TRAINED: dict[str, tuple] = {}


@settings(max_examples=50, **_SETTINGS)
@given(fmt=st.sampled_from(FORMATS), name=st.sampled_from(["exp_avg", "exp_avg_sq"]), m=MALFORMATIONS)
def _load_state_dict_then_step(fmt, name, m):
    if fmt not in _TRAINED:
        _TRAINED[fmt] = _trained(fmt)
    p, opt = _TRAINED[fmt]
    before = _snapshot(p, opt)
    sd = opt.state_dict()
    q, err = _construct(malformed(opt.state[p][name], m))
    if q is None or _still_valid(q, opt.state[p][name]):
        return
    q.state_name = None  # the optimizer names it
    bad = {"state": {0: {**sd["state"][0], name: q}}, "param_groups": sd["param_groups"]}
    err = _error_of(lambda: opt.load_state_dict(bad))
    assert isinstance(err, ValueError), repr(err)
    assert str(err).startswith(f"AdamW: param 0 (shape {SHAPE}, torch.float32), state {name!r}: "), str(err)
    assert _equal(_snapshot(p, opt), before)
    p.grad = torch.ones(SHAPE)
    opt.step()  # the optimizer's own states, as before the load
    assert not _equal(_snapshot(p, opt), before)


@settings(max_examples=50, **_SETTINGS)
@given(fmt=st.sampled_from(FORMATS), m=MALFORMATIONS)
def _kernel_step(fmt, m):
    if fmt not in _TRAINED:
        _TRAINED[fmt] = _trained(fmt)
    p, opt = _TRAINED[fmt]
    good = opt.state[p]["exp_avg"]
    q, _ = _construct(malformed(good, m))
    if q is None or _still_valid(q, good):
        return
    before = _snapshot(p, opt, steps=False)  # a step counts itself before its kernels run
    opt.state[p]["exp_avg"] = q  # past every entrance: the kernel's own checks
    p.grad = torch.ones(SHAPE)
    try:
        opt.step()
        raised = None
    except Exception as e:  # noqa: BLE001  any error is fine here, a crash is not
        raised = e
    finally:
        opt.state[p]["exp_avg"] = good
    # other malformations take the math op by op (the fused kernels take only states of the row layout,
    # whose map is their format's: _kernels.fusable), which may raise after writing the parameter (a
    # bfloat16-appearance state: NotImplementedError): past the entrances nothing promises more than no crash
    if m.what in ("codes_dtype", "codes_width", "scale_dtype", "scale_width"):  # the kernel's layout: its check
        assert isinstance(raised, ValueError) and str(raised).startswith("qstate CPU kernel: state 0"), \
            f"{m}: {raised!r}"
        assert _equal(_snapshot(p, opt, steps=False), before)


def _swapped_buffers() -> None:
    """A prepared call's buffers replaced by narrower ones: the call is not reused, the kernel's check
    refuses them."""
    for fmt in FORMATS:
        p, opt = _trained(fmt)
        p.grad = torch.ones(SHAPE)
        opt.step()  # a prepared call now holds the states' buffers
        good = opt.state[p]["exp_avg"]
        codes = good.codes
        good.codes = codes[:, :1].contiguous()
        before = _snapshot(p, opt, steps=False)
        with pytest.raises(ValueError, match=r"^qstate CPU kernel: state 0 codes: expected contiguous CPU "
                                             r"torch.uint8 \[4, \d+\], got torch.uint8 \[4, 1\]"):
            opt.step()
        assert _equal(_snapshot(p, opt, steps=False), before)
        good.codes = codes
        opt.step()


def _in_child(name: str) -> None:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.path.dirname(os.path.dirname(__file__))]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), name], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (f"child {name} exited with {proc.returncode}"
                                  f"{' (killed by a signal: a crash)' if proc.returncode < 0 else ''}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def test_optimizer_load_state_dict_refuses_malformed_states_before_the_step():
    _in_child("_load_state_dict_then_step")


def test_c_kernel_never_reads_past_a_malformed_state():
    _in_child("_kernel_step")


def test_a_prepared_call_never_runs_over_replaced_buffers():
    _in_child("_swapped_buffers")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
