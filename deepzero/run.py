"""A training run before its loop: planned from the arguments (cheap checks first), then built (group, engine).

``plan_run`` makes every decision that needs no weights and no process group, so bad input fails in seconds;
``setup`` joins the group, builds the engine the plan chose and returns the ``Run`` the loop works on.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepzero import (
    checkpoint,
    checkpoint_storage,
    dsconfig,
    engines,
    methods,
    modeling,
    moe_balance,
    preemption,
    report,
    schedule,
    universal,
    val_split,
)
from deepzero import sequence_parallel as sp
from deepzero.adapters import quant
from deepzero.adapters.lora import LoraSpec, check_moe_targets, check_same_adapters
from deepzero.args import TrainArgs
from deepzero.data import PackedDataset, check_enough_rows, load_meta, open_split
from deepzero.data.tokenizer import check_data_tokenizer, plan_tokenizer
from deepzero.distributed import init_distributed
from deepzero.engines import EngineSettings, TrainEngine
from deepzero.engines.zero import local_values
from deepzero.errors import UserError, warn
from deepzero.flops import flops_per_token, peak_tflops, routed_experts
from deepzero.losses.objectives import PreferenceSettings
from deepzero.memory_savers import MemorySavers
from deepzero.metrics import MetricsSink, redact
from deepzero.op_builds import check_op_builds, lock_report
from deepzero.plan import SaverTerms, check_fit, model_stats
from deepzero.precision import check_fp16_range, fp16_risk
from deepzero.presets import PRESETS
from deepzero.watchdog import phase


@dataclass(frozen=True)
class RunPlan:
    """Every decision that needs no weights and no process group: made first, so bad input fails in seconds."""

    source: modeling.ModelSource
    config: Any
    cfg: dsconfig.ResolvedConfig
    engine_settings: EngineSettings
    lr_source: str
    seq_len: int
    train_data: PackedDataset
    val_data: PackedDataset | None
    tokenizer: Any
    balance: moe_balance.BalanceChoice
    """MoE load balancing (--moe-balance and the model family)."""
    savers: MemorySavers
    """Tiled loss, offloaded checkpoints, tiled MLP (the long-sequence flags, the model and the sequence length)."""
    preference: PreferenceSettings | None = None
    """The preference loss of a preference data folder (None: the LM loss)."""
    grpo: Any = None
    """GRPO's settings for a prompts data folder (``deepzero.losses.grpo.settings.GRPOSettings``; None: no GRPO)."""
    rewards: Any = None
    """GRPO's rewards (``deepzero.rollout.rewards.RewardSet``), parsed and imported at plan time."""
    four_bit: quant.FourBit | None = None
    """The 4-bit base under the LoRA adapters (--load-in-4bit; None: the base in the training precision)."""


@dataclass
class Run:
    """Everything ``setup`` built: the engine, the data, and the numbers the loop reports."""

    args: TrainArgs
    cfg: dsconfig.ResolvedConfig
    engine: TrainEngine
    tokenizer: Any
    train_data: PackedDataset
    val_data: PackedDataset | None
    state: checkpoint.TrainState
    sink: MetricsSink
    lr_source: str
    seq_len: int
    flops_per_token: float
    peak_tflops: float | None
    rank: int = 0
    world: int = 1
    history: list[dict[str, Any]] = field(default_factory=list)
    last_saved_step: int = -1
    """Step of the checkpoint this run last wrote or resumed from (the final save is skipped when it is current)."""
    balancer: moe_balance.Balancer | None = None
    """Router hooks of a DeepSeek MoE: load counts, balance losses, the V3 bias update (None: no routers)."""
    savers: MemorySavers | None = None
    """The long-sequence decision (tiled loss, offloaded checkpoints, tiled MLP), for the header."""
    reference_line: str | None = None
    """How a preference run got its reference log-probs, for the header."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch.global_batch * self.train_data.rows_per_sample * self.seq_len


def plan_run(args: TrainArgs, world: int) -> RunPlan:
    """Resolve the preset against the real world size, check data and model against each other."""
    check_writable(args.out_dir)
    check_op_builds()
    if args.resume:
        check_same_adapters(args.out_dir / "run_config.json", args.lora, args.load_in_4bit)
    meta = load_meta(args.data)
    source = modeling.resolve_model(args.model)
    config = modeling.load_config(source, args.trust_remote_code)
    if args.lora is not None:
        check_moe_targets(LoraSpec.parse(args.lora), config, routed_experts(config))
    preset = PRESETS.get(args.model)
    from_scratch = preset is not None and preset.hub_id is None and preset.pretrain_lr is not None
    scratch_warmup = from_scratch and args.lr is None and args.warmup_steps is None
    default_lr, default_lr_source = None, "the fine-tuning default"
    if from_scratch:
        default_lr, default_lr_source = preset.pretrain_lr, f"model preset {args.model}, random init"
    elif args.lora is not None:
        default_lr, default_lr_source = schedule.lora_default_lr(meta.get("format") == "prompts")
    elif meta.get("format") == "prompts":  # GRPO
        default_lr, default_lr_source = methods.grpo.GRPO_LR, "TRL 1.16's GRPO default"
    hints = dsconfig.TrainingHints(  # the preset's lr is what "lr": "auto" means; a number in the JSON wins
        max_steps=args.max_steps,
        lr=args.lr,
        default_lr=default_lr,
        default_lr_source=default_lr_source,
        warmup_steps=preset.pretrain_warmup_steps if scratch_warmup else args.warmup_steps,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        hidden_size=config.hidden_size,
        lr_schedule=args.lr_schedule,
    )
    if args.experts_impl is not None and not routed_experts(config):
        raise UserError(
            f"--experts-impl {args.experts_impl}",
            f"--model {args.model} is a dense model (no routed experts)",
            "drop --experts-impl",
        )
    balance = moe_balance.choose(config, args.moe_balance, args.moe_bias_rate, args.moe_aux_alpha)
    preference = methods.preference.plan(args, meta)
    grpo, rewards = methods.grpo.plan(args, meta, config)
    settings = methods.preference.engine(choose_engine(args), preference, args.deepspeed_config)
    settings = methods.grpo.engine(settings, grpo, args.seed)
    sequence = sequence_size(settings)
    overrides = [*args.ds, f"sequence_parallel_size={sequence}"] if sequence > 1 else args.ds  # zero.Init reads it
    resolve = partial(dsconfig.resolve, args.deepspeed_config, settings.dp_size(world), overrides=overrides,
                      precision=args.precision)  # fmt: skip
    generations = grpo.num_generations if grpo else None
    fine_tune = not from_scratch and not schedule.kept_on_resume(args)  # a resumed WarmupLR run keeps it
    cfg, args.max_steps = schedule.resolve_steps(args, hints, meta, generations, resolve, fine_tune)
    if warning := schedule.never_peaks(cfg.ds.get("scheduler"), args.max_steps):
        warn(warning)
    settings.check_batch(cfg.batch)
    four_bit = plan_four_bit(args, settings, cfg, source, config)
    if isinstance(settings, engines.ZeroSettings) and settings.lora is not None:  # its export reads the base again
        settings = dataclasses.replace(settings, four_bit=four_bit, base_source=source.pretrained)
    methods.grpo.check_batch(grpo, cfg.batch)
    if cfg.precision_choice.changed:
        warn(f"{cfg.precision_choice.describe()}. Fix: pass --precision to choose another")
    if not source.random_init and (risk := fp16_risk(config, cfg.precision_choice, args.model)):
        warn(risk)
    lr_source = cfg.lr_source
    seq_len = int(meta["seq_len"])
    if seq_len > config.max_position_embeddings:
        raise UserError(
            f"{args.data}/meta.json",
            f"seq_len {seq_len} exceeds the model's max_position_embeddings {config.max_position_embeddings}",
            f"re-run data/prepare.py with --seq-len {config.max_position_embeddings} or less",
        )
    tokenizer = plan_tokenizer(args, meta)
    check_data_tokenizer(args, meta, source)
    vocab = len(tokenizer) if source.random_init else max(len(tokenizer), config.vocab_size)  # make_model's embedding
    train_data = open_split(args.data, "train", documents=args.packing == "documents", vocab_size=vocab)
    check_enough_rows(len(train_data), cfg.batch.global_batch // (grpo.num_generations if grpo else 1), "train")
    val_data = val_split.usable(args, meta, cfg.batch, vocab)
    check_disk(args, config, cfg.precision, four_bit is not None)
    if args.resume:
        ranks = settings.dp_size(world) * sequence  # ZeRO: every rank
        checkpoint.check_resumable(args.checkpoint_dir, ranks, four_bit is not None)
    else:
        check_not_a_finished_run(args)
    pipeline = isinstance(settings, engines.PipelineSettings)
    savers = MemorySavers.choose(args, config, seq_len, pipeline=pipeline, vocab_size=vocab)
    terms = SaverTerms.of(savers)
    if warning := check_fit(
        config,
        settings,
        cfg,
        seq_len,
        world_size=world,
        pretrained=not source.random_init,
        savers=terms,
        rows_per_sample=train_data.rows_per_sample,
    ):
        warn(warning)
    methods.grpo.plan_generation_batch(
        grpo, args, meta, config, settings, cfg, world_size=world, pretrained=not source.random_init, savers=terms
    )
    return RunPlan(
        source,
        config,
        cfg,
        settings,
        lr_source,
        seq_len,
        train_data,
        val_data,
        tokenizer,
        balance,
        savers,
        preference,
        grpo,
        rewards,
        four_bit,
    )


def plan_four_bit(
    args: TrainArgs,
    settings: EngineSettings,
    cfg: dsconfig.ResolvedConfig,
    source: modeling.ModelSource,
    config: Any = None,
) -> quant.FourBit | None:
    """A 4-bit base from --load-in-4bit or the preset's "quantization" section (the flag first), or one line."""
    section = dsconfig.owned_section(args.deepspeed_config, args.ds, quant.SECTION)
    return quant.choose(
        quant.requested(args.load_in_4bit, section, args.deepspeed_config),
        zero_engine=isinstance(settings, engines.ZeroSettings),
        lora=args.lora is not None,
        pretrained=not source.random_init,
        stage=cfg.zero_stage,
        precision=cfg.precision,
        offload_param="param" in cfg.offload,
        hierarchical=int(cfg.ds.get("zero_optimization", {}).get("zero_hpz_partition_size") or 1) > 1,
        expert_targets=args.lora is not None and "experts" in LoraSpec.parse(args.lora).targets,
        quantized_source=getattr(config, "quantization_config", None) is not None,
        fused_experts=routed_experts(config) > 0 and not args.trust_remote_code,  # remote code: nn.Linear experts
    )


def check_disk(args: TrainArgs, config: Any, precision: str, four_bit: bool = False) -> None:
    """Free space for ``keep_last`` checkpoints and the export (one error line when not even one fits, else a
    warning), and on rank 0 whether a SIGTERM save can finish within the launcher's grace (docs/reliability.md)."""
    stats = model_stats(config)
    param_bytes = 4 if precision == "fp32" else 2
    trainable = 0 if args.lora else stats.total  # LoRA: the adapters' optimizer state is negligible
    stored = 0 if four_bit else stats.total  # a 4-bit base is read again from the source, never saved
    ckpt_bytes = checkpoint_storage.checkpoint_bytes(stored, trainable, param_bytes)
    export_bytes = stats.total * param_bytes if args.export else 0
    message = checkpoint_storage.check_disk_space(args.out_dir, ckpt_bytes, args.keep_last, export_bytes)
    if message:
        warn(message)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = ckpt_bytes * int(os.environ.get("LOCAL_WORLD_SIZE", world)) // max(world, 1)
    fast_disk = 5e9  # bytes/s: when even this disk could not miss the deadline, skip measuring (64 MB written)
    if os.environ.get("RANK", "0") == "0" and preemption.deadline_warning(per_node, fast_disk, 0.0):
        speed = checkpoint_storage.measure_write_speed(args.checkpoint_dir, 64 << 20)
        if message := preemption.deadline_warning(per_node, speed, step_seconds=0.0):
            warn(message)


def choose_engine(args: TrainArgs) -> EngineSettings:
    """The way to use the cards, from the preset's "pipeline" section (after --ds overrides) and the flags."""
    raw = dsconfig.load_json(args.deepspeed_config)
    dsconfig.apply_overrides(raw, list(args.ds), args.deepspeed_config)
    lora = LoraSpec.parse(args.lora) if args.lora is not None else None
    return engines.choose(
        raw,
        args.deepspeed_config,
        args.device_map,
        args.device_map_devices,
        args.gradient_checkpointing,
        lora,
        args.sequence_parallel,
    )


def sequence_size(settings: EngineSettings) -> int:
    """Ranks per sequence the engine settings chose (1: whole rows on every rank)."""
    return getattr(settings, "sequence_parallel", 1)


def check_not_a_finished_run(args: TrainArgs) -> None:
    """One line when ``--out`` already holds checkpoints and ``--resume`` was not given: a new run there would save
    over them (a step it reaches replaces the old one, and older ones are pruned)."""
    if args.resume or (tag := checkpoint.latest_tag(args.checkpoint_dir)) is None:
        return
    raise UserError(
        f"--out {args.out_dir}",
        f"already holds a run's checkpoints (latest {tag}), which a new run there would replace",
        "pass --resume to continue that run, or another --out (or remove the folder) to start a new one",
    )


def check_writable(out_dir: Path) -> None:
    """Fail before any work when the run folder cannot be written (a file in the way, no permission, read-only).

    Creates nothing: an existing folder is probed with a temporary file, a new one by its nearest existing parent.
    """
    try:
        if out_dir.is_dir():
            with tempfile.TemporaryFile(dir=out_dir):
                return
        parent = out_dir.absolute()
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(parent))
    except OSError as err:
        raise UserError(
            f"--out {out_dir}",
            f"cannot write the run folder ({err.strerror})",
            "pass a folder you can write to with --out",
        ) from None


def setup(args: TrainArgs) -> Run:
    """Validate everything cheap first (preset, data, model config), then join the group and build the engine."""
    plan = plan_run(args, int(os.environ.get("WORLD_SIZE", "1")))
    if args.resume:  # the first resume after `python -m deepzero.universal` loads the universal checkpoint
        universal.configure_resume(plan.cfg.ds, args.checkpoint_dir)
    rank, world = init_distributed()
    checkpoint_storage.check_shared_storage(args.checkpoint_dir, plan.cfg.ds, plan.cfg.path)
    torch.manual_seed(args.seed)
    with phase("loading the weights and building the DeepSpeed engine (its ops may compile)", detail=lock_report):
        engine = plan.engine_settings.build(partial(make_model, args, plan), plan.cfg.ds, plan.seq_len)
    reference_line = methods.preference.attach(args, plan, engine)  # before any step or checkpoint: the start
    if plan.grpo is not None:  # the prompts, tokenizer and rewards; a frozen copy of the starting weights (beta > 0)
        methods.grpo.attach(engine, plan, args.out_dir)
    balancer = moe_balance.attach(
        engine.model,
        plan.balance,
        partial(grad_scale, engine, plan.cfg.batch.accum),
        engine.device,
        getattr(engine, "sequence", None),  # SP: the routers see slices; the balance loss sums over the group
    )
    state = checkpoint.load(engine, args.checkpoint_dir) if args.resume else checkpoint.TrainState()
    sequence = sequence_size(plan.engine_settings)
    run_config = {
        "args": vars(args),
        "deepspeed": plan.cfg.ds,
        "lr_source": plan.lr_source,
        "precision": plan.cfg.precision_choice.to_json(),
        "moe_balance": plan.balance.to_json(),
        "memory_savers": plan.savers.to_json(),
        "four_bit": plan.four_bit.to_json() if plan.four_bit else None,
        "objective": engine.objective.to_json(),
        "sequence_parallel": {
            "size": sequence,
            "data_parallel": plan.cfg.batch.dp_size,
            "method": sp.METHOD if sequence > 1 else "off",
            "cut": sp.CUT if sequence > 1 else "off",
        },
        "env": redact(report.launch_env()),
    }
    run = Run(
        args=args,
        cfg=plan.cfg,
        engine=engine,
        tokenizer=plan.tokenizer,
        train_data=plan.train_data,
        val_data=plan.val_data,
        state=state,
        sink=MetricsSink(args.out_dir, args.report_to, run_config, enabled=rank == 0),
        lr_source=plan.lr_source,
        seq_len=plan.seq_len,
        flops_per_token=flops_per_token(engine.model, plan.seq_len),
        peak_tflops=peak_tflops(args.peak_tflops),
        rank=rank,
        world=world,
        last_saved_step=state.step if args.resume else -1,
        balancer=balancer,
        savers=plan.savers,
        reference_line=reference_line,
    )
    if run.is_main:
        report.write_run_config(args.out_dir, run_config)
        report.print_header(run, plan.source.spec)
    return run


def make_model(args: TrainArgs, plan: RunPlan) -> nn.Module:
    """The Hugging Face model the plan names, in the training dtype, without a KV cache (training only)."""
    model = modeling.build_model(
        plan.source,
        plan.config,
        vocab_size=len(plan.tokenizer),
        dtype=plan.cfg.precision_choice.torch_dtype,
        attn_implementation=args.attn_implementation,
        experts_implementation=args.experts_impl,
        trust_remote_code=args.trust_remote_code,
        quantization_config=plan.four_bit.bnb_config() if plan.four_bit else None,
        on_host=plan.four_bit is not None and plan.four_bit.load_on_host,
    )
    if plan.four_bit is not None and plan.four_bit.experts:
        quant.quantise_experts(model, plan.four_bit)
    model.config.use_cache = False
    plan.savers.apply(model)
    model.train()  # from_pretrained returns it in eval mode (dropout off, routers' training hooks idle)
    if not plan.source.random_init and plan.cfg.precision == "fp16" and plan.four_bit is None:
        check_fp16_range(model, args.model, local_values)
    return model


def grad_scale(engine: TrainEngine, accum: int) -> float:
    """What the engine multiplies each micro-batch's loss by before backward: 1/accumulation steps (DeepSpeed's
    ``engine.backward``, the layer split) × the fp16 loss scale (a host float: reading it waits for nothing)."""
    return (engine.loss_scale() or 1.0) * getattr(engine, "gradient_factor", 1.0) / accum  # ZeRO-3 under SP: N
