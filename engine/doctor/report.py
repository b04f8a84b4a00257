"""What a doctor run returns: the node's facts and one result per check, as one JSON object (schema below),
and the operator's floors a node must meet. No Paddle here: the CLI's parser and the studio import it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

# Bumped when a field of the JSON object changes meaning or goes away (added fields keep the version).
SCHEMA_VERSION = 1


class DoctorFloors(BaseSettings):
    """Operator floors (``ERNIE_STUDIO_DOCTOR_*``): a node below one fails its doctor and takes no runs.
    0 means no floor."""

    model_config = SettingsConfigDict(env_prefix="ERNIE_STUDIO_DOCTOR_", extra="ignore")

    # tokens/s of the throughput probe (forward + backward + optimizer step of the tiny model)
    min_tokens_per_s: float = 0.0
    # total memory of every visible GPU, in GiB
    min_device_memory_gb: float = 0.0


@dataclass
class Check:
    """One self-test: `detail` says what was measured and, when it failed, why and what to do."""

    name: str
    passed: bool
    detail: str
    duration_s: float = 0.0
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class DoctorReport:
    full: bool
    facts: dict[str, Any]
    checks: list[Check]
    floors: dict[str, float]
    duration_s: float
    # When the checks are a recent passing report of this node reused (ISO time of that run), else None.
    reused_from: str | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def to_dict(self) -> dict[str, Any]:
        """The `--json` object: schema_version, passed, full, duration_s, reused_from, floors, facts, checks."""
        return {
            "schema_version": self.schema_version,
            "passed": self.passed,
            "full": self.full,
            "duration_s": round(self.duration_s, 3),
            "reused_from": self.reused_from,
            "floors": self.floors,
            "facts": self.facts,
            "checks": [asdict(c) for c in self.checks],
        }


def failure_reason(report: dict[str, Any]) -> str:
    """One line naming every failed check of a report (its `--json` form), for the node registry."""
    failed = [c for c in report.get("checks", []) if not c.get("passed")]
    if report.get("error"):
        return str(report["error"])
    return "; ".join(f"{c['name']}: {c['detail']}" for c in failed)


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else "?"


def fact_lines(facts: dict[str, Any]) -> list[tuple[str, str]]:
    """The facts as (label, value) lines for people."""
    paddle = facts.get("paddle", {})
    build = "CUDA build" if paddle.get("compiled_with_cuda") else "CPU build"
    lines = [
        ("host", f"{facts.get('hostname')} ({facts.get('platform')}, Python {facts.get('python')})"),
        ("paddle", f"{paddle.get('version')} (commit {str(paddle.get('commit'))[:10]}), {build}"),
        ("cuda / cudnn", f"{paddle.get('cuda') or '-'} / {paddle.get('cudnn') or '-'}"),
    ]
    devices = facts.get("devices") or []
    if not devices:
        lines.append(("devices", "none (training runs on the CPU)"))
    for d in devices:
        free = f", {_gib(d.get('free_memory_bytes'))} free" if d.get("free_memory_bytes") is not None else ""
        lines.append(
            (
                f"gpu:{d['index']}",
                f"{d.get('name')} (sm{d.get('compute_capability')}), {_gib(d.get('total_memory_bytes'))}{free}",
            )
        )
    mem = facts.get("memory", {})
    lines.append(
        (
            "cpu / ram",
            f"{facts.get('cpu_count')} cores, {_gib(mem.get('total_bytes'))} RAM "
            f"({_gib(mem.get('available_bytes'))} available)",
        )
    )
    fd = facts.get("fastdeploy", {})
    lines.append(
        ("fastdeploy", f"{fd.get('version') or 'installed'}" if fd.get("available") else "not installed")
    )
    return lines


def format_report(report: DoctorReport) -> str:
    """The report for people: facts, one PASS / FAIL line per check, and the verdict."""
    out = [f"ERNIE Studio doctor ({'full' if report.full else 'quick'})"]
    out += [f"  {label:<13} {value}" for label, value in fact_lines(report.facts)]
    out.append("")
    if report.reused_from:
        out.append(f"  checks of {report.reused_from} reused: nothing they depend on has changed since")
    for c in report.checks:
        out.append(f"  {'PASS' if c.passed else 'FAIL'}  {c.name:<22} {c.detail}  [{c.duration_s:.1f} s]")
    out.append("")
    verdict = "node OK" if report.passed else f"node FAILED: {len(report.failures)} check(s) failed"
    out.append(f"{verdict} ({report.duration_s:.1f} s)")
    return "\n".join(out)
