"""Trained LoRA adapters merged into the 16-bit base shard by shard, and the adapters alone in peft's format.

The base is never held whole: each safetensors shard of the model source is read tensor by tensor, every adapted
weight becomes W + (alpha / r) · B · A (summed in fp32, rounded once to W's dtype), the output shard is written
under the same file name and freed before the next one. Host memory stays near one shard plus the adapters, whatever
the model's size. The index, config.json and generation_config.json are the source's own (a quantisation section
removed); the tokenizer is written by its ``save_pretrained``.

The check reads the written files again, one tensor at a time: every adapted tensor must equal the source's own
tensor plus its adapter's product to the dtype's rounding, every other tensor its source byte for byte. Where the
base is small (``LOGIT_CHECK_BYTES``) the merged folder is also loaded by plain Transformers and its logits compared
with the source loaded by stock peft with the written adapter folder applied unmerged: the round trip a user makes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepzero.adapters.logit_check import TokenGaps, round_trip_logits, tolerance_for
from deepzero.errors import UserError, first_line

ADAPTER_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")
"""An adapter tensor's name, as the engine's peft model holds it or as peft saves it."""
LOGIT_CHECK_BYTES = 4 << 30
"""Bases up to this size also get the logit round trip (it holds the merged model and the base at once)."""
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
COPIED_FILES = ("generation_config.json",)
FIX_SOURCE = "export from the 16-bit model folder or hub id the run trained on (its run_config.json names it)"
EXPORT_SHARDS = 4
"""Shards of the base this export holds at once, as the planner counts it (``plan.memory.export_host_bytes``):
measured about 3-4.4 (the input mapped, the output being built, its write; bench/export_memory)."""


@dataclass(frozen=True)
class Adapters:
    """LoRA adapters by the module they adapt: A [r, in] and B [out, r] in fp32, scaled by alpha / r."""

    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    r: int
    alpha: float
    dropout: float = 0.0
    saved: dict[str, torch.Tensor] = field(default_factory=dict)
    """Whole modules the run changed outside its adapters, by tensor name (``model.layers.1.mlp.gate.weight`` and its
    ``e_score_correction_bias``: V3's router, whose bias balancing moves): peft's ``modules_to_save``, so the adapter
    folder on its base is the model that was trained."""

    @property
    def saved_modules(self) -> list[str]:
        return sorted({name.rsplit(".", 1)[0] for name in self.saved})

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], r: int, alpha: float, dropout: float = 0.0) -> Adapters:
        """From adapter tensors named as the engine's peft model (or a ZeRO checkpoint of it) names them."""
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in state.items():
            match = ADAPTER_KEY.match(name)
            if match is None:
                raise ValueError(f"not a LoRA adapter tensor: {name}")
            halves.setdefault(match["module"], {})[match["which"]] = tensor.detach().float().cpu()
        if broken := [m for m, h in halves.items() if set(h) != {"A", "B"}]:
            raise ValueError(f"adapters without both A and B: {broken[:3]}")
        return cls({m: (h["A"], h["B"]) for m, h in sorted(halves.items())}, r, float(alpha), dropout)

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def delta(self, module: str) -> torch.Tensor:
        """(alpha / r) · B · A in fp32: what merging adds to ``module``'s weight."""
        a, b = self.pairs[module]
        return self.scale * (b @ a)

    def merged(self, module: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` + the adapter's product, summed in fp32 and rounded once to ``weight``'s dtype."""
        return (weight.float() + self.delta(module)).to(weight.dtype)

    def peft_config(self, source: str) -> Any:
        """peft's LoraConfig naming every adapted module by its full path (never by a leaf name that peft's
        transformers-4 → 5 rewrite could reinterpret: the form huggingface/peft#3715 keeps as written)."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.pairs),
            modules_to_save=self.saved_modules or None,
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=source,
        )

    def peft_state(self) -> dict[str, torch.Tensor]:
        """The tensors under the names peft saves (``base_model.model.<module>.lora_A.weight``)."""
        out = {}
        for module, (a, b) in self.pairs.items():
            out[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
            out[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        for name, tensor in self.saved.items():
            out[f"base_model.model.{name}"] = tensor.detach().cpu().contiguous()
        return out

    def with_routers(self, trained: dict[str, torch.Tensor], weight: Any) -> Adapters:
        """These adapters plus, as modules to save, every router whose routing bias is in ``trained`` (base names),
        with its weight (``weight(name)``: the tensor of that name)."""
        saved = {}
        for name, tensor in trained.items():
            if name.endswith(ROUTING_BIAS):
                module = name.removesuffix(f".{ROUTING_BIAS}")
                saved[name] = tensor
                saved[f"{module}.weight"] = weight(f"{module}.weight")
        return dataclasses.replace(self, saved=saved)


ROUTING_BIAS = "e_score_correction_bias"


def read_tensor(files: BaseFiles, name: str) -> torch.Tensor:
    """One tensor of the base's files, by name (the index says which shard; else each shard is looked in)."""
    for shard in files.shards:
        with safe_open(shard, framework="pt") as f:
            if name in f.keys():  # noqa: SIM118
                return f.get_tensor(name)
    raise UserError(str(files.shards[0].parent), f"the base's files hold no {name}", FIX_SOURCE)


def write_adapter(adapters: Adapters, source: str, folder: Path) -> None:
    """``folder`` in peft's format (adapter_config.json, adapter_model.safetensors), published atomically."""
    tmp = folder.with_name(f"{folder.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    adapters.peft_config(source).save_pretrained(tmp)
    save_file(adapters.peft_state(), tmp / "adapter_model.safetensors", metadata={"format": "pt"})
    _publish(tmp, folder)


@dataclass(frozen=True)
class BaseFiles:
    """The safetensors weights of a model source: its shards (one file, or those an index names) and its config."""

    shards: list[Path]
    index: Path | None
    config: Path

    @property
    def bytes(self) -> int:
        return sum(p.stat().st_size for p in self.shards)


def base_files(source: str) -> BaseFiles:
    """The source's files on this machine: a local folder, or a hub id's files in the local cache (downloaded if
    the hub is reachable). One line when it has no safetensors weights."""
    from transformers.utils import cached_file

    def find(name: str) -> Path | None:
        try:
            found = cached_file(source, name, _raise_exceptions_for_missing_entries=False)
        except (OSError, ValueError) as err:  # a missing folder read as a malformed hub id, no hub, ...
            raise UserError(source, f"cannot read the 16-bit base ({first_line(err)})", FIX_SOURCE) from None
        return Path(found) if found else None

    config = find("config.json")
    if config is not None and "quantization_config" in json.loads(config.read_text()):
        raise UserError(source, "is a quantised checkpoint, not the 16-bit base to merge into", FIX_SOURCE)
    index = find(INDEX_FILE)
    if index is not None:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        shards = [find(name) for name in names]
        if any(s is None for s in shards):
            raise UserError(str(index), "names shards that are not there", "download the whole model folder")
        return BaseFiles([s for s in shards if s is not None], index, config or index.with_name("config.json"))
    single = find(SINGLE_FILE)
    if single is None or config is None:
        raise UserError(
            source,
            "holds no safetensors weights (model.safetensors or its index), which the export merges shard by shard",
            "save the 16-bit base with save_pretrained (safetensors) and export again",
        )
    return BaseFiles([single], None, config)


@dataclass
class MergeCheck:
    """What the export checked, and what it measured, for the ``[export]`` record."""

    tensors: int = 0
    merged: int = 0
    """Adapted tensors, each equal to W + (alpha / r) · B · A to its dtype's rounding."""
    unchanged: int = 0
    """Every other tensor, byte-equal to the source's."""
    buffers: int = 0
    """Buffers written as the run trained them (V3's routing bias), equal to the engine's."""
    moved: int = 0
    """Adapted tensors whose merge changed at least one element (0: the adapters are below the dtype's rounding)."""
    largest_shard_bytes: int = 0
    base_bytes: int = 0
    logit_check: str = "skipped"
    problems: list[str] = field(default_factory=list)


def merge_files(files: BaseFiles, adapters: Adapters, out: Path, trained: dict[str, torch.Tensor]) -> MergeCheck:
    """Every shard of ``files`` with ``adapters`` merged, written to ``out`` under its own name, one at a time; a
    tensor named in ``trained`` (buffers the run changed: V3's routing bias) is written as trained, in its dtype."""
    check = MergeCheck(base_bytes=files.bytes, largest_shard_bytes=max(p.stat().st_size for p in files.shards))
    placed: set[str] = set()
    for shard in files.shards:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(shard, framework="pt") as f:
            metadata = f.metadata() or {"format": "pt"}
            for key in f.keys():  # noqa: SIM118 (safe_open is no dict)
                tensor = f.get_tensor(key)
                module = key.removesuffix(".weight")
                if key.endswith(".weight") and module in adapters.pairs:
                    tensor = adapters.merged(module, tensor)
                    placed.add(module)
                elif key in trained:
                    tensor = trained[key].to(tensor.dtype)
                tensors[key] = tensor
        save_file(tensors, out / shard.name, metadata=metadata)
        del tensors
    if missing := sorted(set(adapters.pairs) - placed):
        raise UserError(
            str(files.shards[0].parent),
            f"the base's files hold no weight for {len(missing)} adapted modules (e.g. {missing[0]}.weight)",
            "export from the model folder the run trained on (its run_config.json names it)",
        )
    if files.index is not None:
        shutil.copyfile(files.index, out / INDEX_FILE)
    config = json.loads(files.config.read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in COPIED_FILES:
        if (extra := files.config.with_name(name)).is_file():
            shutil.copyfile(extra, out / name)
    return check


def check_files(
    files: BaseFiles, adapters: Adapters, out: Path, check: MergeCheck, trained: dict[str, torch.Tensor]
) -> MergeCheck:
    """Read the written shards again beside the source's, one tensor at a time (see the module docstring)."""
    for shard in files.shards:
        with safe_open(shard, framework="pt") as source, safe_open(out / shard.name, framework="pt") as written:
            if set(source.keys()) != set(written.keys()):
                check.problems.append(f"{shard.name}: other tensor names than the source's")
                continue
            for key in source.keys():  # noqa: SIM118
                check.tensors += 1
                original, exported = source.get_tensor(key), written.get_tensor(key)
                module = key.removesuffix(".weight")
                if key.endswith(".weight") and module in adapters.pairs:
                    if not _within_rounding(exported, original.float() + adapters.delta(module)):
                        check.problems.append(f"{key} is not W + (alpha/r)·B·A")
                    check.merged += 1
                    check.moved += int(not torch.equal(exported, original))
                elif key in trained:
                    check.buffers += 1
                    if not torch.equal(exported, trained[key].to(original.dtype)):
                        check.problems.append(f"{key} is not the run's trained buffer")
                elif exported.dtype != original.dtype or not torch.equal(exported, original):
                    check.problems.append(f"{key} differs from the source's")
                else:
                    check.unchanged += 1
    return check


def _within_rounding(exported: torch.Tensor, exact: torch.Tensor) -> bool:
    """Every element of ``exported`` is ``exact`` rounded to ``exported``'s dtype (half an ulp, with slack)."""
    if exported.shape != exact.shape:
        return False
    ulp = torch.finfo(exported.dtype).eps * exact.abs().clamp(min=torch.finfo(exported.dtype).tiny)
    return bool(((exported.float() - exact).abs() <= ulp).all())


@dataclass(frozen=True)
class MergedExport(TokenGaps):
    """The ``[export]`` record of a merge into the 16-bit base."""

    path: str
    adapter_path: str
    dtype: str
    tensors: int
    merged_tensors: int
    moved_tensors: int
    unchanged_tensors: int
    trained_buffers: int
    """Buffers written as the run trained them (V3's routing bias), not the source's."""
    base_bytes: int
    largest_shard_bytes: int
    peak_host_bytes: int
    """The exporting process's largest resident memory above its level when the export began (sampled)."""
    logit_check: str
    peft: str
    """How stock peft reads the adapter folder (the logit check's finding; "not checked" without it)."""
    max_abs_logit_diff: float | None
    tolerance: float
    """A token's allowed max |Δlogit| (``logit_check``: scaled to the dtype and the logits)."""
    problems: tuple[str, ...]
    compared_with: str = "the source's tensors plus the adapters (each tensor), and stock peft unmerged (logits)"

    @property
    def ok(self) -> bool:
        return not self.problems and (self.max_abs_logit_diff is None or self.logits_ok)

    @property
    def why(self) -> str:
        """What failed, in one line (for a report that is not ``ok``)."""
        if self.problems:
            return f"the merged files are not the base plus the adapters ({'; '.join(self.problems[:3])})"
        return self.logits_why("the merged folder's logits differ from the base with the adapter folder unmerged")


def export_merged(
    source: str,
    adapters: Adapters,
    tokenizer: Any,
    out_dir: Path,
    input_ids: torch.Tensor,
    attn: str = "sdpa",
    logit_check_bytes: int = LOGIT_CHECK_BYTES,
    trained: dict[str, torch.Tensor] | None = None,
) -> MergedExport:
    """``out_dir`` (the merged model, plain Transformers) and ``<out_dir>-adapter`` (peft) from the source's files,
    checked, each published atomically. One process; host memory near one shard plus the adapters. ``trained``:
    the run's persistent buffers under the files' names (those the files hold are written as trained)."""
    trained = trained or {}
    files = base_files(source)
    adapter_dir = out_dir.with_name(f"{out_dir.name}-adapter")
    tmp = out_dir.with_name(f"{out_dir.name}.partial")
    with peak_rss() as peak:  # the merge's own memory (the logit check below holds two whole small models)
        write_adapter(adapters.with_routers(trained, partial(read_tensor, files)), source, adapter_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        check = merge_files(files, adapters, tmp, trained)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        check = check_files(files, adapters, tmp, check, trained)
    if check.problems:  # left under its .partial name for a look, never published
        out_dir = tmp
    else:
        _publish(tmp, out_dir)
    dtype = _dtype_of(files)
    gaps: dict[str, Any] = {"max_abs_logit_diff": None, "tolerance": tolerance_for(dtype, torch.ones(()))}
    note = "not checked"
    if check.base_bytes <= logit_check_bytes and not check.problems:
        vocab = json.loads((out_dir / "config.json").read_text()).get("vocab_size")
        ids = input_ids.cpu()
        ids = ids[:, ids[0] < vocab] if vocab else ids  # tokens added beyond the base's vocabulary are not in it
        gaps, note = round_trip_logits(out_dir, source, set(adapters.pairs), adapter_dir, ids, attn)
        check.logit_check = "merged folder vs the source with the adapter folder applied by peft, unmerged"
    else:
        check.logit_check = f"skipped: the base is {check.base_bytes / 2**30:.1f} GiB (> {logit_check_bytes >> 30} GiB)"
    return MergedExport(
        path=str(out_dir),
        adapter_path=str(adapter_dir),
        dtype=str(dtype).removeprefix("torch."),
        tensors=check.tensors,
        merged_tensors=check.merged,
        moved_tensors=check.moved,
        unchanged_tensors=check.unchanged,
        trained_buffers=check.buffers,
        base_bytes=check.base_bytes,
        largest_shard_bytes=check.largest_shard_bytes,
        peak_host_bytes=peak.bytes,
        logit_check=check.logit_check,
        peft=note,
        problems=tuple(check.problems[:5]),
        **gaps,
    )


def _dtype_of(files: BaseFiles) -> torch.dtype:
    """The dtype of the source's first floating-point weight (what the merged tensors are rounded to)."""
    for shard in files.shards:
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118
                if (t := f.get_slice(key)).get_dtype() in ("BF16", "F16", "F32"):
                    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[t.get_dtype()]
    return torch.float32


def _publish(tmp: Path, final: Path) -> None:
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


class _Peak:
    bytes = 0


@contextmanager
def peak_rss(interval: float = 0.005) -> Iterator[_Peak]:
    """This process's largest resident memory above its level at entry, sampled every ``interval`` seconds."""
    peak, stop = _Peak(), threading.Event()
    start = _rss()

    def sample() -> None:
        while not stop.is_set():
            peak.bytes = max(peak.bytes, _rss() - start)
            time.sleep(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
        peak.bytes = max(peak.bytes, _rss() - start)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
