"""What `learner.compile` needs of the machine beyond torch: a compiler and Python's headers.

torch.compile's code is built on the spot. On a GPU, Triton compiles a small C launcher for each
kernel with a C compiler ($CC, else gcc, else clang: as `triton.runtime.build` looks for one)
against Python.h; on CPU, inductor compiles C++ ($CXX, else g++/c++/clang++) against the same
headers. A slim GPU image often has neither, and the failure then comes from deep inside the
first compiled step; `compile_problem` says it before anything is built.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

# The variable a user sets to name a compiler, and the names searched for without one.
_COMPILERS = {
    "cuda": ("CC", ("gcc", "clang")),
    "cpu": ("CXX", ("g++", "c++", "clang++")),
}


def compiler(device_type: str) -> str | None:
    """The compiler compiled code would be built with on `device_type`; None if none is found."""
    variable, names = _COMPILERS["cuda" if device_type == "cuda" else "cpu"]
    named = os.environ.get(variable)
    if named:
        return shutil.which(named)
    return next((found for name in names if (found := shutil.which(name))), None)


def python_header() -> Path | None:
    """This interpreter's Python.h, None if its headers are not installed."""
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return header if header.is_file() else None


def compile_problem(device_type: str) -> str | None:
    """Why compiled layers cannot be built on `device_type` here; None if they can."""
    variable, names = _COMPILERS["cuda" if device_type == "cuda" else "cpu"]
    missing = []
    if compiler(device_type) is None:
        named = os.environ.get(variable)
        missing.append(
            f"${variable}={named!r} is not an executable" if named else
            f"no C{'' if device_type == 'cuda' else '++'} compiler ({', '.join(names)}) on PATH"
        )  # fmt: skip
    if python_header() is None:
        include = sysconfig.get_paths()["include"]
        missing.append(f"no Python.h in {include} (install the python3-dev package)")
    if not missing:
        return None
    return "compiled layers need a compiler and Python's headers: " + "; ".join(missing)
