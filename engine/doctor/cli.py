"""`ernie-studio doctor [--json] [--full]`: exit status 0 when every check passed, 1 when one failed."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from engine.doctor.report import DoctorFloors


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check this node: Paddle build, GPUs, memory, FastDeploy, and a short training self-test",
        description="Print the node's facts and run its self-tests (a tiny model must learn and train at "
        "least as fast as ERNIE_STUDIO_DOCTOR_MIN_TOKENS_PER_S). Exit status 1 when a check fails. "
        "Workers run the quick form before they take runs.",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (schema_version, facts, checks)"
    )
    p.add_argument("--full", action="store_true", help="more checks and longer measurements (about a minute)")
    p.add_argument(
        "--reuse-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="reuse a passing report of this node at most SECONDS old when its facts, floors and the "
        "engine are unchanged (workers pass ERNIE_STUDIO_DOCTOR_REUSE_S); 0 always runs the checks",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where passing reports are kept (default $XDG_CACHE_HOME/ernie-studio/doctor)",
    )
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from engine.doctor.report import format_report
    from engine.doctor.runner import run_doctor

    if not args.verbose:
        # The probes load their tiny models through the model loader, which logs each load.
        logging.getLogger("engine.models.loading").setLevel(logging.WARNING)
    if args.reuse_s < 0:
        raise SystemExit(f"--reuse-s must be 0 or more seconds, got {args.reuse_s:g}")
    report = run_doctor(full=args.full, floors=DoctorFloors(), reuse_s=args.reuse_s, cache_dir=args.cache_dir)
    if args.json:
        print(json.dumps(report.to_dict(), ensure_ascii=False), flush=True)
    else:
        print(format_report(report), flush=True)
    return 0 if report.passed else 1
