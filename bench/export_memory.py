"""Host memory of the QLoRA export: the shard-by-shard merge against the whole-model merge it replaced (docs/qlora.md).

    python -m bench.export_memory                      # a ~880 MB bf16 Llama in 32 MB shards
    python -m bench.export_memory --layers 4           # a quicker, smaller base

The base is a Llama (hidden 1024, intermediate 2816, vocab 8000, random init) saved in bf16 by ``save_pretrained`` in
32 MB shards; the adapters r16 on every attention projection, drawn at random. Each way runs in a fresh Python
process that reports its peak resident memory above the level before the export (sampled every 5 ms; torch,
Transformers and peft imported before it, as in a training run):

- ``streamed``: ``deepzero.adapters.merge.export_merged`` (no logit round trip, as for a base above 4 GiB);
- ``whole model``: what the export did before, the whole base read by ``from_pretrained``, peft's ``merge_and_unload``,
  ``save_pretrained``, and the folder read back whole for its check.

Writes ``bench/results/export_memory.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.scaling import REPO, machine, write_results

SHARD = "32MB"


def make_base(folder: Path, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, max_shard_size=SHARD)


def adapters(layers: int) -> Any:
    from deepzero.adapters.merge import Adapters

    torch.manual_seed(0)
    pairs = {
        f"model.layers.{i}.self_attn.{p}_proj": (torch.randn(16, 1024) * 0.01, torch.randn(1024, 16))
        for i in range(layers)
        for p in "qkvo"
    }
    return Adapters(pairs, r=16, alpha=32.0)


def run_one(way: str, base: Path, out: Path, layers: int) -> dict[str, Any]:
    """In this (fresh) process: one export, and its peak resident memory above the start."""
    import peft  # noqa: F401  (imported before the measurement, as in a training run)
    from transformers import AutoModelForCausalLM

    from deepzero.adapters.lora import wrap
    from deepzero.adapters.merge import export_merged, peak_rss

    spec = adapters(layers)
    if way == "streamed":
        report = export_merged(str(base), spec, None, out, torch.tensor([[1, 2]]), logit_check_bytes=0)
        assert report.ok, report
        return {"peak_host_bytes": report.peak_host_bytes, "base_bytes": report.base_bytes,
                "largest_shard_bytes": report.largest_shard_bytes}  # fmt: skip
    with peak_rss() as peak:
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        peft_model = wrap(model, spec.peft_config(str(base)))
        peft_model.load_state_dict({k.replace(".weight", ".default.weight"): v for k, v in
                                    spec.peft_state().items()}, strict=False)  # fmt: skip
        merged = peft_model.merge_and_unload(progressbar=False, safe_merge=True)
        merged.save_pretrained(out, max_shard_size=SHARD)
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
        del reloaded
    return {"peak_host_bytes": peak.bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.export_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the base (32: about 880 MB)")
    parser.add_argument("--results", default="bench/results", help="folder for export_memory.{json,md}")
    parser.add_argument("--one", nargs=3, metavar=("WAY", "BASE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one[0], Path(args.one[1]), Path(args.one[2]), args.layers)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        make_base(base, args.layers)
        rows = {}
        for way in ("streamed", "whole model"):
            cmd = [sys.executable, "-m", "bench.export_memory", "--layers", str(args.layers)]
            cmd += ["--one", way, str(base), str(Path(tmp) / way.replace(" ", "_"))]
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True)
            rows[way] = json.loads(done.stdout.strip().splitlines()[-1])
    sizes = rows["streamed"]
    result = {"layers": args.layers, "shard": SHARD, "machine": machine(), **sizes, "ways": rows}
    mb = 1e6
    text = (
        f"# Export host memory (python -m bench.export_memory --layers {args.layers})\n\n"
        f"Base: {sizes['base_bytes'] / mb:.0f} MB of bf16 in {SHARD} shards (largest {sizes['largest_shard_bytes'] / mb:.0f}"
        " MB); adapters r16 on every attention projection. Peak resident memory above the start of the export:\n\n"
        "| way | peak host memory | / base | / largest shard |\n|---|---|---|---|\n"
    )
    for way, row in rows.items():
        peak = row["peak_host_bytes"]
        text += (
            f"| {way} | {peak / mb:.0f} MB | {peak / sizes['base_bytes']:.2f} |"
            f" {peak / sizes['largest_shard_bytes']:.1f} |\n"
        )
    write_results(args.results, "export_memory", result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
