"""The forgetting check of "evaluate after training" (issue 33): general sets (built-in MMLU / C-Eval /
GSM8K-style files, or the person's own eval datasets) are scored with the run's task sets by the base and the
result evals; once both have succeeded, the task gain and the general change, with paired bootstrap
intervals (engine.eval.general), are kept on the run (`run.evaluate["forgetting"]`, returned as the run's
`forgetting`), with a warning when the general score fell by more than the margin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.eval.general import GENERAL_SETS, forgetting_summary, general_set_path
from engine.eval.items import EvalDataError, read_eval_file
from studio.config import Settings
from studio.models import Dataset, EvalSample, Evaluation, Run, RunStatus
from studio.schemas import RequestModel
from studio.services.datasets import dataset_path
from studio.services.errors import InvalidInput
from studio.services.events import add_event
from studio.services.store import RowId

MAX_GENERAL = 16


class GeneralCheck(RequestModel):
    """General sets scored on the base and the result beside the task, and the change that warns."""

    sets: list[str] = Field(
        default_factory=list,
        max_length=len(GENERAL_SETS),
        description=f"built-in general sets: {', '.join(GENERAL_SETS)}",
    )
    dataset_ids: list[RowId] = Field(
        default_factory=list,
        max_length=MAX_GENERAL,
        description="the person's own general sets: eval datasets (benchmark files or chat records)",
    )
    margin: float = Field(
        default=0.05,
        ge=0,
        le=1,
        description="warn when the general score (accuracy, 0-1) fell by more than this",
    )


def general_files(
    settings: Settings, check: GeneralCheck, datasets: list[Dataset], field: str
) -> list[dict[str, Any]]:
    """The general sets as files the evals read: {"path", "type", "records"}; `datasets` are
    `check.dataset_ids` as `evals.eval_datasets` accepted them. Every problem names `field`."""
    if not check.sets and not check.dataset_ids:
        raise InvalidInput(f"{field}: give sets ({', '.join(GENERAL_SETS)}) or dataset_ids (your own)")
    files = []
    for name in dict.fromkeys(check.sets):
        if name not in GENERAL_SETS:
            raise InvalidInput(
                f"{field}.sets: no built-in general set is called {name!r}; pick from {', '.join(GENERAL_SETS)}"
            )
        path = general_set_path(name)
        try:
            kind = read_eval_file(str(path), "auto")
        except EvalDataError as e:  # a broken install, not the request
            raise RuntimeError(f"built-in general set {path}: {e}") from e
        files.append({"path": str(path), "type": kind.type, "records": len(kind.items)})
    for ds in datasets:
        records = ds.num_valid or ds.num_records
        files.append({"path": str(dataset_path(settings, ds)), "type": ds.format, "records": records})
    return files


def check_names(task: list[str], general: list[str], field: str) -> None:
    """The evals key samples by file name: a general set may not share one with a task file."""
    clash = sorted({Path(p).name for p in task} & {Path(p).name for p in general})
    if clash:
        raise InvalidInput(
            f"{field}: {', '.join(clash)} is both a task file and a general set; the evals key samples by file "
            "name, so rename the upload"
        )


def _samples(session: Session, eval_id: int) -> dict[str, tuple[str, dict[str, Any]]]:
    rows = session.execute(
        select(EvalSample.sample_id, EvalSample.dataset, EvalSample.scores).where(
            EvalSample.eval_id == eval_id
        )
    )
    return {sid: (dataset, scores or {}) for sid, dataset, scores in rows}


def record(session: Session, run_id: int | None) -> dict[str, Any] | None:
    """Once the base and the result evals of a run with a general check have both succeeded, keep the
    summary on the run (once; the second eval to finish does it) and say what it found as an event."""
    if run_id is None:
        return None
    # locked, and read afresh (sessions keep objects across commits): the two evals may end together
    query = select(Run).where(Run.id == run_id).with_for_update()
    run = session.scalar(query.execution_options(populate_existing=True))
    plan = run.evaluate if run is not None else None
    if not plan or not plan.get("general_files") or plan.get("forgetting"):
        session.rollback()  # the lock
        return None
    evals = {
        ev.role: ev
        for ev in session.scalars(select(Evaluation).where(Evaluation.after_run_id == run_id)).all()
    }
    if set(evals) != {"base", "result"} or any(e.status != RunStatus.SUCCEEDED for e in evals.values()):
        session.rollback()
        return None
    general = {Path(f["path"]).name for f in plan["general_files"]}
    margin = float((plan.get("general") or {}).get("margin", 0.05))
    summary = forgetting_summary(
        _samples(session, evals["base"].id), _samples(session, evals["result"].id), general, margin,
        seed=int(plan.get("seed") or 0),
    )  # fmt: skip
    summary["eval_ids"] = {"base": evals["base"].id, "result": evals["result"].id}
    run.evaluate = {**plan, "forgetting": summary}
    add_event(session, *_event(summary), run_id=run_id, data={"forgetting": summary})
    session.commit()
    return summary


def _event(summary: dict[str, Any]) -> tuple[str, str]:
    g = summary["general"] or {}
    change = g.get("change")
    said = "no scored general samples" if change is None else f"{g['base']:.3f} -> {g['result']:.3f}"
    if summary["warning"]:
        return (
            "run.forgetting_warning",
            f"general score fell by more than {summary['margin']:g} ({said}): the fine-tune lost general ability",
        )
    return "run.forgetting_checked", f"general score {said}, within the margin {summary['margin']:g}"
