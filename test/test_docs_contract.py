"""Docstrings are contracts: each module states its own storage rules and invariants, briefly, with no
figures (those live in benchmarks/RESULTS.md), and the enumerations users read stay true: every exported
optimizer is documented, every public name has a docstring, and no retired word remains."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import pathlib
import pkgutil
import re
from typing import NamedTuple

import torch

import qstate
import qstate.optim

ROOT = pathlib.Path(qstate.__file__).resolve().parent.parent
PACKAGE = ROOT / "qstate"
USER_DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]

#: the most lines a module docstring may take
MAX_MODULE_DOC_LINES = 20

#: modules still over MAX_MODULE_DOC_LINES, by package and module basename, so that an entry survives a
#: move within its package (qstate.optim._step to qstate.optim._engine._step); drop an entry once its
#: module is shortened (test_allow_list_is_still_needed says which)
LONG_MODULE_DOCS = {
    "qstate.optim": {"_arguments", "rules"},
    "qstate": {"demo"},
    "qstate.integrations": {"torchtitan"},
}

#: modules whose docstrings still quote measurements, by package and basename as above
FIGURES_IN_MODULE_DOCS: dict[str, set[str]] = {}

#: words that named something since renamed or removed (commits 388640c, 191b907, 980eacb, 6980a29)
RETIRED = [
    r"kernel kinds?",            # a kernel's kind is its spec, KernelSpec
    r"\bkernel_kinds\b",         # -> kernel_specs
    r"\bbuilt_kinds\b",          # -> built_specs
    r"\bfused_kind\b",           # -> fused_variant
    r"\bFusedCall\b",            # -> UpdateVariant
    r"\bcall_key\b",             # -> variant_name
    r"\beager_call\b",           # -> eager_variant
    r"\bRule\.kind\b",           # dtensor_rules' Rule.form
    r"\b(fused|eager)_variant\b",  # the op's variant is UpdateVariant(...).name
    r"\bvariant_name\b",         # -> UpdateVariant.name
    r"\b_fused_op\b|\bupdate_cpu\b|\bupdate_default\b",  # the op's kernel: optim/_engine/op.py, update
    r"\boptim\._step\b|\boptim/_step\.py\b",  # the engine's door: optim/_engine/step.py
    r"\b_cpu_kernel\.py\b|\b_cpu_rule\b|\b_cpu_encode\b|\b_cpu_build\b",  # optim/_engine/cpu/
    r"\bUnrepresentableShardWarning\b",  # removed: view(dtype) no longer redistributes
    r"\bpositional_rand(?:_like|om_)",   # removed with the old install()'s scheme
    r"\b_splitmix64\b",          # merged into qstate._random
    r"\boptim[./]_rounding\b",   # -> qstate.optim._engine.param_rounding
    r"\bsessions?\b",            # dates and commits, which readers can look up
    r"\bissue \d+",              # the same
]

#: a measurement: a speed ratio, a time, a bandwidth, a before -> after pair
FIGURE = re.compile(r"\b\d+\.\d+\s*->\s*\d+\.\d+\b"
                    r"|\b\d+(?:\.\d+)?\s*x\s+(?:faster|slower|torch's|the time|the step)\b"
                    r"|\b\d+(?:\.\d+)?\s*%\s+(?:faster|slower)\b"
                    r"|\b\d+(?:\.\d+)?\s*(?:ms|us|µs|ns)\b|\b\d+(?:\.\d+)?\s+(?:s|seconds)\b"
                    r"|\b\d+(?:\.\d+)?\s*[GMK]i?B/s\b")


class Module(NamedTuple):
    name: str
    doc: str


def _modules() -> list[Module]:
    """Every module of qstate with its docstring, read from its source: a module that needs an optional
    package (a trainer's integration) is checked without it."""
    names = ["qstate", *(m.name for m in pkgutil.walk_packages(qstate.__path__, "qstate."))]
    return [Module(name, ast.get_docstring(ast.parse(pathlib.Path(importlib.util.find_spec(name).origin).read_text()),
                                           clean=True) or "")
            for name in names]


def _listed(name: str, table: dict[str, set[str]]) -> bool:
    package, _, basename = name.rpartition(".")
    return any(basename in basenames and (package == p or package.startswith(p + "."))
               for p, basenames in table.items())


def _doc_lines(module: Module) -> int:
    return len(module.doc.splitlines())


def _optimizers() -> list[str]:
    return [name for name in qstate.optim.__all__ if inspect.isclass(getattr(qstate.optim, name))
            and issubclass(getattr(qstate.optim, name), torch.optim.Optimizer)]


def test_every_exported_optimizer_is_documented():
    optimizers = _optimizers()
    assert {"AdamW", "Adam", "SGD", "Lion", "AdEMAMix", "Muon"} <= set(optimizers)
    user_docs = "\n".join(path.read_text() for path in USER_DOCS)
    for name in optimizers:
        if name == "QuantizedOptimizer":  # the base class: named for rule authors, not among the optimizers
            assert "QuantizedOptimizer" in qstate.optim.__doc__
            continue
        assert f"``{name}``" in qstate.optim.__doc__, f"qstate.optim's docstring does not name {name}"
        assert re.search(rf"`(?:qstate\.optim\.)?{name}`|optim\.{name}\b", user_docs), \
            f"neither README.md nor docs/ names {name}"
        assert inspect.getdoc(getattr(qstate.optim, name)), f"{name} has no docstring"


def _has_attribute_comment(name: str) -> bool:
    """A constant's docstring is the ``#:`` comment right above its definition."""
    pattern = re.compile(rf"^#:.*\n{re.escape(name)}\s*[:=]", re.M)
    return any(pattern.search(path.read_text()) for path in PACKAGE.rglob("*.py"))


def test_every_public_name_has_a_docstring():
    missing = []
    for module in (qstate, qstate.optim):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj):
                documented = bool(obj.__doc__ and obj.__doc__.strip())
            else:  # a constant: its type's docstring is not its own
                documented = _has_attribute_comment(name)
            if not documented:
                missing.append(f"{module.__name__}.{name}")
    assert missing == []


def test_no_retired_word_remains():
    paths = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h"), *USER_DOCS]
    found = [f"{path.relative_to(ROOT)}: {match.group()!r}"
             for path in paths for word in RETIRED
             for match in re.finditer(word, path.read_text(), re.I)]
    assert found == []


def test_module_docstrings_hold_no_figures():
    found = [f"{module.name}: {match.group()!r}" for module in _modules()
             if not _listed(module.name, FIGURES_IN_MODULE_DOCS)
             for match in FIGURE.finditer(" ".join(module.doc.split()))]
    assert found == [], "figures belong in benchmarks/RESULTS.md"


def test_figure_pattern_tells_figures_from_math():
    figures = ["about 5x faster than inductor", "about 9x torch's fused AdamW", "(about 0.15 ms)",
               "1.92 -> 1.56", "12 GB/s", "a 2.5 s step", "20% slower"]
    math = ["~4x at 1/225", "4x the error", "[64, 1024]", "2**-126", "256 elements", "1.0166 bytes",
            "codes 0s and 1s", "on 1 rank or 64"]
    assert [text for text in figures if not FIGURE.search(text)] == []
    assert [text for text in math if FIGURE.search(text)] == []


def test_every_module_states_its_contract_briefly():
    modules = _modules()
    assert [m.name for m in modules if not m.doc.strip()] == [], "modules without a docstring"
    long = {m.name: _doc_lines(m) for m in modules
            if _doc_lines(m) > MAX_MODULE_DOC_LINES and not _listed(m.name, LONG_MODULE_DOCS)}
    assert long == {}, f"module docstrings over {MAX_MODULE_DOC_LINES} lines"


def test_allow_lists_are_still_needed():
    modules = _modules()
    for table, needed in ((LONG_MODULE_DOCS, lambda m: _doc_lines(m) > MAX_MODULE_DOC_LINES),
                          (FIGURES_IN_MODULE_DOCS, lambda m: FIGURE.search(" ".join(m.doc.split())))):
        for package, basenames in table.items():
            for basename in basenames:
                matches = [m for m in modules if _listed(m.name, {package: {basename}})]
                assert matches, f"{package}: no module {basename} (moved out of the package?)"
                assert any(needed(m) for m in matches), f"{package}.{basename} meets the rule: drop it from the list"
