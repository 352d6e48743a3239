"""Run `kpo` as the control-plane image would: only the packages of its lock importable.

    python tests/deploy/lock_only_python.py LOCK_FILE kpo-arguments...

Every installed distribution that the lock does not name (torch, transformers, the test tools)
is made unimportable before `services.cli` is, as if it were not installed; Ray's vendored
packages (ray/thirdparty_files) come with Ray's wheel and stay. What was refused is written to
stderr at exit as one line, `refused: name, name, ...`, so that a test sees the optional imports
that fell back too.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from packaging.utils import canonicalize_name


def locked_names(lock: Path) -> set[str]:
    text = lock.read_text(encoding="utf-8")
    return {
        canonicalize_name(m) for m in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", text, re.M)
    }


class OnlyLocked(importlib.abc.MetaPathFinder):
    """Refuses every top-level module whose distribution is installed but not locked."""

    def __init__(self, allowed: set[str]) -> None:
        self.allowed = allowed
        self.owners = importlib.metadata.packages_distributions()
        ray = importlib.util.find_spec("ray")
        assert ray is not None and ray.origin is not None
        self.vendored = {p.name for p in (Path(ray.origin).parent / "thirdparty_files").iterdir()}
        self.refused: set[str] = set()

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = name.partition(".")[0]
        owners = {canonicalize_name(d) for d in self.owners.get(top, [])}
        if owners and not owners & self.allowed and top not in self.vendored:
            self.refused.add(top)
            raise ModuleNotFoundError(f"No module named {name!r} (not in the lock)", name=name)
        return None  # the next finder finds it


def main() -> None:
    lock, *arguments = sys.argv[1:]
    finder = OnlyLocked(locked_names(Path(lock)) | {"kpo-rl"})
    sys.meta_path.insert(0, finder)
    atexit.register(lambda: print(f"refused: {', '.join(sorted(finder.refused))}", file=sys.stderr))
    sys.argv = ["kpo", *arguments]
    from services.cli import app

    app()


if __name__ == "__main__":
    main()
