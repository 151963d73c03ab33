"""Export to a Hugging Face folder (safetensors): the live engine at the end of training, checked by reloading it;
or, offline, any saved ZeRO-1/2/3 checkpoint from its fp32 master weights:

    python -m deepzero.export runs/default --out runs/default/hf-fp32 [--tag step00000100] [--dtype bf16]
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from deepzero.modeling import zero3_init_off
from deepzero.precision import TORCH_DTYPES, logit_tolerance

SAME_DEVICE_ULPS = 2.0
"""Engine and reload compute in the same dtype on the same CPU: they agree to rounding."""
CROSS_DEVICE_ULPS = 16.0
"""A 16-bit engine on a GPU and its CPU reload use different kernels: a few ulps per layer add up."""


@dataclass(frozen=True)
class ExportReport:
    path: str
    max_abs_logit_diff: float
    dtype: str
    tolerance: float = 1e-3
    """Largest |Δlogit| accepted, from the dtype, the logit scale and whether the engine ran on another device."""

    @property
    def ok(self) -> bool:
        return self.max_abs_logit_diff <= self.tolerance

    @property
    def why(self) -> str:
        """What failed, in one line (for a report that is not ``ok``)."""
        return (
            f"the reloaded export differs from the engine: max |Δlogit| {self.max_abs_logit_diff:.3g} > tolerance"
            f" {self.tolerance:.3g} ({self.dtype})"
        )

    @classmethod
    def measured(
        cls, out_dir: Path, diff: torch.Tensor, dtype: torch.dtype, engine_logits: torch.Tensor, engine_device: str
    ) -> ExportReport:
        """The report of :func:`publish_and_compare`'s result for an engine that ran on ``engine_device``."""
        ulps = SAME_DEVICE_ULPS if engine_device.startswith("cpu") else CROSS_DEVICE_ULPS
        tolerance = logit_tolerance(dtype, engine_logits, ulps)
        if dtype == torch.float32 and not engine_device.startswith("cpu"):
            tolerance = max(tolerance, 1e-3)  # fp32 GPU kernels reorder sums too
        return cls(str(out_dir), diff.max().item(), str(dtype).removeprefix("torch."), tolerance)


def consolidated_state_dict(engine: Any) -> dict[str, torch.Tensor] | None:
    """Full 16-bit weights on rank 0 (ZeRO-3 gathers partitions; a collective, so call it on every rank)."""
    if engine.zero_optimization_partition_weights():
        return engine._zero3_consolidated_16bit_state_dict()
    return engine.module.state_dict() if engine.global_rank == 0 else None


@torch.no_grad()
def export_hf(engine: Any, tokenizer: Any, out_dir: Path, probe: dict[str, torch.Tensor]) -> ExportReport | None:
    """Write ``out_dir`` atomically on rank 0, reload it with from_pretrained, compare logits with the engine."""
    engine_logits = eval_logits(engine, probe)
    state_dict = consolidated_state_dict(engine)
    report = None
    if engine.global_rank == 0:
        dtype = next(iter(state_dict.values())).dtype  # read first: save_pretrained may consume the dict
        attn = attn_implementation_of(engine.module)
        with zero3_init_off():
            diff = publish_and_compare(engine.module, tokenizer, out_dir, probe, engine_logits, dtype, attn, state_dict)
        report = ExportReport.measured(out_dir, diff, dtype, engine_logits, str(engine.device))
    if dist.is_initialized():
        dist.barrier()
    return report


@torch.no_grad()
def eval_logits(engine: Any, probe: dict[str, torch.Tensor]) -> torch.Tensor:
    """The engine's fp32 logits for ``probe`` in eval mode (a forward: under ZeRO-3 every rank must call it)."""
    was_training = engine.training
    engine.eval()
    logits = engine(input_ids=probe["input_ids"]).logits.float().cpu()
    if was_training:
        engine.train()
    return logits


def publish_and_compare(
    model: Any,
    tokenizer: Any,
    out_dir: Path,
    probe: dict[str, torch.Tensor],
    engine_logits: torch.Tensor,
    dtype: torch.dtype,
    attn_implementation: str,
    state_dict: dict | None = None,
) -> torch.Tensor:
    """Publish ``model`` (:func:`publish_hf`), reload it in ``dtype`` and return |reloaded − engine| logits."""
    publish_hf(model, tokenizer, out_dir, state_dict)
    return (reloaded_logits(out_dir, dtype, attn_implementation, probe) - engine_logits).abs()


def publish_hf(model: Any, tokenizer: Any, out_dir: Path, state_dict: dict | None = None) -> None:
    """save_pretrained (safetensors) and the tokenizer under ``<out>.partial``, then renamed to ``out_dir``:
    a crash mid-write never leaves a half-written folder under the final name."""
    tmp = out_dir.with_name(f"{out_dir.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


@torch.no_grad()
def reloaded_logits(out_dir: Path, dtype: torch.dtype, attn_implementation: str, probe: dict) -> torch.Tensor:
    """Logits of the exported folder, loaded by plain Transformers on the CPU, for ``probe``."""
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=dtype, attn_implementation=attn_implementation)
    reloaded.eval()
    return reloaded(input_ids=probe["input_ids"].cpu()).logits.float()


def attn_implementation_of(module: torch.nn.Module) -> str:
    """The attention kernel ``module`` was built with, to reload its export the same way."""
    return getattr(module.config, "_attn_implementation", None) or "sdpa"


# ------------------------------------------------------------------ offline export of a saved ZeRO checkpoint


def export_checkpoint(
    ckpt_dir: Path,
    out_dir: Path,
    tag: str | None = None,
    model_config: str | None = None,
    tokenizer: str | None = None,
    dtype: str = "fp32",
    trust_remote_code: bool = False,
) -> tuple[Path, int]:
    """Turn any ZeRO-1/2/3 checkpoint into a Hugging Face folder (safetensors) from its fp32 master weights.

    Works offline, on one CPU process, for any world size that wrote the checkpoint (DeepSpeed's zero_to_fp32).
    The architecture comes from ``model_config`` (a folder or a preset), else the run's ``hf/config.json``, else
    the ``--model`` recorded in the run's ``run_config.json``. Returns the folder and the number of tensors.
    """
    from deepzero.checkpoint import latest_tag
    from deepzero.errors import UserError
    from deepzero.universal import checkpoints_dir, is_universal

    ckpt_dir = checkpoints_dir(Path(ckpt_dir))
    run_dir = ckpt_dir.parent
    tag = tag or latest_tag(ckpt_dir)
    if tag is None:
        raise UserError(str(ckpt_dir), "no 'latest' file, so no checkpoint to export", "pass --tag stepNNNNNNNN")
    if not (ckpt_dir / tag).is_dir():
        raise UserError(str(ckpt_dir / tag), "no such checkpoint folder", f"pick a tag from {ckpt_dir}")
    if is_universal(ckpt_dir / tag):
        raise UserError(str(ckpt_dir / tag), "is a universal checkpoint", "export the ZeRO checkpoint it came from")
    run_args = _run_args(run_dir)
    config, random_init = _export_config(run_dir, run_args, model_config, trust_remote_code)
    tok = _export_tokenizer(run_dir, run_args, tokenizer, model_config, trust_remote_code)
    if random_init:
        config.vocab_size = len(tok)  # as the trainer built it (modeling.build_model)
    elif len(tok) > config.vocab_size:
        config.vocab_size = len(tok)
    state_dict = _fp32_state_dict(ckpt_dir, tag)
    target = TORCH_DTYPES[dtype]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=target, trust_remote_code=trust_remote_code)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    # parameters take the export dtype; buffers keep theirs (as in the trainer's own export)
    state_dict = {k: v.to(target) if k in params and v.is_floating_point() else v for k, v in state_dict.items()}
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as err:
        raise UserError(
            str(ckpt_dir / tag),
            f"weights do not fit the model config ({str(err).strip().splitlines()[-1][:200]})",
            "pass --model-config with the architecture that was trained",
        ) from None
    count = len(state_dict)
    publish_hf(model, tok, out_dir, state_dict)
    return out_dir, count


def _run_args(run_dir: Path) -> dict[str, Any]:
    import json

    path = run_dir / "run_config.json"
    return json.loads(path.read_text()).get("args", {}) if path.is_file() else {}


def _export_config(
    run_dir: Path, run_args: dict[str, Any], model_config: str | None, trust_remote_code: bool
) -> tuple[Any, bool]:
    """The model config and whether it is a random-init preset (its vocab then follows the tokenizer)."""
    from transformers import AutoConfig

    from deepzero.errors import UserError
    from deepzero.modeling import load_config, resolve_model

    if model_config is None and (run_dir / "hf" / "config.json").is_file():
        return AutoConfig.from_pretrained(run_dir / "hf", trust_remote_code=trust_remote_code), False
    spec = model_config or run_args.get("model")
    if spec is None:
        raise UserError(
            str(run_dir), "no run_config.json or hf/config.json to take the architecture from", "pass --model-config"
        )
    source = resolve_model(spec)
    return copy.deepcopy(load_config(source, trust_remote_code)), source.random_init


def _export_tokenizer(
    run_dir: Path, run_args: dict[str, Any], tokenizer: str | None, model_config: str | None, trust_remote_code: bool
) -> Any:
    """--tokenizer, else the run's hf/ export, else what the run trained with (its --tokenizer, data, or model)."""
    from deepzero.data import load_meta
    from deepzero.errors import UserError
    from deepzero.modeling import load_tokenizer

    spec = tokenizer
    if spec is None and (run_dir / "hf" / "tokenizer_config.json").is_file():
        spec = str(run_dir / "hf")
    if spec is None and run_args.get("tokenizer"):
        spec = run_args["tokenizer"]
    if spec is None and run_args.get("data"):
        try:
            spec = load_meta(run_args["data"]).get("tokenizer")
        except UserError:
            spec = None
    spec = spec or model_config or run_args.get("model")
    if spec is None:
        raise UserError(str(run_dir), "cannot tell which tokenizer the run used", "pass --tokenizer")
    return load_tokenizer(spec, trust_remote_code)


def _fp32_state_dict(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's zero_to_fp32: merge every rank's fp32 master partition (ZeRO-1/2/3) into full tensors."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from deepzero.errors import UserError

    try:
        with contextlib.redirect_stdout(sys.stderr):  # zero_to_fp32 prints progress on stdout
            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    except Exception as err:  # truncated files, missing ranks, pipeline layouts: DeepSpeed raises many types
        raise UserError(
            str(ckpt_dir / tag),
            f"not a readable ZeRO checkpoint ({type(err).__name__}: {str(err).strip()[:200]})",
            "export a complete checkpoint (see 'latest'); pipeline checkpoints export at the end of training",
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deepzero.export CKPT_DIR --out HF_DIR``: one line on success, ``error: ...`` and 2 on bad input."""
    import argparse

    from deepzero.errors import UserError

    parser = argparse.ArgumentParser(prog="python -m deepzero.export", description=export_checkpoint.__doc__)
    parser.add_argument("checkpoint", type=Path, help="run folder (--out of train.py) or its checkpoints folder")
    parser.add_argument("--tag", help="checkpoint to export (default: the one 'latest' names)")
    parser.add_argument("--out", type=Path, required=True, help="Hugging Face folder to write")
    parser.add_argument("--model-config", help="folder with config.json, or a preset (default: from the run)")
    parser.add_argument("--tokenizer", help="tokenizer folder or hub id (default: the one the run used)")
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="fp32", help="dtype of the saved weights")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow code from the model repo to run")
    args = parser.parse_args(argv)
    try:
        out, n = export_checkpoint(
            args.checkpoint, args.out, args.tag, args.model_config, args.tokenizer, args.dtype, args.trust_remote_code
        )
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"export: {n} tensors ({args.dtype}) from {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
