"""Layer placement: split a decoder's layers over N cards (naive model parallel) from sizes measured on meta.

``plan_placement`` builds the model on the meta device, measures every module with accelerate's
``compute_module_sizes``, and cuts the decoder layers into contiguous runs, one per card, so that the
fullest card (relative to its budget) is as empty as possible. The embedding goes on the first card,
the final norm and lm_head on the last, and a decoder layer is never split. The resulting
``Placement.device_map`` can be passed to ``from_pretrained(device_map=...)`` or to
``deepzero.placement_hooks.apply_placement``.

Run ``python -m deepzero.placement --model deepseek-coder-1.3b --gpus 3 --gpu-mem 24 --training``
to print the table.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import compute_module_sizes, convert_file_size_to_int
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from deepzero.errors import UserError
from deepzero.modeling import planning_config
from deepzero.precision import TORCH_DTYPES

GiB = 2**30
Device = str | int


@dataclass(frozen=True)
class CardRow:
    """One logical card of a placement: what it holds and how many bytes that costs."""

    card: int
    """Logical card id (0..N-1); several cards may share one torch device (the CPU test)."""
    device: Device
    layers: range
    """Decoder layer indices held by this card (possibly empty)."""
    extras: tuple[str, ...]
    """Non-layer modules held by this card (embedding, final norm, lm_head, rotary embedding)."""
    param_bytes: int
    state_bytes: int
    """Gradients and optimizer states when training (param_bytes × (training_factor − 1)), else 0."""
    reserve_bytes: int
    """Activation / KV-cache reserve: per-layer reserve × layers, plus the logits reserve on the lm_head card."""
    budget_bytes: int | None

    @property
    def total_bytes(self) -> int:
        """Everything this card is planned to hold."""
        return self.param_bytes + self.state_bytes + self.reserve_bytes


@dataclass(frozen=True)
class Placement:
    """A device_map plus the per-card rows that explain it."""

    device_map: dict[str, Device]
    """Module name → torch device, for ``from_pretrained(device_map=...)`` or ``apply_placement``."""
    card_of: dict[str, int]
    """Module name → logical card id (same keys as device_map)."""
    cards: tuple[CardRow, ...]
    layers_name: str
    """Dotted name of the decoder layer list, e.g. "model.layers"."""
    dtype: torch.dtype
    training: bool
    training_factor: float
    reserve_per_layer_bytes: int


def meta_model(config: PretrainedConfig) -> nn.Module:
    """Instantiate a causal LM on the meta device: no memory, real module tree and shapes.

    ``accelerate.init_empty_weights`` is not enough for DeepseekV3 (its experts call ``torch.empty``).
    """
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layer list: the ModuleList whose items are the model's ``_no_split_modules`` (else the longest)."""
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    lists = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.ModuleList) and len(mod) > 0]
    for name, mod in lists:
        if type(mod[0]).__name__ in no_split:
            return name, mod
    if not lists:
        raise UserError(type(model).__name__, "no decoder layer list (nn.ModuleList) found", "use a HF decoder model")
    return max(lists, key=lambda item: len(item[1]))


def layer_sizes(model: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of every placeable module at ``dtype``: each decoder layer and each non-layer top module.

    Keys are device_map keys ("model.embed_tokens", "model.layers.0", ..., "model.norm", "lm_head"), in
    forward order. Tied weights are counted once (on the module that owns them first).
    """
    sizes = compute_module_sizes(model, dtype=dtype)
    layers_name, layers = find_layers(model)
    out: dict[str, int] = {}
    for name in _placeable_modules(model, layers_name, len(layers)):
        out[name] = sizes.get(name, 0)
    return out


def _placeable_modules(model: nn.Module, layers_name: str, n_layers: int) -> list[str]:
    """Module names covering the whole model in forward order: the layers, and the siblings of each of their ancestors."""

    def walk(parent: nn.Module, prefix: str, parts: list[str]) -> list[str]:
        names: list[str] = []
        for child, module in parent.named_children():
            if child != parts[0]:
                names.append(prefix + child)
            elif len(parts) == 1:
                names.extend(f"{prefix}{child}.{i}" for i in range(n_layers))
            else:
                names.extend(walk(module, f"{prefix}{child}.", parts[1:]))
        return names

    return walk(model, "", layers_name.split("."))


def _goes_first(name: str, model: nn.Module) -> bool:
    """Non-layer modules that live on the first card: embeddings, rotary tables, and an lm_head tied to the embedding."""
    leaf = name.rsplit(".", 1)[-1]
    if "embed" in leaf or "rotary" in leaf:
        return True
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    module = model.get_submodule(name)
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
    return tied and module is out_emb


def layer_reserve_bytes(
    config: PretrainedConfig, *, training: bool, seq_len: int, micro_batch: int, dtype: torch.dtype
) -> int:
    """Rough activation (training) or KV-cache (inference) bytes one decoder layer needs on its card.

    Training, no activation checkpointing, fused/SDPA attention: the layer keeps its inputs, q/k/v, the
    attention output and the MLP's gate/up/act tensors, ≈ tokens × (6h + q + kv + 3·mlp) × bytes (34·s·b·h for
    a Llama layer, as in Korthikanti et al. 2022). Inference: the KV cache for ``seq_len × micro_batch`` tokens.
    """
    cfg = config.get_text_config()
    tokens, nbytes = seq_len * micro_batch, torch.finfo(dtype).bits // 8
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if getattr(cfg, "kv_lora_rank", None):  # MLA: HF caches the decompressed per-head k and v
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q_width, kv_width = heads * qk, heads * (qk + cfg.v_head_dim)
    else:
        head_dim = getattr(cfg, "head_dim", None) or h // heads
        q_width, kv_width = heads * head_dim, 2 * getattr(cfg, "num_key_value_heads", heads) * head_dim
    if not training:
        return tokens * nbytes * kv_width
    mlp_width = cfg.intermediate_size
    if getattr(cfg, "n_routed_experts", None):
        moe_width = (cfg.num_experts_per_tok + (getattr(cfg, "n_shared_experts", 0) or 0)) * cfg.moe_intermediate_size
        mlp_width = max(mlp_width, moe_width)
    return tokens * nbytes * (6 * h + q_width + kv_width + 3 * mlp_width)


def logits_reserve_bytes(
    config: PretrainedConfig, *, training: bool, seq_len: int, micro_batch: int, dtype: torch.dtype
) -> int:
    """Bytes of the logits on the lm_head card: the logits, their fp32 upcast and log-softmax (+ their grad if training)."""
    vocab = config.get_text_config().vocab_size
    return seq_len * micro_batch * vocab * (torch.finfo(dtype).bits // 8 + (12 if training else 8))


def _budgets(max_memory: dict | None, devices: Sequence[Device]) -> list[int] | None:
    """Per-card byte budgets from ``max_memory`` (keys: card index; values: bytes or "24GiB"), or None for unbounded."""
    if max_memory is None:
        if torch.cuda.is_available() and all(isinstance(d, int) for d in devices):
            return [torch.cuda.get_device_properties(d).total_memory for d in devices]
        return None
    keys = {int(k): v for k, v in max_memory.items()}
    missing = [c for c in range(len(devices)) if c not in keys]
    if missing:
        raise UserError("max_memory", f"no budget for card(s) {missing}", f"give one per card 0..{len(devices) - 1}")
    extra = sorted(set(keys) - set(range(len(devices))))
    if extra:
        raise UserError("max_memory", f"budget for unknown card(s) {extra}", f"there are {len(devices)} cards")
    budgets = []
    for card in range(len(devices)):
        value = keys[card]
        try:
            budgets.append(int(value) if isinstance(value, int | float) else convert_file_size_to_int(value))
        except ValueError:
            raise UserError("max_memory", f"card {card}: cannot read size {value!r}", 'write e.g. "24GiB"') from None
    return budgets


def _split(costs: list[int], first: int, last: int, budgets: list[float]) -> list[int]:
    """Cut ``costs`` (one per layer) into len(budgets) contiguous runs; return the N+1 cut points.

    Card k holds ``costs[cut[k]:cut[k+1]]`` plus ``first`` (k = 0) and ``last`` (k = N−1). Pass 1 finds the
    smallest possible max_k load_k / budget_k; pass 2, among splits within that max, minimises Σ (load/budget)²
    so the other cards are balanced too.
    """
    n_cards, n_layers = len(budgets), len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def ratio(k: int, i: int, j: int) -> float:
        load = prefix[j] - prefix[i] + (first if k == 0 else 0) + (last if k == n_cards - 1 else 0)
        return load / budgets[k]

    def solve(score, combine, cap: float) -> tuple[list[list[float]], list[list[int]]]:
        best = [[math.inf] * (n_layers + 1) for _ in range(n_cards)]
        arg = [[0] * (n_layers + 1) for _ in range(n_cards)]
        for j in range(n_layers + 1):
            if ratio(0, 0, j) <= cap:
                best[0][j] = score(ratio(0, 0, j))
        for k in range(1, n_cards):
            for j in range(n_layers + 1):
                for i in range(j + 1):
                    r = ratio(k, i, j)
                    if r > cap or best[k - 1][i] == math.inf:
                        continue
                    value = combine(best[k - 1][i], score(r))
                    if value < best[k][j]:
                        best[k][j], arg[k][j] = value, i
        return best, arg

    best, _ = solve(lambda r: r, max, math.inf)
    cap = best[-1][n_layers] * (1 + 1e-9)
    _, arg = solve(lambda r: r * r, lambda a, b: a + b, cap)
    cuts = [n_layers]
    for k in range(n_cards - 1, 0, -1):
        cuts.append(arg[k][cuts[-1]])
    cuts.append(0)
    return cuts[::-1]


def plan_placement(
    config: PretrainedConfig,
    devices: Sequence[Device],
    max_memory: dict | None = None,
    dtype: torch.dtype = torch.bfloat16,
    reserve_per_layer_bytes: int | None = None,
    training: bool = False,
    training_factor: float = 4.0,
    seq_len: int = 2048,
    micro_batch: int = 1,
) -> Placement:
    """Split the model's decoder layers over ``devices`` (one logical card each), balanced by bytes.

    Args:
        config: the model's transformers config (built on meta; nothing is allocated).
        devices: torch device per logical card, e.g. ``[0, 1, 2]`` or ``["cpu", "cpu", "cpu"]``.
        max_memory: card index → budget (bytes or "24GiB"); None: each CUDA card's total memory, else unbounded.
        dtype: dtype of the weights (and of activations, for the reserve).
        reserve_per_layer_bytes: activation/KV reserve per layer; None: ``layer_reserve_bytes(...)``.
        training: count gradients and optimizer states, and training activations.
        training_factor: bytes held per weight byte when training. 4 = weights + grads + AdamW's two moments,
            all in ``dtype`` (plain ``torch.optim.AdamW`` on a bf16 model); 8 = bf16 weights and grads with
            fp32 master weights and moments (16 bytes per parameter).
        seq_len, micro_batch: tokens per forward, for the default reserves.

    Raises UserError when the model does not fit, saying by how much.
    """
    if not devices:
        raise UserError("plan_placement", "no devices given", "pass at least one device, e.g. [0, 1, 2]")
    model = meta_model(config)
    layers_name, layers = find_layers(model)
    sizes = layer_sizes(model, dtype)
    factor = training_factor if training else 1.0
    if reserve_per_layer_bytes is None:
        reserve_per_layer_bytes = layer_reserve_bytes(
            config, training=training, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype
        )
    logits_bytes = logits_reserve_bytes(
        config, training=training, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype
    )
    layer_names = [f"{layers_name}.{i}" for i in range(len(layers))]
    lm_head = model.get_output_embeddings()
    head_names = {name for name in sizes if lm_head is not None and model.get_submodule(name) is lm_head}
    first_names = [n for n in sizes if n not in layer_names and _goes_first(n, model)]
    last_names = [n for n in sizes if n not in layer_names and n not in first_names]
    first = sum(int(sizes[n] * factor) for n in first_names) + (logits_bytes if head_names & set(first_names) else 0)
    last = sum(int(sizes[n] * factor) for n in last_names) + (logits_bytes if head_names & set(last_names) else 0)
    costs = [int(sizes[n] * factor) + reserve_per_layer_bytes for n in layer_names]

    budgets = _budgets(max_memory, devices)
    weights = [float(b) for b in budgets] if budgets else [1.0] * len(devices)
    cuts = _split(costs, first, last, weights)

    device_map: dict[str, Device] = {}
    card_of: dict[str, int] = {}
    rows = []
    for card, device in enumerate(devices):
        layer_range = range(cuts[card], cuts[card + 1])
        extras = tuple((first_names if card == 0 else []) + (last_names if card == len(devices) - 1 else []))
        held = set(extras) | {layer_names[i] for i in layer_range}
        names = [n for n in sizes if n in held]
        for name in names:
            device_map[name], card_of[name] = device, card
        params = sum(sizes[n] for n in names)
        has_head = bool(head_names & set(extras))
        rows.append(
            CardRow(
                card=card,
                device=device,
                layers=layer_range,
                extras=extras,
                param_bytes=params,
                state_bytes=int(params * factor) - params,
                reserve_bytes=reserve_per_layer_bytes * len(layer_range) + (logits_bytes if has_head else 0),
                budget_bytes=budgets[card] if budgets else None,
            )
        )
    device_map = {n: device_map[n] for n in sizes}  # forward order
    card_of = {n: card_of[n] for n in sizes}
    placement = Placement(
        device_map=device_map,
        card_of=card_of,
        cards=tuple(rows),
        layers_name=layers_name,
        dtype=dtype,
        training=training,
        training_factor=factor,
        reserve_per_layer_bytes=reserve_per_layer_bytes,
    )
    _check_fits(placement)
    return placement


def _check_fits(placement: Placement) -> None:
    """Raise UserError if any card is over budget, with the shortfall in GiB."""
    rows = placement.cards
    if rows[0].budget_bytes is None:
        return
    over = [r for r in rows if r.total_bytes > r.budget_bytes]
    if not over:
        return
    need, have = sum(r.total_bytes for r in rows), sum(r.budget_bytes or 0 for r in rows)
    mode = f"training (x{placement.training_factor:g} weight bytes)" if placement.training else "inference"
    fix = "add cards, use a ZeRO offload preset (ds_configs), or pick a smaller model"
    if need > have:
        problem = f"{mode} needs {need / GiB:.1f} GiB but the {len(rows)} card{'s' if len(rows) > 1 else ''} have {have / GiB:.1f} GiB: short by {(need - have) / GiB:.1f} GiB"
    else:
        worst = max(over, key=lambda r: r.total_bytes - (r.budget_bytes or 0))
        short = worst.total_bytes - (worst.budget_bytes or 0)
        problem = (
            f"{mode} needs {need / GiB:.1f} GiB of {have / GiB:.1f} GiB, but whole layers cannot be spread evenly: "
            f"card {worst.card} is short by {short / GiB:.2f} GiB"
        )
    raise UserError("placement", problem, fix)


def _layers_label(row: CardRow, placement: Placement) -> str:
    """E.g. "embed, 0-9" or "20-23, norm, lm_head"."""
    prefix = placement.layers_name + "."
    short = {n: n.rsplit(".", 1)[-1].replace("embed_tokens", "embed") for n in row.extras if "rotary" not in n}
    firsts = [short[n] for n in row.extras if n in short and row.card == 0 and not n.startswith(prefix)]
    lasts = [short[n] for n in row.extras if n in short and short[n] not in firsts]
    span = []
    if len(row.layers) == 1:
        span = [str(row.layers[0])]
    elif len(row.layers) > 1:
        span = [f"{row.layers[0]}-{row.layers[-1]}"]
    return ", ".join(firsts + span + lasts) or "-"


def format_placement(placement: Placement) -> str:
    """The placement as a table: card → device → layers → GiB (weights, grads+optimizer, reserve, total, budget).

    Sizes are in GiB, or in MiB when every card holds under 1 GiB (tiny test models).
    """
    unit, scale = ("GiB", GiB) if max(r.total_bytes for r in placement.cards) >= GiB else ("MiB", 2**20)
    header = ("card", "device", "layers", "weights", "grad+opt", "reserve", f"total {unit}", "budget", "use")
    rows = [header]
    for r in placement.cards:
        budget = r.budget_bytes
        sizes = (r.param_bytes, r.state_bytes, r.reserve_bytes, r.total_bytes)
        rows.append(
            (
                str(r.card),
                str(torch_device(r.device)),
                _layers_label(r, placement),
                *(f"{b / scale:.2f}" for b in sizes),
                f"{budget / scale:.1f}" if budget else "-",
                f"{100 * r.total_bytes / budget:.0f}%" if budget else "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    mode = f"training, weights x{placement.training_factor:g}" if placement.training else "inference"
    n_layers = sum(len(r.layers) for r in placement.cards)
    title = (
        f"{n_layers} layers over {len(placement.cards)} cards, {str(placement.dtype).removeprefix('torch.')}, {mode}, "
        f"reserve {placement.reserve_per_layer_bytes / scale:.3f} {unit}/layer"
    )
    return "\n".join([title, *lines])


def torch_device(device: Device) -> torch.device:
    """A device_map value as a torch.device: an int is a CUDA ordinal, as in accelerate's device_map."""
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def _parse_max_memory(text: str) -> dict[int, str]:
    """ "0=24GiB,1=20GiB" → {0: "24GiB", 1: "20GiB"}."""
    out = {}
    for item in filter(None, text.split(",")):
        card, sep, size = item.partition("=")
        if not sep or not card.strip().isdigit():
            raise UserError("--max-memory", f"cannot read {item!r}", 'write e.g. "0=24GiB,1=20GiB,2=24GiB"')
        out[int(card)] = size.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: print the placement table for a model over N GPUs."""
    parser = argparse.ArgumentParser(prog="python -m deepzero.placement", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="preset name or local checkpoint folder")
    parser.add_argument("--gpus", type=int, default=3)
    parser.add_argument("--gpu-mem", type=float, default=24.0, help="GiB per card, unless --max-memory says otherwise")
    parser.add_argument("--max-memory", default="", help='per-card budgets, e.g. "0=24GiB,1=20GiB,2=24GiB"')
    parser.add_argument("--training", action="store_true", help="count grads, optimizer states and activations")
    parser.add_argument("--training-factor", type=float, default=4.0, help="bytes per weight byte when training")
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="bf16")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        max_memory: dict[int, Any] = {card: int(args.gpu_mem * GiB) for card in range(args.gpus)}
        max_memory.update(_parse_max_memory(args.max_memory))
        placement = plan_placement(
            planning_config(args.model)[1],
            list(range(args.gpus)),
            max_memory,
            dtype=TORCH_DTYPES[args.dtype],
            training=args.training,
            training_factor=args.training_factor,
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
        )
    except UserError as err:
        print(err, file=sys.stderr)
        return 2
    print(f"{args.model}: ", end="")
    print(format_placement(placement))
    return 0


if __name__ == "__main__":
    sys.exit(main())
