"""train.py in this process with its LoRA export measured (bench/lora_export_memory.py runs it, one way a process).

    python -m bench.measured_export WAY PEAK_JSON TRAIN_ARGS...

WAY ``streamed`` keeps the exporter train.py chooses for a base with files (``exporters.export_streamed``); ``in
memory`` makes ``exporters.files_vocab`` answer None, so the run takes the engine's whole-model merge
(``exporters.export_lora_hf``), as a base without files does. Either exporter is wrapped in
``deepzero.adapters.merge.peak_rss``, and its peak resident memory above the level before the export is written to
PEAK_JSON as ``{"peak_host_bytes": N}``.
"""

from __future__ import annotations

import json
import runpy
import sys
from functools import wraps
from pathlib import Path
from typing import Any

from bench.scaling import REPO
from deepzero.adapters import exporters
from deepzero.adapters.merge import peak_rss

EXPORTERS = {"streamed": "export_streamed", "in memory": "export_lora_hf"}


def measure(way: str, peak_json: Path) -> None:
    """Patch ``deepzero.adapters.exporters`` so that the run exports ``way`` and records the export's peak."""
    name = EXPORTERS[way]
    if way == "in memory":
        exporters.files_vocab = lambda source: None
    inner = getattr(exporters, name)

    @wraps(inner)
    def measured(*args: Any, **kwargs: Any) -> Any:
        with peak_rss() as peak:
            result = inner(*args, **kwargs)
        peak_json.write_text(json.dumps({"peak_host_bytes": peak.bytes}))
        return result

    setattr(exporters, name, measured)


def main(argv: list[str]) -> None:
    way, peak_json, *train_args = argv
    measure(way, Path(peak_json))
    sys.argv = ["train.py", *train_args]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
