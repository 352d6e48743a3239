"""A virtualenv that has torch, transformers and what they need, and nothing else: a bare GPU
image's Python, on CPU, built in seconds.

The distributions are not installed again (torch alone is gigabytes): the dependency closure of
torch and transformers in the test suite's own environment is linked, one top-level entry at a
time, into a folder that the new virtualenv's site-packages names in a .pth file. What a GPU
image is known to lack is left out even where transformers' closure pulls it in here (a newer
transformers depends on pydantic through `kernels`), so the prepared wheels must bring it.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOTS = ("torch", "transformers")
# Not in the GPU image the check is written for; `kernels` needs pydantic to import.
LEFT_OUT = {"pydantic", "pydantic-core", "annotated-types", "typing-inspection", "kernels"}


def closure(roots: tuple[str, ...]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions `roots` need (markers evaluated here, no extras)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = list(roots)
    while pending:
        name = str(canonicalize_name(pending.pop()))
        if name in found:
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional dependency this environment does not have
        found[name] = distribution
        for text in distribution.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return found


def link_site(site: Path) -> list[str]:
    """Link the closure's top-level entries (packages, modules, .dist-info) into `site`."""
    site.mkdir(parents=True, exist_ok=True)
    linked = []
    for name, distribution in sorted(closure(ROOTS).items()):
        if name in LEFT_OUT:
            continue
        tops = {Path(str(file)).parts[0] for file in distribution.files or []}
        for top in tops - {"..", "__pycache__"}:
            source = Path(str(distribution.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)
        linked.append(name)
    return linked


def bare_python(root: Path) -> Path:
    """A virtualenv under `root` (no pip, no system site-packages) whose only packages are the
    linked closure; its interpreter."""
    site = root / "site"
    link_site(site)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv / "lib" / version / "site-packages" / "bare.pth").write_text(f"{site}\n")
    return venv / "bin" / "python"
