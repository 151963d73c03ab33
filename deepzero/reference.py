"""Reference log-probs of a preference run: computed once by the starting weights, before the first step, and kept
beside the run (``<out>/reference/``), so that no second model is ever on the cards.

Each data-parallel rank scores its share of every pair (chosen and rejected answers, summed over their target
tokens, in eval mode), the shares are summed over the ranks, and rank 0 publishes ``train.npy``, ``val.npy`` and
``reference.json`` by renaming a finished temp folder. ``reference.json`` records what the numbers depend on (the
model and its weight files or hub commit, the precision, the prepared rows); a later run or a resume reuses the
folder when that matches and stops with one line naming the difference when it does not. Rank 0 alone looks at
the folder and every rank follows its decision (and its numbers), so ranks that see ``<out>`` differently (a
node-local disk) never disagree into a collective that only some of them enter.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from huggingface_hub import try_to_load_from_cache

from deepzero.data import PreferenceDataset
from deepzero.data.dataset import SPLITS, load_meta, shard_files
from deepzero.distributed import rank0_decides
from deepzero.errors import UserError
from deepzero.losses.objectives import sequence_logps
from deepzero.modeling import resolve_model

FOLDER = "reference"
STAMP = "reference.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".json")
_ROW_KEYS = ("format_version", "format", "seq_len", "dtype", "vocab_size", "bos_token_id", "eos_token_id",
             "pad_token_id", "shards")  # fmt: skip
"""The meta.json keys that say how to read the rows; the rest (timings, paths, the inputs' fingerprint) is not
what the log-probs depend on."""


def stamp(model: str, random_init: bool, seed: int, precision: str, data_dir: Path | str) -> dict[str, Any]:
    """What the reference log-probs depend on: the starting weights (a folder's files, a hub model's commit, or
    the seed of a random init), the precision they run in, and the prepared rows."""
    return {
        "model": model,
        "weights": f"random init, seed {seed}" if random_init else _weights(model),
        "precision": precision,
        "data": _rows_digest(Path(data_dir)),
    }


def _weights(model: str) -> str:
    """A local folder's weight and config files; for a hub id (or a preset naming one) the commit Transformers
    loaded it from, read from the cache it loaded through (refs/main), so that a new upstream commit is a change."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        return _files_digest(folder)
    repo = resolve_model(model).pretrained or model
    config = try_to_load_from_cache(repo, "config.json")
    commit = Path(config).parent.name if isinstance(config, str) else None
    return f"hub {repo} at commit {commit}" if commit else f"hub {repo} (commit unknown: not in the local cache)"


def _files_digest(folder: Path) -> str:
    """Names, sizes and mtimes of a model folder's weight and config files."""
    digest = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.suffix in _WEIGHT_SUFFIXES:
            st = f.stat()
            digest.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _rows_digest(data_dir: Path) -> str:
    """The prepared rows themselves (every shard's token ids and loss masks, in order) and how to read them: the
    same data prepared again gives the same digest, whatever meta.json says about timings, paths or mtimes."""
    meta = load_meta(data_dir)
    digest = hashlib.sha256(json.dumps({k: meta.get(k) for k in _ROW_KEYS}, sort_keys=True).encode())
    for split in SPLITS:
        for shard in meta["shards"][split]:
            for path in shard_files(data_dir, shard["file"]):
                if path.is_file():
                    with path.open("rb") as f:
                        while block := f.read(1 << 24):
                            digest.update(block)
    return digest.hexdigest()[:16]


def attach(engine: Any, splits: dict[str, PreferenceDataset], out_dir: Path, expected: dict[str, Any]) -> str:
    """Give every split its reference log-probs (``dataset.reference``): loaded from ``out_dir/reference`` when its
    stamp matches ``expected``, else computed now by the engine's current (starting) weights and published there.
    Every rank calls it; rank 0 decides (and loads) and the others follow. Returns the header's line."""
    folder = out_dir / FOLDER
    pairs = {split: len(data) for split, data in splits.items()}
    kind, found = rank0_decides(lambda: _look(folder, pairs, expected))
    if kind == "refuse":
        raise UserError(*found)
    if kind == "reuse":
        for split, data in splits.items():
            data.reference = found[split]
        return f"reference: log-probs of the starting weights reused from {folder} ({_count(pairs)})"
    start = time.perf_counter()
    values = {split: score(engine, data) for split, data in splits.items()}
    if _rank() == 0:
        publish(folder, values, {**expected, "pairs": pairs})
    if dist.is_initialized():
        dist.barrier()
    for split, data in splits.items():
        data.reference = values[split]
    seconds = time.perf_counter() - start
    return f"reference: log-probs of the starting weights computed in {seconds:.1f} s ({_count(pairs)}) -> {folder}"


def _look(folder: Path, pairs: dict[str, int], expected: dict[str, Any]) -> tuple[str, Any]:
    """Rank 0's look at the folder: ``("reuse", arrays)``, ``("compute", None)`` or ``("refuse", UserError args)``."""
    if not (folder / STAMP).is_file():
        return "compute", None
    fix = f"pass the --model/--data/--precision they were computed for, or delete {folder} to recompute them"
    try:
        found = json.loads((folder / STAMP).read_text())
        changed = [k for k in expected if found.get(k) != expected[k]]
        if changed or found.get("pairs") != pairs:
            what = ", ".join(f"{k} {found.get(k)!r} -> {expected[k]!r}" for k in changed) or f"pairs -> {pairs}"
            problem = f"the reference log-probs were computed for other starting weights or data ({what})"
            return "refuse", (str(folder / STAMP), problem, fix)
        return "reuse", {split: np.load(folder / f"{split}.npy") for split in pairs}
    except (OSError, ValueError) as err:  # a damaged folder: the same line on every rank, not a hang on the others
        return "refuse", (str(folder), f"cannot be read ({type(err).__name__}: {err})", f"delete {folder} to recompute")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _count(pairs: dict[str, int]) -> str:
    return " + ".join(f"{n:,} {split}" for split, n in pairs.items()) + " pairs"


@torch.no_grad()
def score(engine: Any, data: PreferenceDataset) -> np.ndarray:
    """``[pairs, 2]`` float32: each pair's chosen and rejected log-probs under the engine's weights. Rank ``r`` of
    ``dp_size`` scores pairs ``r, r + dp_size, ...`` in micro-batches; every rank runs the same number of forwards
    (ZeRO-3's are collective), the last ones padded with pair 0 and dropped."""
    model = getattr(engine, "engine", engine)
    micro = int(model.train_micro_batch_size_per_gpu()) if hasattr(model, "train_micro_batch_size_per_gpu") else 1
    mine = list(range(engine.dp_rank, len(data), engine.dp_size))
    rounds = math.ceil(len(data) / engine.dp_size / micro)
    totals = torch.zeros(len(data), 2, dtype=torch.float64, device=engine.device)
    model.eval()
    for k in range(rounds):
        chunk = mine[k * micro : (k + 1) * micro]
        batch = PreferenceDataset.collate([data[i] for i in (chunk or [0])])
        logps, _ = sequence_logps(model, {key: v.to(engine.device) for key, v in batch.items()})
        if chunk:
            totals[chunk] = torch.stack(logps.chunk(2), dim=1)[: len(chunk)].double()
    model.train()
    if dist.is_initialized():
        dist.all_reduce(totals)
    return totals.float().cpu().numpy()


def publish(folder: Path, values: dict[str, np.ndarray], stamp_: dict[str, Any]) -> None:
    """Write the arrays and the stamp into a temp folder and rename it into place (a killed run publishes nothing)."""
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for split, array in values.items():
        np.save(tmp / f"{split}.npy", array)
    (tmp / STAMP).write_text(json.dumps(stamp_, indent=2) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
