"""Resolve ``--model`` and ``--tokenizer`` to Transformers objects: presets, local folders or hub ids."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from deepzero.errors import UserError, first_line
from deepzero.presets import PRESETS


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a random-init preset (from_config) or pretrained weights (from_pretrained)."""

    spec: str
    pretrained: str | None
    """Folder or hub id for from_pretrained; None for a random-init preset."""
    preset_config: PretrainedConfig | None = None
    """A random-init preset's config; for a preset naming a checkpoint, the offline stand-in used for the checks
    before weights load when the checkpoint's own config.json cannot be read."""

    @property
    def random_init(self) -> bool:
        return self.pretrained is None


def resolve_model(spec: str) -> ModelSource:
    """Turn ``--model`` into a source, without loading weights."""
    if spec in PRESETS:
        preset = PRESETS[spec]
        if preset.hub_id is None:
            return ModelSource(spec, None, preset.config())
        return ModelSource(spec, preset.hub_id, preset.config())
    path = Path(spec)
    if path.exists():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {spec}", "folder has no config.json", "point at a save_pretrained() folder")
        return ModelSource(spec, str(path))
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return ModelSource(spec, spec)
    raise UserError(
        f"--model {spec}", "not a preset, an existing folder, or an org/name hub id", f"presets: {', '.join(PRESETS)}"
    )


def load_config(source: ModelSource, trust_remote_code: bool = False) -> PretrainedConfig:
    """The model's config only (cheap): used for planning and checks before any weights load. A checkpoint's own
    config.json (RoPE scaling, special ids); a preset naming a checkpoint falls back to its stand-in offline."""
    if source.random_init:
        return source.preset_config
    try:
        return AutoConfig.from_pretrained(source.pretrained, trust_remote_code=trust_remote_code)
    except OSError as err:
        if source.preset_config is not None:
            return source.preset_config
        raise UserError(
            f"--model {source.spec}", f"cannot read its config ({first_line(err)})", _offline_fix()
        ) from None
    except ValueError as err:
        if "trust_remote_code" in str(err):
            raise UserError(
                f"--model {source.spec}",
                "needs custom code from the model repo",
                "pass --trust-remote-code if you trust it",
            ) from None
        raise


def planning_config(spec: str) -> tuple[str, PretrainedConfig]:
    """``--model`` for offline planning (plan, placement, doctor): a preset name or a preset's hub id (its config,
    no download), a local folder with config.json, or a hub id. Returns a display name and the config; no weights."""
    if spec in PRESETS:
        return spec, PRESETS[spec].config()
    for preset in PRESETS.values():
        if preset.hub_id == spec:
            return preset.name, preset.config()
    where = f"--model {spec}"
    if Path(spec).is_dir():
        if not (Path(spec) / "config.json").is_file():
            raise UserError(where, "folder has no config.json", "point at a save_pretrained() folder or use a preset")
        return Path(spec).name, AutoConfig.from_pretrained(spec)
    try:
        return spec, AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise UserError(
            where, f"cannot read its config ({first_line(err)})", f"use a preset name: {', '.join(PRESETS)}"
        ) from None


def load_tokenizer(spec: str, trust_remote_code: bool = False, where: str | None = None) -> PreTrainedTokenizerBase:
    """AutoTokenizer.from_pretrained with a clear error naming ``where`` the spec came from (default
    ``--tokenizer SPEC``); sets a pad token if the tokenizer has none."""
    try:
        tok = AutoTokenizer.from_pretrained(spec, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        where = where or f"--tokenizer {spec}"
        raise UserError(where, f"cannot load tokenizer {spec} ({first_line(err)})", _offline_fix()) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_model(
    source: ModelSource,
    config: PretrainedConfig,
    *,
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    experts_implementation: str | None = None,
    trust_remote_code: bool = False,
    quantization_config: Any = None,
    on_host: bool = False,
    device_map: Any = None,
    max_memory: dict[int, int] | None = None,
) -> torch.nn.Module:
    """Random-init presets are built in fp32 (DeepSpeed casts them); pretrained weights load in the training
    dtype, which halves host RAM per rank against fp32. For ZeRO-3 call ``zero3_context`` first.

    ``experts_implementation`` (MoE models only; None keeps Transformers' default) selects the experts kernel.
    ``quantization_config`` (pretrained weights only) loads a quantised base (``deepzero.adapters.quant``), into host RAM
    with ``on_host`` (Transformers' 4-bit loader otherwise puts it on the current card), or per ``device_map``
    (and ``max_memory``), accelerate's.
    """
    kwargs: dict[str, Any] = {"attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if on_host:
        kwargs["device_map"] = {"": "cpu"}
    elif device_map is not None:  # evaluation: accelerate's placement of a pretrained model
        kwargs["device_map"], kwargs["max_memory"] = device_map, max_memory
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    try:
        if source.random_init:
            if vocab_size is not None:
                config.vocab_size = vocab_size
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
        cpu_only = quantization_config is not None and not torch.cuda.is_available()  # a GPU host keeps its cores
        with one_thread() if cpu_only else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_pretrained(  # the checkpoint's own config.json, never a restated one
                source.pretrained, dtype=dtype, use_safetensors=_has_safetensors(source), **kwargs
            )
    except OSError as err:
        raise UserError(f"--model {source.spec}", f"cannot load weights ({first_line(err)})", _offline_fix()) from None
    except ValueError as err:
        if experts_implementation is None or "experts implementation" not in str(err):
            raise
        raise UserError(
            f"--experts-impl {experts_implementation}",
            f"not supported by this model's code ({first_line(err)})",
            "drop --experts-impl",
        ) from None
    if vocab_size is not None and vocab_size > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(vocab_size)
    return model


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread: bitsandbytes' CPU quantisation sums each weight's block maxima (its NF4 ``offset``, then
    the nested statistics) with torch's threaded reduction, whose last bits follow the thread count; on one thread
    the 4-bit base is the same bytes on any CPU-only host (tests/test_qlora.py). A GPU host quantising a large base
    in host RAM keeps every core (one thread would take several times as long)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters to ``dtype``; buffers keep their dtype, as DeepSpeed (>= 0.19.2) does:
    RoPE's ``inv_freq`` and V3's ``e_score_correction_bias`` stay fp32 (``model.to(bf16)`` would round them).
    Parameters ZeRO-3 has partitioned (``ds_id``) are DeepSpeed's: their data is an empty placeholder."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype and not hasattr(param, "ds_id"):
            param.data = param.data.to(dtype)


def zero3_context(ds_config: dict[str, Any]) -> object:
    """Keep the returned object alive for the whole run: it makes from_pretrained/from_config partition at load."""
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def _has_safetensors(source: ModelSource) -> bool | None:
    """Local folders must hold safetensors (no pickle loads); hub ids let Transformers pick safetensors first."""
    if source.pretrained and Path(source.pretrained).is_dir():
        if not any(Path(source.pretrained).glob("*.safetensors")):
            raise UserError(
                f"--model {source.spec}",
                "no .safetensors weights (pickled .bin weights are not loaded)",
                "convert them with save_pretrained(safe_serialization=True)",
            )
        return True
    return None


def _offline_fix() -> str:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return "HF_HUB_OFFLINE=1 is set: download it first or pass a local folder"
    return "check the name, run `huggingface-cli download <id>` first, or pass a local folder"


@contextlib.contextmanager
def zero3_init_off() -> Iterator[None]:
    """Transformers loads without zero.Init while this lasts: rank 0 alone saving and reloading (a collective there
    would deadlock), or a rank loading a 4-bit base on the host by itself (``deepzero.adapters.partitioned_load``)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved
