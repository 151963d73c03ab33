"""Memory planner: will a model train under ZeRO 1/2/3 on these cards? Reads only the config (meta device).

One module per job, imports pointing one way (arch <- setup <- activations, generation <- memory <- search <- tables
<- evaluation <- cli, and search <- fit): ``arch`` the model's shapes and parameter counts, ``setup`` the run to size
(from a preset or a RunPlan's decisions), ``activations`` what a micro-batch saves for backward, ``generation`` what
GRPO's sampling adds, ``memory`` ZeRO's states and the ``estimate``, ``search`` micro-batch / preset /
longest-sequence searches, ``tables`` the reports, ``evaluation`` how evaluation and sampling (generation only) hold
the model on the cards, ``fit`` the start-of-run check train.py calls, ``cli`` the command line (``python -m
deepzero.plan``). Formulas: docs/memory.md.

Every public name is importable from here (``from deepzero.plan import estimate``); its module loads on first use,
so a training start that imports ``deepzero.plan.fit`` never loads the tables or the command line.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {
    "arch": ("Arch", "ModelStats", "model_stats"),
    "setup": (
        "DS_CONFIG_DIR",
        "EngineTerms",
        "GrpoTerms",
        "LayerSplitLayout",
        "Layout",
        "PipelineLayout",
        "PlannedEngine",
        "SaverTerms",
        "Setup",
        "ZeroKnobs",
        "layer_split_cuts",
        "load_preset",
        "run_setup",
        "setup_from_ds_config",
    ),
    "activations": (
        "activation_bytes",
        "gathered_kv_bytes",
        "layer_activation_bytes",
        "logits_bytes",
        "mlp_tile_bytes",
        "offloaded_bytes",
        "sequence_mask_bytes",
    ),
    "generation": (
        "generation_bytes",
        "kv_cache_bytes",
        "kv_cache_width",
        "kv_layer_bytes",
        "prefill_bytes",
        "reference_copy_bytes",
        "sampling_logits_bytes",
    ),
    "memory": (
        "ADAM_K",
        "CUDA_RESERVE",
        "FRAGMENTATION",
        "HOST_PER_RANK",
        "Estimate",
        "GiB",
        "RankStates",
        "Share",
        "estimate",
        "four_bit_base_bytes",
        "four_bit_load_bytes",
        "gib",
        "host_bytes",
        "pipeline_parts",
        "rank_states",
        "shares",
    ),
    "search": (
        "COMPLETION_STEP",
        "MAX_MICRO_BATCH",
        "MAX_SEQ_SEARCH",
        "PRESET_ORDER",
        "SAVER_CHOICES",
        "SEQ_STEP",
        "LongestSeq",
        "Recommendation",
        "longest_seq_len",
        "longest_sequence",
        "longest_completion",
        "longest_completions",
        "longest_sequences",
        "generation_rows",
        "max_micro_batch",
        "recommend",
    ),
    "tables": (
        "LORA_RANK",
        "TABLE_ROWS",
        "fit_table",
        "format_table",
        "render",
        "render_grpo",
        "render_longest",
        "table_setups",
    ),
    "fit": ("check_fit", "detected_cpu_mem_gb", "detected_gpu_mem_gb", "generation_batch", "run_estimate"),
    "evaluation": (
        "DOES_NOT_FIT",
        "MODES",
        "CardBytes",
        "EvalPlan",
        "card_bytes",
        "plan_evaluation",
        "plan_evaluation_of",
        "render_evaluation",
        "unit_bytes",
    ),
    "cli": ("PAIR_ROWS", "main"),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    """A public name of one of the package's modules, loading that module on first use (PEP 562)."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
