"""The C kernel's build cache (``qstate/optim/_cpu_build.py``): only libraries qstate built are loaded.

Real builds throughout, each load in a fresh interpreter (a bad library that crashes on loading takes that
one down, not the test's). Two levels: :func:`_cpu_build.load` of a one-function C source, in an interpreter
that imports ``_cpu_build.py`` alone (it needs only the standard library where the cache folder is given:
``$QSTATE_CPU_KERNEL_CACHE``), for private folders, refused folders, planted, truncated and linked cache
entries, ``$CC`` with arguments and missing compilers; and the optimizer's step (plain-state SGD, the
smallest kernel spec): a planted kernel is never loaded and the step still gives the written-out update
exactly, a truncated one is built again, a folder others can write is refused and nothing changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import expecttest
import pytest

from qstate.optim._engine.cpu import build as _cpu_build

pytestmark = pytest.mark.skipif(_cpu_build.compiler() is None, reason="no C compiler")

_ROOT = Path(__file__).resolve().parents[2]

#: the library :func:`_load` builds: it answers ``ANSWER`` (42 unless the compiler's command defines it)
_SOURCE = "#ifndef ANSWER\n#define ANSWER 42\n#endif\nint qstate_answer(void) { return ANSWER; }\n"

#: a library someone else put in the cache: loading it runs its constructor, which writes the file ``MARKER``
_PLANTED = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) fclose(f);
}
int qstate_answer(void) { return 666; }
void qstate_update(void) {}
void qstate_update_many(void) {}
"""

#: :func:`_cpu_build.load` of ``argv[2]`` with ``_cpu_build.py`` (``argv[1]``) imported alone; its answer or
#: error as JSON
_LOAD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("_cpu_build", sys.argv[1])
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
try:
    print(json.dumps({"answer": build.load(sys.argv[2], "answer", "the test library").qstate_answer()}))
except RuntimeError as error:
    print(json.dumps({"error": str(error)}))
"""


def _load(cache: Path, **env: str) -> dict:
    """``{"answer": ...}`` of :data:`_SOURCE` loaded through ``cache``, or ``{"error": message}``, in a fresh
    interpreter with the test process's environment (no extra flags), ``env`` added."""
    env = dict(os.environ, QSTATE_CPU_KERNEL_CACHE=str(cache), **env)
    env.pop("QSTATE_CPU_KERNEL_CFLAGS", None)
    proc = subprocess.run([sys.executable, "-c", _LOAD, _cpu_build.__file__, _SOURCE], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def _library(cache: Path) -> Path:
    (lib,) = cache.glob("*.so")
    return lib


def _sidecar(lib: Path) -> Path:
    return lib.parent / (lib.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_whole(lib: Path) -> None:
    """``lib`` is a regular file whose SHA-256 its sidecar records."""
    assert stat.S_ISREG(os.lstat(lib).st_mode)
    assert _sidecar(lib).read_text().strip() == _sha256(lib)


@pytest.fixture
def seeded(tmp_path) -> Path:
    """A cache folder holding the library of :data:`_SOURCE` and its sidecar (and ``tmp_path / "seed.so"``, a
    copy of the library)."""
    assert _load(tmp_path / "cache") == {"answer": 42}
    shutil.copy(_library(tmp_path / "cache"), tmp_path / "seed.so")
    return tmp_path / "cache"


def _plant(lib: Path, marker: Path, sidecar: bool = True) -> None:
    """Put :data:`_PLANTED` at ``lib``; with ``sidecar``, its SHA-256 in ``lib``'s sidecar."""
    src = lib.parent / "planted.c"
    src.write_text(_PLANTED)
    subprocess.run([*_cpu_build.compiler(), "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(lib)],
                   check=True)
    src.unlink()
    if sidecar:
        _sidecar(lib).write_text(_sha256(lib) + "\n")


def test_the_cache_folder_is_created_private_with_a_hash_of_each_library(tmp_path):
    cache = tmp_path / "a" / "b" / "cache"
    assert _load(cache) == {"answer": 42}
    for level in (tmp_path / "a", tmp_path / "a" / "b", cache):  # every level qstate created
        assert stat.S_IMODE(os.lstat(level).st_mode) == 0o700
    lib = _library(cache)
    _assert_whole(lib)
    assert sorted(p.name for p in cache.iterdir()) == [lib.name, lib.name + ".sha256"]
    built = os.lstat(lib).st_ino
    assert _load(cache) == {"answer": 42}
    assert os.lstat(lib).st_ino == built  # loaded from the cache, not built again


def test_the_umask_never_widens_the_cache(tmp_path):
    old = os.umask(0)  # the children inherit it
    try:
        assert _load(tmp_path / "cache") == {"answer": 42}
        built = os.lstat(_library(tmp_path / "cache")).st_ino
        assert _load(tmp_path / "cache") == {"answer": 42}
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(tmp_path / "cache").st_mode) == 0o700
    assert os.lstat(_library(tmp_path / "cache")).st_ino == built  # its entries are trusted: not built again


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_folder_others_can_write_is_refused_and_nothing_in_it_loaded(seeded, tmp_path, mode):
    marker = tmp_path / "marker"
    _plant(_library(seeded), marker)  # with a matching sidecar: only the folder's check keeps it out
    seeded.chmod(mode)
    assert f"group or others can write it (mode {mode:#o})" in _load(seeded)["error"]
    assert not marker.exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
def test_a_folder_of_another_user_is_refused_and_nothing_in_it_loaded(seeded, tmp_path):
    marker = tmp_path / "marker"
    _plant(_library(seeded), marker)
    os.chown(seeded, 65534, -1)
    assert "it is owned by uid 65534, not by this user (uid 0)" in _load(seeded)["error"]
    assert not marker.exists()


def test_a_linked_folder_is_refused(seeded, tmp_path):
    (tmp_path / "link").symlink_to(seeded)
    assert "link: it is a symbolic link;" in _load(tmp_path / "link")["error"]


def test_a_folder_above_that_others_can_write_is_refused_unless_sticky(tmp_path):
    above = tmp_path / "above"
    above.mkdir()
    above.chmod(0o777)  # others could rename the cache folder away and put theirs in its place
    assert "above, a folder above it, can be written by others" in _load(above / "cache")["error"]
    above.chmod(0o1777)  # as /tmp: only an entry's owner may rename or delete it
    assert _load(above / "cache") == {"answer": 42}


@pytest.mark.parametrize("how", ["stale sidecar", "no sidecar", "matching sidecar, library linked",
                                 "library and sidecar linked"])
def test_a_planted_library_is_never_loaded_but_built_over(seeded, tmp_path, how):
    marker, lib = tmp_path / "marker", _library(seeded)
    if how == "stale sidecar":  # the sidecar of the library qstate built
        _plant(lib, marker, sidecar=False)
    elif how == "no sidecar":
        _plant(lib, marker, sidecar=False)
        _sidecar(lib).unlink()
    else:  # entries that are links to a planted library and its hash, outside the folder
        outside = tmp_path / "outside"
        outside.mkdir()
        _plant(outside / "planted.so", marker)
        lib.unlink()
        lib.symlink_to(outside / "planted.so")
        if how == "library and sidecar linked":
            _sidecar(lib).unlink()
            _sidecar(lib).symlink_to(outside / "planted.so.sha256")
    assert _load(seeded) == {"answer": 42}
    assert not marker.exists()
    _assert_whole(lib)
    assert _sha256(lib) == _sha256(tmp_path / "seed.so")  # the build is reproducible
    if how != "stale sidecar" and how != "no sidecar":  # the links were replaced, not their targets
        assert _sha256(tmp_path / "outside" / "planted.so") != _sha256(lib)


def test_a_truncated_library_is_built_again(seeded, tmp_path):
    lib = _library(seeded)
    lib.write_bytes(lib.read_bytes()[:len(lib.read_bytes()) // 2])
    assert _load(seeded) == {"answer": 42}
    _assert_whole(lib)


def test_a_library_that_fails_to_load_is_built_again_once(seeded):
    # truncated, and a sidecar that matches it: the hash check passes, dlopen fails ("file too short")
    lib = _library(seeded)
    lib.write_bytes(lib.read_bytes()[:100])
    _sidecar(lib).write_text(_sha256(lib))
    assert _load(seeded) == {"answer": 42}
    _assert_whole(lib)


def test_cc_with_arguments_reaches_the_compiler(tmp_path):
    # split as make splits $(CC): the words after the program are its arguments (here they change the answer)
    assert _load(tmp_path / "cache", CC=shlex.join(_cpu_build.compiler()) + " -O2 -DANSWER=43") == {"answer": 43}


#: a "compiler" whose output never loads: it counts its runs in ``$1`` and writes text where the library goes
_FAKE_CC = """\
echo run >> "$1"
shift
while [ $# -gt 1 ]; do
  if [ "$1" = -o ]; then echo 'not a library' > "$2"; fi
  shift
done
"""


class TestErrors(expecttest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = Path(tmp.name)

    def _error(self, **env: str) -> str:
        return _load(self.tmp / "cache", **env)["error"].replace(str(self.tmp), "TMP")

    def test_a_missing_compiler_names_cc(self):
        self.assertExpectedInline(self._error(CC="/nonexistent"), """\
qstate: the C compiler $CC='/nonexistent' was not found: '/nonexistent' is not an executable file; set CC to a C compiler (e.g. gcc or clang, with arguments if needed), or unset it to use the first of cc, gcc, clang on PATH""")  # noqa: B950
        self.assertExpectedInline(self._error(CC="qstate-no-such-cc -O2"), """\
qstate: the C compiler $CC='qstate-no-such-cc -O2' was not found: 'qstate-no-such-cc' is not found on PATH; set CC to a C compiler (e.g. gcc or clang, with arguments if needed), or unset it to use the first of cc, gcc, clang on PATH""")  # noqa: B950
        self.assertExpectedInline(self._error(CC="gcc '-O2"), """\
qstate: the C compiler $CC="gcc '-O2" does not split into words as a shell would: No closing quotation""")
        self.assertExpectedInline(self._error(CC="", PATH=str(self.tmp)), """\
qstate: building the test library needs a C compiler: $CC is not set and none of cc, gcc, clang is on PATH""")

    def test_a_library_that_never_loads_raises_after_one_rebuild(self):
        (self.tmp / "fake_cc.sh").write_text(_FAKE_CC)
        runs = self.tmp / "runs"
        message = self._error(CC=f"{shutil.which('sh')} {self.tmp / 'fake_cc.sh'} {runs}")
        self.assertEqual(runs.read_text().split(), ["run", "run"])  # the first build, then one again
        self.assertExpectedInline(message.split(": TMP/cache")[0].replace(shutil.which("sh"), "SH"), """\
qstate: loading the test library built with SH TMP/fake_cc.sh TMP/runs failed, also after building it again""")

    def test_a_refused_folder_names_it_and_what_is_wrong(self):
        (self.tmp / "cache").mkdir()
        (self.tmp / "cache").chmod(0o777)
        self.assertExpectedInline(self._error(), """\
qstate: refusing to build or load C kernels in TMP/cache: group or others can write it (mode 0o777); use a folder that only this user owns and can write, under folders others cannot write (chmod go-w), or set QSTATE_CPU_KERNEL_CACHE to one""")  # noqa: B950


#: one optimizer step's check in a fresh interpreter: two steps of SGD with momentum on a plain float32
#: state (the C kernel's smallest spec), then the written-out update in float32, as JSON
_STEP = """
import json, torch
from qstate.optim._engine.cpu import kernel as _cpu_kernel
from qstate.optim import functional as F

torch.manual_seed(0)
p, buf = torch.randn(1000), torch.zeros(1000)
grads = [torch.randn(1000), torch.randn(1000)]
p0 = p.clone()
try:
    for step, g in enumerate(grads, 1):
        F.sgd([p], [g], [buf], [step], lr=0.1, momentum=0.9, compile=True)
except RuntimeError as error:
    print(json.dumps({"error": str(error), "unchanged": torch.equal(p, p0) and not buf.any().item()}))
else:
    b = grads[0]
    q = p0 - 0.1 * b
    b = 0.9 * b + grads[1]
    q = q - 0.1 * b
    print(json.dumps({"built": _cpu_kernel.built_specs(), "exact": torch.equal(p, q) and torch.equal(buf, b)}))
"""


def _step(cache: Path) -> dict:
    """The result of :data:`_STEP` in a fresh interpreter with ``cache`` as the C kernel's cache folder."""
    env = dict(os.environ, QSTATE_CPU_KERNEL_CACHE=str(cache), TORCHINDUCTOR_CACHE_DIR=str(cache.parent / "inductor"))
    env.pop("QSTATE_CPU_KERNEL_CFLAGS", None)
    proc = subprocess.run([sys.executable, "-c", _STEP], cwd=_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


_SPEC = "sgd_float32_rn_plain_float32"


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory) -> Path:
    """A cache folder with the step's kernel, built by a step (which gave the written-out update)."""
    cache = tmp_path_factory.mktemp("kernel") / "cache"
    assert _step(cache) == {"built": [_SPEC], "exact": True}
    return cache


@pytest.fixture
def kernel_copy(kernel_cache, tmp_path) -> Path:
    shutil.copytree(kernel_cache, tmp_path / "cache")
    return tmp_path / "cache"


def test_a_planted_kernel_is_not_loaded_and_the_step_updates(kernel_copy, tmp_path):
    lib, marker = _library(kernel_copy), tmp_path / "marker"
    _plant(lib, marker, sidecar=False)  # under the kernel's cached name, beside the sidecar of qstate's build
    assert _step(kernel_copy) == {"built": [_SPEC], "exact": True}
    assert not marker.exists()
    _assert_whole(lib)


def test_a_truncated_kernel_is_built_again_and_the_step_updates(kernel_copy):
    lib = _library(kernel_copy)
    lib.write_bytes(lib.read_bytes()[:100])
    (lib.parent / (lib.name + ".sha256")).write_text(_sha256(lib))  # passes the hash check, fails dlopen
    assert _step(kernel_copy) == {"built": [_SPEC], "exact": True}
    _assert_whole(lib)


def test_a_kernel_cache_others_can_write_is_refused_and_the_step_changes_nothing(kernel_copy, tmp_path):
    lib, marker = _library(kernel_copy), tmp_path / "marker"
    _plant(lib, marker)  # with a matching sidecar
    kernel_copy.chmod(0o777)
    result = _step(kernel_copy)
    assert result["unchanged"] and not marker.exists()
    assert result["error"].startswith(f"qstate: refusing to build or load C kernels in {kernel_copy}: group or "
                                      f"others can write it (mode 0o777)")
