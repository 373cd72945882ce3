"""Write docs/mismatch.md from the JSON files `probe-engine mismatch --json` wrote in docs/data/.

    for f in qwen2 qwen3 llama; do
      probe-engine mismatch vllm --family $f --json docs/data/mismatch-vllm-0.32.0-$f.json
    done
    .venv/bin/python scripts/make_mismatch_docs.py
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLS = ("exact_match", "k3_kl", "abs_dp_max", "abs_dp_mean", "abs_dlogp_mean", "abs_dlogp_max", "ppl_ratio")
HEAD = "| trainer | exact match | k3 KL | \\|Δp\\| max | \\|Δp\\| mean | \\|Δlogp\\| mean | \\|Δlogp\\| max | PPL ratio |"


def table(rows: list[dict]) -> str:
    out = [HEAD, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{100 * r['exact_match']:.1f}%"] + [f"{r[c]:.2e}" for c in COLS[1:-1]] + [f"{r['ppl_ratio']:.5f}"]
        out.append(f"| {r['trainer']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    files = sorted((REPO / "docs" / "data").glob("mismatch-*.json"))
    intro = (REPO / "docs" / "mismatch-intro.md").read_text()
    parts = [intro.rstrip(), ""]
    for f in files:
        d = json.loads(f.read_text())
        e = d["engine"]
        parts += [f"## {e['name']} {e['version']} ({e.get('compilation_mode', '')}), family {d['family']}", "",
                  f"Command: `probe-engine mismatch {e['name']} --family {d['family']} --json {f.relative_to(REPO)}`. "
                  f"Profile applied: `{d['profile']}`; the trainer's own: `{d['trainer_profile']}`. "
                  f"{d['sampled'][0]['tokens']} sampled tokens.", ""]
        for w in d.get("warnings", []):
            parts += [f"Warning: {w}", ""]
        parts += ["Sampled tokens, against the engine's decode log-probs:", "", table(d["sampled"]), "",
                  "Every token re-scored in one prefill, against the engine's prompt log-probs:", "",
                  table(d["prefill"]), ""]
    (REPO / "docs" / "mismatch.md").write_text("\n".join(parts) + "\n")
    print("wrote docs/mismatch.md")


if __name__ == "__main__":
    main()
