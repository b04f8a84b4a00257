"""Evaluations as a person handles them: create one for a run, an export, a deployment's model or a base
model on chosen datasets; get, cancel, resume, delete; the worker's side of the record. Reading them (the
list, scored samples, comparisons) is `studio.services.eval_reads`; "evaluate after training" (a held-out
split, the base and the result evaluated once the run succeeded) is `studio.services.eval_after`.

The engine does the scoring (`ernie-studio eval`, `engine.eval`); the job's life cycle is
`studio.services.jobs` (kind EVALS), the worker side `workers/evaluating.py`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from engine.eval.config import BENCHMARK_TYPES, CHAT_TYPES, OCR_TYPES, EvalConfig, option_problems
from engine.messages import Word
from engine.train.config_load import config_from_dict
from engine.train.options import ConfigError
from studio import queue
from studio.config import Settings
from studio.models import (
    TERMINAL_RUN_STATUSES,
    Dataset,
    Deployment,
    EvalSample,
    Evaluation,
    Export,
    Run,
    RunStatus,
    utcnow,
)
from studio.schemas import RequestModel
from studio.services import forgetting, jobs
from studio.services.datasets import BENCHMARK, dataset_path, get_dataset
from studio.services.errors import Conflict, InvalidInput
from studio.services.events import add_event
from studio.services.messages import SERVICES, not_succeeded
from studio.services.models import is_ocr_model, model_dir_for
from studio.services.paths import confine
from studio.services.run_lifecycle import _insert_ignore
from studio.services.store import RowId, get_or_404

MAX_DATASETS = 16
MAX_KEY = 4096
MAX_NAME = 200
SAMPLES_PAGE = 50
# EvalConfig keys the studio fills in itself (paths under home, secrets from the worker's environment).
MANAGED = {
    "model_name_or_path": "pick the model with model, run_id, export_id or deployment_id",
    "output_dir": "the studio writes every eval under evals/<id>/output",
    "logging_dir": "the studio writes every eval under evals/<id>/output",
    "eval_dataset_path": "upload eval files as datasets and pass their ids in dataset_ids",
    "eval_dataset_type": "the studio reads each dataset's format",
    "eval_dataset_prob": "every record of every dataset is scored",
    "judge_baseline": "pass judge_baseline_eval_id (an eval of the baseline model on the same datasets)",
    "judge_api_key": "pass judge_api_key beside options (it is kept out of the config), or set "
    "ERNIE_STUDIO_JUDGE_API_KEY and ERNIE_STUDIO_JUDGE_URLS in the workers' environment",
}
EVAL_KEYS = {f.name for f in dataclasses.fields(EvalConfig)}


class EvalSpec(RequestModel):
    """One model on one or more datasets; `options` are `ernie-studio eval` keys (docs/evaluation.md)."""

    name: str | None = Field(default=None, max_length=MAX_NAME)
    model: str | None = Field(
        default=None,
        max_length=1024,
        description="a name /api/v1/models lists (preset, local model, run:<id>)",
    )
    run_id: RowId | None = Field(default=None, description="a succeeded run: its result")
    export_id: RowId | None = Field(default=None, description="a succeeded export")
    deployment_id: RowId | None = Field(default=None, description="a deployment: the model it serves")
    dataset_ids: list[RowId] = Field(min_length=1, max_length=MAX_DATASETS)
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="ernie-studio eval keys (metrics, max_new_tokens, normalize, judge_url, ...); paths and "
        "keys the studio sets are refused",
    )
    judge_deployment_id: RowId | None = Field(
        default=None, description="a running deployment that judges (sets judge_url)"
    )
    judge_baseline_eval_id: RowId | None = Field(
        default=None, description="pairwise judging against this eval's predictions (same datasets)"
    )
    judge_api_key: SecretStr | None = Field(
        default=None,
        description="the key of an external judge (options.judge_url): kept in evals/<id>/judge_api_key "
        "(mode 600) and handed to the scorer in its environment; never returned nor written to the config",
    )


# ---- choices -> the engine's config ----------------------------------------------------------------------


def check_options(options: dict[str, Any], field: str) -> None:
    """Keys the engine knows, never the ones the studio sets, plain values only."""
    problems = []
    for key, value in options.items():
        if key in MANAGED:
            problems.append(f"{field}.{key}: set by the studio; {MANAGED[key]}")
        elif key not in EVAL_KEYS:
            import difflib

            close = difflib.get_close_matches(key, sorted(EVAL_KEYS - set(MANAGED)), n=1)
            problems.append(
                f"{field}.{key}: not an ernie-studio eval key"
                + (f"; did you mean {close[0]!r}?" if close else "")
            )
        elif not _plain(value):
            problems.append(
                f"{field}.{key}: must be a string, number, boolean or list of strings, got {value!r}"
            )
    if problems:
        raise InvalidInput("; ".join(problems), details=problems)


def _plain(value: Any) -> bool:
    if isinstance(value, list):
        return all(isinstance(v, str) for v in value)
    return isinstance(value, str | int | float | bool)


def engine_config(
    model_dir: str,
    files: list[tuple[str, str]],
    options: dict[str, Any],
    output_dir: str,
    field: str,
    *,
    ocr_model: bool,
) -> dict[str, Any]:
    """The `ernie-studio eval` config, checked by the engine (choices, bounds, required keys, and options
    that would score nothing for the model's kind: `ocr_model` is a PaddleOCR-VL model's)."""
    cfg = {
        **options,
        "model_name_or_path": model_dir,
        "output_dir": output_dir,
        "eval_dataset_type": ",".join(t for _, t in files),
        "eval_dataset_path": ",".join(p for p, _ in files),
    }
    try:
        config = config_from_dict(EvalConfig, cfg, source="eval")
    except (ConfigError, ValueError, TypeError) as e:
        raise InvalidInput(f"{field}: {str(e).removeprefix('eval: ')}") from None
    problems = [f"{field}.{p}" for p in option_problems(config, ocr_model)]
    if problems:
        raise InvalidInput("; ".join(problems), details=problems)
    return cfg


def eval_datasets(session: Session, settings: Settings, ids: list[int], field: str) -> list[Dataset]:
    """The datasets `ids` name; each must hold chat records the engine generates and scores, benchmark
    questions (multiple_choice, gsm8k), or OCR pairs a PaddleOCR-VL model reads (`check_model_reads`)."""
    datasets = [get_dataset(session, i) for i in ids]
    if len(set(ids)) != len(ids):
        raise InvalidInput(f"{field}: a dataset is listed twice")
    for ds in datasets:
        chat = ds.kind == "sft" and ds.format in (*CHAT_TYPES, *OCR_TYPES)
        if not chat and not (ds.kind == BENCHMARK and ds.format in BENCHMARK_TYPES):
            raise InvalidInput(
                f"{field}: dataset {ds.id} ({ds.name}) holds {ds.format} {ds.kind} records; evaluation "
                f"scores chat records ({', '.join(CHAT_TYPES)}) whose last answer is the reference, "
                f"benchmark files ({', '.join(BENCHMARK_TYPES)}), or OCR sets ({', '.join(OCR_TYPES)}: images "
                "with their text) read by a PaddleOCR-VL model"
            )
    names = [Path(ds.path).name for ds in datasets]
    for ds, n in zip(datasets, names, strict=True):
        if names.count(n) > 1:
            raise InvalidInput(
                f"{field}: two datasets are files named {n} (dataset {ds.id} is one); the engine keys samples "
                "by file name, so evaluate them separately"
            )
    return datasets


def check_model_reads(datasets: list[Dataset], ocr_model: bool, model: str, field: str) -> None:
    """A PaddleOCR-VL model is evaluated on OCR sets only, and other models never on them."""
    for ds in datasets:
        if ds.format in OCR_TYPES and not ocr_model:
            raise InvalidInput(
                f"{field}: dataset {ds.id} ({ds.name}) is an OCR set (images with the text they show), which a "
                f"PaddleOCR-VL model reads, and {model} is not one; evaluate a PaddleOCR-VL model (or a run "
                "fine-tuned from one) on it"
            )
        if ocr_model and ds.format not in OCR_TYPES:
            raise InvalidInput(
                f"{field}: dataset {ds.id} ({ds.name}) holds {ds.format} records, and {model} is a PaddleOCR-VL "
                "model, which reads images; evaluate it on an OCR set (image + text pairs) and this dataset "
                "with a text model"
            )


def _resolve_model(session: Session, settings: Settings, spec: EvalSpec) -> tuple[str, str, int | None, str]:
    """(reference, model dir, run id, default name) of the one model `spec` names."""
    given = [k for k in ("model", "run_id", "export_id", "deployment_id") if getattr(spec, k) is not None]
    if len(given) != 1:
        raise InvalidInput(
            "give exactly one of model (a /models name), run_id, export_id or deployment_id"
            + (f"; got {', '.join(given)}" if given else "")
        )
    if spec.run_id is not None:
        run = get_or_404(session, Run, spec.run_id, "run")
        if run.status != RunStatus.SUCCEEDED:
            raise Conflict(not_succeeded("run", run.id, run.status, "evaluate", "run_id"))
        directory = confine(settings, run.model_dir or run.output_dir, field="run_id")
        return f"run:{run.id}", str(directory), run.id, run.name
    if spec.export_id is not None:
        export = get_or_404(session, Export, spec.export_id, "export")
        if export.status != RunStatus.SUCCEEDED:
            raise Conflict(not_succeeded("export", export.id, export.status, "evaluate", "export_id"))
        if export.export_format == "gguf":
            raise InvalidInput(
                f"export_id: export {export.id} is a GGUF export, which only llama.cpp runs, and evaluation runs "
                f"the model in Paddle; evaluate the run it was exported from (run_id {export.run_id})"
            )
        directory = confine(settings, export.export_dir, field="export_id")
        return f"export:{export.id}", str(directory), export.run_id, Path(export.export_dir).name
    if spec.deployment_id is not None:
        dep = get_or_404(session, Deployment, spec.deployment_id, "deployment")
        if Path(dep.model_dir).suffix == ".gguf":
            raise InvalidInput(
                f"deployment_id: deployment {dep.id} serves a GGUF file with llama.cpp, and evaluation runs "
                "the model in Paddle; evaluate the run the GGUF was exported from (run_id)"
            )
        directory = confine(settings, dep.model_dir, field="deployment_id", roots=settings.extra_model_roots)
        return f"deployment:{dep.id}", str(directory), dep.run_id, dep.name
    directory = model_dir_for(session, settings, spec.model or "", field="model")
    return spec.model.strip(), str(directory), None, Path(directory).name


def _judge_options(session: Session, settings: Settings, spec: EvalSpec, options: dict[str, Any]) -> None:
    """The judge a spec names (a running deployment, or an external URL with its key) and its pairwise
    baseline, as engine options; what the judge is given must be used, so the judge metric must be asked for."""
    given = [
        k
        for k in ("judge_deployment_id", "judge_baseline_eval_id", "judge_api_key")
        if getattr(spec, k) is not None
    ]
    if given and "judge" not in _metric_names(options):
        raise InvalidInput(
            f"{given[0]}: options.metrics has no judge; add judge to the metrics to use the judge"
        )
    _judge_endpoint(session, spec, options)
    if spec.judge_baseline_eval_id is not None:
        _judge_baseline(session, spec, options)


def _judge_endpoint(session: Session, spec: EvalSpec, options: dict[str, Any]) -> None:
    if spec.judge_deployment_id is not None and options.get("judge_url"):
        raise InvalidInput(
            "judge_deployment_id: judge with a deployment of the studio or with options.judge_url, not both"
        )
    if spec.judge_api_key is not None:
        key = spec.judge_api_key.get_secret_value()
        if not options.get("judge_url"):
            raise InvalidInput(
                "judge_api_key: the key of an external judge needs options.judge_url (its .../v1 URL); a "
                "deployment of the studio (judge_deployment_id) needs no key"
            )
        if not key.strip() or len(key) > MAX_KEY or any(c.isspace() for c in key):
            raise InvalidInput(f"judge_api_key: must be 1 to {MAX_KEY} characters without spaces")
    if spec.judge_deployment_id is not None:
        dep = get_or_404(session, Deployment, spec.judge_deployment_id, "deployment")
        if dep.status != "running" or not dep.url:
            raise Conflict(
                f"judge_deployment_id: deployment {dep.id} is {dep.status}; judge with a running deployment"
            )
        options["judge_url"] = dep.url.rstrip("/") + ("" if dep.url.rstrip("/").endswith("/v1") else "/v1")


def _judge_baseline(session: Session, spec: EvalSpec, options: dict[str, Any]) -> None:
    base = get_eval(session, spec.judge_baseline_eval_id)
    if base.status != RunStatus.SUCCEEDED:
        raise Conflict(
            f"judge_baseline_eval_id: eval {base.id} is {base.status}; judge against a finished eval"
        )
    if options.setdefault("judge_mode", "pairwise") != "pairwise":
        raise InvalidInput(
            f"judge_baseline_eval_id: a baseline is for judge_mode pairwise; options.judge_mode is "
            f"{options['judge_mode']!r}"
        )
    missing = [i for i in spec.dataset_ids if i not in (base.dataset_ids or [])]
    if missing:
        raise InvalidInput(
            f"judge_baseline_eval_id: eval {base.id} did not score dataset(s) {missing}; the baseline must "
            "have predictions for the same datasets"
        )
    options["judge_baseline"] = str(Path(base.output_dir) / "eval_samples.jsonl")


def _metric_names(options: dict[str, Any]) -> list[str]:
    metrics = options.get("metrics", EvalConfig().metrics)
    return [str(m).strip() for m in (metrics.split(",") if isinstance(metrics, str) else metrics)]


def judge_key_path(settings: Settings, eval_id: int) -> Path:
    """The external judge's key of an eval (only the studio and its workers read it)."""
    return eval_dir(settings, eval_id) / "judge_api_key"


def _write_key(path: Path, key: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(key)


def create_eval(session: Session, settings: Settings, spec: EvalSpec) -> Evaluation:
    """Record a queued evaluation and put it on the training workers' queue."""
    check_options(spec.options, "options")
    ref, model_dir, run_id, default_name = _resolve_model(session, settings, spec)
    datasets = eval_datasets(session, settings, list(spec.dataset_ids), "dataset_ids")
    ocr_model = is_ocr_model(ref, model_dir)
    check_model_reads(datasets, ocr_model, ref, "dataset_ids")
    options = dict(spec.options)
    _judge_options(session, settings, spec, options)
    files = [(str(dataset_path(settings, ds)), ds.format) for ds in datasets]
    engine_config(model_dir, files, options, "<eval dir>/output", "options", ocr_model=ocr_model)
    total = sum(_limited(ds.num_valid or ds.num_records, options) for ds in datasets)
    key = spec.judge_api_key.get_secret_value() if spec.judge_api_key is not None else None
    return _queue_eval(
        session, settings, name=spec.name or f"eval-{default_name}", model=ref, model_dir=model_dir,
        run_id=run_id, dataset_ids=list(spec.dataset_ids), files=files, options=options, samples_total=total,
        judge_api_key=key,
    )  # fmt: skip


def _limited(records: int, options: dict[str, Any]) -> int:
    cap = int(options.get("max_samples") or 0)
    return min(records, cap) if cap else records


def _queue_eval(
    session: Session,
    settings: Settings,
    *,
    name: str,
    model: str,
    model_dir: str,
    run_id: int | None,
    dataset_ids: list[int],
    files: list[tuple[str, str]],
    options: dict[str, Any],
    samples_total: int,
    after_run_id: int | None = None,
    role: str | None = None,
    commit: bool = True,
    judge_api_key: str | None = None,
) -> Evaluation:
    ev = Evaluation(
        name=name[:MAX_NAME], model=model, model_dir=model_dir, run_id=run_id, after_run_id=after_run_id,
        role=role, dataset_ids=dataset_ids, config={}, status=RunStatus.QUEUED, output_dir="",
        samples_total=samples_total,
    )  # fmt: skip
    session.add(ev)
    session.flush()
    out = eval_dir(settings, ev.id) / "output"
    ev.output_dir = str(out)
    ev.config = engine_config(
        model_dir, files, options, str(out), "options", ocr_model=is_ocr_model(model, model_dir)
    )
    # Before the commit (a worker may take the eval at once); a key left by an insert that was rolled back
    # (its id is used again) goes.
    if judge_api_key:
        _write_key(judge_key_path(settings, ev.id), judge_api_key)
    else:
        judge_key_path(settings, ev.id).unlink(missing_ok=True)
    add_event(
        session, "eval.queued", f"eval {ev.name} of {model} queued", run_id=run_id, data={"eval_id": ev.id}
    )
    if commit:
        session.commit()
        jobs.dispatch(session, settings, jobs.EVALS, ev)
    return ev


def eval_dir(settings: Settings, eval_id: int) -> Path:
    return settings.home / "evals" / str(eval_id)


def log_path(settings: Settings, eval_id: int) -> Path:
    return eval_dir(settings, eval_id) / "eval.log"


def get_eval(session: Session, eval_id: int) -> Evaluation:
    return get_or_404(session, Evaluation, eval_id, "eval")


# ---- person's actions ------------------------------------------------------------------------------------


def cancel_eval(session: Session, settings: Settings, eval_id: int) -> Evaluation:
    """A queued eval is cancelled at once; a running one is flagged and its worker stops the scorer."""
    ev = get_eval(session, eval_id)
    if ev.status in TERMINAL_RUN_STATUSES:
        raise Conflict(SERVICES("nothing_to_cancel", what=Word("eval"), id=eval_id, status=str(ev.status)))
    n = session.execute(
        update(Evaluation)
        .where(Evaluation.id == eval_id, Evaluation.status == RunStatus.QUEUED)
        .values(status=RunStatus.CANCELLED, ended_at=utcnow(), cancel_requested=True)
    ).rowcount
    if n:
        jobs.EVALS.event(session, ev, "cancelled", "cancelled while queued")
        session.commit()
        queue.purge_job(settings, queue.EVAL_TASK, eval_id, jobs.EVALS.queue)
    else:
        session.execute(update(Evaluation).where(Evaluation.id == eval_id).values(cancel_requested=True))
        jobs.EVALS.event(session, ev, "cancel_requested", "cancel requested")
        session.commit()
    session.refresh(ev)
    return ev


def resume_eval(session: Session, settings: Settings, eval_id: int) -> Evaluation:
    """Queue a failed or cancelled eval again; samples already scored are kept and not scored again."""
    ev = get_eval(session, eval_id)
    if ev.status not in (RunStatus.FAILED, RunStatus.CANCELLED):
        raise Conflict(SERVICES("not_resumable", what=Word("eval"), id=eval_id, status=str(ev.status)))
    ev.status, ev.cancel_requested, ev.error, ev.ended_at, ev.dispatched_at = (
        RunStatus.QUEUED, False, None, None, None
    )  # fmt: skip
    jobs.EVALS.event(session, ev, "resumed", "queued again; scored samples are kept")
    session.commit()
    jobs.dispatch(session, settings, jobs.EVALS, ev)
    return ev


def delete_eval(session: Session, settings: Settings, eval_id: int) -> None:
    ev = get_eval(session, eval_id)
    if ev.status == RunStatus.RUNNING:
        raise Conflict(SERVICES("running_cancel_first", what=Word("eval"), id=eval_id))
    if ev.status == RunStatus.QUEUED:
        queue.purge_job(settings, queue.EVAL_TASK, eval_id, jobs.EVALS.queue)
    session.delete(ev)
    session.commit()
    shutil.rmtree(eval_dir(settings, eval_id), ignore_errors=True)


# ---- worker side -----------------------------------------------------------------------------------------


def eval_heartbeat(session: Session, eval_id: int, worker: str, pid: int | None) -> str:
    """ "ok", "cancel" (a cancel was requested) or "lost" (the eval is no longer running on this worker)."""
    if not jobs.heartbeat(session, jobs.EVALS, eval_id, worker, pid=pid):
        return "lost"
    cancel = session.scalar(select(Evaluation.cancel_requested).where(Evaluation.id == eval_id))
    return "cancel" if cancel else "ok"


def judge_environment(settings: Settings, eval_id: int) -> dict[str, str]:
    """The scorer's ERNIE_STUDIO_EVAL_JUDGE_API_KEY when the eval was given an external judge's key: the eval's
    own key, sent to its judge_url (the worker's ERNIE_STUDIO_JUDGE_API_KEY goes only to ERNIE_STUDIO_JUDGE_URLS)."""
    from engine.eval.judge import EVAL_KEY_VAR

    try:
        return {EVAL_KEY_VAR: judge_key_path(settings, eval_id).read_text(encoding="utf-8")}
    except FileNotFoundError:
        return {}


def record_samples(session: Session, eval_id: int, rows: list[dict[str, Any]]) -> int:
    """Store eval_samples.jsonl lines; a sample already stored (a re-read after a restart) is skipped."""
    values = [
        {
            "eval_id": eval_id,
            "sample_id": str(r["id"])[:512],
            "dataset": str(r.get("dataset", ""))[:255],
            "line": int(r.get("line") or 0),
            "prompt": str(r.get("prompt", "")),
            "reference": str(r.get("reference", "")),
            "prediction": str(r.get("prediction", "")),
            "scores": r.get("scores") or {},
            "values": {
                k: v for k, v in r.items() if k not in ("prompt", "reference", "prediction", "scores")
            },
        }
        for r in rows
        if isinstance(r, dict) and r.get("id")
    ]
    n = 0
    for start in range(0, len(values), 500):
        n += _insert_ignore(
            session, EvalSample.__table__, values[start : start + 500], ["eval_id", "sample_id"]
        )
    session.commit()
    return n


def finish_eval(
    session: Session,
    eval_id: int,
    status: RunStatus,
    *,
    error: str | None = None,
    results: dict | None = None,
) -> None:
    values: dict[str, Any] = {"error": error, "pid": None}
    if results is not None:
        values["metrics"] = results.get("metrics") or {}
        values["results"] = results.get("datasets") or {}
    message = error or ("scored" if status == RunStatus.SUCCEEDED else status.value)
    jobs.finish(session, jobs.EVALS, eval_id, status, message[:2000], **values)
    if status == RunStatus.SUCCEEDED:  # the second of a run's base / result evals ends its forgetting check
        forgetting.record(session, session.get(Evaluation, eval_id).after_run_id)
