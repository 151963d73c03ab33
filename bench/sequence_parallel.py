"""Sequence parallelism on the CPU: tokens/s and peak memory per rank, SP 1 vs SP 3, and the all-gathers' share.

    python -m bench.sequence_parallel                              # tiny-deepseek-v3 (its 4,096 vocabulary)
    python -m bench.sequence_parallel --vocab 129280 --seq-lens 1536,3072  # DeepSeek's vocabulary

Each case is ``size`` gloo processes (1: the whole row on one rank; 3: one sequence group, each rank its slice,
keys and values all-gathered as train.py runs it: ``deepzero.sequence_parallel.install`` and ``shard``), the model
a preset's architecture (random init, fp32) with train.py's tiled loss, one warm-up step, then one measured step
of the product's loss (``losses.lm.lm_loss``) and backward. Measured per rank: the step's peak resident memory
above what the process held before it (``bench.long_context``'s high-water mark), the step's time, and the time
inside the sequence all-gathers (forward gather, backward all-reduce; waits for the slowest rank included). Beside
it, the formula's bytes per step: ``gathered_bytes`` × layers × rows, forward plus as many in backward.

Writes ``bench/results/sequence_parallel.json`` and ``.md``. On a 2-core machine three ranks share two cores: the
times are of this machine, the memory per rank is what carries over.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.long_context import MALLOC_ENV, build, hwm_bytes, predicted_bytes, rss_bytes, savers_for  # noqa: E402
from bench.scaling import write_results  # noqa: E402


def timed_gathers(sp: Any, seconds: list[float], values: list[float]) -> None:
    """Add the time spent in the sequence all-gather's forward and backward to ``seconds[0]``, and each forward
    gather's values per token of the gathered rows (``[batch, heads, seq, dim]``: heads × dim) to ``values[0]``."""
    gather = sp._GatherSequence
    forward, backward = gather.forward, gather.backward

    def timed(fn: Any, count: bool) -> Any:
        def run(*args: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args)
            seconds[0] += time.perf_counter() - start
            if count:
                values[0] += out.numel() / (out.shape[0] * out.shape[2])
            return out

        return staticmethod(run)

    gather.forward, gather.backward = timed(forward, True), timed(backward, False)


def _rank(rank: int, spec: dict[str, Any], port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from deepzero import sequence_parallel as sp
    from deepzero.losses.lm import lm_loss

    torch.set_num_threads(1)
    size = spec["size"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    model, _, _ = build(spec["model"], spec["layers"], spec["vocab"], "tiled", spec["seq_len"], "cpu")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec["vocab"], (spec["micro"], spec["seq_len"]), generator=gen)
    batch = {"input_ids": ids, "labels": ids, "shift_labels": torch.roll(ids, -1, 1)}
    normalizer = torch.tensor(float(ids.numel()))
    if size > 1:
        groups = sp.SequenceGroups(size, rank, dist.new_group(list(range(size))), 0, 1, None)
        sp.install(model, groups)
        batch = groups.shard(batch)
    gathers, values = [0.0], [0.0]
    timed_gathers(sp, gathers, values)

    def step() -> None:
        lm_loss(model, batch, normalizer).backward()

    step()  # warm-up: gradients allocated
    dist.barrier()
    gathers[0] = values[0] = 0.0
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_bytes()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    result = {"rank": rank, "peak_bytes": hwm_bytes() - before, "step_s": seconds, "gather_s": gathers[0]}
    result["gathered_values_per_token_layer"] = values[0] / spec["layers"]
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["size"]`` ranks on this machine; the per-rank results and the formula's bytes."""
    import torch.multiprocessing as mp

    from deepzero import sequence_parallel as sp
    from deepzero.distributed import free_port
    from deepzero.presets import PRESETS

    os.environ.update(MALLOC_ENV)  # read by each spawned rank's allocator at its start
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(spec, free_port(), out), nprocs=spec["size"], join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(spec["size"])]
    config = PRESETS[spec["model"]].config(vocab_size=spec["vocab"], num_hidden_layers=spec["layers"])
    per_layer = sp.gathered_bytes(config, spec["seq_len"], spec["size"], 4) if spec["size"] > 1 else 0
    step_s = max(r["step_s"] for r in ranks)
    savers, checkpointing = savers_for("tiled", config, spec["seq_len"])
    predicted = predicted_bytes({**spec, "device": "cpu"}, savers, checkpointing, spec["size"])
    return {
        **spec,
        "ranks": ranks,
        "peak_bytes_per_rank": max(r["peak_bytes"] for r in ranks),
        "predicted_bytes_per_rank": predicted,
        "step_s": step_s,
        "tokens_per_s": spec["micro"] * spec["seq_len"] / step_s,
        "gather_share": max(r["gather_s"] for r in ranks) / step_s,
        "formula_bytes_per_rank": 2 * per_layer * spec["layers"] * spec["micro"],
        "gathered_values_per_token_layer": ranks[0]["gathered_values_per_token_layer"],
        "formula_values_per_token_layer": sp.gathered_values(config) if spec["size"] > 1 else 0,
        "expanded_values_per_token_layer": math.prod(sp.attention_shape(config)[:2])
        + math.prod(sp.attention_shape(config)[::2]),
    }


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(rows: list[dict[str, Any]], title: str) -> str:
    lines = [
        f"# {title}",
        "",
        "| seq len | SP | tokens/s | peak per rank | vs SP 1 | planner | measured / planner |"
        " all-gather bytes per rank (formula) | gathered values per token per layer (measured / formula / expanded"
        " k+v) | gather time share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    one = {r["seq_len"]: r for r in rows if r["size"] == 1}
    for r in rows:
        ratio = r["peak_bytes_per_rank"] / one[r["seq_len"]]["peak_bytes_per_rank"] if r["seq_len"] in one else 0
        lines.append(
            f"| {r['seq_len']} | {r['size']} | {r['tokens_per_s']:.0f} | {_mb(r['peak_bytes_per_rank'])} |"
            f" {ratio:.2f} | {_mb(r['predicted_bytes_per_rank'])} |"
            f" {r['peak_bytes_per_rank'] / r['predicted_bytes_per_rank']:.2f} |"
            f" {_mb(r['formula_bytes_per_rank'])} | {r['gathered_values_per_token_layer']:.0f} /"
            f" {r['formula_values_per_token_layer']} / {r['expanded_values_per_token_layer']} | {r['gather_share']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--seq-lens", default="6144,12288", help="multiples of every size")
    parser.add_argument("--sizes", default="1,3")
    parser.add_argument("--results", default="bench/results")
    args = parser.parse_args(argv)
    rows = []
    for seq_len in map(int, args.seq_lens.split(",")):
        for size in map(int, args.sizes.split(",")):
            spec = dict(model=args.model, layers=args.layers, vocab=args.vocab, micro=args.micro)
            rows.append(run_case({**spec, "seq_len": seq_len, "size": size}))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "ranks"}), flush=True)
    title = f"Sequence parallelism on the CPU: {args.model}, {args.layers} layers, vocab {args.vocab}, fp32"
    write_results(args.results, "sequence_parallel", {"title": title, "rows": rows}, report(rows, title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
