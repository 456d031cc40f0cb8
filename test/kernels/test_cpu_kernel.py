"""The hand-written CPU kernel (``qstate/optim/_cpu_kernel.py``): the inductor kernel's results bit for bit.

Updates run through the public API (the functional optimizers, ``qstate::fused_update``,
``cpu_kernel_enabled``); builds without the vector paths, SIMDe's build of the AVX-512 ones and a failing
compiler run in a fresh interpreter configured through the build's environment (``$CC``,
``$QSTATE_CPU_KERNEL_CFLAGS``, ``$TORCHINDUCTOR_CACHE_DIR``). Private (``_cpu_kernel``), as nothing public
reaches them: the checkers that compile C harnesses against the kernel's configured source (its
``#define`` block, source file, flags and compiler) to test its vector encodes and decodes function by
function, the tables they read, and whether the C kernel takes a kernel spec (:func:`_cpu_kernel.supports`),
which makes sure a test of it does not run inductor's kernel instead.
"""

from __future__ import annotations

import functools
import platform
import shlex
import subprocess
from pathlib import Path

import expecttest
import pytest
import torch

import qstate
from qstate.optim import cpu_kernel_enabled
from qstate.optim._engine.cpu import build as _cpu_build, kernel as _cpu_kernel
from qstate.optim._engine.spec import KernelSpec
from qstate.optim._engine.spec import StateKind
from qstate.optim import functional as F
from rounding_keys import param_keys

#: aligned, ragged, odd (4-bit nibble) and one-element rows, 1-D and 3-D, and rows of several segments
#: (_cpu_kernel._MIN_ENC8_UNIT) ending in a partial one
SHAPES = [(4, 512), (33, 71), (7, 513), (1000,), (1,), (3, 5, 7), (2, 2100)]


def _adamw_8bit(ps, gs, states, step):
    torch.manual_seed(step)  # the step's stochastic-rounding keys (the default generator's)
    F.adamw(ps, gs, *states, [step] * len(ps), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
            compile=True, grad_scale=torch.tensor(4.0))


def _adam_4bit_amsgrad(ps, gs, states, step):
    torch.manual_seed(step)  # the step's stochastic-rounding keys (the default generator's)
    F.adam(ps, gs, states[0], states[1], [step] * len(ps), max_exp_avg_sqs=states[2], lr=1e-2, beta1=0.8,
           beta2=0.99, eps=1e-6, weight_decay=0.01, amsgrad=True, maximize=True, compile=True)


def _lion_8bit(ps, gs, states, step):
    torch.manual_seed(step)  # the step's stochastic-rounding keys (the default generator's)
    F.lion(ps, gs, states[0], [step] * len(ps), lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.1, compile=True)


def _adamw_beta1_low(ps, gs, states, step):  # lerp weight 1 - beta1 >= 0.5: torch.lerp's other form
    torch.manual_seed(step)  # the step's stochastic-rounding keys (the default generator's)
    F.adamw(ps, gs, *states, [step] * len(ps), lr=1e-2, beta1=0.3, beta2=0.999, eps=1e-8, weight_decay=0.1,
            compile=True)


def _lion_beta1_low(ps, gs, states, step):  # one lerp of each form
    torch.manual_seed(step)  # the step's stochastic-rounding keys (the default generator's)
    F.lion(ps, gs, states[0], [step] * len(ps), lr=1e-3, beta1=0.2, beta2=0.99, weight_decay=0.1, compile=True)


def _sgd_4bit_nesterov(ps, gs, states, step):
    torch.manual_seed(step)  # the step's stochastic-rounding keys (the default generator's)
    F.sgd(ps, gs, states[0], [step] * len(ps), lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True,
          compile=True)


def _adamw_bf16_sr(ps, gs, states, step):  # bf16 params rounded stochastically: both kernels hash a key per param
    F.adamw(ps, gs, *states, [step] * len(ps), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
            compile=True, stochastic_round=True)


def _adam_amsgrad(ps, gs, states, step):
    F.adam(ps, gs, states[0], states[1], [step] * len(ps), max_exp_avg_sqs=states[2], lr=1e-2, beta1=0.8,
           beta2=0.99, eps=1e-6, weight_decay=0.01, amsgrad=True, maximize=True, compile=True)


SR = "stochastic"
#: plain states (``torch.zeros_like`` in this dtype) instead of a quantized format
PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: shapes of the plain-state cases: 65536 elements or more, so that with the C kernel off the inductor
#: kernel runs them (smaller plain states would run the eager math)
PLAIN_SHAPES = [(300, 301), (70_001,), (3, 130, 171)]

#: name -> (update, param dtype, per state (format, signed, block size[, rounding])); mixed block sizes,
#: bf16 params, stochastic rounding (as the optimizers' default for 4-bit first moments)
CASES = {
    "adamw_8bit": (_adamw_8bit, torch.float32, [("8bit", True, 256), ("8bit", False, 256)]),
    "adam_4bit_amsgrad_bf16": (_adam_4bit_amsgrad, torch.bfloat16,
                               [("4bit", True, 64, SR), ("4bit", False, 128), ("4bit", False, 128)]),
    "lion_8bit_block_100_stochastic": (_lion_8bit, torch.float32, [("8bit", True, 100, SR)]),
    "sgd_4bit_nesterov": (_sgd_4bit_nesterov, torch.float32, [("4bit", True, 128)]),
    "adamw_8bit_beta1_low": (_adamw_beta1_low, torch.float32, [("8bit", True, 256), ("8bit", False, 256)]),
    # blocks that end inside a 64-value chunk: the pipelined encode's chunks, then each block's scalar tail
    "adamw_8bit_blocks_100_96": (_adamw_8bit, torch.float32, [("8bit", True, 100), ("8bit", False, 96)]),
    "lion_8bit_beta1_low": (_lion_beta1_low, torch.float32, [("8bit", True, 256)]),
    "adamw_fp8": (_adamw_8bit, torch.float32, [("fp8", True, 256), ("fp8", False, 128)]),
    "sgd_fp8_nesterov_bf16": (_sgd_4bit_nesterov, torch.bfloat16, [("fp8", True, 64)]),
    # fp8 second moments rounded stochastically (the optimizers' default for unsigned fp8 states)
    "adamw_fp8_stochastic": (_adamw_8bit, torch.float32, [("fp8", True, 256), ("fp8", False, 128, SR)]),
    "adam_fp8_amsgrad_bf16_stochastic": (_adam_amsgrad, torch.bfloat16,
                                         [("fp8", True, 64), ("fp8", False, 128, SR), ("fp8", False, 96, SR)]),
    "adamw_fp32_states": (_adamw_8bit, torch.float32, [("fp32", True, 0), ("fp32", False, 0)]),
    "adam_amsgrad_bf16_states_bf16": (_adam_amsgrad, torch.bfloat16,
                                      [("bf16", True, 0), ("bf16", False, 0), ("bf16", False, 0)]),
    "lion_fp32_states_bf16": (_lion_8bit, torch.bfloat16, [("fp32", True, 0)]),
    "sgd_nesterov_fp32_states": (_sgd_4bit_nesterov, torch.float32, [("fp32", True, 0)]),
    "adamw_8bit_bf16_sr": (_adamw_bf16_sr, torch.bfloat16, [("8bit", True, 256), ("8bit", False, 256)]),
    "adamw_fp32_states_bf16_sr": (_adamw_bf16_sr, torch.bfloat16, [("fp32", True, 0), ("fp32", False, 0)]),
}


def _run(case: str, c_kernel: bool, steps: int = 3, extreme: bool = False):
    update, dtype, kinds = CASES[case]
    gen = torch.Generator().manual_seed(0)
    shapes = PLAIN_SHAPES if kinds[0][0] in PLAIN else SHAPES
    ps = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    states = [[torch.zeros_like(p, dtype=PLAIN[kind[0]]) if kind[0] in PLAIN else
               qstate.zeros_like(p, kind[0], signed=kind[1], block_size=kind[2], dtype=torch.float32,
                                 rounding=kind[3] if len(kind) > 3 else "nearest") for p in ps]
              for kind in kinds]
    with cpu_kernel_enabled(c_kernel):
        for step in range(1, steps + 1):
            # tiny and huge magnitudes in one block: codes across the whole map
            gs = [(torch.randn(s, generator=gen) * 10 ** (8 * torch.rand(s, generator=gen) - 4)).to(dtype)
                  for s in shapes]
            if extreme:  # and each run of 64 elements scaled by 2**[-149, 30]: subnormal to large scales
                gs = [(g.float().flatten() * 2.0 ** torch.randint(-149, 31, (g.numel() // 64 + 1,), generator=gen)
                       .repeat_interleave(64)[:g.numel()].float()).reshape(g.shape).to(dtype) for g in gs]
            torch.manual_seed(step)  # the stochastic-rounding keys' draws (rounding_keys.param_keys)
            update(ps, gs, states, step)
    return ps, states


@functools.lru_cache(maxsize=None)
def _inductor(case: str):
    return _run(case, c_kernel=False)


#: the cases the main run takes (one per format and rounding); the exhaustive run takes every case
QUICK_CASES = ("adamw_8bit", "lion_8bit_block_100_stochastic", "sgd_4bit_nesterov", "adamw_fp8_stochastic",
               "adamw_fp32_states")


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in QUICK_CASES else pytest.mark.exhaustive)
                                  for c in sorted(CASES)])
def test_c_kernel_equals_inductor_kernel_bit_for_bit(case):
    _assert_same_bits(_run(case, c_kernel=True), _inductor(case))


@pytest.mark.parametrize("case", ["adamw_8bit", "adam_4bit_amsgrad_bf16", "adamw_fp8", "lion_8bit_block_100_stochastic",
                                  "adamw_fp8_stochastic"])
def test_c_kernel_equals_inductor_kernel_at_extreme_magnitudes(case):
    # blocks whose scales range from subnormal to about 2**43, for each kind of quantized state (fp8's
    # saturation, which needs a scale of a few subnormal steps: test_fp8_blocks_with_subnormal_scales_...)
    _assert_same_bits(*(_run(case, c_kernel, extreme=True) for c_kernel in (True, False)))


def _assert_same_bits(run: tuple, ref: tuple) -> None:
    """Two ``_run`` results: the parameters, and each state's codes and scales (or plain values), bit for bit."""
    (ps, states), (ref_ps, ref_states) = run, ref
    for p, q in zip(ps, ref_ps):
        assert torch.equal(p, q)
    for group, ref_group in zip(states, ref_states):
        for s, r in zip(group, ref_group):
            assert torch.equal(*_parts(s, r))


def _parts(s, r) -> tuple:
    """What must be equal in states ``s`` and ``r``: codes and scales, or the plain values."""
    if isinstance(s, qstate.QuantizedState):
        return torch.cat([s.codes.flatten().float(), s.scale.flatten()]), torch.cat([r.codes.flatten().float(),
                                                                                  r.scale.flatten()])
    return s, r


def test_small_plain_states_run_the_c_kernel_with_its_results():
    # below 65536 elements (where plain specs it does not take run the eager math) a plain spec the C kernel
    # takes runs it: the update is elementwise, so a 1024-element parameter gets the first 1024 elements of
    # the inductor kernel's update of a large parameter holding the same values
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(70_000, generator=gen)
    grads = [torch.randn(70_000, generator=gen) for _ in range(3)]
    results = []
    for c_kernel, n in ((True, 1024), (False, 70_000)):
        p = big[:n].clone()
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        with cpu_kernel_enabled(c_kernel):
            for step, g in enumerate(grads, 1):
                _adamw_8bit([p], [g[:n].clone()], [[m], [v]], step)
        results.append([t[:1024] for t in (p, m, v)])
    for x, y in zip(*results):
        assert torch.equal(x, y)


def _non_finite_run(fmt: str, rounding: str, c_kernel: bool, steps: int) -> list:
    """AdamW steps on gradients holding NaN, +inf and -inf (one block each, and a NaN beside a -inf):
    the parameter, then each state's codes and scale."""
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(4, 512, generator=gen), torch.randn(4, 512, generator=gen)
    g[0, 3], g[1, 300], g[2, 5], g[3, 7], g[3, 9] = float("nan"), float("inf"), -float("inf"), float("nan"), -float("inf")
    states = [qstate.zeros_like(p, fmt, signed=signed, dtype=torch.float32,
                                rounding=rounding if signed else "nearest") for signed in (True, False)]
    with cpu_kernel_enabled(c_kernel):
        for step in range(1, steps + 1):
            _adamw_8bit([p], [g], [[states[0]], [states[1]]], step)
    return [p] + [t for s in states for t in (s.codes, s.scale)]


@functools.lru_cache(maxsize=None)
def _non_finite_inductor(fmt: str, rounding: str, steps: int) -> list:
    return _non_finite_run(fmt, rounding, c_kernel=False, steps=steps)


#: the (format, first moment's rounding) pairs of the non-finite gradient checks
_NON_FINITE = [("8bit", "nearest"), ("8bit", "stochastic"), ("4bit", "stochastic"), ("4bit", "nearest"),
               ("fp8", "nearest")]


@pytest.mark.exhaustive  # every build variant
@pytest.mark.parametrize("fmt, rounding", _NON_FINITE)
@pytest.mark.parametrize("without", [None, "-mno-avx512f", "-mno-avx2"])
def test_non_finite_gradients_match_the_inductor_kernel(fmt, rounding, without, built_with):
    # blocks with an infinity get an infinite scale (even beside a NaN), blocks with only a NaN a NaN scale;
    # their values normalize by BlockFormat.normalize's rule (the C kernel's scalar encode), so the codes
    # are equal bit for bit on every build (native, AVX2 only, portable); NaN parameters and scales may
    # differ in their NaN's sign
    if without is not None and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 vector extensions")
    for steps in (1, 2):  # the second reads states holding +-inf
        call = ("_non_finite_run", fmt, rounding, True, steps)
        got = _non_finite_run(fmt, rounding, True, steps) if without is None else built_with(without)[call]
        ref = _non_finite_inductor(fmt, rounding, steps)
        for x, y in zip(got, ref):
            assert torch.equal(x, y) or torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
        if steps == 1:
            scale, bs = got[2], 512 // got[2].shape[1]  # the first moment's, which is g / 10
            assert scale[0, 0].isnan() and scale[1, 300 // bs] == scale[2, 0] == scale[3, 0] == float("inf")
            assert int(scale.isfinite().sum()) == scale.numel() - 4


def test_fp8_blocks_with_subnormal_scales_saturate_as_torch_converts():
    # an fp8 block's scale is amax / 448; a subnormal one is coarse, so x / scale can pass 448: amax 1000 * 2**-149
    # has the scale 2 * 2**-149 and a value 500, which torch's float8_e4m3fn conversion saturates to 448 (0x7e;
    # NaN only from NaN). The first SGD step's momentum buffer is the gradient itself, so its codes must be the
    # conversion of g / scale, computed here in torch, for blocks of subnormal, border and normal scales
    # (16 and 8 lanes, and each block's scalar tail), with the C kernel and with inductor's
    ulp = 2.0**-149
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 520, generator=gen)  # normal scales; blocks of 40: the vector loops, then a tail of 8
    small = torch.randint(-999, 1000, (3, 40), generator=gen).float() * ulp
    g[0, :40], g[0, 40:80], g[1, :40] = small[0], small[1], small[2] * 2.0**20  # subnormal and border scales
    g[0, 7], g[0, 45], g[1, 3] = 1000 * ulp, -1000 * ulp, 447 * 2.0**-126
    codes = []
    for c_kernel in (True, False):
        p = torch.zeros(3, 520)
        buf = qstate.zeros_like(p, "fp8", signed=True, block_size=40, dtype=torch.float32)
        with cpu_kernel_enabled(c_kernel):
            F.sgd([p], [g.clone()], [buf], [1], lr=0.1, momentum=0.9, compile=True)
        codes.append(buf.codes)
        scale = buf.scale.repeat_interleave(40, dim=1)
        expected = qstate.formats.get_format("fp8").code_of(g / torch.where(scale == 0, 1.0, scale), True, None)
        assert torch.equal(buf.codes, expected)
        assert float(buf.scale[0, 0]) == 2 * ulp and int(buf.codes[0, 7]) == 0x7E and int(buf.codes[0, 45]) == 0xFE
    assert torch.equal(*codes)


#: the cases run by the builds without vector paths
_WITHOUT_CASES = ["adamw_8bit", "adam_4bit_amsgrad_bf16", "adamw_fp8", "adam_amsgrad_bf16_states_bf16"]


@pytest.mark.exhaustive  # every build variant
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector extensions")
@pytest.mark.parametrize("case", _WITHOUT_CASES)
@pytest.mark.parametrize("without", ["-mno-avx512f", "-mno-avx2"])
def test_builds_without_vector_paths_give_the_same_bits(case, without, built_with):
    # the vector paths (AVX-512 VBMI, AVX2) and the portable loops are separate implementations: a build
    # without AVX-512 (AVX2 paths only) and one without AVX2 (portable loops only) give the native build's bits
    _assert_same_bits(built_with(without)[("_run", case, True)], _run(case, c_kernel=True))


#: the cases run at extreme magnitudes by the builds without vector paths: stochastic fp8 has its own encode on
#: each path (fp8_sr_code16, fp8_sr_code8, the scalar stochastic_code), and only blocks of subnormal to large
#: scales reach the spec's edges (values one float from an entry, quotients that underflow)
_WITHOUT_EXTREME_CASES = ["adamw_fp8_stochastic"]


@pytest.mark.exhaustive  # every build variant
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector extensions")
@pytest.mark.parametrize("case", _WITHOUT_EXTREME_CASES)
@pytest.mark.parametrize("without", ["-mno-avx512f", "-mno-avx2"])
def test_builds_without_vector_paths_give_the_inductor_kernels_bits_at_extreme_magnitudes(case, without, built_with):
    _assert_same_bits(built_with(without)[("_run", case, True, 3, True)], _run(case, c_kernel=False, extreme=True))


#: a fresh interpreter's run of this module's functions: argv: the folders to import from, the calls (a
#: file of ``(function name, *arguments)`` tuples), the file for their results
_IN_FRESH_INTERPRETER = """
import sys
import torch
sys.path[:0] = sys.argv[1:3]
import test_cpu_kernel
calls = torch.load(sys.argv[3], weights_only=False)
torch.save([getattr(test_cpu_kernel, name)(*args) for name, *args in calls], sys.argv[4])
"""

_ROOT = Path(__file__).resolve().parents[2]


def _run_in_build(flags: tuple[str, ...], calls: list[tuple], tmp: Path) -> list:
    """The results of ``calls`` (this module's function name, then its arguments) in a fresh interpreter
    whose C kernels build with the extra compiler ``flags`` (``$QSTATE_CPU_KERNEL_CFLAGS``) into an empty
    cache under ``tmp`` (``$TORCHINDUCTOR_CACHE_DIR``: never the library's own cache)."""
    import os
    import shlex
    import sys

    torch.save(calls, tmp / "calls.pt")
    env = dict(os.environ, QSTATE_CPU_KERNEL_CFLAGS=shlex.join(flags), TORCHINDUCTOR_CACHE_DIR=str(tmp / "cache"))
    env.pop("QSTATE_CPU_KERNEL_CACHE", None)  # the cache is <inductor cache dir>/qstate
    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", _IN_FRESH_INTERPRETER, str(here), str(here.parent),
                           str(tmp / "calls.pt"), str(tmp / "results.pt")], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / "results.pt", weights_only=False)


def _build_calls(build: str) -> list[tuple]:
    """What each build of :func:`built_with` runs, all at once (one interpreter per build)."""
    if build == "simde":
        return [("_run", case, True, 3, extreme) for case, extreme in _SIMDE_CASES]
    return ([("_run", case, True) for case in _WITHOUT_CASES]
            + [("_run", case, True, 3, True) for case in _WITHOUT_EXTREME_CASES]
            + [("_non_finite_run", fmt, rounding, True, steps) for fmt, rounding in _NON_FINITE for steps in (1, 2)])


@pytest.fixture(scope="module")
def built_with(tmp_path_factory):
    """``built_with(build)[call]``: the result of ``call`` (:func:`_build_calls`) with the C kernel built with
    the extra flag ``build``, or ``"simde"``: SIMDe's AVX-512 VBMI (:func:`_simde_flags`)."""
    results: dict = {}

    def get(build: str) -> dict:
        if build not in results:
            flags = _simde_flags() if build == "simde" else (build,)
            calls = _build_calls(build)
            results[build] = dict(zip(calls, _run_in_build(flags, calls, tmp_path_factory.mktemp("build"))))
        return results[build]

    return get


#: force-included into builds that take the AVX-512 VBMI paths with SIMDe's portable intrinsics
_SIMDE_SHIM = Path(__file__).with_name("simde_avx512.h")


@functools.lru_cache(maxsize=None)
def _native_defines() -> str:
    """The predefined macros of the kernel's native build (``-march=native``): its vector extensions."""
    cc = _cpu_build.compiler()  # the compiler the kernel builds with (its words)
    if cc is None:
        return ""
    return subprocess.run([*cc, "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                          text=True).stdout


@functools.lru_cache(maxsize=None)
def _simde_flags() -> tuple[str, ...] | None:
    """Compiler flags with which the kernel takes its AVX-512 VBMI paths on an x86-64 machine with AVX2 but
    without AVX-512 (``QSTATE_SIMDE_AVX512``, and ``test/simde_avx512.h``: SIMDe's intrinsics), or None where
    they do not build (another architecture, no C compiler, no SIMDe headers: Debian's ``libsimde-dev``)."""
    cc = _cpu_build.compiler()  # the compiler the kernel builds with (its words)
    if platform.machine() not in ("x86_64", "AMD64") or cc is None or "__AVX2__" not in _native_defines():
        return None
    flags = ("-DQSTATE_SIMDE_AVX512", "-include", str(_SIMDE_SHIM))
    probe = subprocess.run([*cc, "-march=native", *flags, "-fsyntax-only", "-x", "c", "/dev/null"], capture_output=True)
    return flags if probe.returncode == 0 else None


def _vector_flags(lanes: int) -> tuple[str, ...]:
    """Extra flags for a build that takes the ``lanes``-wide vector encodes: none where the native build does
    (or for 8 lanes, whose checks skip without AVX2), SIMDe's for AVX-512 VBMI (16 lanes) on machines without
    it; skips where neither can."""
    if lanes == 8 or "__AVX512VBMI__" in _native_defines():
        return ()
    flags = _simde_flags()
    if flags is None:
        pytest.skip("no AVX-512 VBMI on this machine, and no SIMDe headers to emulate it (libsimde-dev)")
    return flags


#: the cases of the SIMDe build: (case, extreme magnitudes)
_SIMDE_CASES = ([(case, False) for case in sorted(CASES) if CASES[case][2][0][0] not in PLAIN]
                + [(case, True) for case in ("adamw_8bit", "adam_4bit_amsgrad_bf16", "adamw_fp8",
                                             "adamw_fp8_stochastic")])


@pytest.mark.exhaustive  # every build variant
@pytest.mark.parametrize("case, extreme", _SIMDE_CASES)
def test_avx512_paths_built_with_simde_give_the_inductor_kernels_bits(case, extreme, built_with):
    # the AVX-512 VBMI paths (encode8_64 and decode8's in-register lookups, map4_code16, fp8_code16), which only
    # AVX-512 machines build natively, built with SIMDe's portable intrinsics so that every x86-64 machine (CI's)
    # checks them against the inductor kernel; the same cases as the native build's tests
    if _simde_flags() is None:
        pytest.skip("the AVX-512 VBMI paths cannot build here through SIMDe (x86-64 with AVX2 and "
                    "libsimde-dev's headers needed)")
    _assert_same_bits(built_with("simde")[("_run", case, True, 3, extreme)],
                      _run(case, c_kernel=False, extreme=True) if extreme else _inductor(case))


#: the vector paths' builds (``-march``) that no machine runs all of: AVX-512 VBMI (with AVX2 for what its
#: loops leave), AVX2 only, and the portable loops
_MARCH = {"avx512_vbmi": "-march=icelake-server", "avx2": "-march=haswell", "portable": "-march=x86-64"}


@pytest.mark.exhaustive  # every build variant
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector extensions")
@pytest.mark.parametrize("isa", list(_MARCH))
@pytest.mark.parametrize("fmt", ["8bit", "4bit", "fp8", "bf16"])
def test_kernel_source_compiles_for_every_vector_path(fmt, isa, tmp_path):
    # the machine running the suite takes one vector path; the others must at least build (compile only,
    # each kind of AdamW's states: 8bit, 4bit with a stochastic first moment, fp8, plain bf16)
    cc = _cpu_build.compiler()  # the compiler the kernel builds with (its words)
    if cc is None:
        pytest.skip("no C compiler")
    p = torch.zeros(2, 256)
    if fmt in PLAIN:
        states = [torch.zeros_like(p, dtype=PLAIN[fmt]) for _ in range(2)]
    else:
        states = [qstate.zeros_like(p, fmt, signed=signed, dtype=torch.float32,
                                    rounding=SR if signed and fmt == "4bit" else "nearest") for signed in (True, False)]
    spec = KernelSpec.of("adam", _ADAMW_FLAGS, p, states, False)
    (tmp_path / "kernel.c").write_text(_cpu_kernel.kernel_source(spec, torch.float32))
    flags = [f for f in _cpu_build.CFLAGS if not f.startswith("-march=")] + [_MARCH[isa]]
    proc = subprocess.run([*cc, *flags, "kernel.c", "-o", "kernel.so"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.exhaustive  # every build variant
def test_one_build_per_spec_not_per_shape(tmp_path):
    # in a fresh interpreter whose kernels build into an empty cache: one library per case, whatever the shapes
    # and scalars (adamw_8bit_beta1_low is adamw_8bit's spec)
    _run_in_build((), [("_run", case, True, 1) for case in CASES], tmp_path)  # several shapes per case
    assert len(list((tmp_path / "cache" / "qstate").glob("*.so"))) == len(CASES) - 1


def _kernel_stochastic_round(value: torch.Tensor, key: int) -> torch.Tensor:
    """The C kernel's stochastic rounding (``store_p_sr``, ``param_draw``) of float32 ``value`` with the 64-bit
    ``key``, in torch ops: qstate.optim.stochastic_round_bf16 with the position_draws of each element's flat
    index. ``value`` finite."""
    from qstate.optim import stochastic_round_bf16
    from qstate._random import position_draws

    draws = position_draws(key, torch.arange(value.numel(), dtype=torch.int64))
    return stochastic_round_bf16(value.flatten(), draws).reshape(value.shape)


@pytest.mark.parametrize("fmt", ["8bit", "fp32"])
def test_bf16_stochastic_rounding_of_params_in_the_c_kernel(fmt):
    # bfloat16 parameters with stochastic rounding take the C kernel, which rounds with its own draws: one key
    # per parameter and update (rounding_keys.param_keys: one base from torch's generator, mixed with the
    # parameter's position), hashed with each element's flat index. Each parameter equals that rule applied in
    # torch ops to the float32 result of the same update of float32 copies, both when the parameters run one by
    # one (first step) and as one prepared call (second; that such calls give the full path's bits is
    # test_prepared_calls.py's test_parameters_of_a_spec_run_in_one_call_with_the_same_results)
    shapes = PLAIN_SHAPES if fmt == "fp32" else SHAPES
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
    states = [[torch.zeros_like(p, dtype=torch.float32) if fmt == "fp32" else
               qstate.zeros_like(p, fmt, signed=signed, dtype=torch.float32) for p in ps] for signed in (True, False)]
    cpu = torch.device("cpu")
    spec = KernelSpec.of("adam", _ADAMW_FLAGS, ps[0], [s[0] for s in states], True)
    assert _cpu_kernel.supports(spec, torch.bfloat16)
    for step in (1, 2):
        gs = [torch.randn(s, generator=gen).bfloat16() for s in shapes]
        ref_ps = [p.float() for p in ps]
        ref_states = [[s.clone() for s in group] for group in states]
        _adamw_8bit(ref_ps, [g.float() for g in gs], ref_states, step)  # float32: nothing to round
        torch.manual_seed(step)
        F.adamw(ps, gs, *states, [step] * len(ps), lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                compile=True, grad_scale=torch.tensor(4.0), stochastic_round=True)
        torch.manual_seed(step)
        keys = param_keys(len(ps))
        for p, ref, key in zip(ps, ref_ps, keys):
            assert torch.equal(p, _kernel_stochastic_round(ref, key))
        for group, ref_group in zip(states, ref_states):
            for s, r in zip(group, ref_group):
                assert torch.equal(*_parts(s, r))
    # not every element rounded to nearest, nor all one way
    p, ref = ps[0].float(), ref_ps[0]
    assert bool((p > ref).any()) and bool((p < ref).any()) and not torch.equal(ps[0], ref.bfloat16())


_FAILING_COMPILER = """
import torch
import qstate
from qstate.optim import functional as F

p = torch.randn(4, 256)
buf = qstate.zeros_like(p, "8bit", signed=True, block_size=32, dtype=torch.float32)
before = [p.clone(), buf.codes.clone(), buf.scale.clone()]
try:
    F.sgd([p], [torch.randn(4, 256)], [buf], [1], lr=0.1, momentum=0.5, compile=True)
except RuntimeError as error:
    print(str(error).splitlines()[0])
print("unchanged:", all(torch.equal(x, y) for x, y in zip([p, buf.codes, buf.scale], before)))
"""


def _run_failing_step(**env: str) -> str:
    """The output of ``_FAILING_COMPILER`` in a fresh interpreter with ``env`` added and an empty cache."""
    import os
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-c", _FAILING_COMPILER], cwd=_ROOT, capture_output=True, text=True,
                              env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tmp, **env), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


class TestErrors(expecttest.TestCase):
    def test_a_failing_compiler_raises_and_changes_nothing(self):
        # CC=false: the kernel's compiler fails
        self.assertExpectedInline(_run_failing_step(CC="false"), """\
qstate: compiling the CPU update kernel sgd_float32_rn_q_8bit_True_32_nearest with false failed:
unchanged: True
""")

    def test_extra_cflags_reach_the_compiler(self):
        # $QSTATE_CPU_KERNEL_CFLAGS is appended to the build's flags: an option the compiler rejects fails the
        # build (the step raises, nothing changes), and valid extra flags build another library of the spec
        out = _run_failing_step(QSTATE_CPU_KERNEL_CFLAGS="-fqstate-no-such-option")
        self.assertExpectedInline(out.replace(shlex.join(_cpu_build.compiler()), "CC"), """\
qstate: compiling the CPU update kernel sgd_float32_rn_q_8bit_True_32_nearest with CC failed:
unchanged: True
""")


def test_extra_cflags_build_their_own_library(tmp_path):
    _run_in_build((), [("_run", "adamw_8bit", True, 1)], tmp_path)
    _run_in_build(("-O2",), [("_run", "adamw_8bit", True, 1)], tmp_path)
    assert len(list((tmp_path / "cache" / "qstate").glob("qstate_update_*.so"))) == 2  # one spec, two flag sets


@pytest.mark.parametrize("signed", [True, False])
def test_in_register_encode_tables_give_the_packed_tables_codes(signed):
    # _binade_tables' rule (the C kernel's encode8_64): bucket by sign, binade and top mantissa
    # bits, then code = lower code c + (y > t_c), with the tables' t_zero = +0 for unsigned states;
    # emulated here on every threshold and its float neighbours, map entries, specials and values over
    # 9 decades, against Codec.encode
    from qstate.formats._codec import get_codec

    codec = get_codec("8bit", signed, "cpu")
    binade, bucket, t = _cpu_kernel._binade_tables("8bit", signed)
    qmap = codec.tables[0]
    gen = torch.Generator().manual_seed(0)
    y = torch.cat([t, torch.nextafter(t, torch.tensor(2.0)), torch.nextafter(t, torch.tensor(-2.0)), qmap, -qmap,
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 2.0**-31, -(2.0**-30), 1e-30, float("nan")]),
                   (torch.rand(200_000, generator=gen) * 2 - 1) * 10 ** (-9 * torch.rand(200_000, generator=gen))])
    y = torch.where(y.isnan(), y, y.clamp(-1, 1))
    w = y.abs().view(torch.int32).long() >> 15  # exponent, then the top 8 mantissa bits
    j = ((w >> 8) - _cpu_kernel._E_LOW).clamp(0, 31) + 32 * (y < 0).long()
    entry = binade.long()[j]
    code = bucket.long()[(entry & 0x1FF) + ((w & 0xFF) >> (entry >> 9))]
    if not signed:  # _encode_thresholds: a positive value never takes the zero code, by the compare
        assert float(t[codec.zero_code]) == 0.0
    code = code + (y > t[code]).long()
    assert torch.equal(code, codec.encode(y, codec.tables).long())


def _checker(tmp_path, states: list, source: str, function: str, flags: tuple = ()):
    """``function`` of ``source`` (C, which includes ``kernel.c``: the kernel configured for AdamW over
    ``states``), compiled as the kernel is (plus ``flags``); skips without a C compiler."""
    import ctypes

    cc = _cpu_build.compiler()  # the compiler the kernel builds with (its words)
    if cc is None:
        pytest.skip("no C compiler")
    spec = KernelSpec.of("adam", _ADAMW_FLAGS, torch.zeros(2, 256), states, False)
    (tmp_path / "kernel.c").write_text(_cpu_kernel.kernel_source(spec, torch.float32))
    (tmp_path / "check.c").write_text(source)
    lib = tmp_path / "check.so"
    subprocess.run([*cc, *_cpu_build.CFLAGS, *flags, str(tmp_path / "check.c"), "-o", str(lib), "-lm"], check=True,
                   cwd=tmp_path)
    fn = getattr(ctypes.CDLL(str(lib)), function)
    fn.restype = ctypes.c_int64
    return fn


#: the instruction set of each vector encode width (the checkers' ``lanes``)
_VECTOR_ISA = {16: "AVX-512 VBMI", 8: "AVX2"}


_FP8_CHECK = r"""
#include "kernel.c"
/* floats start + stride * m for m = 0 .. count - 1 (count a power of two, at least 32; as bit patterns, in a
 * scrambled order so that neighbouring lanes get unrelated codes): how many codes of
 * the ``lanes``-wide vector encode (16: fp8_code16, AVX-512 VBMI; 8: fp8_code8 and store_codes32, AVX2)
 * differ from fp8_code's, for a signed (is_signed = 1) or unsigned state; ``bounded``: the encode for
 * blocks of numbers below 464 in magnitude, given those floats (others, NaNs included, replaced by their
 * pattern's low 8 bits as a float: a zero or a tiny subnormal); -1 if this build lacks it */
int64_t fp8_mismatches(uint32_t start, uint32_t stride, int64_t count, int is_signed, int lanes, int bounded) {
    int64_t bad = 0;
    for (int64_t k = 0; k < count; k += 32) {
        float y[32];
        uint8_t got[32];
        for (int i = 0; i < 32; i++) {
            const uint32_t m = (uint32_t)(k + i) * 0x9e3779b1u & (uint32_t)(count - 1); /* a bijection */
            y[i] = u2f(start + stride * m);
            if (bounded && !(fabsf(y[i]) < 464.0f)) y[i] = u2f((start + stride * m) & 0xffu);
        }
        if (lanes == 16) {
#if HAVE_VBMI
            for (int h = 0; h < 2; h++)
                _mm_storeu_si128((__m128i *)(got + 16 * h), fp8_code16(_mm512_loadu_ps(y + 16 * h), is_signed, bounded));
#else
            return -1;
#endif
        } else {
#if HAVE_AVX2
            __m256i c[4];
            for (int q = 0; q < 4; q++) c[q] = fp8_code8(_mm256_loadu_ps(y + 8 * q), is_signed, bounded);
            store_codes32(c, got);
#else
            return -1;
#endif
        }
        for (int i = 0; i < 32; i++) bad += got[i] != fp8_code(y[i], is_signed);
    }
    return bad;
}
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector extensions")
@pytest.mark.parametrize("bounded", [0, 1], ids=["any", "bounded"])
@pytest.mark.parametrize("lanes", [16, 8])
def test_fp8_vector_encode_equals_the_scalar_encode(tmp_path, lanes, bounded):
    # fp8_code16 / fp8_code8 (16 / 8 codes at a time) against fp8_code on 2**25 float bit patterns per
    # signedness: every 128th pattern from starts 0 and 77, scrambled (all signs, exponents, NaNs, infinities and
    # subnormals; the development checks covered all 2**32); bounded (the encode of fp8_bounded blocks): the
    # patterns below 464 in magnitude
    import ctypes

    p = torch.zeros(2, 256)
    states = [qstate.zeros_like(p, "fp8", signed=s, dtype=torch.float32) for s in (True, False)]
    fn = _checker(tmp_path, states, _FP8_CHECK, "fp8_mismatches", _vector_flags(lanes))
    fn.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    results = {(start, signed): fn(start, 128, 2**25, signed, lanes, bounded)
               for start in (0, 77) for signed in (1, 0)}
    if -1 in results.values():
        pytest.skip(f"this machine's build has no {_VECTOR_ISA[lanes]} path")
    assert results == {key: 0 for key in results}


_FP8_SCALAR = r"""
#include "kernel.c"
/* fp8_code of the n values y[] (the scalar encode, which the vector encodes are checked against) */
int64_t fp8_scalar_codes(const float *y, int64_t n, int is_signed, uint8_t *out) {
    for (int64_t k = 0; k < n; k++) out[k] = fp8_code(y[k], is_signed);
    return 0;
}
"""


def test_fp8_scalar_encode_equals_torchs_conversion(tmp_path):
    # fp8_code against qstate.formats' fp8 code_of (torch's float8_e4m3fn conversion, then the unsigned
    # rules) on every 1024th float bit pattern (all signs, exponents, subnormals, NaNs) and the saturation
    # range: 448 .. 480 and past it, infinities
    import ctypes

    p = torch.zeros(2, 256)
    states = [qstate.zeros_like(p, "fp8", signed=s, dtype=torch.float32) for s in (True, False)]
    fn = _checker(tmp_path, states, _FP8_SCALAR, "fp8_scalar_codes")
    edges = torch.tensor([448.0, 463.99, 464.0, 464.01, 479.99, 480.0, 500.0, 3e38, float("inf"), float("nan")])
    y = torch.cat([(torch.arange(2**22, dtype=torch.int64) * 1024 + 77).to(torch.int32).view(torch.float32),
                   edges, -edges, torch.linspace(440.0, 490.0, 4001)])
    fp8 = qstate.formats.get_format("fp8")
    for signed in (True, False):
        out = torch.empty(y.shape, dtype=torch.uint8)
        fn(ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(y.numel()), ctypes.c_int(signed), ctypes.c_void_p(out.data_ptr()))
        assert torch.equal(out, fp8.code_of(y, signed, None))


_FP8_SR_CHECK = r"""
#include "kernel.c"
/* An unsigned fp8 state's stochastic codes of the n values y[] (n a multiple of 16; values 16 b .. 16 b + 15 at the
 * flat indices base[b] .. base[b] + 15, whose draws under key they take) by the ``lanes``-wide encode (0: the
 * scalar ENCODE's steps, fp8_code then stochastic_code on qmap, the 127 non-negative codes' values; 16:
 * fp8_sr_code16, AVX-512 VBMI; 8: fp8_sr_code8, AVX2); -1 if this build lacks it */
int64_t fp8_sr_codes(const float *y, int64_t n, const uint64_t *base, uint64_t key, int lanes, const float *qmap,
                     uint8_t *out) {
    for (int64_t k = 0; k < n; k += 16) {
        const uint64_t b = base[k / 16];
        if (lanes == 0) {
            for (int64_t j = k; j < k + 16; j++) {
                out[j] = fp8_code(y[j], 0);
                if (y[j] > 0.0f) {
                    const int32_t c = stochastic_code(y[j], out[j], qmap, FP8_NON_NEGATIVE_CODES,
                                                      position_hash64(key, b + (uint64_t)(j - k)));
                    out[j] = (uint8_t)(c > 1 ? c : 1);
                }
            }
        } else if (lanes == 16) {
#if HAVE_VBMI
            _mm_storeu_si128((__m128i *)(out + k), fp8_sr_code16(_mm512_loadu_ps(y + k), key, b));
#else
            return -1;
#endif
        } else {
#if HAVE_AVX2
            for (int h = 0; h < 16; h += 8)
                store_codes8(fp8_sr_code8(_mm256_loadu_ps(y + k + h), key, b + (uint64_t)h), out + k + h);
#else
            return -1;
#endif
        }
    }
    return 0;
}
"""


def _lowbias32_inverse(x: int) -> int:
    """The 32-bit word whose lowbias32 is ``x`` (each step undone in reverse order)."""
    x ^= x >> 16
    x = (x * pow(0x846CA68B, -1, 2**32)) & 0xFFFFFFFF
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * pow(0x7FEB352D, -1, 2**32)) & 0xFFFFFFFF
    return x ^ (x >> 16)


@pytest.mark.parametrize("lanes", [0, 16, 8], ids=["scalar", "16", "8"])
def test_fp8_stochastic_encodes_follow_the_rounding_spec(tmp_path, lanes):
    # every encode of an unsigned fp8 state rounded stochastically (scalar, fp8_sr_code16, fp8_sr_code8) against
    # qstate.formats' fp8 code_of with the same draws, on the spec's edges: every map entry and the floats one
    # and two away from it, the smallest subnormal (a quotient that underflowed), values past 448, zeros,
    # negatives, NaN and infinity, each at an index whose draw is the largest (2**24 - 1) and one whose draw is
    # 0 (which round a float one below an entry down, one above up, were the rule only the draw's compare), and
    # values over 60 binades at random indices
    import ctypes

    from qstate._random import lowbias32_int, position_hash32
    from qstate.formats.fp8 import NON_NEGATIVE_VALUES

    if lanes and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 vector extensions")
    p = torch.zeros(2, 256)
    fn = _checker(tmp_path, [qstate.zeros_like(p, "fp8", signed=False, dtype=torch.float32, rounding=SR)],
                  _FP8_SR_CHECK, "fp8_sr_codes", _vector_flags(lanes) if lanes else ())
    entries = NON_NEGATIVE_VALUES
    up, down = torch.nextafter(entries, torch.tensor(1e3)), torch.nextafter(entries, torch.tensor(-1.0))
    edges = torch.cat([entries, up, down, torch.nextafter(up, torch.tensor(1e3)),
                       torch.nextafter(down, torch.tensor(-1.0)),
                       torch.tensor([2.0**-149, 2 * 2.0**-149, 2.0**-10, 448.5, 500.0, 1e4, float("inf"),
                                     float("nan"), -0.0, -(2.0**-149), -1.0, -500.0])])
    key = 0x123456789ABCDEF0
    # the index n < 2**32 with position_hash32(key, n) == h: lowbias32(n ^ k_lo ^ lowbias32(k_hi)) == h
    inner = int(lowbias32_int(torch.tensor([key >> 32]))[0])
    hashes = [0xFFFFFFFF - m % 256 for m in range(len(edges))] + [m % 256 for m in range(len(edges))]
    bases = [_lowbias32_inverse(h) ^ (key & 0xFFFFFFFF) ^ inner for h in hashes]
    gen = torch.Generator().manual_seed(0)
    blocks = 2 * len(edges) + 500
    y = torch.rand(blocks, 16, generator=gen) * 2.0 ** torch.randint(-40, 20, (blocks, 16), generator=gen).float()
    y[: 2 * len(edges), 0] = edges.repeat(2)  # lane 0 of a block: the draw chosen above
    bases += torch.randint(0, 2**40, (500,), generator=gen).tolist()
    base = torch.tensor(bases, dtype=torch.int64)
    index = (base[:, None] + torch.arange(16)).flatten()
    out = torch.empty(y.numel(), dtype=torch.uint8)
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p,
                   ctypes.c_void_p]
    if fn(y.data_ptr(), y.numel(), base.data_ptr(), key, lanes, entries.data_ptr(), out.data_ptr()) == -1:
        pytest.skip(f"this machine's build has no {_VECTOR_ISA[lanes]} path")
    draws = position_hash32(key, index)
    assert torch.equal(draws[0 : 32 * len(edges) : 16] >> 8, torch.tensor([2**24 - 1, 0]).repeat_interleave(len(edges)))
    assert torch.equal(out, qstate.formats.get_format("fp8").code_of(y.flatten(), False, None, SR, draws))


_FP8_DECODE_CHECK = r"""
#include "kernel.c"
/* how many of the 256 fp8 codes fp8_value8 (AVX2) decodes to other bits than qmap[code]; -1 if this build
 * lacks it */
int64_t fp8_decode_mismatches(const float *qmap) {
#if HAVE_AVX2
    const __m256 nan[2] = {_mm256_set1_ps(qmap[0x7f]), _mm256_set1_ps(qmap[0xff])};
    int64_t bad = 0;
    for (int c = 0; c < 256; c += 8) {
        float got[8];
        const __m256i codes = _mm256_add_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_storeu_ps(got, fp8_value8(codes, nan));
        for (int i = 0; i < 8; i++) bad += f2u(got[i]) != f2u(qmap[c + i]);
    }
    return bad;
#else
    return -1;
#endif
}
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector extensions")
def test_fp8_vector_decode_equals_the_table_on_every_code(tmp_path):
    # fp8_value8 computes the value of a code from its bits: the same bits as the kernel's fp8 decode table
    # (one for signed and unsigned states) on all 256 codes, signed zero, subnormals and both NaNs included
    import ctypes

    state = qstate.zeros_like(torch.zeros(2, 256), "fp8", signed=True, dtype=torch.float32)
    fn = _checker(tmp_path, [state], _FP8_DECODE_CHECK, "fp8_decode_mismatches")
    qmap = _cpu_kernel._table_pointers(StateKind.of(state))[0]  # what the kernel decodes with
    result = fn(ctypes.c_void_p(qmap))
    if result == -1:
        pytest.skip("this machine's build has no AVX2 path")
    assert result == 0


def _map_inputs(fmt: str, specials: list, multiple: int, clamp: bool) -> torch.Tensor:
    """Inputs of a map format's vector-encode checker: every 512th float in [0, 1], each threshold and map
    value of both signednesses with its float neighbours, and ``specials``, all with both signs (clamped
    to [-1, 1] if ``clamp``), in a scrambled order (unrelated codes side by side); ``multiple`` divides the count."""
    from qstate.formats._codec import _code_thresholds as code_thresholds, get_codec

    sweep = torch.arange(0, 0x3F800001, 512, dtype=torch.int64).to(torch.int32).view(torch.float32)
    marks = [torch.tensor(specials)]
    for signed in (True, False):
        codec = get_codec(fmt, signed, "cpu")
        for v in (codec.qmap, code_thresholds(codec.qmap)):
            marks += [v, torch.nextafter(v, torch.tensor(2.0)), torch.nextafter(v, torch.tensor(-2.0))]
    y = torch.cat([sweep, -sweep] + [m.abs() for m in marks] + [-m.abs() for m in marks])
    y = y.clamp(-1, 1) if clamp else y
    y = torch.cat([y, y[: (-y.numel()) % multiple]])
    return y[torch.randperm(y.numel(), generator=torch.Generator().manual_seed(0))]


#: the checkers' reference for map states: ENCODE of state 0 or 1 of the configured spec (its tables given), with
#: the draw of flat index n under the key ``key`` (the state's own: STATE_KEY already applied; read only by
#: stochastically rounding states)
_SCALAR_CODE = r"""
#include "kernel.c"
static uint8_t scalar_code(float y, int state, const float *qmap0, const int32_t *tab0, const float *qmap1,
                           const int32_t *tab1, uint64_t key, uint64_t n) {
    uint8_t c;
    if (state == 0) ENCODE(0, y, c, position_hash64(key, n));
    else ENCODE(1, y, c, position_hash64(key, n));
    return c;
}
"""


_MAP4_CHECK = _SCALAR_CODE + r"""
/* how many of the n values y[] (no NaN; n a multiple of 16) get another code from the ``lanes``-wide
 * vector encode (16: map4_code16, AVX-512 VBMI; 8: map4_code8 and store_nibbles8, AVX2) than from the scalar
 * ENCODE, for state ``state`` (0: signed, stochastic; 1: unsigned, nearest) of the configured spec, drawing
 * under ``key``; -1 if this build lacks it. y[k] has the flat index base + k, or with ``wrap`` each run of 16
 * (the m-th) has base's high word + m and starts at low word 2**32 - 1 - m % 17: its low word wraps at lane
 * 1 + m % 17 (none for 16), carrying into the high word (and the AVX2 halves' second one starts past it) */
int64_t map4_mismatches(const float *y, int64_t n, const float *qmap0, const int32_t *tab0, const float *thr0,
                        const float *qmap1, const int32_t *tab1, const float *thr1, int state, int lanes,
                        uint64_t key, uint64_t base, int wrap) {
    int64_t bad = 0;
    const float *qmap = state == 0 ? qmap0 : qmap1, *thr = state == 0 ? thr0 : thr1;
    const int sr = state == 0 ? S0_SR : S1_SR;
    for (int64_t k = 0; k + 16 <= n; k += 16) {
        const uint64_t m = (uint64_t)k / 16;
        const uint64_t n0 = wrap ? ((base & 0xffffffff00000000ull) + (m << 32)) | (0xffffffffull - m % 17)
                                 : base + (uint64_t)k;
        uint8_t got[16];
        if (lanes == 16) {
#if HAVE_VBMI
            int32_t c[16];
            const __m512 t = map4_search16(thr, qmap, sr), q = _mm512_loadu_ps(qmap);
            _mm512_storeu_si512(c, map4_code16(_mm512_loadu_ps(y + k), t, q, sr, key, n0));
            for (int i = 0; i < 16; i++) got[i] = (uint8_t)c[i];
#else
            return -1;
#endif
        } else {
#if HAVE_AVX2
            const search4_t s = map4_search8(thr, qmap, sr);
            const __m256 q[2] = {_mm256_loadu_ps(qmap), _mm256_loadu_ps(qmap + 8)};
            uint8_t packed[8];
            for (int h = 0; h < 2; h++)
                store_nibbles8(map4_code8(_mm256_loadu_ps(y + k + 8 * h), &s, q, sr, key, n0 + 8 * h), packed + 4 * h);
            for (int i = 0; i < 16; i++) got[i] = (packed[i / 2] >> (4 * (i % 2))) & 15;
#else
            return -1;
#endif
        }
        for (int i = 0; i < 16; i++)
            bad += got[i] != scalar_code(y[k + i], state, qmap0, tab0, qmap1, tab1, key, n0 + (uint64_t)i);
    }
    return bad;
}
"""

@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector extensions")
@pytest.mark.parametrize("lanes", [16, 8])
def test_4bit_vector_encode_equals_the_scalar_encode(tmp_path, lanes):
    # map4_code16 / map4_code8 against ENCODE (the packed table, then stochastic rounding) for the two states of 4bit
    # AdamW: every 512th float in [-1, 1], each threshold and map value with its float neighbours, specials; the
    # stochastic state's draws by position under random keys, from flat indices below and above 2**32 and
    # with the low word wrapping inside the vectors (the carry into the high word)
    import ctypes

    p = torch.zeros(2, 256)
    states = [qstate.zeros_like(p, "4bit", signed=True, dtype=torch.float32, rounding="stochastic"),
              qstate.zeros_like(p, "4bit", signed=False, dtype=torch.float32)]
    fn = _checker(tmp_path, states, _MAP4_CHECK, "map4_mismatches", _vector_flags(lanes))
    y = _map_inputs("4bit", [0.0, 1.0, 2.0**-149, 1e-30], 16, clamp=True)
    tables = [_cpu_kernel._table_pointers(StateKind.of(s)) for s in states]
    args = [ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(y.numel())]
    for qmap, table, _, _, threshold in tables:
        args += [ctypes.c_void_p(qmap), ctypes.c_void_p(table), ctypes.c_void_p(threshold)]
    gen = torch.Generator().manual_seed(0)
    keys = [int(k) & (2**64 - 1) for k in torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64, generator=gen)]
    places = [(0, 0), (2**32 - y.numel() // 2 - 5, 0), (5 << 32 | 12345, 0), (7 << 32, 1), (2**64 - 2**32, 1)]
    results = {(state, key, base, wrap): fn(*args, ctypes.c_int(state), ctypes.c_int(lanes), ctypes.c_uint64(key),
                                            ctypes.c_uint64(base), ctypes.c_int(wrap))
               for state in (0, 1) for key in keys for base, wrap in places}
    if -1 in results.values():
        pytest.skip(f"this machine's build has no {_VECTOR_ISA[lanes]} path")
    assert results == {case: 0 for case in results}


def _sr_state_codes(fmt: str, g: torch.Tensor, key: int, start: int) -> torch.Tensor:
    """The codes (one per element) of the stochastically rounded first moment after one C-kernel AdamW step
    from zero states with beta1 = 0 (so the new first moment is ``g`` exactly: torch.lerp's form for weight 1
    adds -0 * (g - 0)), run with the given key and start."""
    p = torch.zeros_like(g)
    bs = 64 if fmt == "4bit" else 100
    states = [qstate.zeros_like(p, fmt, signed=True, block_size=bs, dtype=torch.float32, rounding=SR),
              qstate.zeros_like(p, fmt, signed=False, block_size=bs, dtype=torch.float32)]
    from qstate.optim._engine.op import UpdateVariant

    spec = KernelSpec.of("adam", _ADAMW_FLAGS, p, states, False)
    assert _cpu_kernel.supports(spec, g.dtype) and spec.keyed and not spec.param_sr
    # lr, grad_unscale, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt, m_bound
    hyper = torch.tensor([1e-3, 1.0, 0.0, 0.999, 1e-8, 0.0, 1.0, 1.0, 1.0])
    with cpu_kernel_enabled(True):
        torch.ops.qstate.fused_update([p], [g], states, hyper, UpdateVariant("adam", _ADAMW_FLAGS, False).name,
                                      sr_keys=[key - 2**64 if key >= 2**63 else key], starts=[torch.tensor([start])])
    codes = states[0].codes
    if fmt == "4bit":
        codes = torch.stack([codes & 15, codes >> 4], -1).flatten(-2)[:, :g.shape[1]]
    return codes.long()


@pytest.mark.parametrize("fmt", ["4bit", "8bit"])
def test_state_stochastic_rounding_draws_by_position(fmt):
    # the C kernel's stochastic rounding of a state is qstate.formats.stochastic_code with the draws
    # position_hash32(state_key(key, i), n) of each element's flat index n = start + row * row_len + column
    # (state i = 0: the first moment); ragged rows (vector loops, then scalar tails) and a start just below
    # 2**32, so that the low word of n wraps inside a row (the carry into the high word)
    from qstate.formats import position_hash32, state_key, stochastic_code
    from qstate.formats._codec import get_codec

    gen = torch.Generator().manual_seed(0)
    g = torch.randn(3, 203, generator=gen) * 10 ** (2 * torch.rand(3, 203, generator=gen) - 1)
    key, start = 0x9A3F_1C2B_7D4E_5F60, 2**32 - 300
    codes = _sr_state_codes(fmt, g, key, start)
    # the reference: y = g / the block's absmax, the floor code by search, then the spec's rounding
    bs = 64 if fmt == "4bit" else 100
    qmap = get_codec(fmt, True, "cpu").qmap
    blocks = torch.nn.functional.pad(g, (0, -g.shape[1] % bs)).reshape(3, -1, bs)
    scale = blocks.abs().amax(-1, keepdim=True)
    y = (blocks / scale).reshape(3, -1)[:, :g.shape[1]].contiguous()
    nearest = torch.searchsorted(qmap, y).clamp(max=qmap.numel() - 1)
    n = start + torch.arange(g.numel(), dtype=torch.int64).reshape(g.shape)
    draws = position_hash32(state_key(key, 0), n)
    ref = stochastic_code(y, nearest, qmap, draws)
    assert torch.equal(codes, ref)
    assert not torch.equal(codes, stochastic_code(y, nearest, qmap, None))  # not by value
    # another start or key moves the draws: some codes change, the rest stays as the reference has it
    for other_key, other_start in ((key, start + 1), (key ^ 1 << 40, start)):
        other = _sr_state_codes(fmt, g, other_key, other_start)
        n = other_start + torch.arange(g.numel(), dtype=torch.int64).reshape(g.shape)
        assert not torch.equal(other, codes)
        assert torch.equal(other, stochastic_code(y, nearest, qmap, position_hash32(state_key(other_key, 0), n)))


_MAP8_CHECK = _SCALAR_CODE + r"""
/* how many of the n values y[] (n a multiple of 32) get another code from the AVX2 encode of 8-bit map states
 * (table_code8 through CODE8, and store_codes32) than from the scalar ENCODE, for state ``state`` (0: signed,
 * 1: unsigned; both round to nearest) of the configured spec; -1 if this build lacks it */
int64_t map8_mismatches(const float *y, int64_t n, const float *qmap0, const int32_t *tab0, const float *qmap1,
                        const int32_t *tab1, int state) {
#if HAVE_AVX2
    int64_t bad = 0;
    for (int64_t k = 0; k + 32 <= n; k += 32) {
        __m256i c[4];
        uint8_t got[32];
        for (int q = 0; q < 4; q++)
            c[q] = state == 0 ? CODE8(0, _mm256_loadu_ps(y + k + 8 * q), 0)
                           : CODE8(1, _mm256_loadu_ps(y + k + 8 * q), 0);
        store_codes32(c, got);
        for (int i = 0; i < 32; i++) bad += got[i] != scalar_code(y[k + i], state, qmap0, tab0, qmap1, tab1, 0, 0);
    }
    return bad;
#else
    return -1;
#endif
}
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 vector extensions")
def test_8bit_vector_encode_equals_the_scalar_encode(tmp_path):
    # table_code8 (8 codes at a time, AVX2) against ENCODE (the packed table) for the two states of 8bit AdamW:
    # every 512th float in [-1, 1], each threshold and map value with its float neighbours, values past 1
    # (the table's clamped keys), zeros of both signs, infinities and NaNs of both signs
    import ctypes

    p = torch.zeros(2, 256)
    states = [qstate.zeros_like(p, "8bit", signed=s, dtype=torch.float32) for s in (True, False)]
    fn = _checker(tmp_path, states, _MAP8_CHECK, "map8_mismatches")
    y = _map_inputs("8bit", [0.0, 1.0, 1.5, 2.0**-149, 1e-30, 2.0**100, float("inf"), float("nan")], 32, clamp=False)
    args = [ctypes.c_void_p(y.data_ptr()), ctypes.c_int64(y.numel())]
    for qmap, table, *_ in (_cpu_kernel._table_pointers(StateKind.of(s)) for s in states):
        args += [ctypes.c_void_p(qmap), ctypes.c_void_p(table)]
    results = [fn(*args, ctypes.c_int(state)) for state in (0, 1)]
    if -1 in results:
        pytest.skip("this machine's build has no AVX2 path")
    assert results == [0, 0]


@pytest.mark.exhaustive  # builds and times two kernels
def test_the_kernel_ab_benchmark_still_runs(tmp_path):
    # benchmarks/bench_kernel_ab.py reaches into this module (it wraps _cpu_kernel.run, builds the kernel's
    # slots and calls the C entry point itself): an internal change must not break it silently
    import pathlib
    import sys

    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernel_ab.py"
    source = tmp_path / "kernel.c"
    args = ["--format", "8bit", "--numel", "64K"]
    subprocess.run([sys.executable, str(script), "--dump", str(source), *args], check=True, capture_output=True)
    out = subprocess.run([sys.executable, str(script), str(source), str(source), *args, "--calls", "2"],
                         check=True, capture_output=True, text=True).stdout
    assert "B / A = " in out
    # --phases edits the kernel's source at fixed anchors: a kernel change that moves them must show here
    out = subprocess.run([sys.executable, str(script), "--phases", *args, "--calls", "2"],
                         check=True, capture_output=True, text=True).stdout
    assert "without the encodes and decodes" in out and "x fused" in out


#: AdamW's static flags, as the optimizer gives them (sorted)
_ADAMW_FLAGS = (("amsgrad", False), ("decoupled", True), ("maximize", False))


def _sr_adamw_op(ps, gs, states, sr_keys, starts=None, variant=None):
    """qstate::fused_update of bf16 AdamW with stochastic rounding (step 1 scalars) on plain tensors;
    ``starts``: ints (default 0 for each parameter)."""
    from qstate.optim._engine.op import UpdateVariant
    from qstate.optim.adam import ADAM

    group = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    hyper = torch.tensor([1e-2, 1.0] + [ADAM.scalars(group, 1)[n] for n in ADAM.scalar_names[2:]])
    variant = variant or UpdateVariant("adam", _ADAMW_FLAGS, True).name
    starts = [torch.tensor([s]) for s in (starts or [0] * len(ps))]
    torch.ops.qstate.fused_update(ps, gs, [s for st in states for s in st], hyper, variant, sr_keys=sr_keys,
                                  starts=starts)


@pytest.mark.parametrize("fmt", ["8bit", "fp32"])
def test_stochastic_rounding_draws_by_place_in_the_full_tensor(fmt):
    # the op's sr_keys and starts (DTensor's strategy gives each shard its first element's flat index): the
    # update of a tensor's row ranges, each with its start, is the whole tensor's update bit for bit (states'
    # blocks never cross rows); with start 0 the second range draws other bits
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(10, 300, generator=gen).bfloat16(), torch.randn(10, 300, generator=gen).bfloat16()
    key = 0x9E3779B97F4A7C15 - 2**64  # an int64 key whose uint64 form has the top bit set

    def states(p):
        if fmt == "fp32":
            return [torch.zeros_like(p, dtype=torch.float32) for _ in range(2)]
        return [qstate.zeros_like(p, fmt, signed=s, dtype=torch.float32) for s in (True, False)]

    whole = p0.clone()
    _sr_adamw_op([whole], [g], [states(whole)], [key])
    parts = [p0[:4].clone(), p0[4:].clone()]
    _sr_adamw_op(parts, [g[:4], g[4:]], [states(q) for q in parts], [key, key], [0, 4 * 300])
    assert torch.equal(torch.cat(parts), whole)
    unplaced = p0[4:].clone()
    _sr_adamw_op([unplaced], [g[4:]], [states(unplaced)], [key], [0])
    assert not torch.equal(unplaced, whole[4:])
    assert not torch.equal(whole, p0)  # the update moved it


def test_sr_keys_on_tensors_the_fused_kernels_do_not_take_draw_by_place_op_by_op():
    # a non-contiguous shard runs the rule's math op by op; with sr_keys and starts its draws still follow
    # each element's place in the full tensor: row ranges of a transposed tensor, each with its start, are
    # updated as the whole (transposed, so also op by op) tensor is with the same key and start 0
    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(10, 300, generator=gen).bfloat16(), torch.randn(10, 300, generator=gen).bfloat16()
    key = 0x9E3779B97F4A7C15 - 2**64
    whole, st = p0.t().contiguous().t(), [torch.zeros(10, 300) for _ in range(2)]
    _sr_adamw_op([whole], [g], [st], [key])
    parts = [p0[:4].t().contiguous().t(), p0[4:].t().contiguous().t()]  # not contiguous: no fused kernel
    assert not any(q.is_contiguous() for q in parts + [whole])
    states = [[torch.zeros(q.shape) for _ in range(2)] for q in parts]
    _sr_adamw_op(parts, [g[:4], g[4:]], states, [key, key], [0, 4 * 300])
    assert torch.equal(torch.cat(parts), whole)
    assert all(torch.equal(torch.cat([a[i], b[i]]), st[i]) for a, b in [states] for i in range(2))
    assert not torch.equal(whole, p0)
    # the places matter: the second range with start 0 draws other bits
    unplaced, unplaced_states = p0[4:].t().contiguous().t(), [torch.zeros(6, 300) for _ in range(2)]
    _sr_adamw_op([unplaced], [g[4:]], [unplaced_states], [key], [0])
    assert not torch.equal(unplaced, whole[4:])


class TestSrKeysErrors(expecttest.TestCase):
    def test_sr_keys_need_a_stochastically_rounding_variant_and_change_nothing(self):
        from qstate.optim._engine.op import UpdateVariant

        ok = torch.zeros(10, 300, dtype=torch.bfloat16)
        g = torch.ones(10, 300, dtype=torch.bfloat16)
        st = [[torch.zeros(10, 300) for _ in range(2)] for _ in range(2)]
        before = [t.clone() for t in (ok, *st[0], *st[1])]

        def error(fn) -> str:
            with self.assertRaises(Exception) as info:
                fn()
            return f"{type(info.exception).__name__}: {info.exception}"

        self.assertExpectedInline(error(lambda: _sr_adamw_op([ok], [g], st[:1], [1, 2])), """ValueError: qstate::fused_update: expected one sr_key and start per param, got 1 params, 2 sr_keys, 1 starts""")
        # keys come with starts (a shard's draws need its place in the full tensor)
        hyper = torch.zeros(9)
        self.assertExpectedInline(error(lambda: torch.ops.qstate.fused_update([ok], [g], st[0], hyper, UpdateVariant("adam", _ADAMW_FLAGS, True).name, sr_keys=[1])), """ValueError: qstate::fused_update: expected one sr_key and start per param, got 1 params, 1 sr_keys, no starts""")
        for t, b in zip((ok, *st[0], *st[1]), before):
            assert torch.equal(t, b)
