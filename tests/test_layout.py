"""The house (issue "The house"): no module over MAX_LINES lines, and no import that runs up the layers — a module
imports (at the top or inside a function) only modules of its own layer or of a layer below. Circles within a layer
are tests/test_imports.py's to find."""

from __future__ import annotations

from pathlib import Path

from conftest import REPO
from helpers.import_graph import PACKAGE, cycles, import_graph

MAX_LINES = 500
"""A module holds one job and stays readable in one sitting (~400 lines; this is the hard ceiling)."""
SCRIPTS = ("train.py", "evaluate.py", "sample.py", "data/*.py")

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "entry points: what a command runs",
        (
            "deepzero.trainer",
            "deepzero.run",
            "deepzero.score",
            "deepzero.export",
            "deepzero.doctor",
            "deepzero.doctor_checks",
            "deepzero.plot",
            "deepzero.plan.cli",
            "deepzero.plan.__main__",
        ),
    ),
    (
        "what a run or a job is assembled from: the training methods, the engines, the evaluation and sampling job,"
        " the run's schedule and val split",
        (
            "deepzero.methods",
            "deepzero.engines",
            "deepzero.rollout.jobs",
            "deepzero.rollout.job_args",
            "deepzero.rollout.layout",
            "deepzero.schedule",
            "deepzero.val_split",
        ),
    ),
    (
        "the parts: the planner, data, losses, adapters, the model, samplers and rewards, placement, memory savers",
        (
            "deepzero.plan",
            "deepzero.data",
            "deepzero.losses",
            "deepzero.adapters",
            "deepzero.rollout",
            "deepzero.modeling",
            "deepzero.hf_export",
            "deepzero.placement",
            "deepzero.placement_hooks",
            "deepzero.memory_savers",
            "deepzero.tiled_loss",
            "deepzero.sequence_parallel",
            "deepzero.moe_balance",
            "deepzero.reference",
        ),
    ),
    (
        "configuration and the run's services: flags, presets, the DeepSpeed config, precision, processes, checkpoints,"
        " metrics, reports",
        (
            "deepzero.args",
            "deepzero.presets",
            "deepzero.dsconfig",
            "deepzero.dsconfig_checks",
            "deepzero.precision",
            "deepzero.distributed",
            "deepzero.op_builds",
            "deepzero.flops",
            "deepzero.metrics",
            "deepzero.report",
            "deepzero.checkpoint",
            "deepzero.checkpoint_storage",
            "deepzero.universal",
        ),
    ),
    (
        "leaf utilities",
        (
            "deepzero",
            "deepzero.errors",
            "deepzero.quiet",
            "deepzero.progress",
            "deepzero.watchdog",
            "deepzero.preemption",
        ),
    ),
)
"""Top to bottom. A name stands for that module and, if a package, every module under it, unless a longer name
places one elsewhere (``deepzero.rollout.jobs`` above ``deepzero.rollout``); ``deepzero`` is the package itself."""

ALLOWED_UPWARD: frozenset[tuple[str, str]] = frozenset()
"""Imports that still run up the layers, each with why it could not be fixed yet. None today: the tokenizer checks moved
from run.py to data/tokenizer.py (rollout.layout no longer imports run), and the planner takes engine settings as data
(``plan.setup.EngineTerms``) instead of importing engines."""


def layer_of(module: str) -> int | None:
    """The index in LAYERS (0: the top) of ``module``, by the longest name that covers it; None: in no layer."""
    best: tuple[int, int] | None = None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            covers = module == name or (name != "deepzero" and module.startswith(f"{name}."))
            if covers and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Each import of a module of a higher layer, as ``a (layer) -> b (layer)``, except ALLOWED_UPWARD."""
    found = []
    for module, targets in sorted(edges.items()):
        for target in sorted(targets):
            low, high = layer_of(module), layer_of(target)
            if low is not None and high is not None and high < low and (module, target) not in ALLOWED_UPWARD:
                found.append(f"{module} ({LAYERS[low][0].split(':')[0]}) -> {target} ({LAYERS[high][0].split(':')[0]})")
    return found


def oversized(paths: list[Path]) -> list[str]:
    """Each file over MAX_LINES lines, as ``path: lines``, longest first."""
    counts = {path: len(path.read_text().splitlines()) for path in paths}
    return [
        f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: {n}"
        for path, n in sorted(counts.items(), key=lambda item: -item[1])
        if n > MAX_LINES
    ]


def test_every_module_has_a_layer() -> None:
    assert [m for m in sorted(import_graph()) if layer_of(m) is None] == []


def test_no_import_runs_up_the_layers() -> None:
    found = upward_imports(import_graph())
    assert found == [], "imports that run up the layers (move the helper down, or pass data):\n" + "\n".join(found)


def test_the_allow_list_holds_only_imports_that_exist() -> None:
    edges = import_graph()
    assert [pair for pair in sorted(ALLOWED_UPWARD) if pair[1] not in edges.get(pair[0], set())] == []


def test_an_upward_import_hidden_inside_a_function_is_caught() -> None:
    edges = import_graph()
    edges["deepzero.plan.setup"] = {*edges["deepzero.plan.setup"], "deepzero.engines"}  # as the planner once did
    edges["deepzero.errors"] = {*edges["deepzero.errors"], "deepzero.run"}
    found = upward_imports(edges)
    assert any(line.startswith("deepzero.plan.setup (the parts) -> deepzero.engines") for line in found), found
    assert any(line.startswith("deepzero.errors (leaf utilities) -> deepzero.run") for line in found), found


def package_loops(edges: dict[str, set[str]]) -> list[list[str]]:
    """The loops between packages (``deepzero.losses`` for every module under it; a top-level module stands for
    itself): each set of two or more that import each other round, sorted."""

    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {unit(m): set() for m in {*edges, *(t for ts in edges.values() for t in ts)}}
    for module, targets in edges.items():
        graph[unit(module)].update(unit(t) for t in targets if unit(t) != unit(module))
    return sorted(cycles(graph))


def test_no_package_imports_another_that_imports_it_back() -> None:
    assert package_loops(import_graph()) == []


def test_a_package_loop_is_found() -> None:
    edges = import_graph()
    edges["deepzero.tiled_loss"] = {*edges.get("deepzero.tiled_loss", set()), "deepzero.memory_savers"}
    assert ["deepzero.memory_savers", "deepzero.tiled_loss"] in package_loops(edges)


def test_no_module_is_over_the_limit() -> None:
    paths = sorted(PACKAGE.rglob("*.py")) + sorted(p for pattern in SCRIPTS for p in REPO.glob(pattern))
    found = oversized(paths)
    assert found == [], f"modules over {MAX_LINES} lines (split them by job):\n" + "\n".join(found)


def test_the_size_check_names_an_oversized_file(tmp_path: Path) -> None:
    small, big = tmp_path / "small.py", tmp_path / "big.py"
    small.write_text("x = 1\n" * MAX_LINES)
    big.write_text("x = 1\n" * (MAX_LINES + 1))
    assert oversized([small, big]) == [f"{big}: {MAX_LINES + 1}"]
