"""Reference log-probs of a preference run: computed once by the starting weights, before the first step, and kept
beside the run (``<out>/reference/``), so that no second model is ever on the cards.

Each data-parallel rank scores its share of every pair (chosen and rejected answers, summed over their target
tokens, in eval mode), the shares are summed over the ranks, and rank 0 publishes ``train.npy``, ``val.npy`` and
``reference.json`` by renaming a finished temp folder. ``reference.json`` records what the numbers depend on (the
model and its weight files, the precision, the data folder's meta.json); a later run or a resume reuses the folder
when that matches and stops with one line naming the difference when it does not.
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

from deepzero.data import PreferenceDataset
from deepzero.errors import UserError
from deepzero.losses.objectives import sequence_logps

FOLDER = "reference"
STAMP = "reference.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".json")


def stamp(model: str, random_init: bool, seed: int, precision: str, data_dir: Path | str) -> dict[str, Any]:
    """What the reference log-probs depend on: the starting weights (the model's files, or the seed of a random
    init), the precision they run in, and the prepared data (its meta.json)."""
    return {
        "model": model,
        "weights": f"random init, seed {seed}" if random_init else _files_digest(Path(model).expanduser()),
        "precision": precision,
        "data": hashlib.sha256((Path(data_dir) / "meta.json").read_bytes()).hexdigest()[:16],
    }


def _files_digest(folder: Path) -> str:
    """Names, sizes and mtimes of a model folder's weight and config files (a hub id: the id alone)."""
    if not folder.is_dir():
        return "hub id"
    digest = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.suffix in _WEIGHT_SUFFIXES:
            st = f.stat()
            digest.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def attach(engine: Any, splits: dict[str, PreferenceDataset], out_dir: Path, expected: dict[str, Any]) -> str:
    """Give every split its reference log-probs (``dataset.reference``): loaded from ``out_dir/reference`` when its
    stamp matches ``expected``, else computed now by the engine's current (starting) weights and published there.
    Every rank calls it. Returns the header's line."""
    folder = out_dir / FOLDER
    if (folder / STAMP).is_file():
        found = json.loads((folder / STAMP).read_text())
        changed = [k for k in expected if found.get(k) != expected[k]]
        pairs = {split: len(data) for split, data in splits.items()}
        if changed or found.get("pairs") != pairs:
            what = ", ".join(f"{k} {found.get(k)!r} -> {expected[k]!r}" for k in changed) or f"pairs -> {pairs}"
            raise UserError(
                str(folder / STAMP),
                f"the reference log-probs were computed for other starting weights or data ({what})",
                f"pass the --model/--data/--precision they were computed for, or delete {folder} to recompute them",
            )
        for split, data in splits.items():
            data.reference = np.load(folder / f"{split}.npy")
        return f"reference: log-probs of the starting weights reused from {folder} ({_count(pairs)})"
    start = time.perf_counter()
    values = {split: score(engine, data) for split, data in splits.items()}
    if os.environ.get("RANK", "0") == "0":
        publish(folder, values, {**expected, "pairs": {s: len(v) for s, v in values.items()}})
    if dist.is_initialized():
        dist.barrier()
    for split, data in splits.items():
        data.reference = values[split]
    seconds = time.perf_counter() - start
    return (
        f"reference: log-probs of the starting weights computed in {seconds:.1f} s"
        f" ({_count({s: len(v) for s, v in values.items()})}) -> {folder}"
    )


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
