"""Reading evaluations: the list, one evaluation and its events, its scored samples (paged, filtered to
where two evaluations differ) and two or more compared side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, aliased

from studio.models import (
    EvalSample,
    Evaluation,
    Event,
    RunStatus,
)
from studio.services.errors import InvalidInput
from studio.services.evals import SAMPLES_PAGE, get_eval


def list_evals(
    session: Session, *, run_id: int | None = None, status: str | None = None, limit: int = 200
) -> list[Evaluation]:
    """Newest first; `run_id` selects the evals of a run's result and those its evaluate-after made."""
    if status is not None and status not in {s.value for s in RunStatus}:
        raise InvalidInput(f"status: {status!r} is not one of {', '.join(s.value for s in RunStatus)}")
    q = select(Evaluation).order_by(Evaluation.id.desc()).limit(limit)
    if run_id is not None:
        q = q.where((Evaluation.run_id == run_id) | (Evaluation.after_run_id == run_id))
    if status:
        q = q.where(Evaluation.status == status)
    return list(session.scalars(q).all())


def eval_events(session: Session, eval_id: int, limit: int = 200) -> list[Event]:
    """The eval's events, oldest first (events keep their eval's id in `data`)."""
    rows = session.scalars(
        select(Event).where(Event.kind.like("eval.%")).order_by(Event.id.desc()).limit(5000)
    )
    return list(reversed([e for e in rows if (e.data or {}).get("eval_id") == eval_id][:limit]))


def samples_done(session: Session, eval_ids: list[int]) -> dict[int, int]:
    """{eval id: sample rows stored}."""
    if not eval_ids:
        return {}
    rows = session.execute(
        select(EvalSample.eval_id, func.count())
        .where(EvalSample.eval_id.in_(eval_ids))
        .group_by(EvalSample.eval_id)
    ).all()
    return {i: 0 for i in eval_ids} | dict(rows)


def list_samples(
    session: Session,
    eval_id: int,
    *,
    offset: int = 0,
    limit: int = SAMPLES_PAGE,
    dataset: str | None = None,
    compare_to: int | None = None,
    only_differ: bool = False,
) -> dict[str, Any]:
    """A page of an eval's samples in (dataset, line) order. With `compare_to` each sample carries the other
    eval's prediction and scores, the samples where the two predictions differ come first, and
    `only_differ` keeps only those."""
    if offset < 0 or not 1 <= limit <= 1000:
        raise InvalidInput("offset must be >= 0 and limit between 1 and 1000")
    get_eval(session, eval_id)
    a = aliased(EvalSample)
    q = select(a).where(a.eval_id == eval_id)
    other = None
    if compare_to is not None:
        if compare_to == eval_id:
            raise InvalidInput("compare_to: compare with another eval")
        get_eval(session, compare_to)
        other = aliased(EvalSample)
        shared = session.scalar(
            select(func.count()).select_from(a).join(other, (other.sample_id == a.sample_id) & (other.eval_id == compare_to))
            .where(a.eval_id == eval_id)
        )  # fmt: skip
        total_a = session.scalar(select(func.count()).select_from(a).where(a.eval_id == eval_id))
        if total_a and not shared:
            raise InvalidInput(
                f"compare_to: evals {eval_id} and {compare_to} share no samples; compare evals of the same datasets"
            )
        q = (
            select(a, other)
            .where(a.eval_id == eval_id)
            .outerjoin(other, (other.sample_id == a.sample_id) & (other.eval_id == compare_to))
        )
        differ = (other.id.is_(None)) | (other.prediction != a.prediction)
        if only_differ:
            q = q.where(differ)
        q = q.order_by(case((differ, 0), else_=1), a.dataset, a.line)
    else:
        if only_differ:
            raise InvalidInput("only_differ: needs compare_to, the eval to compare predictions with")
        q = q.order_by(a.dataset, a.line)
    if dataset:
        q = q.where(a.dataset == dataset)
    total = session.scalar(select(func.count()).select_from(q.order_by(None).subquery()))
    rows = session.execute(q.offset(offset).limit(limit)).all()
    items = []
    for row in rows:
        s = row[0]
        item = _sample_out(s)
        if other is not None:
            o = row[1]
            item["other"] = None if o is None else {"prediction": o.prediction, "scores": o.scores}
            item["differ"] = o is None or o.prediction != s.prediction
        items.append(item)
    return {"eval_id": eval_id, "compare_to": compare_to, "total": total, "offset": offset, "items": items}


def _sample_out(s: EvalSample) -> dict[str, Any]:
    return {
        "sample_id": s.sample_id, "dataset": s.dataset, "line": s.line, "prompt": s.prompt,
        "reference": s.reference, "prediction": s.prediction, "scores": s.scores,
    }  # fmt: skip


def compare_evals(session: Session, eval_ids: list[int]) -> dict[str, Any]:
    """Evals side by side: every headline metric (with its interval) per eval, how often the first two
    evals' predictions differ, and the pairwise judge's wins, ties and losses where one judged."""
    if not 1 <= len(eval_ids) <= 20:
        raise InvalidInput("eval_ids: compare between 1 and 20 evals")
    if len(set(eval_ids)) != len(eval_ids):
        raise InvalidInput("eval_ids: an eval is listed twice")
    evals = [get_eval(session, i) for i in eval_ids]
    names = sorted({k for ev in evals for k in (ev.metrics or {})})
    metrics = {n: {str(ev.id): (ev.metrics or {}).get(n) for ev in evals} for n in names}
    intervals: dict[str, dict[str, list[float]]] = {}
    for ev in evals:
        for ds_name, res in (ev.results or {}).items():
            for metric, value in (res.get("metrics") or {}).items():
                if isinstance(value, dict) and "ci_low" in value:
                    key = f"{Path(ds_name).stem}/{metric}"
                    intervals.setdefault(key, {})[str(ev.id)] = [value["ci_low"], value["ci_high"]]
    out: dict[str, Any] = {
        "evals": [
            {"id": ev.id, "name": ev.name, "model": ev.model, "role": ev.role, "status": ev.status}
            for ev in evals
        ],
        "metrics": metrics,
        "intervals": intervals,
        "pairwise": {str(ev.id): pairwise_summary(session, ev) for ev in evals if _pairwise(ev)},
    }
    if len(evals) >= 2:
        page = list_samples(session, evals[0].id, compare_to=evals[1].id, only_differ=True, limit=1)
        shared = _shared_samples(session, evals[0].id, evals[1].id)
        out["differ"] = {"evals": [evals[0].id, evals[1].id], "samples": page["total"], "of": shared}
    return out


def _shared_samples(session: Session, a_id: int, b_id: int) -> int:
    a, b = aliased(EvalSample), aliased(EvalSample)
    return int(
        session.scalar(
            select(func.count()).select_from(a)
            .join(b, (b.sample_id == a.sample_id) & (b.eval_id == b_id)).where(a.eval_id == a_id)
        ) or 0
    )  # fmt: skip


def _pairwise(ev: Evaluation) -> bool:
    cfg = ev.config or {}
    metrics = cfg.get("metrics") or []
    return cfg.get("judge_mode") == "pairwise" and ("judge" in metrics or metrics == "judge")


def pairwise_summary(session: Session, ev: Evaluation) -> dict[str, Any]:
    """Wins (judge > 0.5: both orders, or one order and a tie), ties and losses of a pairwise-judged eval,
    and its win rate (the mean judge score, ties counting half)."""
    scores = [
        s.get("judge") for s in session.scalars(select(EvalSample.scores).where(EvalSample.eval_id == ev.id))
    ]
    judged = [float(s) for s in scores if isinstance(s, int | float)]
    return {
        "baseline": (ev.config or {}).get("judge_baseline", "reference"),
        "wins": sum(s > 0.5 for s in judged),
        "ties": sum(s == 0.5 for s in judged),
        "losses": sum(s < 0.5 for s in judged),
        "unparsed": len(scores) - len(judged),
        "win_rate": sum(judged) / len(judged) if judged else None,
    }
