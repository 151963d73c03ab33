"""Resume a ZeRO checkpoint on a different number of ranks, through DeepSpeed's universal checkpoint format.

A ZeRO checkpoint splits the fp32 master weights and the Adam moments by data-parallel rank, so DeepSpeed loads
it only with the world size that wrote it. ``ds_to_universal`` rewrites it as one folder per parameter
(``<tag>/zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``), which any world size loads when the DeepSpeed config says
``"checkpoint": {"load_universal": true}``:

    python -m deepzero.universal runs/default      # checkpoints/<latest>.universal; 'latest' now points to it
    deepspeed --num_gpus=2 train.py ... --out runs/default --resume

Only the first resume needs ``load_universal``: the checkpoints that run saves are ordinary ZeRO ones again.
train.py sets the flag on ``--resume`` from what ``latest`` points to (:func:`configure_resume`), so the command
line stays the same. The global batch changes with the world size, so the data position is continued from
``samples_seen``, not from the step count: :func:`data_start_step`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deepzero.checkpoint import latest_tag, write_atomic
from deepzero.errors import UserError

SUFFIX = ".universal"
"""Tag suffix of a universal checkpoint written next to the ZeRO checkpoint it came from."""


def is_universal(tag_dir: Path) -> bool:
    """True for a folder written by ``ds_to_universal`` (one sub-folder per parameter under ``zero/``)."""
    return (tag_dir / "zero").is_dir()


def checkpoints_dir(path: Path) -> Path:
    """Accept a run folder (``--out``) or its ``checkpoints`` folder."""
    if not (path / "latest").is_file() and (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def convert(ckpt_dir: Path, tag: str | None = None, out_dir: Path | None = None, workers: int = 1) -> Path:
    """Write the universal form of ``ckpt_dir/tag`` (default: what ``latest`` names) and point ``latest`` at it.

    The output is ``out_dir/<tag>`` when ``out_dir`` is another folder, else ``ckpt_dir/<tag>.universal``; it is
    written under a ``.partial`` name and renamed when complete, like a training checkpoint. The source is untouched.
    """
    from deepspeed.checkpoint import ds_to_universal

    ckpt_dir = checkpoints_dir(Path(ckpt_dir))
    tag = tag or latest_tag(ckpt_dir)
    if tag is None:
        raise UserError(str(ckpt_dir), "no 'latest' file, so no checkpoint to convert", "pass --tag stepNNNNNNNN")
    src = ckpt_dir / tag
    if not src.is_dir():
        raise UserError(str(src), "no such checkpoint folder", f"pick a tag from {ckpt_dir}")
    if is_universal(src):
        raise UserError(str(src), "is already a universal checkpoint", "resume from it with --resume")
    out_dir = Path(out_dir) if out_dir is not None else ckpt_dir
    same_place = out_dir.resolve() == ckpt_dir.resolve()
    final = out_dir / (f"{tag}{SUFFIX}" if same_place else tag)
    if final.exists():
        raise UserError(str(final), "already exists", "delete it or pass another --out")
    partial = final.with_name(f"{final.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(
        input_folder=str(src),
        output_folder=str(partial),
        num_extract_workers=workers,
        num_merge_workers=max(1, workers // 2),
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # HF models carry no UNIVERSAL_CHECKPOINT_INFO; plain ZeRO needs none
    )
    try:
        ds_to_universal.main(args)
    except Exception as err:  # DeepSpeed raises AssertionError, ValueError, RuntimeError, ...
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(
            str(src),
            f"ds_to_universal failed ({type(err).__name__}: {str(err)[:200]})",
            "convert a ZeRO-1/2/3 data-parallel checkpoint (pipeline checkpoints are not supported)",
        ) from None
    for rng in src.glob("rng_rank*.pt"):  # ranks that exist in both worlds keep their RNG streams
        shutil.copy2(rng, partial / rng.name)
    os.replace(partial, final)
    write_atomic(out_dir / "latest_universal", final.name)
    write_atomic(out_dir / "latest", final.name)
    return final


def configure_resume(ds_config: dict[str, Any], ckpt_dir: Path) -> bool:
    """Set ``checkpoint.load_universal`` to whether the checkpoint ``latest`` names is universal; return that.

    Call before ``deepspeed.initialize`` on ``--resume``: the first resume after :func:`convert` loads the
    universal folder, later resumes load the ordinary checkpoints that run wrote, with the same command line.
    """
    tag = latest_tag(ckpt_dir)
    universal = tag is not None and is_universal(ckpt_dir / tag)
    ds_config.setdefault("checkpoint", {})["load_universal"] = universal
    return universal


def data_start_step(samples_seen: int, global_batch: int) -> int:
    """The sampler's start step when resuming with ``global_batch`` sequences per step (any world size).

    Equals the optimizer step when the world size never changed (``samples_seen = step × global_batch``). After
    a change, ``samples_seen // global_batch`` continues the same permutation where the old run stopped, repeating
    at most ``global_batch - 1`` sequences; it stays consistent over later resumes on the new world size. Each
    epoch drops its incomplete tail, so past the first epoch the position may drift by one batch per epoch.
    """
    if global_batch < 1 or samples_seen < 0:
        raise ValueError(f"global_batch {global_batch} and samples_seen {samples_seen} must be positive")
    return samples_seen // global_batch


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: convert one checkpoint and print the command that resumes from it."""
    parser = argparse.ArgumentParser(prog="python -m deepzero.universal", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="run folder (--out of train.py) or its checkpoints folder")
    parser.add_argument("--tag", help="checkpoint to convert (default: the one 'latest' names)")
    parser.add_argument("--out", type=Path, help="checkpoints folder to write to (default: next to the source)")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="extraction processes")
    args = parser.parse_args(argv)
    try:
        final = convert(args.checkpoint, args.tag, args.out, args.workers)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    run_dir = final.parent.parent if final.parent.name == "checkpoints" else final.parent
    print(f"universal: wrote {final}; 'latest' points to it")
    print(f"resume on any number of ranks: train.py ... --out {run_dir} --resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
