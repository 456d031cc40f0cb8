"""The op audit (``upstream/audit.py``), its fast slice, under ``qstate.dtensor_rules.install()``.

The audit runs ops x input placements x dtypes on simulated ranks (fake process
group + ``LocalTensorMode``) and judges every case right, raises (a refusal) or
silently wrong against the plain op on the full tensor; random ops by their
properties (shards differ, replicas agree, the same seed gives the same numbers).
Here its fast slice (``audit.FAST_*``: every op, one dtype of each width for
dtype pairs, six of the eight layouts) runs with the opt-in rules installed, on
whichever torch runs the suite; ``upstream/check`` runs the full table under
``install()`` and on the patched torch.

No case may be silently wrong.  A case torch gets wrong for a reason written up
as an upstream issue is listed in ``audit.KNOWN_WRONG`` with that issue; such a
case must still be wrong (else the entry goes), never skipped.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import pytest

import qstate.dtensor_rules as rules

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_audit():
    spec = importlib.util.spec_from_file_location("dtensor_audit", os.path.join(_ROOT, "upstream", "audit.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


audit = _load_audit()
CASES = audit.all_cases("fast")
ROWS = sorted({c.op.row for c in CASES})


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list]:
    """Every case of the fast slice under install(), by row; the prior install state is restored
    right after the run."""
    was_installed = rules.is_installed()
    rules.install()
    try:
        results = audit.run_audit(CASES)
    finally:
        if not was_installed:
            rules.uninstall()
    by_row: dict[str, list] = {}
    for o in results:
        by_row.setdefault(o.row, []).append(o)
    return by_row


def test_the_fast_slice_covers_every_op_and_layout() -> None:
    assert ROWS == sorted({op.row for op in audit.OPS})
    assert {c.layout.name for c in CASES} == set(audit.FAST_LAYOUTS)


@pytest.mark.parametrize("row", ROWS)
def test_no_case_is_silently_wrong(outcomes: dict[str, list], row: str) -> None:
    cases = outcomes[row]
    wrong = [f"{o.case} -> {o.placements}: {o.detail}" for o in cases if o.outcome == "wrong" and not o.known]
    assert wrong == []
    # not passing by not running: some case of every row has a result or a refusal
    assert any(o.outcome in ("right", "raises") for o in cases), [(o.case, o.detail) for o in cases]


def test_known_wrong_cases_are_still_wrong(outcomes: dict[str, list]) -> None:
    """Every ``KNOWN_WRONG`` entry names an upstream issue draft and matches a case that is still wrong."""
    for entry in audit.KNOWN_WRONG:
        assert os.path.isfile(os.path.join(_ROOT, "upstream", "issues", entry.issue)), entry
        matched = [o for o in outcomes.get(entry.row, []) if o.known == entry.issue]
        assert matched, f"{entry}: no case of the fast slice is wrong any more; remove the entry"


@pytest.mark.skipif(bool(os.environ.get("DTENSOR_OVERLAY")), reason="a patched torch (upstream/check)")
def test_the_audit_finds_torch_bugs_without_the_rules() -> None:
    """The audit is not vacuous: with torch's own rules, ``rand_like`` on a CPU mesh draws the
    same numbers on every shard, and the audit says so."""
    if rules.is_installed():
        pytest.skip("install() was in effect before this module")
    cases = [c for c in CASES if c.op.row == "rand_like" and c.layout.name == "S(0)"]
    found = {o.case: (o.outcome, o.detail) for o in audit.run_audit(cases)}
    assert found == {"rand_like float32 S(0)": ("wrong", "two shards drew the same numbers")}
