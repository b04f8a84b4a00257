"""The run directory: metrics.jsonl (one line per logged step, never duplicated), checkpoints, summary.

Checkpoints are written to ``checkpoint-N.tmp`` and renamed when complete, so a run killed while saving
resumes from the previous good checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class MetricsLog:
    """Appends one JSON object per logged step; steps already in the file are not written again."""

    def __init__(self, path: Path):
        self.path = path
        self.steps: set[int] = set()
        self.last: dict[str, Any] = {}
        if path.exists():
            text = path.read_text(encoding="utf-8")
            good, bad = [], 0 if not text or text.endswith("\n") else 1
            for line in text.splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    row = None
                if isinstance(row, dict) and "step" in row and row["step"] not in self.steps:
                    self.steps.add(row["step"])
                    good.append(line)
                    self.last = row
                else:
                    bad += 1
            if bad:
                # Only a run killed mid-write leaves such a line; readers tail the file by byte offset,
                # so it is rewritten only then, keeping every complete line where it was.
                log.warning("%s: repairing %d partly written line(s) left by an interrupted run", path, bad)
                path.write_text("".join(g + "\n" for g in good), encoding="utf-8")

    def write(self, row: dict[str, Any]) -> bool:
        if row["step"] in self.steps:
            return False
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.steps.add(row["step"])
        self.last = row
        return True


def list_checkpoints(output_dir: Path) -> list[Path]:
    found = []
    if output_dir.is_dir():
        for p in output_dir.iterdir():
            m = CHECKPOINT_RE.match(p.name)
            if m and p.is_dir() and (p / "trainer_state.json").exists():
                found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Path | None:
    cps = list_checkpoints(output_dir)
    return cps[-1] if cps else None


def begin_checkpoint(output_dir: Path, step: int) -> Path:
    tmp = output_dir / f"checkpoint-{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_checkpoint(tmp: Path) -> Path:
    final = tmp.with_name(tmp.name[: -len(".tmp")])
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
