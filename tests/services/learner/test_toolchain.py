"""What compiled layers need of the machine (services/learner/toolchain.py): a compiler found as
Triton and inductor look for one, and Python.h; each missing piece named."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from services.learner.toolchain import compile_problem, compiler, python_header
from tests.services.learner.conftest import make_core


def executable(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def headers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An include folder standing in for this interpreter's; Python.h is added by the test."""
    include = tmp_path / "include"
    include.mkdir()
    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**paths, "include": str(include)})
    return include


def test_a_gpu_compiler_is_cc_var_else_gcc_else_clang_and_cpu_takes_cxx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = tmp_path / "bin"
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    assert compiler("cuda") is None and compiler("cpu") is None
    executable(tools, "cc")
    assert compiler("cuda") is None  # Triton looks for gcc and clang, not cc
    clang = executable(tools, "clang")
    assert compiler("cuda") == str(clang)
    gcc = executable(tools, "gcc")
    assert compiler("cuda") == str(gcc)  # gcc first, as Triton takes it
    assert compiler("cpu") is None  # inductor's CPU code is C++
    named = executable(tmp_path / "elsewhere", "my-cc")
    monkeypatch.setenv("CC", str(named))
    assert compiler("cuda") == str(named)
    monkeypatch.setenv("CC", str(tmp_path / "missing-cc"))
    assert compiler("cuda") is None  # a named compiler that is not there is not replaced


def test_the_problem_names_each_missing_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, headers: Path
) -> None:
    tools = tmp_path / "bin"
    monkeypatch.setenv("PATH", str(tools))
    monkeypatch.delenv("CC", raising=False)
    problem = compile_problem("cuda")
    assert problem is not None and "no C compiler" in problem and "Python.h" in problem
    executable(tools, "gcc")
    problem = compile_problem("cuda")
    assert problem is not None and "compiler" not in problem.split(":", 1)[1]
    assert str(headers) in problem
    (headers / "Python.h").write_text("/* the header */\n")
    assert python_header() == headers / "Python.h"
    assert compile_problem("cuda") is None
    monkeypatch.setenv("CC", "not-a-compiler")
    problem = compile_problem("cuda")
    assert problem is not None and "$CC='not-a-compiler'" in problem
    assert "no C++ compiler (g++" in (compile_problem("cpu") or "")


def test_a_learner_that_cannot_compile_says_so_before_loading_the_model(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-compilers"))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match=r"learner.compile: .*no C\+\+ compiler"):
        make_core(tiny_model_dir, compile=True)
    make_core(tiny_model_dir, compile=False)  # the same machine trains uncompiled
