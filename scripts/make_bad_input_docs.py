"""Write docs/bad-input.md: run every case of the bad-input sweep (tests/bad_inputs.py) and tabulate
what each bad input does (tests/test_bad_input.py checks that the file is what this writes).

    .venv/bin/python scripts/make_bad_input_docs.py

Writes nothing, and exits 1, when a case misses its expected outcome or damaged something.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import bad_inputs as B  # noqa: E402


def main() -> int:
    results = {c.id: B.run_case(c) for c in B.CASES}
    failing = [(c, results[c.id], B.check(c, results[c.id])) for c in B.CASES]
    failing = [f for f in failing if f[2]]
    for c, r, problems in failing:
        print(B.explain(c, r, problems), file=sys.stderr)
    if failing:
        print(f"error: {len(failing)} case(s) miss their expected outcome; {B.DOCS} not written", file=sys.stderr)
        return 1
    from engineprofiles.files import write_atomic

    write_atomic(B.DOCS, B.render_markdown(results))
    print(f"wrote {B.DOCS.relative_to(REPO)} ({sum(c.in_docs for c in B.CASES)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
