"""Corpus-scale data/prepare.py: throughput against the raw tokenizer ceiling, peak memory at two sizes, 1 vs N workers.

    python -m bench.prepare                               # 200 MB and 2 GB corpora, 1 vs 2 workers
    python -m bench.prepare --sizes-mb 50 500             # what bench/results/prepare.json holds (2 shared cores)

Generates corpora here from the Python standard library's sources (each copy of a file gets a header naming the
copy, so documents differ; the order is shuffled), trains a vocab-4096 BPE once on the stdlib (not timed), then:

- ceiling: ``tokenizers`` ``encode_batch_fast`` of the small corpus's first ``--ceiling-mb`` in memory, on every
  core (its own Rust threads) and on one thread, in a fresh process: tokenizing only, no reading or writing;
- prepare: ``data/prepare.py --input <corpus> --tokenizer <tok> --seq-len 256 --workers W --force`` for the small
  corpus with 1 and with N workers and the large one with N; MB/s of input over the whole run (start-up, reading,
  tokenizing, writing, publishing), peak RSS of the main process, of the largest worker, and of their sum (sampled every
  0.2 s with psutil; forked workers share pages with the main process, so the sum is an upper bound).

The corpora and outputs are deleted at the end. Writes ``bench/results/prepare.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_CEILING = """
import json, resource, sys, time
from pathlib import Path
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
files, limit, texts, size = sorted(Path(sys.argv[2]).rglob("*.py")), int(sys.argv[3]), [], 0
for f in files:
    texts.append(f.read_text())
    size += len(texts[-1].encode())
    if size >= limit:
        break
batches, cur, n = [], [], 0
for t in texts:
    cur.append(t); n += len(t)
    if n >= 1 << 20:
        batches.append(cur); cur, n = [], 0
batches.append(cur)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
start, cpu0, tokens = time.perf_counter(), cpu(), 0
for b in batches:
    tokens += sum(len(e.ids) for e in tok.encode_batch_fast(b, add_special_tokens=False))
secs, cpu_s = time.perf_counter() - start, cpu() - cpu0
print(json.dumps({"mb": size / 1e6, "seconds": secs, "mb_s": size / 1e6 / secs, "tokens_s": tokens / secs,
                  "cpu_s_per_mb": cpu_s / (size / 1e6)}))
"""


def make_corpus(folder: Path, size_mb: float, seed: int) -> int:
    """Copies of stdlib sources, each with a header naming its copy, in shuffled order; returns the bytes written."""
    from deepzero.data import stdlib_corpus

    sources = [f.read_text(errors="replace") for f in stdlib_corpus()]
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    written, copy = 0, 0
    while written < size_mb * 1e6:
        order = list(range(len(sources)))
        rng.shuffle(order)
        sub = folder / f"{copy:04d}"
        sub.mkdir()
        for i in order:
            data = f"# copy {copy} of stdlib file {i}\n{sources[i]}".encode()
            (sub / f"{i:05d}.py").write_bytes(data)
            written += len(data)
            if written >= size_mb * 1e6:
                break
        copy += 1
    return written


def ceiling(tok_json: Path, corpus: Path, limit_mb: float, one_thread: bool) -> dict[str, Any]:
    """encode_batch_fast over the corpus's first ``limit_mb`` in memory, in a fresh process."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false" if one_thread else "true"}
    cmd = [sys.executable, "-c", _CEILING, str(tok_json), str(corpus), str(int(limit_mb * 1e6))]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout)


def run_prepare(corpus: Path, tok: Path, out: Path, workers: int, seq_len: int) -> dict[str, Any]:
    """One data/prepare.py run: wall time, MB/s, and peak memory of its processes."""
    cmd = [sys.executable, "data/prepare.py", "--input", str(corpus), "--tokenizer", str(tok)]
    cmd += ["--seq-len", str(seq_len), "--workers", str(workers), "--out", str(out), "--force"]
    start, cpu0 = time.perf_counter(), _children_cpu()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ps, peak = psutil.Process(proc.pid), {"sum": 0, "main": 0, "worker": 0}
    while proc.poll() is None:
        try:
            rss = [p.memory_info().rss for p in (ps, *ps.children(recursive=True))]
        except psutil.Error:
            continue
        for key, value in (("sum", sum(rss)), ("main", rss[0]), ("worker", max(rss[1:], default=0))):
            peak[key] = max(peak[key], value)
        time.sleep(0.2)
    stdout = proc.stdout.read()
    secs, cpu_s = time.perf_counter() - start, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"prepare failed ({proc.returncode}):\n{stdout}")
    meta = json.loads((out / "meta.json").read_text())
    return {
        "workers": workers,
        "input_mb": meta["input_bytes"] / 1e6,
        "seconds": round(secs, 2),
        "mb_s": meta["input_bytes"] / 1e6 / secs,
        "stream_seconds": meta["stream_seconds"],
        "stream_mb_s": meta["input_bytes"] / 1e6 / meta["stream_seconds"],
        "tokens_s": (sum(meta["n_tokens"].values()) + sum(meta["n_dropped"].values())) / secs,
        "cpu_s_per_mb_whole_run": cpu_s / (meta["input_bytes"] / 1e6),
        "cpu_s_per_mb": meta["stream_cpu_seconds"] / (meta["input_bytes"] / 1e6),
        "peak_rss_sum_mb": peak["sum"] / 2**20,
        "peak_rss_main_mb": peak["main"] / 2**20,
        "peak_rss_worker_mb": peak["worker"] / 2**20,
        "rows": meta["n_rows"],
        "shards": {s: len(v) for s, v in meta["shards"].items()},
        "summary": stdout.strip().splitlines()[-7:],
    }


def _children_cpu() -> float:
    """CPU seconds of the waited-for descendants so far (prepare and, through it, its workers)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mb", type=float, nargs=2, default=[200, 2000], help="small and large corpus, MB")
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="N in 1 vs N workers")
    p.add_argument("--ceiling-mb", type=float, default=12, help="MB of one stdlib copy the ceiling tokenizes")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--work-dir", type=Path, default=REPO / "artifacts" / "bench-prepare")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "prepare.json")
    args = p.parse_args()
    from deepzero.data import stdlib_corpus, train_tokenizer

    work = args.work_dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        tok = work / "tokenizer"
        train_tokenizer(stdlib_corpus(), vocab_size=4096, out_dir=tok)
        small, large = work / "small", work / "large"
        sizes = {"small": make_corpus(small, args.sizes_mb[0], 0)}
        tok_json, all_cores = tok / "tokenizer.json", f"{args.workers}_threads"
        ceilings: dict[str, list[dict[str, Any]]] = {all_cores: [], "1_thread": []}

        def measured(corpus: str, folder: Path, workers: int) -> dict[str, Any]:
            """One prepare run between two ceiling measurements of its kind (the machine's load drifts)."""
            one = workers == 1
            before = ceiling(tok_json, small_sample, args.ceiling_mb, one_thread=one)
            run = run_prepare(folder, tok, work / "out", workers, args.seq_len)
            after = ceiling(tok_json, small_sample, args.ceiling_mb, one_thread=one)
            ceilings["1_thread" if one else all_cores] += [before, after]
            ref = (before["mb_s"] + after["mb_s"]) / 2
            return {
                "corpus": corpus,
                **run,
                "ceiling_mb_s": ref,
                "vs_ceiling": run["stream_mb_s"] / ref,
            }

        small_sample = work / "sample"
        shutil.copytree(small / "0000", small_sample)  # stays when the corpora go
        runs = [measured("small", small, 1), measured("small", small, args.workers)]
        shutil.rmtree(small)
        shutil.rmtree(work / "out")
        sizes["large"] = make_corpus(large, args.sizes_mb[1], 1)
        runs.append(measured("large", large, args.workers))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    one_thread_cpu = statistics.mean(c["cpu_s_per_mb"] for c in ceilings["1_thread"])
    for r in runs:
        r["ceiling_cpu_s_per_mb"] = one_thread_cpu
        r["cpu_efficiency"] = one_thread_cpu / r["cpu_s_per_mb"]
        r["vs_ceiling_all_cores"] = r["stream_mb_s"] / statistics.mean(c["mb_s"] for c in ceilings[all_cores])
    result = {
        "command": "python -m bench.prepare " + " ".join(sys.argv[1:]),
        "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform()},
        "load_avg_at_end": os.getloadavg(),
        "corpus_mb": {k: v / 1e6 for k, v in sizes.items()},
        "ceiling": ceilings,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    """The measured numbers as a Markdown table."""
    lines = [
        "| run | input MB | workers | MB/s streaming (whole run) | ceiling MB/s (same threads, around the run) "
        "| vs ceiling | vs all-core ceiling | CPU s/MB (1-thread ceiling) | CPU efficiency | peak RSS MB: sum / main / "
        "largest worker |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| prepare {r['corpus']} | {r['input_mb']:.0f} | {r['workers']} | {r['stream_mb_s']:.2f} "
            f"({r['mb_s']:.2f}) | {r['ceiling_mb_s']:.2f} | {r['vs_ceiling']:.0%} | {r['vs_ceiling_all_cores']:.0%} | "
            f"{r['cpu_s_per_mb']:.2f} ({r['ceiling_cpu_s_per_mb']:.2f}) | {r['cpu_efficiency']:.0%} | "
            f"{r['peak_rss_sum_mb']:.0f} / {r['peak_rss_main_mb']:.0f} / {r['peak_rss_worker_mb']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
