"""The start-of-run fit check (``check_fit``): plan what the run's engine will hold, and when it does not fit
the cards or the host, say by how much and what would."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from deepzero.errors import UserError
from deepzero.plan.arch import ModelStats, model_stats
from deepzero.plan.memory import Estimate, GiB, estimate, gib
from deepzero.plan.search import generation_rows, max_micro_batch, recommend
from deepzero.plan.setup import (
    GrpoTerms,
    LayerSplitLayout,
    PipelineLayout,
    PlannedEngine,
    SaverTerms,
    Setup,
    run_setup,
)

if TYPE_CHECKING:
    from deepzero.dsconfig import ResolvedConfig


def detected_gpu_mem_gb() -> float | None:
    """Smallest visible CUDA card in GiB, or None when the ranks do not train on CUDA."""
    from deepzero.distributed import on_cuda

    if not on_cuda():
        return None
    sizes = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    return min(sizes) / GiB


def detected_cpu_mem_gb() -> float | None:
    """Physical host RAM in GiB (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB
    except (ValueError, OSError, AttributeError):
        return None


def check_fit(
    model_config: PretrainedConfig,
    engine: PlannedEngine,
    cfg: ResolvedConfig,
    seq_len: int,
    *,
    world_size: int,
    pretrained: bool,
    gpu_mem_gb: float | None = None,
    cpu_mem_gb: float | None = None,
    savers: SaverTerms | None = None,
    rows_per_sample: int = 1,
) -> str | None:
    """A one-line warning when the planned run will not fit the cards (or host RAM), else None.

    Plans what the engine will hold (``run_setup``); a preference pair is ``rows_per_sample`` = 2 sequences per
    sample (the reference model is never on the cards: its log-probs are precomputed, or it is the same model
    with the LoRA adapters off). Call before loading weights. ``gpu_mem_gb`` None = detect
    the smallest visible card; without CUDA there is nothing to check and the answer is None. ``cpu_mem_gb``
    None = detect the machine's RAM.
    """
    if (memory := _memory(gpu_mem_gb, cpu_mem_gb)) is None:
        return None
    gpu_mem_gb, cpu_mem_gb, gpu_mem, cpu_mem = memory
    try:
        stats, est = run_estimate(model_config, engine, cfg, seq_len, world_size, pretrained, savers, rows_per_sample)
    except UserError:
        return None  # e.g. a layer split over every GPU with none visible: the engine reports it itself
    except (ValueError, KeyError, AttributeError) as err:  # e.g. a remote-code architecture
        return f"memory plan skipped: cannot build {model_config.model_type} on the meta device ({err})"
    if est.fits(gpu_mem, cpu_mem):
        return None
    shortfall = _shortfall(est, gpu_mem_gb, cpu_mem_gb, rows_per_sample)
    return f"{shortfall}; {_advice(stats, est.setup, gpu_mem, cpu_mem, rows_per_sample)}"


def run_estimate(
    model_config: PretrainedConfig,
    engine: PlannedEngine,
    cfg: ResolvedConfig,
    seq_len: int,
    world_size: int,
    pretrained: bool,
    savers: SaverTerms | None = None,
    rows_per_sample: int = 1,
) -> tuple[ModelStats, Estimate]:
    """The model's stats and the estimate of what the engine will hold for this run (:func:`check_fit`'s plan;
    bench/gpu_train.py sets it beside what a card measured). Raises what ``run_setup`` and ``model_stats`` raise."""
    setup = run_setup(model_config, engine, cfg, seq_len, world_size, pretrained, savers)
    setup = replace(setup, micro_batch=setup.micro_batch * rows_per_sample)
    name = getattr(model_config, "name_or_path", "") or "model"
    stats = model_stats(model_config, name, lora=engine.plan_terms().lora)
    return stats, estimate(stats, setup)


def generation_batch(
    model_config: PretrainedConfig,
    engine: PlannedEngine,
    cfg: ResolvedConfig,
    grpo: GrpoTerms,
    completion: int,
    *,
    world_size: int,
    pretrained: bool,
    most: int,
    savers: SaverTerms | None = None,
    gpu_mem_gb: float | None = None,
    cpu_mem_gb: float | None = None,
) -> int | None:
    """GRPO: the most of a rank's ``most`` completion rows one ``generate`` call can take beside training, with
    prompts of ``grpo.prompt_len`` and ``completion`` tokens (``generation_rows``); None without CUDA (nothing to
    fit: every row in one call) or where the model cannot be planned."""
    if (memory := _memory(gpu_mem_gb, cpu_mem_gb)) is None:
        return None
    gpu_mem, cpu_mem = memory[2:]
    seq_len = grpo.prompt_len + completion
    try:
        setup = run_setup(model_config, engine, cfg, seq_len, world_size, pretrained, savers)
        stats = model_stats(model_config, "model", lora=engine.plan_terms().lora)
    except (UserError, ValueError, KeyError, AttributeError):
        return None
    return generation_rows(stats, replace(setup, grpo=grpo), gpu_mem, cpu_mem, most)


def _memory(
    gpu_mem_gb: float | None, cpu_mem_gb: float | None
) -> tuple[float, float | None, float, float | None] | None:
    """The card's and host's GiB (detected where None) and bytes; None without a card (nothing to fit)."""
    if gpu_mem_gb is None:
        gpu_mem_gb = detected_gpu_mem_gb()
        if gpu_mem_gb is None:
            return None
    if cpu_mem_gb is None:
        cpu_mem_gb = detected_cpu_mem_gb()
    return gpu_mem_gb, cpu_mem_gb, gpu_mem_gb * GiB, cpu_mem_gb * GiB if cpu_mem_gb else None


def _micro_text(sequences: int, rows_per_sample: int) -> str:
    """A micro-batch as the user sets it: sequences, or pairs of them for a preference run."""
    if rows_per_sample == 1:
        return str(sequences)
    pairs = sequences // rows_per_sample
    return f"{pairs} pair{'s' * (pairs != 1)} ({sequences} sequences)"


def _shortfall(est: Estimate, gpu_mem_gb: float, cpu_mem_gb: float | None, rows_per_sample: int = 1) -> str:
    setup = est.setup
    if est.gpu_total > gpu_mem_gb * GiB:
        return (
            f"memory plan: {setup.label()} at micro-batch {_micro_text(setup.micro_batch, rows_per_sample)}, seq"
            f" {setup.seq_len} needs "
            f"~{gib(est.gpu_total)} GiB per GPU ({est.where}: params {gib(est.params)}, grads {gib(est.grads)}, "
            f"optimizer {gib(est.optimizer)}, activations {gib(est.activations)}, logits {gib(est.logits)}, "
            f"buffers {gib(est.buffers)}) but the cards have {gpu_mem_gb:.1f} GiB"
        )
    load = "pretrained weights" if setup.pretrained else "fp32 random-init models"
    what = "offloaded states" if est.host_states >= est.host_load else f"{load} while loading"
    procs = "1 process" if isinstance(setup.layout, LayerSplitLayout) else f"{setup.world_size} ranks"
    return (
        f"memory plan: {setup.label()} needs ~{gib(est.host)} GiB of host RAM for {procs} "
        f"({gib(max(est.host_states, est.host_load))} of it {what}) but the machine has {cpu_mem_gb:.0f} GiB"
    )


def _advice(stats: ModelStats, setup: Setup, gpu_mem: float, cpu_mem: float | None, rows_per_sample: int = 1) -> str:
    """What would fit: a smaller micro-batch (whole samples: a preference pair is ``rows_per_sample`` sequences),
    checkpointing in this layout, else the first ZeRO preset that fits."""
    mb = max_micro_batch(stats, setup, gpu_mem, cpu_mem) // rows_per_sample * rows_per_sample
    if mb:
        micro = _micro_text(mb, rows_per_sample)
        return f"micro-batch {micro} fits (raise gradient_accumulation_steps to keep the global batch)."
    layout = setup.layout
    ckpt, fix = None, ""
    if isinstance(layout, PipelineLayout) and not layout.checkpoint_interval:
        ckpt = replace(setup, checkpointing=True, layout=replace(layout, checkpoint_interval=1))
        fix = "set pipeline.activation_checkpoint_interval to 1."
    elif layout is None and not setup.checkpointing:
        ckpt, fix = replace(setup, checkpointing=True), "turn on gradient checkpointing."
    if ckpt is not None and max_micro_batch(stats, ckpt, gpu_mem, cpu_mem) >= rows_per_sample:
        return fix
    if isinstance(layout, LayerSplitLayout):
        return "split over more cards (--device-map-devices), or use a ZeRO preset with LoRA or offload."
    n = setup.world_size
    rec = recommend(
        stats,
        n,
        setup.seq_len,
        gpu_mem,
        cpu_mem,
        lora_rank=setup.lora_rank,
        pretrained=setup.pretrained,
        savers=setup.savers,
        min_micro=rows_per_sample,
        four_bit=setup.four_bit,
    )
    if rec is None:
        return "no ds_configs preset fits: use LoRA, a smaller model, shorter sequences or more cards."
    ckpt = " with gradient checkpointing" if rec.setup.checkpointing else ""
    ckpt += " and --activation-offload" if rec.setup.savers.offload and not setup.savers.offload else ""
    micro = _micro_text(rec.micro_batch, rows_per_sample)
    return f"try ds_configs/{rec.preset}.json{ckpt} at micro-batch {micro} (python -m deepzero.plan)."
