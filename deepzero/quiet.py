"""Silence the library messages a user can do nothing about, each by its exact text (nothing else is hidden).

:func:`install` is called once per process at the start of ``train.py`` (``deepzero.trainer.main``). Each entry
names where the message comes from, so it can be dropped when the library stops saying it:

- torch 2.13 deprecated ``torch.distributed.all_gather_into_tensor`` (a ``FutureWarning``, printed once per rank
  from ``torch/distributed/c10d_logger.py``). DeepSpeed 0.19.8's ZeRO-1/2 optimizer calls it after every step to
  gather the updated partitions (``runtime/utils.py: all_gather_into_tensor_dp_groups``).
- DeepSpeed's ``WarmupLR``/``WarmupDecayLR``/``WarmupCosineLR`` constructors call their own ``get_lr()`` to set the
  starting lr, which logs ``Attempting to get learning rate from scheduler before it has started`` on every rank
  (``runtime/lr_schedules.py``). deepzero never asks the scheduler for its lr before a step (it reads the
  optimizer's); the message comes from inside ``deepspeed.initialize``.
- DeepSpeed 0.19.8's CPU backend prints ``DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully``
  on every rank whenever it loads its shared-memory op, built or not (``comm/torch.py: build_shm_op``, a plain
  ``print`` inside ``deepspeed.init_distributed``): :func:`printed_lines_dropped` around that call.
- bitsandbytes 0.50's CPU backend, on a CPU with AVX512-BF16 (a GPU host's CPU too), asks the Hub's ``kernels`` for
  a faster CPU 4-bit matmul when it is imported and logs ``Failed to load CPU gemm_4bit_forward from
  kernels-community: ... could not verify publisher trust status`` on every rank when that is refused (always,
  offline or not; ``backends/cpu/ops.py``); it then uses its own kernel, as it would without ``kernels``.
- Transformers' and huggingface_hub's tqdm bars ("Loading weights", "Writing model shards", downloads) when stderr is
  not a terminal: in a log file each redraw is another line of carriage returns. On a terminal they stay.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterator

FUTURE_WARNINGS = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated\. ",)
"""Message regexes (matched at the start) of the FutureWarnings ignored."""
DEEPSPEED_MESSAGES = frozenset({"Attempting to get learning rate from scheduler before it has started"})
"""Exact messages dropped from DeepSpeed's logger."""
DEEPSPEED_LOGGER = "DeepSpeed"
BITSANDBYTES_PREFIXES = ("Failed to load CPU gemm_4bit_forward from kernels-community",)
"""Message starts dropped from bitsandbytes' CPU backend logger."""
BITSANDBYTES_LOGGER = "bitsandbytes.backends.cpu.ops"
PRINTED = (re.compile(r"DeepSpeed \S+ built successfully"),)
"""Whole lines that DeepSpeed prints (not logs) and :func:`printed_lines_dropped` drops."""


class _Drop(logging.Filter):
    """Drops records whose message is exactly one of ``exact`` or starts with one of ``prefixes``."""

    def __init__(self, exact: frozenset[str] = frozenset(), prefixes: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.exact, self.prefixes = exact, prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return message not in self.exact and not message.startswith(self.prefixes)


LOGGED = {DEEPSPEED_LOGGER: _Drop(exact=DEEPSPEED_MESSAGES), BITSANDBYTES_LOGGER: _Drop(prefixes=BITSANDBYTES_PREFIXES)}
"""Each library logger's filter (bitsandbytes' set before it is imported: its notice comes at import)."""


def install() -> None:
    """Install the filters (idempotent: a second call adds nothing); library progress bars off in a log."""
    isatty = getattr(sys.stderr, "isatty", None)  # a stand-in stream (a test's recorder) may have none
    if not (callable(isatty) and isatty()):
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        disable_progress_bars()
    for pattern in FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=FutureWarning)  # de-duplicated by warnings
    for name, drop in LOGGED.items():
        logger = logging.getLogger(name)
        if drop not in logger.filters:
            logger.addFilter(drop)


@contextlib.contextmanager
def printed_lines_dropped() -> Iterator[None]:
    """Standard output of the block, less the whole lines that match ``PRINTED`` (the rest is written after it)."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        kept = [
            line for line in buffer.getvalue().splitlines(True) if not any(p.fullmatch(line.strip()) for p in PRINTED)
        ]
        sys.stdout.write("".join(kept))
