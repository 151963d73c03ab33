"""The whole input surface, generated (issue 17): every key of every ds_configs preset, every train.py and
prepare.py flag, data folders, tokenizer folders and checkpoint folders, each given bad values. Every case either
passes the checks or raises exactly one UserError, one line, naming the key/flag/file and a fix; never another
exception. The cases run in-process against the planning step (``run.plan_run``, what train.py does before any
rank starts), so over two thousand cases take seconds; tests/test_errors.py and tests/test_reliability.py run
samples through launched ranks.

``KNOWN`` lists the cases that still fail because the fix belongs to a file other helpers own (data/, run.py); the
test asserts the failures are exactly those, so a fix there makes it fail until the entry is removed.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import re
import shutil
import typing
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import NATIVE_16BIT, REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepzero import checkpoint, checkpoint_storage, dsconfig
from deepzero.args import TrainArgs, parse_args
from deepzero.errors import UserError

PRESETS = sorted((REPO / "ds_configs").glob("*.json"))
BAD_VALUES: dict[str, object] = {
    "wrong type (string)": "x",
    "wrong type (list)": [1],
    "wrong type (object)": {"a": 1},
    "wrong type (bool)": True,
    "zero": 0,
    "negative": -1,
    "fraction": 0.5,
    "null": None,
    "huge": 10**30,
    "NaN": float("nan"),
    "auto": "auto",
}
"""What each preset key is set to, one at a time."""
TRIED: Counter[str] = Counter()
"""Cases tried per surface (reported by the last test; docs/errors.md states the total)."""
KNOWN: dict[str, str] = {}
"""Case → where the fix belongs (a file this suite's owner does not edit)."""
BUGS_LEFT: list[str] = []
HINTS = dsconfig.TrainingHints(max_steps=100, hidden_size=128)


def classify(name: str, run: Callable[[], object], names: tuple[str, ...], must_fail: bool = False) -> str | None:
    """None when ``run`` passes (unless ``must_fail``) or raises one good UserError; else a line describing the bug."""
    try:
        with redirect_stderr(io.StringIO()), redirect_stdout(io.StringIO()):
            run()
        if must_fail:
            return f"{name}: accepted by the checks (fails later, on every rank)"
    except UserError as err:
        text = str(err)
        if "\n" in text or not err.fix.strip() or not err.where.strip():
            return f"{name}: UserError not one line with a place and a fix: {text!r}"
        if names and not any(n in text for n in names):
            return f"{name}: the error names none of {names}: {text}"
    except BaseException as err:
        return f"{name}: {type(err).__name__}: {' '.join(str(err).split())[:200]}"
    return None


Case = tuple  # (name, run, names the error may mention, must it fail?)


def check_all(surface: str, cases: Iterator[Case]) -> None:
    """Run every case; the bugs found must be exactly the ``KNOWN`` ones of this surface."""
    found = []
    for name, run, names, *must_fail in cases:
        TRIED[surface] += 1
        if (bug := classify(name, run, names, bool(must_fail and must_fail[0]))) is not None:
            found.append(bug)
    known = [b for b in found if any(b.startswith(k) for k in KNOWN)]
    unexpected = [b for b in found if b not in known]
    if report := os.environ.get("DEEPZERO_FUZZ_REPORT"):  # counting bugs of an older checkout
        with open(report, "a") as f:
            f.writelines(f"{surface}\t{b}\n" for b in unexpected)
        return
    assert not unexpected, f"{len(unexpected)} of {TRIED[surface]} {surface} cases:\n" + "\n".join(unexpected[:40])
    BUGS_LEFT.extend(known)


def plan(argv: list[str], world: int = 3) -> object:
    from deepzero.run import plan_run

    return plan_run(parse_args(argv), world)


@pytest.fixture(autouse=True, scope="module")
def offline() -> Iterator[None]:
    """Names that are not folders are hub ids: fail at once instead of waiting on the network (HF_HUB_OFFLINE)."""
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def base(tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A command line that plans fine on 3 ranks: tiny model, tiny data, a fresh run folder."""
    out = tmp_path_factory.mktemp("fuzz") / "run"
    argv = ["--data", str(tiny_data), "--out", str(out), "--max-steps", "4", "--no-export"]
    plan(argv)
    return argv


# ------------------------------------------------------------------------------------ DeepSpeed presets


def key_paths(node: dict, prefix: str = "") -> Iterator[str]:
    for key, value in node.items():
        if key.startswith("_"):
            continue
        yield f"{prefix}{key}"
        if isinstance(value, dict):
            yield from key_paths(value, f"{prefix}{key}.")


def set_path(cfg: dict, path: str, value: object) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        cfg = cfg[part]
    cfg[leaf] = value


def test_every_key_of_every_preset(base: list[str], tmp_path: Path) -> None:
    def cases() -> Iterator[Case]:
        for preset in PRESETS:
            raw = json.loads(preset.read_text())
            for path in key_paths(raw):
                for label, value in BAD_VALUES.items():
                    cfg = copy.deepcopy(raw)
                    set_path(cfg, path, value)
                    file = tmp_path / f"{preset.stem}.json"
                    file.write_text(json.dumps(cfg))
                    leaf = path.rsplit(".", 1)[-1]
                    yield (
                        f"{preset.name} {path}={json.dumps(value)} ({label})",
                        lambda f=file: plan([*base, "--deepspeed_config", str(f)]),
                        (leaf, str(file)),
                    )

    check_all("preset key", cases())


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8) | st.just("auto"),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
PATHS = sorted({(p.name, path) for p in PRESETS for path in key_paths(json.loads(p.read_text()))})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(PATHS), value=JSON, extra=st.booleans())
def test_any_json_value_anywhere_in_a_preset(
    where: tuple[str, str], value: object, extra: bool, tmp_path: Path
) -> None:
    """Hypothesis: any JSON value at any preset key (or as a new key next to it) → a result or one UserError."""
    name, path = where
    cfg = json.loads((REPO / "ds_configs" / name).read_text())
    if extra:
        path = f"{path.rsplit('.', 1)[0]}.x_new" if "." in path else "x_new"
    set_path(cfg, path, value)
    file = tmp_path / "h.json"
    file.write_text(json.dumps(cfg))
    dp = 1 if "pipeline" in cfg else 3
    TRIED["hypothesis preset value"] += 1
    bug = classify(path, lambda: dsconfig.resolve(file, dp, HINTS, kernels=NATIVE_16BIT), (str(file),))
    assert bug is None, bug


# ------------------------------------------------------------------------------------------ train.py flags


def bad_flag_values(f: dataclasses.Field, tmp: Path) -> list[str]:
    kind = typing.get_type_hints(TrainArgs)[f.name]
    text = str(kind)
    if f.name == "ds":
        return [
            "=",
            "nokey",
            "zero_optimization=3",
            "zero_optimization.stage.x=1",
            "zero_optimization.stage=abc",
            "a..b=1",
        ]
    if "Literal" in text:
        return ["bogus", ""]
    if kind is bool:
        return ["maybe"]
    if "int" in text:
        return ["0", "-1", "abc", "1.5", "99999999999999999999"]
    if "float" in text:
        return ["nan", "inf", "-1", "0", "abc"]
    (tmp / "a-file").write_text("not a folder")
    (tmp / "empty").mkdir(exist_ok=True)
    return ["", "/nonexistent/x", str(tmp / "a-file"), str(tmp / "empty"), "bogus", "r=0", "r=abc,targets=none"]


ZERO_ALLOWED = {"eval_interval", "save_interval", "seed", "moe_bias_rate", "moe_aux_alpha", "top_k", "min_p"}
ZERO_ALLOWED |= {"reward_timeout"}  # 0: no limit
PATH_FLAGS = {"deepspeed_config", "model", "tokenizer", "data"}


def must_refuse(name: str, value: str, tmp: Path) -> bool:
    """Whether ``--name value`` is wrong for sure (some values are fine: a new --out folder, a huge --max-steps)."""
    if value in ("-1", "nan", "inf", "abc", "1.5", "bogus", "maybe") or name == "ds":
        return name not in ("device_map_devices", "out", "tokenizer") or value not in ("bogus",)
    if value == "0":
        return name not in ZERO_ALLOWED
    if value == "/nonexistent/x":
        return name in PATH_FLAGS
    if value == str(tmp / "a-file"):
        return name in PATH_FLAGS | {"out"}
    return name in ("lora", "device_map") and value != ""


def test_every_train_flag(base: list[str], tmp_path: Path) -> None:
    skip = {"local_rank"}  # set by the launcher

    def cases() -> Iterator[Case]:
        for f in dataclasses.fields(TrainArgs):
            if f.name in skip:
                continue
            flag = f"--{f.name.replace('_', '-')}" if f.name != "deepspeed_config" else "--deepspeed_config"
            for value in bad_flag_values(f, tmp_path):
                names = (flag, f.name, f"--{f.name}", value) if value else (flag, f.name, f"--{f.name}")
                refuse = must_refuse(f.name, value, tmp_path)
                yield f"{flag} {value!r}", lambda a=[*base, flag, value]: plan(a), names, refuse

    check_all("train.py flag", cases())


def test_prepare_flags(tmp_path: Path) -> None:
    """data/prepare.py: bad values stop before any work with one line (in-process ``main``)."""
    from deepzero.data.prepare import main

    doc = tmp_path / "doc.txt"
    doc.write_text("def f():\n    return 1\n" * 50)
    (tmp_path / "empty").mkdir()
    base = ["--input", str(doc), str(doc), "--out"]
    values = {
        "--seq-len": ["0", "-1", "abc"],
        "--val-fraction": ["0", "1", "-1", "nan", "abc"],
        "--vocab-size": ["0", "-1", "abc"],
        "--format": ["bogus"],
        "--tokenizer": ["/nonexistent/x", str(tmp_path / "empty"), str(doc)],
        "--input": ["/nonexistent/x", str(tmp_path / "empty")],
        "--seed": ["abc"],
        "--out": [str(doc)],
    }

    def run(argv: list[str]) -> None:
        try:
            code = main(argv)
        except SystemExit as stop:  # argparse: usage + "prog: error: ..." (two lines, not ours)
            raise AssertionError(f"argparse exit {stop.code}") from None
        if code not in (0, 2):
            raise AssertionError(f"exit {code}")

    def cases() -> Iterator[Case]:
        for flag, bad in values.items():
            for i, value in enumerate(bad):
                out = str(tmp_path / f"out{flag}{i}")
                argv = [*base, out, flag, value] if flag != "--input" else ["--input", value, "--out", out]
                yield f"prepare {flag} {value!r}", lambda a=argv: run(a), ()

    check_all("prepare.py flag", cases())


# ---------------------------------------------------------------------------------- data and tokenizers


def data_copy(src: Path, dst: Path) -> Path:
    """A data folder whose big files are links to ``src`` (replaced by a test before it changes them)."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).symlink_to(p) if p.name != "meta.json" else shutil.copy(p, dst / p.name)
    return dst


def split_file(folder: Path, split: str) -> Path:
    """The (first) token file of ``split`` (``train.bin`` or ``train-00000.bin``, whichever layout prepare wrote)."""
    return sorted(p for p in folder.glob(f"{split}*.bin") if "mask" not in p.name)[0]


def own(path: Path) -> Path:
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return path


def data_variants(src: Path, root: Path) -> Iterator[tuple[str, Path]]:
    """(name, folder); every name that does not start with "data: meta.json <key>=" must be refused."""
    meta = json.loads((src / "meta.json").read_text())
    n = 0

    def fresh() -> Path:
        nonlocal n
        n += 1
        return data_copy(src, root / f"d{n}")

    for split in ("train", "val"):
        for cut in (1, 2, 1000):
            d = fresh()
            f = own(split_file(d, split))
            f.write_bytes(f.read_bytes()[:-cut])
            yield f"data: {split}.bin truncated by {cut} bytes", d
        d = fresh()
        split_file(d, split).unlink()
        yield f"data: {split}.bin missing", d
        d = fresh()
        own(split_file(d, split)).write_bytes(b"")
        yield f"data: {split}.bin empty", d
    for cut in (0, 1, 10, len(json.dumps(meta)) // 2):
        d = fresh()
        (d / "meta.json").write_text(json.dumps(meta)[:cut])
        yield f"data: meta.json cut to {cut} chars", d
    d = fresh()
    (d / "meta.json").unlink()
    yield "data: meta.json missing", d
    for key in meta:
        d = fresh()
        (d / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != key}))
        yield f"data: meta.json without {key}", d
        for label, value in BAD_VALUES.items():
            d = fresh()
            (d / "meta.json").write_text(json.dumps({**meta, key: value}))
            yield f"data: meta.json {key}={json.dumps(value)} ({label})", d
    for dtype in ("uint32", "int8", "float32"):
        d = fresh()
        (d / "meta.json").write_text(json.dumps({**meta, "dtype": dtype}))
        yield f"data: meta.json dtype {dtype} (files written as {meta['dtype']})", d
    d = fresh()
    train = own(split_file(d, "train"))
    tokens = np.fromfile(train, dtype=meta["dtype"])
    tokens[:: max(1, len(tokens) // 50)] = 4000  # beyond the tokenizer's 512 ids
    tokens.tofile(train)
    (d / "meta.json").write_text(json.dumps({**meta, "vocab_size": 4096}))
    yield "data: token ids >= the tokenizer's vocabulary", d


def test_data_folders(base: list[str], tiny_data: Path, tmp_path: Path) -> None:
    def cases() -> Iterator[Case]:
        for name, folder in data_variants(tiny_data, tmp_path):
            must_fail = not re.match(r"data: meta.json (without )?\w+=?", name) or "dtype" in name
            yield name, lambda f=folder: plan([*base, "--data", str(f)]), (str(folder),), must_fail

    check_all("data folder", cases())


def test_tokenizer_folders(base: list[str], tiny_data: Path, tmp_path: Path) -> None:
    src = tiny_data / "tokenizer"
    variants: dict[str, Path] = {"tokenizer: missing folder": tmp_path / "none"}
    (tmp_path / "empty").mkdir()
    variants["tokenizer: empty folder"] = tmp_path / "empty"
    for name in sorted(p.name for p in src.iterdir()):
        for how in ("missing", "truncated", "not JSON"):
            d = tmp_path / f"{name}-{how}".replace(" ", "_")
            shutil.copytree(src, d)
            if how == "missing":
                (d / name).unlink()
            elif how == "truncated":
                (d / name).write_bytes((src / name).read_bytes()[: (src / name).stat().st_size // 2])
            else:
                (d / name).write_text("not json {")
            variants[f"tokenizer: {name} {how}"] = d
    small = tmp_path / "small"
    shutil.copytree(src, small)
    spec = json.loads((src / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    spec["model"]["vocab"] = {t: i for t, i in vocab.items() if i < 300}
    spec["model"]["merges"] = []
    (small / "tokenizer.json").write_text(json.dumps(spec))
    variants["tokenizer: smaller than the data's vocabulary"] = small

    def cases() -> Iterator[Case]:
        for name, folder in variants.items():
            must_fail = "folder" in name or "smaller" in name or "tokenizer.json" in name
            yield name, lambda f=folder: plan([*base, "--tokenizer", str(f)]), (str(folder), "--tokenizer"), must_fail

    check_all("tokenizer folder", cases())


# ------------------------------------------------------------------------------------------ checkpoints


def fake_checkpoint(ckpt: Path, tag: str, world: int, stage: int, universal: bool = False) -> Path:
    """DeepSpeed's file names with small torch zip archives inside (what check_resumable reads)."""
    folder = ckpt / tag
    folder.mkdir(parents=True)
    prefix = "bf16_" if stage == 3 else ""
    for r in range(world):
        torch.save({"r": torch.zeros(4)}, folder / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        torch.save({"rng": torch.zeros(4)}, folder / f"rng_rank{r:03d}.pt")
    torch.save({"module": {}}, folder / "mp_rank_00_model_states.pt")
    if universal:
        (folder / "zero" / "w").mkdir(parents=True)
        torch.save(torch.zeros(2), folder / "zero" / "w" / "fp32.pt")
    (ckpt / "latest").write_text(tag)
    return folder


def checkpoint_variants(root: Path) -> Iterator[tuple[str, Path, int, bool]]:
    """(name, checkpoints folder, data-parallel size of the resuming run, whether it must pass)."""
    n = 0

    def fresh(world: int = 2, stage: int = 2, universal: bool = False) -> Path:
        nonlocal n
        n += 1
        ckpt = root / f"c{n}" / "checkpoints"
        fake_checkpoint(ckpt, "step00000002", world, stage, universal)
        return ckpt

    for world, stage in ((2, 2), (3, 3)):
        yield f"checkpoint: complete, world {world}, stage {stage}", fresh(world, stage), world, True
    yield "checkpoint: universal, resumed on another world size", fresh(3, 3, universal=True), 2, True
    for saved, now in ((3, 2), (2, 3), (1, 2), (2, 1)):
        yield f"checkpoint: from {saved} ranks resumed on {now} without conversion", fresh(saved, 2), now, False
    ckpt = fresh()
    (ckpt / "latest").unlink()
    yield "checkpoint: no latest", ckpt, 2, False
    for text in ("", "step00000009", "../../etc", "step00000002\n\n"):
        ckpt = fresh()
        (ckpt / "latest").write_text(text)
        yield f"checkpoint: latest says {text!r}", ckpt, 2, text.strip() == "step00000002"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_rank000.pt"):
        for how in ("truncated", "empty", "garbage"):
            ckpt = fresh()
            f = ckpt / "step00000002" / name
            f.write_bytes(
                {"truncated": f.read_bytes()[: f.stat().st_size // 2], "empty": b"", "garbage": b"x" * 99}[how]
            )
            yield f"checkpoint: {name} {how}", ckpt, 2, False
    ckpt = fresh()
    for f in (ckpt / "step00000002").iterdir():
        f.unlink()
    yield "checkpoint: empty folder", ckpt, 2, False
    ckpt = fresh()
    (ckpt / "step00000002" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    yield "checkpoint: one rank's optimizer file missing", ckpt, 2, False


def test_checkpoint_folders(tmp_path: Path) -> None:
    """``checkpoint.check_resumable`` (run by ``checkpoint.load`` before DeepSpeed opens anything): corrupt or
    foreign folders stop with one line; complete and universal ones pass."""
    wrong = []

    def cases() -> Iterator[Case]:
        for name, ckpt, dp, ok in checkpoint_variants(tmp_path):

            def run(c: Path = ckpt, d: int = dp, good: bool = ok, label: str = name) -> None:
                try:
                    checkpoint.check_resumable(c, d)
                except UserError:
                    if good:
                        wrong.append(f"{label}: refused")
                    raise
                if not good:
                    wrong.append(f"{label}: accepted")

            yield name, run, (str(ckpt), "latest")

    check_all("checkpoint folder", cases())
    assert not wrong, wrong


WRITE_FAILURES = {
    "[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0": (
        "No space left on device",
        "free space under",
    ),
    "basic_ios::clear: iostream error": ("Input/output error", "check the disk under"),  # with free space: not ENOSPC
}


@pytest.mark.parametrize("message", WRITE_FAILURES)
def test_no_partial_checkpoint_is_published_when_a_write_fails(tmp_path: Path, message: str) -> None:
    """checkpoint.save with a write failure injected (the RuntimeErrors torch.save raises when its zip writer or its
    C++ stream fails, both seen on a full tmpfs): one SaveFailed naming the last good checkpoint, the .partial folder
    removed, ``latest`` unchanged. The real full disk is in test_reliability (tmpfs)."""

    class Engine:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> None:
            (Path(save_dir) / tag).mkdir(parents=True)
            torch.save({"w": torch.ones(3)}, Path(save_dir) / tag / "mp_rank_00_model_states.pt")
            if self.fail:
                raise RuntimeError(message)

    ckpt = tmp_path / "checkpoints"
    checkpoint.save(Engine(False), ckpt, checkpoint.TrainState(step=1), keep_last=2)
    with pytest.raises(UserError) as err:
        checkpoint.save(Engine(True), ckpt, checkpoint.TrainState(step=2), keep_last=2)
    TRIED["injected write failure"] += 1
    reason, fix = WRITE_FAILURES[message]
    assert str(err.value) == (
        f"{ckpt}/step00000002: saving the checkpoint failed ({reason}: torch.save: {message}); removed the partial"
        f" folder, the last good checkpoint is {ckpt}/step00000001. Fix: {fix} {ckpt} (or lower --keep-last), then"
        " --resume"
    )
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step00000001"]
    assert checkpoint.latest_tag(ckpt) == "step00000001"


def test_disk_space_check(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    assert checkpoint_storage.check_disk_space(tmp_path / "run", 1000, keep_last=2, export=500) is None
    warning = checkpoint_storage.check_disk_space(tmp_path / "run", free // 2, keep_last=2, export=0)
    assert warning and re.search(r"room for 1 checkpoint\(s\).*Fix: free .* GB or pass --keep-last 1", warning)
    with pytest.raises(UserError, match=r"not enough disk space for one checkpoint and the export"):
        checkpoint_storage.check_disk_space(tmp_path / "run", free * 2, keep_last=2, export=0)
    assert checkpoint_storage.checkpoint_bytes(10, 10, 2) == 140 and checkpoint_storage.checkpoint_bytes(10, 1, 2) == 32
    assert checkpoint_storage.checkpoint_bytes(10, 10, 4) == 120  # fp32 training: no separate master copy


def test_the_suite_tries_hundreds_of_cases() -> None:
    """Runs last (file order): the count docs/errors.md states."""
    total = sum(TRIED.values())
    print(f"fuzz cases tried: {total} {dict(TRIED)}")
    print("left for other files:", *BUGS_LEFT, sep="\n  ")
    if len(TRIED) >= 7:  # the whole file ran (not a -k selection)
        assert total >= 2000, dict(TRIED)
