"""LoRA adapters through peft (``--lora r=16,alpha=32,targets=attn``), and the merged Hugging Face export.

What LoRA can target in these models (transformers 5.24, peft 0.21):

- ``nn.Linear`` layers, by name (peft ``target_modules``). In DeepSeek-V2/V3: the MLA projections (``q_proj``, or
  ``q_a_proj``/``q_b_proj`` when ``q_lora_rank`` is set; ``kv_a_proj_with_mqa``, ``kv_b_proj``), ``o_proj``, and
  ``gate_proj``/``up_proj``/``down_proj`` of the dense MLP layers (the first ``first_k_dense_replace``) and of the
  shared experts.
- The routed experts are no ``nn.Linear`` in transformers 5: each MoE layer holds them as two fused 3-D parameters,
  ``mlp.experts.gate_up_proj`` ``[n_experts, 2 × moe_intermediate, hidden]`` and ``mlp.experts.down_proj``. peft
  reaches those through ``target_parameters`` (its ``ParamWrapper``: rank r per expert, no dropout); here that is the
  ``experts`` group. It trains and merges under ZeRO-2 and ZeRO-3 (peft reads ``ds_shape``).
- Never targeted: the router (``mlp.gate``, a ``TopkRouter`` module, not Linear), the embeddings and ``lm_head``.

Targets are module names (``o_proj``, or dotted suffixes like ``self_attn.o_proj``) or groups resolved per
architecture against what exists: ``attn`` (the default), ``mlp`` and, for MoE models, ``experts``.

peft 0.21 on transformers 5 rewrites ``gate_proj``/``up_proj``/``down_proj`` targets of DeepSeek/Qwen-MoE models into
the fused expert parameters (so adapters trained on transformers 4 still load) and drops them from ``target_modules``,
which silently leaves the dense and shared-expert Linears out (huggingface/peft#3711). New adapters here name
transformers-5 modules, so :func:`apply_lora` switches that remap off while injecting and then checks that exactly
the resolved modules were wrapped.

Order in the trainer: build the model (under ZeRO-3 inside HfDeepSpeedConfig, so partitioned at load), then
:func:`apply_lora`, then ``deepspeed.initialize`` with only the parameters that require grad. The adapters are
created after ``zero.Init`` has ended; DeepSpeed's ZeRO-3 engine partitions them at ``initialize``. At the end every
rank calls the exporter ``exporters.lora_exporter`` chose: a plain HF folder with merged weights under the original
names, loadable without peft, merged from the base's own files shard by shard where it has them.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepzero.adapters.peft_compat import no_v4_target_remap
from deepzero.errors import UserError
from deepzero.flops import count_params

FLAG = "--lora"
KEYS = ("r", "alpha", "dropout", "targets")
EXAMPLE = "r=16,alpha=32,dropout=0.0,targets=attn"

_DEEPSEEK = {
    "attn": ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
_LLAMA = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
GROUPS: dict[str, dict[str, tuple[str, ...]]] = {
    "deepseek_v2": _DEEPSEEK,
    "deepseek_v3": _DEEPSEEK,
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "mistral": _LLAMA,
}
"""Linear-layer groups per ``model_type``; any other model type gets the Llama names."""

EXPERTS = "experts"
EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj")
"""The ``experts`` group: the routed experts' fused 3-D parameters (peft ``target_parameters``)."""


@dataclass(frozen=True)
class LoraSpec:
    """The ``--lora`` value: rank, scaling, dropout and targets (group names or module names)."""

    r: int = 16
    alpha: float | None = None
    """LoRA alpha; the update is scaled by alpha / r. Default: 2 × r."""
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attn",)

    @property
    def lora_alpha(self) -> float:
        return float(2 * self.r if self.alpha is None else self.alpha)

    @classmethod
    def parse(cls, text: str) -> LoraSpec:
        """``r=16,alpha=32,dropout=0.0,targets=q_a_proj,q_b_proj,o_proj``: names after ``targets=`` run to the end
        or to the next ``key=``. Every key is optional."""
        fields: dict[str, list[str]] = {}
        key: str | None = None
        for token in (t.strip() for t in text.split(",")):
            if not token:
                continue
            if "=" in token:
                key, _, value = token.partition("=")
                key = key.strip()
                if key not in KEYS:
                    close = difflib.get_close_matches(key, KEYS, n=1)
                    hint = f"did you mean '{close[0]}'? " if close else ""
                    raise UserError(f"{FLAG} {text}", f"unknown key '{key}'", f"{hint}keys: {', '.join(KEYS)}")
                if key in fields:
                    raise UserError(f"{FLAG} {text}", f"'{key}' given twice", "give each key once")
                fields[key] = [value.strip()] if value.strip() else []
            elif key == "targets":
                fields[key].append(token)
            else:
                raise UserError(
                    f"{FLAG} {text}", f"'{token}' is not key=value", f"only targets= takes a list; e.g. {EXAMPLE}"
                )
        spec = cls(
            r=_number(fields, "r", int, text) if "r" in fields else 16,
            alpha=_number(fields, "alpha", float, text) if "alpha" in fields else None,
            dropout=_number(fields, "dropout", float, text) if "dropout" in fields else 0.0,
            targets=tuple(fields["targets"]) if "targets" in fields else ("attn",),
        )
        spec.check(text)
        return spec

    def check(self, where: str) -> None:
        """Range checks that need no model."""
        if self.r < 1:
            raise UserError(f"{FLAG} {where}", f"r must be a positive integer, got {self.r}", "e.g. r=16")
        if self.alpha is not None and self.alpha <= 0:
            raise UserError(f"{FLAG} {where}", f"alpha must be positive, got {self.alpha:g}", "e.g. alpha=32")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"{FLAG} {where}", f"dropout must be in [0, 1), got {self.dropout:g}", "e.g. dropout=0.05")
        if not self.targets:
            raise UserError(f"{FLAG} {where}", "targets= names nothing", "e.g. targets=attn or targets=attn,mlp")
        for target in self.targets:
            if target.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens"):
                raise UserError(
                    f"{FLAG} targets={target}",
                    "lm_head is not adapted (embeddings and lm_head stay frozen)",
                    "drop it from targets: they name the decoder's Linear layers (attn, mlp, experts or module names)",
                )
        if EXPERTS in self.targets and self.dropout:
            raise UserError(
                f"{FLAG} {where}",
                "LoRA on the fused routed experts (targets=experts) cannot use dropout (peft ParamWrapper)",
                "set dropout=0.0 or drop 'experts' from targets",
            )

    def describe(self) -> str:
        return f"r={self.r},alpha={self.lora_alpha:g},dropout={self.dropout:g},targets={','.join(self.targets)}"


def _number(fields: dict[str, list[str]], key: str, kind: type, text: str) -> Any:
    values = fields[key]
    raw = values[0] if values else ""
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise UserError(f"{FLAG} {text}", f"{key} must be {what}, got '{raw}'", f"e.g. {EXAMPLE}") from None


def linear_names(model: torch.nn.Module) -> list[str]:
    """Full names of every ``nn.Linear`` LoRA may wrap (the output embedding / ``lm_head`` excluded)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and m is not out and not name.endswith("lm_head")
    ]


def expert_param_names(model: torch.nn.Module) -> list[str]:
    """Full names of the routed experts' fused 3-D parameters (empty for dense models)."""
    return [name for name, p in model.named_parameters() if is_fused_expert(name, p)]


def is_fused_expert(name: str, param: torch.Tensor) -> bool:
    """Whether the parameter ``name`` is a routed-experts' fused 3-D tensor (its full shape under ZeRO-3)."""
    return any(_matches(name, t) for t in EXPERT_PARAMS) and len(getattr(param, "ds_shape", param.shape)) == 3


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith(f".{target}")


@dataclass(frozen=True)
class Targets:
    """What peft wraps: Linear leaf names (``target_modules``) and fused expert parameters (``target_parameters``)."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...] = ()

    def wrapped_modules(self, model: torch.nn.Module) -> list[str]:
        """The full names of the Linear layers these targets select in ``model``."""
        return [n for n in linear_names(model) if any(_matches(n, t) for t in self.modules)]


def check_moe_targets(spec: LoraSpec, config: Any, routed_experts: int) -> None:
    """Before any weight loads, on a model with routed experts: its router (``gate``) is no Linear to adapt, and peft
    exports ``gate_proj`` and ``up_proj`` adapters as one fused ``gate_up_proj`` (its transformers-5 conversion), so
    naming one without the other trains and then fails the export: one line each."""
    if routed_experts and "gate" in {t.rsplit(".", 1)[-1] for t in spec.targets}:
        raise UserError(
            f"{FLAG} targets={','.join(spec.targets)}",
            f"'gate' is the {getattr(config, 'model_type', 'MoE')} router (not nn.Linear): routers are never adapted",
            "use gate_proj for the MLP's gate projection, or targets=experts for the routed experts",
        )
    named = {t.rsplit(".", 1)[-1] for t in spec.targets} & {"gate_proj", "up_proj"}
    if routed_experts and len(named) == 1:
        (one,) = named
        other = "up_proj" if one == "gate_proj" else "gate_proj"
        kind = getattr(config, "model_type", "this MoE")
        raise UserError(
            f"{FLAG} targets={','.join(spec.targets)}",
            f"names {one} without {other}: on a {kind} model peft exports the two as one fused gate_up_proj and"
            " cannot convert one alone (the export would fail after training)",
            f"add {other} (targets={','.join(spec.targets)},{other}), or use targets=mlp",
        )


def resolve_targets(model: torch.nn.Module, spec: LoraSpec) -> Targets:
    """Groups keep only the names present in ``model``; an explicit name must match at least one Linear."""
    linears = linear_names(model)
    experts = expert_param_names(model)
    groups = GROUPS.get(getattr(model.config, "model_type", ""), _LLAMA)
    leaf_names = sorted({n.rsplit(".", 1)[-1] for n in linears})
    group_names = [*groups, EXPERTS] if experts else list(groups)
    available = f"Linear layers here: {', '.join(leaf_names[:10])}; groups: {', '.join(group_names)}"
    modules: list[str] = []
    parameters: list[str] = []
    for target in spec.targets:
        if target == EXPERTS:
            if not experts:
                raise UserError(f"{FLAG} targets={target}", "this model has no fused routed experts", available)
            parameters += EXPERT_PARAMS
        elif target in groups:
            present = [n for n in groups[target] if any(_matches(m, n) for m in linears)]
            if not present:
                raise UserError(f"{FLAG} targets={target}", "this group matches no Linear layer here", available)
            modules += present
        elif any(_matches(m, target) for m in linears):
            modules.append(target)
        else:
            raise UserError(f"{FLAG} targets={target}", _why_not(model, target, leaf_names), available)
    return Targets(tuple(dict.fromkeys(modules)), tuple(dict.fromkeys(parameters)))


def _why_not(model: torch.nn.Module, target: str, leaf_names: list[str]) -> str:
    """Why ``target`` names no Linear layer: lm_head, a fused expert parameter, another module type, or nothing."""
    if _matches("lm_head", target):
        return "lm_head is not adapted (embeddings and lm_head stay frozen)"
    if any(_matches(n, target) for n, _ in model.named_parameters()) and target.rsplit(".", 1)[-1] in (
        e.rsplit(".", 1)[-1] for e in EXPERT_PARAMS
    ):
        return (
            f"'{target}' is a fused 3-D routed-expert parameter in transformers 5, not nn.Linear; use targets=experts"
        )
    kinds = sorted({type(m).__name__ for n, m in model.named_modules() if n and _matches(n, target)})
    if any("Experts" in k for k in kinds):
        return f"'{target}' holds the routed experts as fused 3-D parameters (not nn.Linear); use targets=experts"
    if kinds:
        return f"'{target}' is a {', '.join(kinds)}, not nn.Linear"
    close = difflib.get_close_matches(target, leaf_names, n=1)
    return f"'{target}' matches no module" + (f" (did you mean '{close[0]}'?)" if close else "")


def lora_config(spec: LoraSpec, targets: Targets, full_names: list[str] | None = None) -> Any:
    """The peft LoraConfig for ``spec`` (plain LoRA: no DoRA, no rsLoRA, no bias, no modules_to_save), targeting
    ``targets``' leaf names or, given, exactly the modules ``full_names``."""
    from peft import LoraConfig

    return LoraConfig(
        r=spec.r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.dropout,
        target_modules=list(full_names if full_names is not None else targets.modules),
        target_parameters=list(targets.parameters) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """``peft.get_peft_model`` with the targets taken literally (no transformers-4 rewrite)."""
    from peft import get_peft_model

    with no_v4_target_remap():
        return get_peft_model(model, config)


@dataclass(frozen=True)
class LoraSummary:
    """What :func:`apply_lora` wrapped and how many parameters now train."""

    modules: tuple[str, ...]
    parameters: tuple[str, ...]
    wrapped_linear: int
    """Linear layers that received an adapter."""
    wrapped_experts: int
    """Fused routed-expert parameters that received an adapter."""
    trainable: int
    total: int

    def describe(self, spec: LoraSpec) -> str:
        share = 100.0 * self.trainable / max(1, self.total)
        experts = f" + {self.wrapped_experts} fused expert tensors" if self.wrapped_experts else ""
        return (
            f"lora: {spec.describe()} (scale {spec.lora_alpha / spec.r:g}) on {self.wrapped_linear} Linear layers"
            f" [{', '.join(self.modules)}]{experts}; trainable {self.trainable:,} of {self.total:,} params"
            f" ({share:.2f}%)"
        )


def apply_lora(model: torch.nn.Module, spec: LoraSpec, verbose: bool = True) -> torch.nn.Module:
    """Wrap ``model`` with peft LoRA adapters; only adapter weights keep requires_grad. Call before
    ``deepspeed.initialize`` (under ZeRO-3 the model may already be partitioned by zero.Init: that is fine)."""
    if is_lora(model):
        raise RuntimeError("apply_lora: the model already carries peft adapters")
    targets = resolve_targets(model, spec)
    expected_linear = targets.wrapped_modules(model)
    expected_experts = [n for n in expert_param_names(model) if any(_matches(n, t) for t in targets.parameters)]
    # a parametrised module (4-bit experts: ``experts.parametrizations.down_proj``) would match a leaf name: full names
    parametrised = any(".parametrizations." in n for n, _ in model.named_modules())
    peft_model = wrap(model, lora_config(spec, targets, expected_linear if parametrised else None))
    base = peft_model.get_base_model()
    linear = sorted(
        n for n, m in base.named_modules() if hasattr(m, "lora_A") and isinstance(_base_layer(m), torch.nn.Linear)
    )
    experts = [n for n, m in base.named_modules() if type(m).__name__ == "ParamWrapper"]
    if linear != sorted(expected_linear) or len(experts) != len(expected_experts):
        raise RuntimeError(
            f"peft wrapped {len(linear)} Linear layers and {len(experts)} expert tensors, expected"
            f" {len(expected_linear)} and {len(expected_experts)} (targets {targets})"
        )
    counts = count_params(peft_model)
    trainable, total = counts.trainable, counts.total
    summary = LoraSummary(targets.modules, targets.parameters, len(linear), len(experts), trainable, total)
    peft_model._deepzero_lora = summary
    if verbose and _rank() == 0:
        print(summary.describe(spec), flush=True)
    return peft_model


def _base_layer(module: torch.nn.Module) -> torch.nn.Module:
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def is_lora(module: torch.nn.Module) -> bool:
    """True for a peft-wrapped model (what :func:`apply_lora` returns)."""
    return hasattr(module, "peft_config") and hasattr(module, "merge_and_unload")


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merged_model(state_dict: dict[str, torch.Tensor], peft_config: Any, base_config: Any) -> torch.nn.Module:
    """A plain HF model with the adapters merged in, from a full peft state dict (e.g. the engine's consolidated
    16-bit one). Built on the meta device and filled with ``assign=True``: no second copy of the weights, no
    random init. Non-persistent buffers (rotary tables) stay on meta: fit for save_pretrained, not for forward."""
    from transformers import AutoModelForCausalLM

    dtype = next(iter(state_dict.values())).dtype
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(copy.deepcopy(base_config), dtype=dtype)
        peft_model = wrap(base, copy.deepcopy(peft_config))
    result = peft_model.load_state_dict(state_dict, strict=False, assign=True)
    tied = set(getattr(base, "_tied_weights_keys", None) or ())
    missing = [k for k in result.missing_keys if k.removeprefix("base_model.model.") not in tied]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"LoRA export: state dict mismatch, missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    merged = peft_model.merge_and_unload(progressbar=False, safe_merge=True)
    if getattr(merged.config, "tie_word_embeddings", False):
        merged.tie_weights()
    return merged


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def check_same_adapters(run_config: Path, lora: str | None, load_in_4bit: bool | None) -> None:
    """A resumed run must train the adapters its checkpoint holds (``run_config``: the run's ``run_config.json``):
    another rank, alpha, dropout, targets or 4-bit base is one line naming the key and both values."""
    import json

    if not run_config.is_file():
        return
    saved, where = json.loads(run_config.read_text()).get("args", {}), str(run_config)
    before, now = saved.get("lora"), lora
    if (before is None) != (now is None):
        raise UserError(
            f"--resume ({where})",
            f"the run trained {'LoRA adapters' if before else 'every weight'}, this launch asks"
            f" {'--lora ' + str(now) if now else 'no --lora'}",
            f"pass {'--lora ' + before if before else 'no --lora'} to resume it, or another --out",
        )
    if before is not None:
        a, b = LoraSpec.parse(before), LoraSpec.parse(now)
        for key, x, y in (
            ("r", a.r, b.r),
            ("alpha", a.lora_alpha, b.lora_alpha),
            ("dropout", a.dropout, b.dropout),
            ("targets", a.targets, b.targets),
        ):
            if x != y:
                raise UserError(
                    f"--resume ({where})",
                    f"--lora {key} was {x!r}, now {y!r}: the checkpoint's adapters are another model",
                    f"pass --lora {before} to resume it, or another --out",
                )
    was = saved.get("load_in_4bit")
    if was is not None and load_in_4bit is not None and bool(was) != bool(load_in_4bit):
        raise UserError(
            f"--resume ({where})",
            f"load_in_4bit was {bool(saved.get('load_in_4bit'))}, now {bool(load_in_4bit)}: another base",
            "pass the same --load-in-4bit, or another --out",
        )
