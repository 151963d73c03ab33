"""Export a saved checkpoint to a Hugging Face folder, offline, on one CPU process:

    python -m deepzero.export runs/default --out runs/default/hf-fp32 [--tag step00000100] [--dtype bf16]

A ZeRO-1/2/3 checkpoint exports from its fp32 master weights (a LoRA run's adapters merged); a run over a 4-bit base
(QLoRA), whose checkpoints hold the adapters only, merges them into its 16-bit base read again from the model source,
shard by shard, as the run's own export does (``deepzero.adapters.merge``). The live engine's export at the end of
training is ``deepzero.hf_export``.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from deepzero.hf_export import publish_hf
from deepzero.precision import TORCH_DTYPES

# ------------------------------------------------------------------ offline export of a saved ZeRO checkpoint


def export_checkpoint(
    ckpt_dir: Path,
    out_dir: Path,
    tag: str | None = None,
    model_config: str | None = None,
    tokenizer: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[Path, int]:
    """Turn any ZeRO-1/2/3 checkpoint into a Hugging Face folder (safetensors) from its fp32 master weights (in
    ``dtype``, default fp32; a LoRA run's adapters merged).

    Works offline, on one CPU process, for any world size that wrote the checkpoint (DeepSpeed's zero_to_fp32).
    The architecture comes from ``model_config`` (a folder or a preset), else the run's ``hf/config.json``, else
    the ``--model`` recorded in the run's ``run_config.json``. A run over a 4-bit base exports as its own export
    does (:func:`export_four_bit_run`). Returns the folder and the number of tensors.
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
    run_config = _run_config(run_dir)
    run_args = run_config.get("args", {})
    tok = _export_tokenizer(run_dir, run_args, tokenizer, model_config, trust_remote_code)
    if run_config.get("four_bit"):
        if dtype is not None:
            raise UserError(
                f"--dtype {dtype}",
                "a run over a 4-bit base exports into its 16-bit base's own dtype",
                "drop --dtype",
            )
        return export_four_bit_run(ckpt_dir, tag, out_dir, run_config, tok, model_config)
    config, random_init = _export_config(run_dir, run_args, model_config, trust_remote_code)
    if random_init:
        config.vocab_size = len(tok)  # as the trainer built it (modeling.build_model)
    elif len(tok) > config.vocab_size:
        config.vocab_size = len(tok)
    state_dict = _fp32_state_dict(ckpt_dir, tag)
    target = TORCH_DTYPES[dtype or "fp32"]
    if run_args.get("lora"):  # peft's names (base_layer, lora_A/B): merged into the plain model's
        state_dict = _merged_lora_state(state_dict, run_args["lora"], config, ckpt_dir / tag)
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


def _run_config(run_dir: Path) -> dict[str, Any]:
    import json

    path = run_dir / "run_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _merged_lora_state(
    state_dict: dict[str, torch.Tensor], lora: str, config: Any, where: Path
) -> dict[str, torch.Tensor]:
    """A LoRA run's fp32 state dict (peft names) with its adapters merged, under the plain model's names."""
    from deepzero.adapters.lora import LoraSpec, lora_config, merged_model, resolve_targets
    from deepzero.errors import UserError

    spec = LoraSpec.parse(lora)
    with torch.device("meta"):
        targets = resolve_targets(AutoModelForCausalLM.from_config(copy.deepcopy(config)), spec)
    try:
        merged = merged_model(state_dict, lora_config(spec, targets), config)
    except RuntimeError as err:
        raise UserError(
            str(where),
            f"the LoRA weights do not fit the model config ({str(err).strip().splitlines()[-1][:200]})",
            "pass --model-config with the architecture that was trained",
        ) from None
    return merged.state_dict()


def export_four_bit_run(
    ckpt_dir: Path, tag: str, out_dir: Path, run_config: dict[str, Any], tokenizer: Any, model_config: str | None
) -> tuple[Path, int]:
    """A QLoRA checkpoint (the adapters only) merged into the 16-bit base read again from the run's model source
    (or ``model_config``), shard by shard: the same folders as the run's own export (``out_dir`` and
    ``<out_dir>-adapter``), the adapters taken as the engine held them (fp32 masters in the training dtype)."""
    from deepzero.adapters.lora import LoraSpec, is_adapter_param
    from deepzero.adapters.merge import Adapters, export_merged
    from deepzero.errors import UserError
    from deepzero.modeling import resolve_model

    args = run_config["args"]
    source = resolve_model(model_config or args["model"]).pretrained
    training = TORCH_DTYPES[run_config["precision"]["dtype"]]
    masters = _fp32_state_dict(ckpt_dir, tag)
    state = {k: v.to(training) for k, v in masters.items() if is_adapter_param(k)}
    spec = LoraSpec.parse(args["lora"])
    adapters = Adapters.from_state(state, spec.r, spec.lora_alpha, spec.dropout)
    probe = torch.tensor([tokenizer.encode("def export(checkpoint):\n    return merged")[:32] or [0]])
    if Path(str(source)).resolve() == (ckpt_dir.parent / "hf").resolve():
        raise UserError(
            f"--model-config {model_config}",
            "is the run's own export, where the adapters are merged already",
            "pass the 16-bit base the run trained on (its run_config.json names it)",
        )
    trained = {k.removeprefix("base_model.model."): v for k, v in masters.items() if not is_adapter_param(k)}
    report = export_merged(str(source), adapters, tokenizer, out_dir, probe, trained=trained)
    if not report.ok:
        raise UserError(report.path, report.why, "export from the model folder the run trained on (--model-config)")
    return Path(report.path), report.tensors


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


def _saved_dtype(folder: Path) -> str:
    """The dtype ``folder/config.json`` records, as --dtype names it (fp32, bf16, fp16)."""
    import json

    recorded = json.loads((folder / "config.json").read_text()).get("dtype") or "float32"
    names = {str(dtype).removeprefix("torch."): name for name, dtype in TORCH_DTYPES.items()}
    return names.get(recorded, recorded)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deepzero.export CKPT_DIR --out HF_DIR``: one line on success, ``error: ...`` and 2 on bad input."""
    import argparse

    from deepzero.errors import UserError

    parser = argparse.ArgumentParser(prog="python -m deepzero.export", description=export_checkpoint.__doc__)
    parser.add_argument("checkpoint", type=Path, help="run folder (--out of train.py) or its checkpoints folder")
    parser.add_argument("--tag", help="checkpoint to export (default: the one 'latest' names)")
    parser.add_argument("--out", type=Path, required=True, help="Hugging Face folder to write")
    parser.add_argument(
        "--model-config", help="folder with config.json, or a preset (default: from the run; QLoRA: the 16-bit base)"
    )
    parser.add_argument("--tokenizer", help="tokenizer folder or hub id (default: the one the run used)")
    parser.add_argument(
        "--dtype", choices=sorted(TORCH_DTYPES), help="dtype of the saved weights (default fp32; QLoRA: the base's)"
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="allow code from the model repo to run")
    args = parser.parse_args(argv)
    try:
        out, n = export_checkpoint(
            args.checkpoint, args.out, args.tag, args.model_config, args.tokenizer, args.dtype, args.trust_remote_code
        )
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"export: {n} tensors ({args.dtype or _saved_dtype(out)}) from {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
