"""Evaluate after training: a seeded split of a run's training data held out (the trainer never reads it),
and, once the run has succeeded, evaluations of the base and the result on it (with the forgetting check's
general set when the run asks for one). The evaluations are ordinary ones (`studio.services.evals`)."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from engine.data.formats_vl import resolve_image
from engine.data.records import iter_raw
from engine.eval.config import CHAT_TYPES, OCR_TYPES
from studio.config import Settings
from studio.models import (
    Dataset,
    Evaluation,
    Run,
    RunStatus,
)
from studio.services import jobs
from studio.services.datasets import dataset_path
from studio.services.errors import InvalidInput
from studio.services.evals import _limited, _queue_eval
from studio.services.events import add_event


def hold_out(
    settings: Settings,
    session: Session,
    run: Run,
    datasets: list[Dataset],
    holdout: int,
    seed: int,
    field: str,
) -> tuple[list[str], list[dict[str, Any]]]:
    """Split the run's training datasets: `holdout` records drawn at random (seeded) from all of them go to
    held-out files, the rest to the training files the trainer is given instead of the uploads, so a
    held-out record is never trained on. Returns (training file paths, held-out files as
    {"path", "type", "records"})."""
    records = []
    for ds in datasets:
        if ds.format not in (*CHAT_TYPES, *OCR_TYPES):
            raise InvalidInput(
                f"{field}: dataset {ds.id} ({ds.name}) is {ds.format}; hold out chat records "
                f"({', '.join(CHAT_TYPES)}) or OCR sets ({', '.join(OCR_TYPES)}) only"
            )
        rows = [
            r.record for r in iter_raw(dataset_path(settings, ds)) if r.error is None and r.record is not None
        ]
        records.append(rows)
    total = sum(map(len, records))
    if not 1 <= holdout < total:
        raise InvalidInput(
            f"{field}: hold out between 1 and {total - 1} records (the training data holds {total}); got {holdout}"
        )
    picked = set(random.Random(seed).sample(range(total), holdout))
    folder = eval_data_dir(settings, run.id)
    folder.mkdir(parents=True, exist_ok=True)
    train_paths, held_files, start = [], [], 0
    stems = [Path(ds.path).stem for ds in datasets]
    for ds, rows, stem in zip(datasets, records, stems, strict=True):
        name = stem if stems.count(stem) == 1 else f"{stem}-{ds.id}"
        keep = [r for i, r in enumerate(rows) if start + i not in picked]
        held = [r for i, r in enumerate(rows) if start + i in picked]
        start += len(rows)
        if not keep:
            raise InvalidInput(
                f"{field}: holding out {holdout} records leaves dataset {ds.id} ({ds.name}) nothing to train "
                "on; hold out fewer"
            )
        where = folder
        if ds.format in OCR_TYPES:  # images are read relative to the data file: the split gets their links
            where = folder / name
            _link_images(dataset_path(settings, ds).parent, rows, where)
        train_paths.append(str(_write_jsonl(where / f"{name}.train.jsonl", keep)))
        if held:
            path = _write_jsonl(where / f"{name}.holdout.jsonl", held)
            held_files.append({"path": str(path), "type": ds.format, "records": len(held)})
    return train_paths, held_files


def _link_images(base: Path, rows: list[Any], folder: Path) -> None:
    """Every local image OCR records name (inside the dataset folder `base`), hard-linked (copied across file
    systems) into `folder` at the same relative path, so split files there read them as the upload did. An
    image that is missing or outside the folder is left for the trainer to report by line; a URL is fetched
    by the run."""
    folder.mkdir(parents=True, exist_ok=True)
    root = base.resolve()
    for url in (u for r in rows for u in _image_refs(r)):
        if url.startswith(("http://", "https://")):
            continue
        path, why = resolve_image(url, base)
        if path is None or why is not None:
            continue
        target = folder / path.relative_to(root)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)


def _image_refs(record: Any) -> list[str]:
    """The image paths an OCR record names: an OCR pair's `image`, ERNIEKit's `image_info[].image_url`."""
    if not isinstance(record, dict):
        return []
    infos = record.get("image_info")
    urls = [i.get("image_url") for i in infos if isinstance(i, dict)] if isinstance(infos, list) else []
    return [u for u in [record.get("image"), *urls] if isinstance(u, str) and u]


def eval_data_dir(settings: Settings, run_id: int) -> Path:
    """Where a run's training split and held-out files are written (inside its run directory)."""
    return settings.runs_dir / str(run_id) / "data"


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def evaluate_after(session: Session, settings: Settings, run: Run) -> list[Evaluation]:
    """Queue the base and the result evals of a succeeded run with "evaluate after training"; once only
    (the worker and the reconciler may both ask: (after_run_id, role) is unique)."""
    plan = run.evaluate
    if not plan or run.status != RunStatus.SUCCEEDED:
        return []
    if session.scalar(select(func.count()).where(Evaluation.after_run_id == run.id)):
        return []
    datasets = [session.get(Dataset, i) for i in plan.get("dataset_ids") or []]
    files = [(f["path"], f["type"]) for f in plan.get("holdout_files") or []]
    files += [(str(dataset_path(settings, ds)), ds.format) for ds in datasets if ds is not None]
    general = plan.get("general_files") or []  # the forgetting check's sets (studio.services.forgetting)
    files += [(f["path"], f["type"]) for f in general]
    options = dict(plan.get("options") or {})
    counts = [f.get("records", 0) for f in [*(plan.get("holdout_files") or []), *general]]
    counts += [ds.num_valid or ds.num_records for ds in datasets if ds is not None]
    total = sum(_limited(n, options) for n in counts)
    ids = [ds.id for ds in datasets if ds is not None]
    ids += [i for i in (plan.get("general") or {}).get("dataset_ids") or [] if i not in ids]
    sides = (
        ("base", run.base_model, run.config.get("model_name_or_path", ""), None),
        ("result", f"run:{run.id}", run.model_dir or run.output_dir, run.id),
    )
    made = []
    try:
        for role, ref, directory, run_id in sides:
            made.append(
                _queue_eval(
                    session, settings, name=f"{run.name} · {role}", model=ref, model_dir=directory, run_id=run_id,
                    dataset_ids=ids, files=files, options=options, samples_total=total, after_run_id=run.id,
                    role=role, commit=False,
                )
            )  # fmt: skip
        session.commit()
    except IntegrityError:  # another process queued them first
        session.rollback()
        return []
    except InvalidInput as e:  # a held-out file or dataset went away: say so on the run
        session.rollback()
        add_event(session, "run.evaluate_failed", e.message, run_id=run.id)
        session.commit()
        return []
    for ev in made:
        jobs.dispatch(session, settings, jobs.EVALS, ev)
    return made


def evaluate_finished_runs(session: Session, settings: Settings) -> int:
    """The reconciler's part: succeeded runs with evaluate-after whose evals were never queued (the worker
    died between finishing the run and queueing them)."""
    has_evals = select(Evaluation.id).where(Evaluation.after_run_id == Run.id).exists()
    pending = session.scalars(
        select(Run).where(Run.status == RunStatus.SUCCEEDED, Run.evaluate.is_not(None), ~has_evals)
    ).all()
    return sum(bool(evaluate_after(session, settings, run)) for run in pending)
