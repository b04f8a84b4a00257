"""The work of an export task: claim it, run `ernie-studio export` on the run's config, record the result."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import yaml

from studio.config import Settings
from studio.db import session_factory
from studio.models import Run, RunStatus
from studio.services import exports as exports_svc
from workers.process import engine_command, spawn, stop_group, tail

log = logging.getLogger(__name__)

POLL_S = 0.5
PERPLEXITY_RE = re.compile(r"^perplexity: (\{.*\})$", re.M)


def execute_export(settings: Settings, export_id: int, worker: str) -> str | None:
    """Run one export; returns its final status (None when it was not queued)."""
    factory = session_factory(settings)
    with factory() as session:
        export = exports_svc.claim_export(session, export_id, worker)
        if export is None:
            return None
        run = session.get(Run, export.run_id)
        directory = Path(run.output_dir).parent / "exports" / str(export_id)
        directory.mkdir(parents=True, exist_ok=True)
        config_file = directory / "export.yaml"
        config_file.write_text(yaml.safe_dump(exports_svc.export_config(run, export), sort_keys=False))
        log_file = directory / "export.log"
        proc = spawn(
            engine_command("export", str(config_file)),
            log_file,
            cwd=directory,
            niceness=settings.batch_niceness,
        )
        while proc.poll() is None:
            # Deleting the run ends its export.
            if session.get(Run, run.id) is None:
                stop_group(proc, settings.kill_grace_s)
                break
            exports_svc.export_heartbeat(session, export_id)
            session.expire_all()
            time.sleep(POLL_S)
        code = proc.wait()
        output = tail(log_file, 8000)
        summary_file = Path(export.export_dir) / "export_summary.json"
        if code == 0 and export.export_format == "gguf" and summary_file.exists():
            summary = json.loads(summary_file.read_text())
            exports_svc.finish_export(
                session, settings, export_id, RunStatus.SUCCEEDED, perplexity=summary.get("perplexity") or None,
                gguf_files=summary.get("gguf"),
            )  # fmt: skip
            return RunStatus.SUCCEEDED.value
        if code == 0 and (Path(export.export_dir) / "config.json").exists():
            found = PERPLEXITY_RE.findall(output)
            ppl = json.loads(found[-1]) if found else None
            exports_svc.finish_export(session, settings, export_id, RunStatus.SUCCEEDED, perplexity=ppl)
            return RunStatus.SUCCEEDED.value
        error = f"ernie-studio export exited with code {code}:\n{output[-2000:]}"
        exports_svc.finish_export(session, settings, export_id, RunStatus.FAILED, error=error)
        return RunStatus.FAILED.value
