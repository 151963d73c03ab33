"""Progress bars on a terminal: tqdm sized by the terminal, with a width even where the terminal reports none."""

from __future__ import annotations

import shutil
import sys
from typing import Any

from tqdm import tqdm


def bar(total: int | None, show: bool = True, tty_only: bool = True, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, shown when ``show`` and (with ``tty_only``) stderr is a terminal. Its size is the
    terminal's, or 80 × 24 where the terminal reports 0 × 0 (a pseudo-terminal nobody sized: ``script``, ``docker
    run -t``, some CI runners), where tqdm's own sizing hides the bar (it takes 0 rows as no room for it)."""
    enabled = show and (sys.stderr.isatty() or not tty_only)
    size = shutil.get_terminal_size(fallback=(80, 24))
    return tqdm(total=total, disable=not enabled, file=sys.stderr, ncols=size.columns, nrows=size.lines, **kwargs)
