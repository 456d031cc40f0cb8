"""Building the C kernel's source into a shared library, caching it, loading it.

Compiler (:func:`compiler`): ``$CC`` split as a shell splits it, else the first of ``cc``, ``gcc``,
``clang`` on ``PATH``. Flags (:func:`cflags`): :data:`CFLAGS`, then ``$QSTATE_CPU_KERNEL_CFLAGS``. A
missing compiler or a failing build raises; nothing falls back silently.

Cache (:func:`cache_folder`): ``$QSTATE_CPU_KERNEL_CACHE``, else ``<inductor cache dir>/qstate``; one
library per source, compiler, flags and CPU, with its SHA-256 in a sidecar file. Storage rules,
checked before anything in the folder is read (:func:`private_cache_folder`, :func:`load`): the
folder is created ``0o700``, must be a real folder owned by this user that no one else can write,
and no level above it may be writable by others (unless sticky); otherwise the build raises naming
the folder. A library loads only if it and its sidecar are regular files (never followed links)
owned by this user, not group/other-writable, and its hash is the sidecar's; else it is built again
into a fresh private folder and moved in atomically. A library that fails ``dlopen`` is built once
more, then the error is raised.

This guards against truncated or corrupt files; keeping other users out of the folder and every
level above it is what keeps their code out of this process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["CFLAGS", "cflags", "compiler", "cache_folder", "private_cache_folder", "load"]

#: the flags every kernel is built with (``-ffp-contract=off``: no fused multiply-adds)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC",
          "-shared", "-std=c11")

#: the compilers tried, in order, where ``$CC`` is not set
DEFAULT_COMPILERS = ("cc", "gcc", "clang")


def cflags() -> tuple[str, ...]:
    """The flags a kernel is built with: :data:`CFLAGS`, then those of ``$QSTATE_CPU_KERNEL_CFLAGS`` (split
    as a shell splits them).

    The variable is read when a spec's kernel is built, that is at its first use in a process (a process keeps
    the kernels it loaded); its flags are part of the build cache's key, so builds with other flags
    never share a cached library. E.g. ``-mno-avx512f`` builds without the AVX-512 paths, ``-march=x86-64``
    (after ``-march=native``) the portable loops only; every build gives the same results bit for bit."""
    return CFLAGS + tuple(shlex.split(os.environ.get("QSTATE_CPU_KERNEL_CFLAGS", "")))


@functools.lru_cache(maxsize=None)
def compiler() -> Optional[tuple[str, ...]]:
    """The C compiler's command (its words): ``$CC`` split as a shell splits it, else the path of the first of
    :data:`DEFAULT_COMPILERS` on ``PATH``, or None where ``$CC`` is unset (or empty) and none is found.

    Raises ``RuntimeError`` where ``$CC`` does not split or its first word is not a program found on ``PATH``
    (a word with a ``/``: an executable file)."""
    cc = os.environ.get("CC", "")
    if not cc.strip():
        found = next((path for name in DEFAULT_COMPILERS if (path := shutil.which(name))), None)
        return None if found is None else (found,)
    try:
        words = tuple(shlex.split(cc))
    except ValueError as error:
        raise RuntimeError(f"qstate: the C compiler $CC={cc!r} does not split into words as a shell would: "
                           f"{error}") from None
    if shutil.which(words[0]) is None:
        where = "is not an executable file" if os.sep in words[0] else "is not found on PATH"
        raise RuntimeError(f"qstate: the C compiler $CC={cc!r} was not found: {words[0]!r} {where}; set CC to a C "
                           f"compiler (e.g. gcc or clang, with arguments if needed), or unset it to use the first "
                           f"of {', '.join(DEFAULT_COMPILERS)} on PATH")
    return words


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + platform.processor() + flags


def cache_folder() -> Path:
    """The folder libraries are cached in (absolute; not created or checked: :func:`private_cache_folder`):
    ``$QSTATE_CPU_KERNEL_CACHE``, else ``qstate`` in inductor's cache dir."""
    explicit = os.environ.get("QSTATE_CPU_KERNEL_CACHE")
    if explicit:
        return Path(os.path.abspath(explicit))
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(os.path.abspath(cache_dir())) / "qstate"


def private_cache_folder() -> Path:
    """:func:`cache_folder`, its missing levels created ``0o700``, after the checks of the module docstring
    (``RuntimeError`` naming the folder and what is wrong where one fails)."""
    folder = cache_folder()
    missing = []
    level = folder
    while not os.path.lexists(level):
        missing.append(level)
        level = level.parent
    for level in reversed(missing):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:  # a concurrent process made it: checked below like any other
            pass
    if hasattr(os, "geteuid"):
        problem = _folder_problem(folder)
        if problem is not None:
            raise RuntimeError(f"qstate: refusing to build or load C kernels in {folder}: {problem}; use a folder "
                               f"that only this user owns and can write, under folders others cannot write (chmod "
                               f"go-w), or set QSTATE_CPU_KERNEL_CACHE to one")
    return folder


def _folder_problem(folder: Path) -> Optional[str]:
    """What makes ``folder`` unfit to cache libraries in (module docstring), or None."""
    uid = os.geteuid()
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group or others can write it (mode {stat.S_IMODE(st.st_mode):#o})"
    for level in reversed(list(folder.parents)):
        st = os.lstat(level)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, uid):
            return f"{level}, a symbolic link above it, is owned by uid {st.st_uid}"
    real = Path(os.path.realpath(folder.parent))
    for level in [*reversed(list(real.parents)), real]:
        st = os.stat(level)
        if st.st_uid not in (0, uid):
            return f"{level}, a folder above it, is owned by uid {st.st_uid}, neither root nor this user (uid {uid})"
        if not st.st_mode & stat.S_ISVTX and (st.st_mode & stat.S_IWOTH or (
                st.st_mode & stat.S_IWGRP and st.st_gid != os.getegid())):
            return (f"{level}, a folder above it, can be written by others or another group (mode "
                    f"{stat.S_IMODE(st.st_mode):#o}, not sticky)")
    return None


def _read_entry(path: Path) -> Optional[bytes]:
    """The content of the cache entry ``path``, or None where it is missing or not a regular file of this user
    that only this user can write (a symbolic link is not followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # missing, or a link (ELOOP)
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return None
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            return None
        return f.read()


def _sidecar(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _intact(lib: Path) -> bool:
    """Whether the cached ``lib`` may be loaded: it and its sidecar readable (:func:`_read_entry`) and the
    library's SHA-256 the sidecar's."""
    recorded = _read_entry(_sidecar(lib))
    if recorded is None:
        return False
    data = _read_entry(lib)
    return data is not None and hashlib.sha256(data).hexdigest() == recorded.decode("ascii", "replace").strip()


def _compile(cc: tuple[str, ...], flags: tuple[str, ...], source: str, lib: Path, what: str) -> None:
    """Build ``source`` into ``lib`` and write its sidecar, both through a private folder beside them."""
    with tempfile.TemporaryDirectory(dir=lib.parent, prefix=".build-") as tmp:  # mkdtemp: 0o700
        src, out = Path(tmp) / "kernel.c", Path(tmp) / "kernel.so"
        src.write_text(source)
        try:
            proc = subprocess.run([*cc, *flags, str(src), "-o", str(out), "-lm"], capture_output=True, text=True)
        except OSError as error:  # found by compiler() but not runnable (permissions, a bad interpreter line)
            raise RuntimeError(f"qstate: compiling {what} with {shlex.join(cc)} failed to start: {error}") from None
        if proc.returncode != 0:
            raise RuntimeError(f"qstate: compiling {what} with {shlex.join(cc)} failed:\n{proc.stderr.strip()}")
        digest = Path(tmp) / "kernel.so.sha256"
        digest.write_text(hashlib.sha256(out.read_bytes()).hexdigest() + "\n")
        os.chmod(out, 0o755)  # whatever the umask: entries group or others can write are never loaded
        os.chmod(digest, 0o644)
        os.replace(out, lib)
        os.replace(digest, _sidecar(lib))


def load(source: str, name: str, what: str) -> ctypes.CDLL:
    """``source`` (C) built into a shared library with :func:`compiler` and :func:`cflags` and loaded, through
    the cache (``name``: the library's name before its key; ``what``: what it is, for error messages).
    Raises ``RuntimeError`` where no compiler is found, the build fails, the cache folder is not private
    (module docstring) or the library built still fails to load."""
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"qstate: building {what} needs a C compiler: $CC is not set and none of "
                           f"{', '.join(DEFAULT_COMPILERS)} is on PATH")
    flags = cflags()
    resolved = shutil.which(cc[0]) or cc[0]
    key = hashlib.sha256("\0".join([source, *cc, resolved, *flags, _machine()]).encode()).hexdigest()[:24]
    lib = private_cache_folder() / f"{name}_{key}.so"
    if not _intact(lib):
        _compile(cc, flags, source, lib, what)
    try:
        return ctypes.CDLL(str(lib))
    except OSError:  # a library its compiler left unloadable, or a cached one from a broken build
        pass
    _compile(cc, flags, source, lib, what)
    try:
        return ctypes.CDLL(str(lib))
    except OSError as error:
        raise RuntimeError(f"qstate: loading {what} built with {shlex.join(cc)} failed, also after building it "
                           f"again: {error}") from None
