"""Where a sandboxed program's cgroup can be made: its memory and process count bounded for all its processes together.

Probed once per process: cgroup v2 (the unified hierarchy with the ``memory`` and ``pids`` controllers delegated to
this process's own cgroup) or v1 (writable ``memory`` and ``pids`` hierarchies), by making, setting and removing a
trial cgroup. Root in a container usually has one; a plain user rarely does (v2 needs delegation, e.g. systemd's
``Delegate=yes``). Without one the sandbox falls back to one process per program (docs/code.md).
"""

from __future__ import annotations

import contextlib
import os
from functools import cache
from pathlib import Path


def _mounts() -> dict[str, str]:
    """Each cgroup hierarchy's mount point: ``"2"`` for the unified one, else by v1 controller name."""
    found: dict[str, str] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        kind, _, options = right.split()[:3] if len(right.split()) >= 3 else ("", "", "")
        point = left.split()[4]
        if kind == "cgroup2":
            found.setdefault("2", point)
        elif kind == "cgroup":
            for option in options.split(","):
                found.setdefault(option, point)
    return found


def _own() -> dict[str, str]:
    """This process's cgroup path, per hierarchy (``"2"``, or each v1 controller)."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else ["2"]:
            paths[name] = path
    return paths


def _folder(mount: str, path: str) -> Path:
    own = Path(mount) / path.lstrip("/")
    return own if own.is_dir() else Path(mount)


def _trial(folders: list[Path], files: list[str]) -> bool:
    """Whether a cgroup can be made under each of ``folders`` and its ``files`` written."""
    made: list[Path] = []
    try:
        for folder in folders:
            child = folder / f"deepzero-probe-{os.getpid()}"
            child.mkdir()
            made.append(child)
        for file in files:
            target = next((c / file for c in made if (c / file).exists()), None)
            if target is None:
                return False
            target.write_text(target.read_text().split()[0] if target.read_text().split() else "max")
        return True
    except OSError:
        return False
    finally:
        for child in made:
            with contextlib.suppress(OSError):
                child.rmdir()


@cache
def probe() -> dict | None:
    """``{"version": 1|2, "memory": folder, "pids": folder}`` to make programs' cgroups under, or None."""
    if os.environ.get("DEEPZERO_SANDBOX_CGROUP") == "off":  # the fallback, on demand (tests, docs)
        return None
    try:
        mounts, own = _mounts(), _own()
    except (OSError, ValueError):
        return None
    if "2" in mounts and "2" in own:
        base = _folder(mounts["2"], own["2"])
        try:
            wanted = {"memory", "pids"}
            if not wanted <= set((base / "cgroup.subtree_control").read_text().split()):
                (base / "cgroup.subtree_control").write_text("+memory +pids")
        except OSError:
            pass
        if _trial([base], ["memory.max", "pids.max"]):
            return remove_stale({"version": 2, "memory": str(base), "pids": str(base)})
    if "memory" in mounts and "pids" in mounts:
        memory = _folder(mounts["memory"], own.get("memory", "/"))
        pids = _folder(mounts["pids"], own.get("pids", "/"))
        if _trial([memory, pids], ["memory.limit_in_bytes", "pids.max"]):
            return remove_stale({"version": 1, "memory": str(memory), "pids": str(pids)})
    return None


def remove_stale(spec: dict | None) -> dict | None:
    """Remove the empty cgroups of referees no longer alive (``deepzero-PID``, one killed before its own clean-up);
    ``spec`` back."""
    for folder in {spec["memory"], spec["pids"]} if spec else ():
        for child in Path(folder).glob("deepzero-*"):
            pid = child.name.removeprefix("deepzero-")
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                with contextlib.suppress(OSError):
                    child.rmdir()
    return spec
