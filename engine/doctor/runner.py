"""Runs the doctor: facts first, then the checks in order, each timed; a check that raises fails with the
error instead of stopping the others."""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from engine.doctor import reuse
from engine.doctor.collectives import collective_check
from engine.doctor.facts import node_facts
from engine.doctor.fastdeploy_probe import fastdeploy_checks
from engine.doctor.gpu_checks import gpu_checks
from engine.doctor.llamacpp_probe import llamacpp_checks
from engine.doctor.probes import (
    device_check,
    fast_path_checks,
    sharding_check,
    throughput_probe,
    training_probe,
)
from engine.doctor.report import Check, DoctorFloors, DoctorReport
from engine.models.initialize import init_model

log = logging.getLogger(__name__)


class Probe:
    """What every check gets: the facts, the floors, quick or full, and tiny model dirs built on demand."""

    def __init__(self, facts: dict, floors: DoctorFloors, full: bool, workdir: Path) -> None:
        self.facts = facts
        self.floors = floors
        self.full = full
        self.workdir = workdir

    def model_dir(self, preset: str) -> Path:
        """A random-initialised `preset` model (as `init-model` writes it), built once per doctor run."""
        out = self.workdir / preset
        if not out.exists():
            init_model(preset, out, seed=0)
        return out


# The seam: (name, what turns a Probe into checks), run in this order; the name stands for the checks when
# the callable raises. An entry returns [] when it does not apply (quick form, module not installed).
CHECKS: list[tuple[str, Callable[[Probe], list[Check]]]] = [
    ("devices", lambda p: [device_check(p.facts, p.floors)]),
    ("collectives", lambda p: [collective_check(p.facts)]),
    ("fast_paths", lambda p: fast_path_checks(quick=not p.full)),
    ("sharding", lambda p: [sharding_check()]),
    ("training_probe", lambda p: [training_probe(p.model_dir("tiny"))]),
    (
        "training_probe_moe",
        lambda p: [training_probe(p.model_dir("tiny-moe"), "training_probe_moe", steps=40)] if p.full else [],
    ),
    (
        "throughput",
        lambda p: [throughput_probe(p.model_dir("tiny"), p.floors, timed_steps=12 if p.full else 4)],
    ),
    # --help against the launcher's flags; --full on a GPU node also serves the tiny model through FastDeploy
    (
        "fastdeploy",
        lambda p: fastdeploy_checks(p.facts, p.model_dir("tiny") if p.full and p.facts["devices"] else None),
    ),
    # llama-server's --help against the flags `serve --backend llamacpp` passes (CPU serving)
    ("llamacpp", lambda p: llamacpp_checks()),
    # --full: fp16 loss scaling, fp32 rotary tables and the mixed-dtype all-reduce on the GPUs themselves
    ("gpu_checks", lambda p: gpu_checks(p.facts, p.model_dir, p.workdir) if p.full else []),
]


def run_doctor(
    full: bool = False,
    floors: DoctorFloors | None = None,
    reuse_s: float = 0.0,
    cache_dir: Path | None = None,
) -> DoctorReport:
    """The node's facts and self-tests; the quick form takes a few seconds on a 2-core CPU. With
    ``reuse_s`` > 0, a passing report of the same node, floors, form and engine at most that old (in
    ``cache_dir``) stands in for the self-tests; the facts are always read afresh."""
    floors = floors or DoctorFloors()
    start = time.perf_counter()
    facts = node_facts()
    cache_dir = cache_dir or reuse.default_cache_dir()
    key = reuse.report_key(facts, floors.model_dump(), full)
    if (
        reuse_s > 0
        and (reused := reuse.reused(key, facts, floors, full, reuse_s, cache_dir, start)) is not None
    ):
        return reused
    checks: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="ernie-doctor-") as tmp:
        probe = Probe(facts, floors, full, Path(tmp))
        for name, make in CHECKS:
            t0 = time.perf_counter()
            try:
                made = make(probe)
            except Exception as e:  # one broken probe must not hide the others' results
                log.debug("doctor check failed", exc_info=True)
                made = [Check(name, False, f"{type(e).__name__}: {e}")]
            for c in made:
                c.duration_s = c.duration_s or round((time.perf_counter() - t0) / len(made), 3)
            checks += made
    report = DoctorReport(
        full=full,
        facts=facts,
        checks=checks,
        floors=floors.model_dump(),
        duration_s=time.perf_counter() - start,
    )
    reuse.save(cache_dir, key, report.to_dict())
    return report
