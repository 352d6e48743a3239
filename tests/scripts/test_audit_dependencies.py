"""The dependency audit's decisions, offline: what fails the build and what the allowlist accepts.

`fetch_project` is replaced by canned answers in the shape of PyPI's project JSON (a stand-in for
the network, which the audit's real sources need); the rest is the audit's own code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import audit_dependencies as audit
import pytest
from audit_dependencies import ConfigError, Package, read_allowlist, summarize

ADVISORY = {
    "id": "GHSA-aaaa-bbbb-cccc",
    "aliases": ["PYSEC-2024-1", "CVE-2024-0001"],
    "fixed_in": ["2.0.0"],
    "withdrawn": None,
}


def project(latest: str, *vulnerabilities: dict[str, Any]) -> dict[str, Any]:
    return {"info": {"version": latest}, "releases": {}, "vulnerabilities": list(vulnerabilities)}


def run_audit(
    monkeypatch: pytest.MonkeyPatch,
    answers: dict[str, dict[str, Any] | None],
    allowlist: Path,
    *packages: Package,
) -> int:
    def fetch(name: str) -> tuple[int, dict[str, Any] | None, str]:
        answer = answers[name]
        return (200, answer, "") if answer is not None else (503, None, "HTTP 503")

    monkeypatch.setattr(audit, "fetch_project", fetch)
    monkeypatch.setattr(audit, "PIP_AUDIT_SERVICES", {})  # only the project JSON source
    report = audit.audit(list(packages))
    return summarize(report, read_allowlist(allowlist), allowlist)


def test_a_known_vulnerability_fails_and_its_allowlist_entry_passes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its alias in the latest release's data and a duplicate under another id: one finding.
    twin = {**ADVISORY, "id": "PYSEC-2024-1", "aliases": ["GHSA-aaaa-bbbb-cccc"]}
    answers = {"lib": project("1.0.0", ADVISORY, twin)}
    empty = tmp_path / "none.txt"
    assert run_audit(monkeypatch, answers, empty, Package("lib", "1.0.0")) == 1
    out = capsys.readouterr().out
    assert out.count("VULNERABLE lib 1.0.0") == 1 and "fixed in 2.0.0" in out

    allow = tmp_path / "allow.txt"
    allow.write_text("CVE-2024-0001 lib no fixed release we can take yet: tracked in #12\n")
    assert run_audit(monkeypatch, answers, allow, Package("lib", "1.0.0")) == 0
    assert "ALLOWED lib 1.0.0 GHSA-aaaa-bbbb-cccc" in capsys.readouterr().out


def test_an_advisory_fixed_at_or_before_the_installed_release_does_not_count(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    answers = {"lib": project("2.0.0", ADVISORY)}
    assert run_audit(monkeypatch, answers, tmp_path / "none", Package("lib", "2.0.0+cpu")) == 0


def test_an_older_release_is_audited_in_part_and_fails_only_when_exactness_is_required(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    answers = {"lib": project("3.0.0")}
    assert run_audit(monkeypatch, answers, tmp_path / "none", Package("lib", "2.5.0")) == 0
    assert "PARTIAL lib: installed 2.5.0, latest 3.0.0" in capsys.readouterr().out
    monkeypatch.setenv("KPO_AUDIT_REQUIRE_EXACT", "1")
    assert run_audit(monkeypatch, answers, tmp_path / "none", Package("lib", "2.5.0")) == 2


def test_no_data_fails_unless_allowed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    answers: dict[str, dict[str, Any] | None] = {"lib": None}
    assert run_audit(monkeypatch, answers, tmp_path / "none", Package("lib", "1.0.0")) == 2
    monkeypatch.setenv("KPO_AUDIT_ALLOW_UNREACHABLE", "1")
    assert run_audit(monkeypatch, answers, tmp_path / "none", Package("lib", "1.0.0")) == 0


def test_an_allowlist_entry_needs_a_reason(tmp_path: Path) -> None:
    allow = tmp_path / "allow.txt"
    allow.write_text("# comment\n\nCVE-1 lib\n")
    with pytest.raises(ConfigError, match=r"allow.txt:3: want `ID PACKAGE WHY`"):
        read_allowlist(allow)
