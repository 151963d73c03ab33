"""Where metrics go: the console (via tqdm), a JSONL file, and optionally wandb or TensorBoard. Rank 0 only."""

from __future__ import annotations

import json
import math
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def peak_memory_gb() -> tuple[float, str]:
    """Peak memory of this process: GPU allocated on CUDA, else host RSS (Linux reports KiB)."""
    from deepzero.distributed import on_cuda

    if on_cuda():
        return torch.cuda.max_memory_allocated() / 2**30, "gpu"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "host"


def redact(env: dict[str, str]) -> dict[str, str]:
    """Environment without secrets (WANDB_API_KEY, HF_TOKEN, ...), for logs and saved run configs."""
    return {k: ("***" if any(m in k.upper() for m in SECRET_MARKERS) else v) for k, v in env.items()}


class MetricsSink:
    """Writes each record as one JSON line, and forwards scalars to the chosen tracker."""

    def __init__(self, out_dir: Path, report_to: str, run_config: dict[str, Any], enabled: bool) -> None:
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self._tracker: Any = None
        self._kind = report_to
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        if report_to == "wandb":
            import wandb

            self._tracker = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "deepzero"), dir=str(out_dir), config=run_config
            )
        elif report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self._tracker = SummaryWriter(log_dir=str(out_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        self._file.flush()
        step = record.get("step", 0)
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float) and k not in ("step", "time")}
        if self._kind == "wandb":
            self._tracker.log({f"{record.get('kind', 'train')}/{k}": v for k, v in scalars.items()}, step=step)
        elif self._kind == "tensorboard":
            for k, v in scalars.items():
                self._tracker.add_scalar(f"{record.get('kind', 'train')}/{k}", v, step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._kind == "wandb":
            self._tracker.finish()
        elif self._kind == "tensorboard":
            self._tracker.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return str(value)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
