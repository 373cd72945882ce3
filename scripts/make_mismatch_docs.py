"""Write docs/mismatch.md from the JSON files `probe-engine mismatch --json` wrote in docs/data/
(scripts/make_mismatch_data.sh runs every measurement, then this).

    .venv/bin/python scripts/make_mismatch_docs.py
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLS = ("exact_match", "k3_kl", "abs_dp_max", "abs_dp_mean", "abs_dlogp_mean", "abs_dlogp_max", "ppl_ratio")
HEAD = "| trainer | exact match | k3 KL | \\|Δp\\| max | \\|Δp\\| mean | \\|Δlogp\\| mean | \\|Δlogp\\| max | PPL ratio |"


def pct(x: float) -> str:
    """Never shows a partial match as 100%."""
    if x == 1.0:
        return "100%"
    d = 1
    while f"{100 * x:.{d}f}".startswith("100") and d < 8:
        d += 1
    return f"{100 * x:.{d}f}%"


def table(rows: list[dict]) -> str:
    out = [HEAD, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [pct(r['exact_match'])] + [f"{r[c]:.2e}" for c in COLS[1:-1]] + [f"{r['ppl_ratio']:.5f}"]
        out.append(f"| {r['trainer']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


BATCH_INTRO = """## Batch invariance: the engine against itself

`probe-engine mismatch ENGINE --batch-check` has the engine score the same sequences again in other
batch compositions (alone again, all together, reversed, each beside a longer unrelated sequence; the
prompts decoded greedily alone, alone again and all together, and for vLLM all together with staggered
completion lengths, so that requests leave the batch at different steps) and compares each log-prob bitwise with
the same sequence alone. A trainer scores a sequence one way; where the engine's numbers change with
the batch, no trainer can match every rollout. "tokens/forward" shows that the sequences really shared
an engine forward. The control rows (alone, again) show the engine repeats itself."""


def batch_section(files: list[Path]) -> list[str]:
    parts = [BATCH_INTRO, ""]
    for f in files:
        d = json.loads(f.read_text())
        e, bc, m = d["engine"], d["batch_check"], d.get("model") or {}
        att = e.get("attention") or {}
        cmd = d.get("command") or f"probe-engine mismatch {e['name']} --batch-check"
        verdict = "**batch-invariant**" if bc["batch_invariant"] else "**not batch-invariant**"
        parts += [f"### {e['name']} {e['version']} (mode {e.get('mode', 'default')}, split-KV {att.get('split_kv', '?')}), "
                  f"family {d['family']}, first prompt {d.get('prompt_len', '?')} tokens: {verdict}", "",
                  f"Command: `{cmd}`. CPU capability {e.get('cpu_capability', '?')}, attention "
                  f"{att.get('backend', '?')}, split-KV {att.get('split_kv', '?')}, {att.get('torch_threads', '?')} "
                  f"threads; first prompt {d.get('prompt_len', '?')} tokens; up to {bc.get('max_num_seqs')} sequences "
                  "at once, prefix caching off.", "",
                  "| composition | kind | sequences per call | tokens per forward | bit-equal | \\|Δlogp\\| max |",
                  "|---|---|---|---|---|---|"]
        for r in bc["rows"]:
            fw = r["forward_tokens"]
            shown = " ".join(map(str, fw[:4])) + (f" ... ({len(fw)} forwards)" if len(fw) > 4 else "")
            eq = f"{r['equal']}/{r['tokens']}" + (f", {r['diverged']} diverged" if r.get("diverged") else "")
            kind = "decode (greedy)" if r["kind"] == "decode" else "prefill"
            parts.append(f"| {r['composition']} | {kind} | {'/'.join(map(str, sorted(set(r['requests_per_call']))))} | {shown} | {eq} | "
                         f"{r['abs_dlogp_max']:.2e} |")
        parts.append("")
        if bc.get("exact"):
            parts += ["Exact mode (`--exact`) against the engine's batched decode runs, each sequence scored in one "
                      "forward: its completion rows split as sampled alone (`as_sampled(prompt_length)`) and as "
                      "sampled together with its batch (`as_sampled(prompt_lengths, completion_lengths, rows=[i])`).",
                      "", "| engine run | completion lengths | trainer | exact match | \|Δlogp\| max |", "|---|---|---|---|---|"]
            for r in bc["exact"]:
                parts.append(f"| {r['composition']} | {' '.join(map(str, r['completion_lengths']))} | {r['trainer']} | "
                             f"{pct(r['exact_match'])} of {r['tokens']} | {r['abs_dlogp_max']:.2e} |")
            parts.append("")
    return parts


def main() -> None:
    files = sorted((REPO / "docs" / "data").glob("mismatch-*.json"))
    intro = (REPO / "docs" / "mismatch-intro.md").read_text()
    parts = [intro.rstrip(), ""]
    # each engine's runs, the shortest name (the default run) first
    batch = sorted((REPO / "docs" / "data").glob("batch-*.json"), key=lambda f: (f.stem.split("-")[1], len(f.stem), f.stem))
    if batch:
        parts += batch_section(batch)
    for f in files:
        d = json.loads(f.read_text())
        e = d["engine"]
        m = d.get("model") or {}
        mlp = (f"MLP {m.get('intermediate_size')}" if not m.get("num_experts") else
               f"{m['num_experts']} experts of width {m.get('moe_intermediate_size')}, top-{m.get('num_experts_per_tok')}"
               + (" renormalized" if m.get("norm_topk_prob") else "")
               + (f", a shared expert of width {m['shared_expert_intermediate_size']}"
                  if m.get("shared_expert_intermediate_size") else ""))
        size = (f"{m.get('num_hidden_layers')} layers, hidden {m.get('hidden_size')}, {mlp}, "
                f"{m.get('num_attention_heads')}/{m.get('num_key_value_heads')} heads, head dim {m.get('head_dim')}"
                if m else "the tiny default")
        rope = m.get("rope_parameters")
        if rope:
            size += ", RoPE " + rope["rope_type"] + " (" + ", ".join(
                f"{k} {v}" for k, v in rope.items() if k != "rope_type") + ")"
        cmd = d.get("command") or f"probe-engine mismatch {e['name']} --family {d['family']}"
        parts += [f"## {e['name']} {e['version']} ({e.get('compilation_mode', '')}, mode {e.get('mode', 'default')}), "
                  f"family {d['family']}: {size}", "",
                  f"Command: `{cmd}`. Engine on CPU capability {e.get('cpu_capability', '?')}, attention "
                  f"{(e.get('attention') or {}).get('backend', '?')} (isa {(e.get('attention') or {}).get('isa', '?')}, "
                  f"split-KV {(e.get('attention') or {}).get('split_kv', '?')}). First prompt {d.get('prompt_len', '?')} "
                  f"tokens, {d['sampled'][0]['tokens']} sampled tokens. Profile applied: `{d['profile']}`; the "
                  f"trainer's own: `{d['trainer_profile']}`."
                  + (f" The engine's own decode log-probs equal its prefill ones on "
                     f"{pct(d['engine_decode_equals_prefill'])} of the sampled tokens."
                     if d.get("engine_decode_equals_prefill") is not None else ""), ""]
        for w in d.get("warnings", []):
            parts += [f"Warning: {w}", ""]
        parts += ["Sampled tokens, against the engine's decode log-probs:", "", table(d["sampled"]), "",
                  "Every token re-scored in one prefill, against the engine's prompt log-probs:", "",
                  table(d["prefill"]), ""]
    (REPO / "docs" / "mismatch.md").write_text("\n".join(parts) + "\n")
    print("wrote docs/mismatch.md")


if __name__ == "__main__":
    main()
