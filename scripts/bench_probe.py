"""Time a full probe of one engine: from a cold compile cache, then warm.

    .venv/bin/python scripts/bench_probe.py [vllm|sglang|transformers] [--env VERSION] [--runs N] [--in-situ]

--in-situ times the README's main job instead (`scripts/probe.sh vllm`: the engine on a tiny model, the
in-situ fit, the self-check), phase by phase: capture (the engine's run), fit regions, fit attention,
self-check (a second engine run and exact mode on other widths). Cold and warm then also mean vLLM's own
compile cache (VLLM_CACHE_ROOT), one fresh folder per round like Inductor's.

Each round runs the whole command `probe-engine ENGINE -o FILE` (op-level for vLLM and SGLang: the
per-region probe, three regions plus plain RMSNorm, attention and the MoE experts, the whole shape
sweep, in the engine's environment) twice
with one fresh Inductor cache folder: the first run compiles every graph (cold), the second finds
them in the cache (warm). It prints the wall time of the whole command (process start to exit,
including the re-exec into the engine environment and writing the YAML) and the time per region
as the probe measured it, for every round side by side, the median over rounds, and the load
average before each run. Absolute times depend on the machine and on what else runs on it: the
numbers hold for that run only; a loaded machine (load average near or above the core count)
is slower, so read them together with the load printed beside them.

The bound this checks (issue #3): at most 90 s cold and 30 s warm on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BOUND = {"cold": 90.0, "warm": 30.0}


def run(engine: str, env: str | None, cache: str, work: str, tag: str, in_situ: bool = False) -> dict[str, float]:
    timings = os.path.join(work, f"{tag}.json")
    e = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, ENGINEPROFILES_TIMINGS=timings,
             VLLM_CACHE_ROOT=cache + "-vllm")
    cmd = [str(REPO / ".venv" / "bin" / "probe-engine"), engine, "-o", os.path.join(work, f"{tag}.yaml")]
    if engine in ("vllm", "sglang") and not in_situ:
        cmd.append("--op-level")  # the per-region probe; in situ (their default) starts a whole engine
    if env:
        cmd += ["--env", env]
    load = os.getloadavg()[0]
    t = time.perf_counter()
    r = subprocess.run(cmd, env=e, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"probe failed (exit {r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    print(f"  {tag}: {wall:.1f} s (load average before: {load:.2f})", file=sys.stderr, flush=True)
    return {"load avg": load, "wall": wall, **json.loads(Path(timings).read_text())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", nargs="?", default="vllm", choices=["vllm", "sglang", "transformers"])
    ap.add_argument("--env", default=None, help="engine environment (version or path), as probe-engine --env")
    ap.add_argument("--runs", type=int, default=1, help="cold+warm rounds, each with a fresh cache (default 1)")
    ap.add_argument("--in-situ", action="store_true", help="time the in-situ probe (vllm, sglang: the main job)")
    a = ap.parse_args()
    if a.runs < 1:
        ap.error("--runs must be at least 1")
    if a.in_situ and a.engine == "transformers":
        ap.error("--in-situ: the in-situ fit runs vllm or sglang")
    rounds: list[tuple[dict, dict]] = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(a.runs):
            cache = os.path.join(d, f"inductor{i}")
            print(f"round {i + 1}/{a.runs}", file=sys.stderr, flush=True)
            rounds.append((run(a.engine, a.env, cache, d, f"cold{i}", a.in_situ),
                           run(a.engine, a.env, cache, d, f"warm{i}", a.in_situ)))

    how = " (in situ)" if a.in_situ else " --op-level" if a.engine in ("vllm", "sglang") else ""
    print(f"probe-engine {a.engine}{how}: seconds "
          f"({os.cpu_count()} cores; wall = the whole command, process start to exit)")
    cols = [f"cold {i + 1}" for i in range(a.runs)] + [f"warm {i + 1}" for i in range(a.runs)]
    if a.runs > 1:
        cols += ["cold med", "warm med"]
    print(f"{'':12}" + "".join(f"{c:>10}" for c in cols))
    keys = list(rounds[0][0])
    for k in keys:
        cold = [r[0].get(k, float("nan")) for r in rounds]
        warm = [r[1].get(k, float("nan")) for r in rounds]
        vals = cold + warm + ([statistics.median(cold), statistics.median(warm)] if a.runs > 1 else [])
        fmt = "{:10.2f}" if k == "load avg" else "{:10.1f}"
        print(f"{k:12}" + "".join(fmt.format(v) for v in vals))
    for which, idx in (("cold", 0), ("warm", 1)):
        wall = statistics.median(r[idx]["wall"] for r in rounds)
        verdict = "within" if wall <= BOUND[which] else "OVER"
        print(f"{which}: median wall {wall:.1f} s, {verdict} the {BOUND[which]:.0f} s bound")


if __name__ == "__main__":
    main()
