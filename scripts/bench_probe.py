"""Time a full probe of one engine: once from a cold compile cache, once warm.

    .venv/bin/python scripts/bench_probe.py [vllm|sglang|transformers] [--env VERSION]

Runs `probe-engine ENGINE` (op-level, in the engine's environment) twice with the same fresh Inductor cache
folder, and prints the wall time of each run and the time per region, side by side. Absolute
times depend on the machine and on what else runs on it; the numbers hold for this run only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(engine: str, env: str | None, cache: str, timings: str) -> tuple[float, dict]:
    e = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, ENGINEPROFILES_TIMINGS=timings)
    cmd = [str(REPO / ".venv" / "bin" / "probe-engine"), engine, "-o", "-"]
    if engine == "vllm":
        cmd.append("--op-level")  # the per-region probe; in situ starts a whole engine
    if env:
        cmd += ["--env", env]
    t = time.perf_counter()
    r = subprocess.run(cmd, env=e, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"probe failed:\n{r.stderr[-3000:]}")
    return wall, json.loads(Path(timings).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", nargs="?", default="vllm")
    ap.add_argument("--env", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        cache = os.path.join(d, "inductor")
        cold_wall, cold = run(a.engine, a.env, cache, os.path.join(d, "t1.json"))
        warm_wall, warm = run(a.engine, a.env, cache, os.path.join(d, "t2.json"))
    print(f"probe-engine {a.engine}: wall time of the whole command (process start to exit)")
    print(f"{'':14}{'cold cache':>12}{'warm cache':>12}")
    print(f"{'wall':14}{cold_wall:12.1f}{warm_wall:12.1f}")
    for k in cold:
        print(f"{k:14}{cold[k]:12.1f}{warm.get(k, float('nan')):12.1f}")


if __name__ == "__main__":
    main()
