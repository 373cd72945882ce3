"""The bad-input sweep (issue 15): one test per case of tests/bad_inputs.py, each against its
expected outcome (a typed error, a CLI exit with an ``error:`` line and no traceback, or a result
bitwise equal to the torch reference) and its damage check; and docs/bad-input.md, the table of
those outcomes, checked to be what scripts/make_bad_input_docs.py writes now.

These tests can fail, and were seen to: with one expectation changed by hand (``file-empty``
expecting the fragment "got NoneType", the message it had before this sweep) the sweep test of that
case failed with the expected and the actual message, and the docs test failed too (the docs are
written only from cases that meet their expectation); likewise a wrong exception class
(``apply-meta-model`` expecting ProfileMismatch) and a line added to docs/bad-input.md by hand. The
damage checks were seen to fail on a simulated regression: an apply_profile that binds a forward
before it refuses (``apply-fp32-model``: bound forward and logits reported) and a save that leaves a
temporary file behind (``file-save-under-a-file``: the leftover reported).
"""

from __future__ import annotations

import pytest

from . import bad_inputs as B


# each case's outcome as its own test saw it, for the docs test (which runs only the cases no test of this
# process ran: under pytest-xdist another worker may have run them)
_SEEN: dict[str, object] = {}


@pytest.mark.parametrize("case", B.CASES, ids=lambda c: c.id)
def test_bad_input_has_its_outcome_and_damages_nothing(case):
    r = _SEEN[case.id] = B.run_case(case)
    problems = B.check(case, r)
    assert not problems, B.explain(case, r, problems)


def test_the_sweep_covers_every_category_and_the_ids_are_unique():
    ids = [c.id for c in B.CASES]
    assert len(ids) == len(set(ids))
    assert {c.category for c in B.CASES} == set(B.CATEGORIES)
    kinds = {type(c.expect) for c in B.CASES}
    assert kinds == {B.Raises, B.CliExit, B.Bitwise, B.Succeeds}


def test_docs_bad_input_md_is_what_the_script_writes_now():
    results = {c.id: _SEEN[c.id] if c.id in _SEEN else B.run_case(c) for c in B.CASES}
    failing = [c.id for c in B.CASES if B.check(c, results[c.id])]
    assert not failing, f"cases that miss their expected outcome (see their own tests): {failing}"
    want = B.render_markdown(results)
    got = B.DOCS.read_text(encoding="utf-8") if B.DOCS.exists() else ""
    assert got == want, "docs/bad-input.md is stale: run .venv/bin/python scripts/make_bad_input_docs.py"
