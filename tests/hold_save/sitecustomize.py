"""Test-only: processes started with this folder on PYTHONPATH and DEEPZERO_HOLD_SAVE="STEP:MARKER" hold rank 0 in
the middle of its first checkpoint save at STEP or later: its ``.partial`` folder holds DeepSpeed's files, rank 0
touches MARKER and sleeps instead of writing its last file. A test then kills it there, every time, whatever the
machine's speed (polling for the ``.partial`` folder from outside races a save that takes milliseconds).

The fake CPU (tests/fake_cpu) still applies: Python imports one sitecustomize, so this one runs that one as well.
"""

import os
import runpy
from pathlib import Path

_SPEC = os.environ.get("DEEPZERO_HOLD_SAVE")

if _SPEC is not None and os.environ.get("RANK") == "0":
    import re
    import time

    import torch

    _step, _marker = _SPEC.split(":", 1)
    _real_save = torch.save

    def _held_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        path = Path(str(f))
        tag = re.fullmatch(r"step(\d+)\.partial", path.parent.name)
        if tag and path.name.startswith("rng_rank") and int(tag.group(1)) >= int(_step):
            Path(_marker).write_text(path.parent.name)
            time.sleep(3600)
        _real_save(obj, f, *args, **kwargs)

    torch.save = _held_save

if os.environ.get("DEEPZERO_FAKE_CPU_KERNELS") is not None:
    runpy.run_path(str(Path(__file__).parent.parent / "fake_cpu" / "sitecustomize.py"))
