"""Transformers' MoE experts implementations, eager vs batched_mm vs grouped_mm: forward + backward time, one process.

    python -m bench.experts_impl                                   # tiny and medium DeepSeek-V3 MoE, on the CPU
    python -m bench.experts_impl --sizes v2-lite-2l --device cuda --dtype bfloat16 --tag gpu

How transformers 5.24 selects it (transformers/integrations/moe.py, modeling_utils.py): expert modules decorated
with ``@use_experts_implementation`` (DeepseekV3NaiveMoe, DeepseekV2Experts, ...) dispatch every forward on
``config._experts_implementation``. Set it at construction with
``AutoModelForCausalLM.from_config(config, experts_implementation="grouped_mm")`` (same keyword for
``from_pretrained``), or afterwards with ``model.set_experts_implementation("batched_mm")``. ``None`` (the default)
resolves to ``"grouped_mm"``. Other registered names: ``deepgemm``, ``sonicmoe`` (need their kernels).

One model is built per size; the implementations are switched on the same weights, so the timings differ only by the
experts kernel, and the loss and gradient norm are checked to agree across them. Rounds are interleaved (every round
times each implementation once, in rotating order) and the median per implementation is reported. Writes
``bench/results/experts_impl[-TAG].{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.scaling import machine, write_results
from deepzero.presets import PRESETS

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")

# DeepSeek-V3-architecture MoE configs at bench sizes (overrides on top of the tiny preset's architecture).
SIZES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("tiny-deepseek-v3", {}),
    "medium": (
        "tiny-deepseek-v3",
        dict(
            hidden_size=512,
            intermediate_size=1408,
            moe_intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=8,
            n_routed_experts=32,
            num_experts_per_tok=4,
            q_lora_rank=128,
            kv_lora_rank=64,
            qk_rope_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=64,
        ),
    ),
    # DeepSeek-V2-Lite widths (64 experts, top-6, 1408 wide, MLA 512), 2 layers: the GPU-sized check.
    "v2-lite-2l": ("deepseek-v2-lite", dict(num_hidden_layers=2, vocab_size=32000)),
}


def build(size: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A random-init MoE model of the named size (seed 0)."""
    from transformers import AutoModelForCausalLM

    preset, overrides = SIZES[size]
    config = PRESETS[preset].config(**overrides)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="eager")
    model.config.use_cache = False
    return model.train()


def batched_mm_gather_gb(config: Any, tokens: int, dtype: torch.dtype) -> float:
    """Memory batched_mm needs: it copies each routed (token, expert) pair's weights, kept for backward, per layer.

    ``gate_up_proj[expert_ids]`` and ``down_proj[expert_ids]`` are ``S × 3·I × H`` elements for ``S = tokens × top_k``
    pairs, in every MoE layer. Fine for decoding a few tokens; prohibitive for training batches.
    """
    pairs = tokens * config.num_experts_per_tok
    per_layer = pairs * 3 * config.moe_intermediate_size * config.hidden_size * dtype.itemsize
    moe_layers = config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)
    return per_layer * moe_layers / 2**30


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fwd_bwd(model: torch.nn.Module, batch: torch.Tensor) -> tuple[float, float]:
    """One forward + backward; the loss and the global gradient norm (both synced: only outside timed regions)."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    grads = [p.grad.float().norm() for p in model.parameters() if p.grad is not None]
    return float(loss.detach()), float(torch.stack(grads).norm())


def time_size(size: str, args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved forward+backward timings of every implementation on one model."""
    dtype = getattr(torch, args.dtype)
    model = build(size, dtype, args.device)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, model.config.vocab_size, (args.micro_batch, args.seq_len), generator=g).to(args.device)
    gather_gb = batched_mm_gather_gb(model.config, args.micro_batch * args.seq_len, dtype)
    impls = [i for i in args.impls if i != "batched_mm" or gather_gb <= args.max_gather_gb]
    skipped = {} if impls == args.impls else {"batched_mm": f"would copy {gather_gb:.1f} GB of expert weights"}
    checks = {}
    for impl in impls:  # warm-up and agreement check
        model.set_experts_implementation(impl)
        for _ in range(args.warmup):
            checks[impl] = fwd_bwd(model, batch)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for r in range(args.iters):
        k = r % len(impls)
        for impl in impls[k:] + impls[:k]:
            model.set_experts_implementation(impl)
            model.zero_grad(set_to_none=True)
            sync(args.device)
            start = time.perf_counter()
            model(input_ids=batch, labels=batch).loss.backward()
            sync(args.device)
            times[impl].append(time.perf_counter() - start)
    ref_loss, ref_norm = checks[impls[0]]
    tokens = args.micro_batch * args.seq_len
    rows = {}
    for impl in impls:
        median = statistics.median(times[impl])
        loss, norm = checks[impl]
        rows[impl] = {
            "median_s": median,
            "tokens_per_s": tokens / median,
            "loss": loss,
            "grad_norm": norm,
            "rel_diff_loss": abs(loss - ref_loss) / abs(ref_loss),
            "rel_diff_grad_norm": abs(norm - ref_norm) / max(abs(ref_norm), 1e-12),
        }
    fastest = min(rows, key=lambda i: rows[i]["median_s"])
    for row in rows.values():
        row["vs_fastest"] = row["median_s"] / rows[fastest]["median_s"]
    cfg = model.config
    print(f"{size}: " + "  ".join(f"{i} {r['median_s'] * 1e3:.1f} ms" for i, r in rows.items()), skipped or "")
    return {
        "size": size,
        "experts": f"{cfg.n_routed_experts} routed top-{cfg.num_experts_per_tok}, width {cfg.moe_intermediate_size}",
        "hidden_size": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "default": model.get_correct_experts_implementation(None),
        "fastest": fastest,
        "batched_mm_gather_gb": gather_gb,
        "skipped": skipped,
        "results": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# MoE experts implementation: forward + backward",
        "",
        f"Device {result['device']} ({result['machine'].get('gpu') or 'CPU, ' + str(result['threads']) + ' thread(s)'}),"
        f" {result['dtype']}, micro-batch {result['micro_batch']} × {result['seq_len']} tokens,"
        f" median of {result['iters']} interleaved rounds.",
        "",
        "| size | experts | impl | median ms | tokens/s | × fastest | Δloss (rel) | Δgrad norm (rel) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in result["sizes"]:
        for impl, r in s["results"].items():
            name = f"**{impl}**" if impl == s["fastest"] else impl
            lines.append(
                f"| {s['size']} ({s['params_m']:.1f}M) | {s['experts']} | {name} | {r['median_s'] * 1e3:.1f}"
                f" | {r['tokens_per_s']:,.0f} | {r['vs_fastest']:.2f} | {r['rel_diff_loss']:.1e}"
                f" | {r['rel_diff_grad_norm']:.1e} |"
            )
        for impl, why in s["skipped"].items():
            lines.append(f"| {s['size']} ({s['params_m']:.1f}M) | {s['experts']} | {impl} | skipped: {why} | | | | |")
    lines += [
        "",
        "Select with `AutoModelForCausalLM.from_config(config, experts_implementation=...)` /"
        " `from_pretrained(..., experts_implementation=...)`, or `model.set_experts_implementation(...)`;"
        " the default resolves to `grouped_mm`.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["tiny", "medium"], choices=list(SIZES))
    p.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), choices=list(IMPLEMENTATIONS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="Default: bfloat16 on CUDA, float32 on the CPU.")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--max-gather-gb", type=float, default=2.0, help="Skip batched_mm above this weight copy.")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (the CPU here is shared).")
    p.add_argument("--tag", default="", help="Suffix of the result files (e.g. gpu).")
    p.add_argument("--results", default="bench/results")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    result = {
        "device": args.device,
        "dtype": args.dtype,
        "threads": args.threads,
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "iters": args.iters,
        "machine": machine(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sizes": [time_size(size, args) for size in args.sizes],
    }
    name = "experts_impl" + (f"-{args.tag}" if args.tag else "")
    write_results(args.results, name, result, markdown(result))
    return result


if __name__ == "__main__":
    main()
