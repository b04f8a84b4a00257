"""Exports of finished runs (`ernie-studio export`): LoRA merge, Paddle or HF layout, PTQ. The result is a
model directory under home/models, so it shows up among the base models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from engine.train.config_load import config_from_dict
from engine.train.export_config import EXPORT_CHOICES, ExportConfig
from engine.train.options import ConfigError, config_default, field_info
from studio.config import Settings
from studio.models import Deployment, DeploymentStatus, Export, Run, RunStatus, utcnow
from studio.services import deployments, jobs
from studio.services.errors import Conflict, InvalidInput, NotFound, ServiceError
from studio.services.events import add_event
from studio.services.messages import not_succeeded
from studio.services.paths import confine_config_paths
from studio.services.store import get_or_404


def export_default(key: str) -> Any:
    """The engine's default of one `ernie-studio export` key (ExportConfig), which REST and the UI start from."""
    return config_default(ExportConfig, key)


DTYPE_NAMES = {"float32": "", "bfloat16": "bf16", "float16": "fp16"}  # as export folder names show them
# The name the REST body and the Runs tab gave quantization before both were made from ExportConfig.
FORMER_NAMES = {"ptq": "quantization"}


def create_export(
    session: Session,
    settings: Settings,
    run_id: int,
    *,
    elastic_member: str | None = None,
    deploy_on_success: bool = False,
    **choices: Any,
) -> Export:
    """Queue an export of a succeeded run into home/models/run-<id>[-<member>]-<layout>[-<bf16|fp16>][-<ptq>]
    (GGUF: run-<id>[-<member>]-gguf). ``choices`` are ExportConfig's EXPORT_CHOICES (``ptq`` read as
    quantization), each None or left out at the engine's default, and checked by it; ``elastic_member``
    names a member of an elastic run's family to write as a model of its own; ``deploy_on_success`` starts
    a deployment of it once it is written."""
    run = get_or_404(session, Run, run_id, "run")
    if run.status != RunStatus.SUCCEEDED:
        raise Conflict(not_succeeded("run", run_id, run.status, "export"))
    member = (elastic_member or "").strip()
    if member:
        check_member(run, member)
    confine_config_paths(settings, run.config, f"run {run.id}'s config")
    options, names = read_choices(choices)
    for key in ("export_format", "gpas_gates"):
        _check_choice(key, options[key], names)
    if options["export_format"] == "gguf":
        return _create_gguf_export(session, settings, run, options, member, deploy_on_success)
    if choices.get("gguf_types"):
        raise InvalidInput("gguf_types: GGUF types apply to export_format gguf")
    for key in ("layout", "quantization", "dtype"):
        _check_choice(key, options[key], names)
    checked = {key: options[key] for key in EXPORT_CHOICES if key != "gguf_types"}
    _engine_checks(run, checked)
    parts = (DTYPE_NAMES[options["dtype"]], options["quantization"])
    name = f"run-{run.id}{f'-{member}' if member else ''}-{options['layout']}" + "".join(
        f"-{p}" for p in parts if p
    )
    export = Export(
        run_id=run.id,
        elastic_member=member,
        **checked,
        status=RunStatus.QUEUED,
        export_dir=str(settings.models_dir / name),
        deploy_on_success=deploy_on_success,
    )
    return _queue(session, settings, export, f"export {name} queued")


def read_choices(given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Every export choice (EXPORT_CHOICES) from a request's: None or left out takes the engine's default.
    Also returns the name each was given under (``ptq`` for quantization), which errors use."""
    unknown = sorted(set(given) - set(EXPORT_CHOICES) - set(FORMER_NAMES))
    if unknown:
        raise InvalidInput(f"{unknown[0]}: not an export choice; the choices are {', '.join(EXPORT_CHOICES)}")
    names = {key: key for key in EXPORT_CHOICES}
    given = dict(given)
    for former, key in FORMER_NAMES.items():
        if given.get(former) is None:
            given.pop(former, None)
            continue
        if given.get(key) is not None:
            raise InvalidInput(f"{former}: the former name of {key}; give one of the two")
        given[key], names[key] = given.pop(former), former
    options = {key: export_default(key) if given.get(key) is None else given[key] for key in EXPORT_CHOICES}
    if isinstance(options["max_shard_size"], str):
        options["max_shard_size"] = options["max_shard_size"].strip()
    return options, names


def _check_choice(key: str, value: Any, names: dict[str, str]) -> None:
    """One choice against the engine's (ExportConfig), the error naming the field as the request did."""
    allowed = field_info(ExportConfig, key)["choices"]
    if value not in allowed:
        shown = ", ".join(c for c in allowed if c)
        raise InvalidInput(f"{names[key]}: {value!r} is not one of {shown}")


def _engine_checks(run: Run, options: dict[str, Any]) -> None:
    """The engine's own checks of the choices together (max_shard_size's form, PTQ's layout and dtype, GGUF
    types), as `ernie-studio export` makes them."""
    try:
        config_from_dict(ExportConfig, {**options, "output_dir": run.output_dir}, source="export")
    except ConfigError as e:
        raise InvalidInput(str(e).removeprefix("export: ")) from None


def _create_gguf_export(
    session: Session,
    settings: Settings,
    run: Run,
    options: dict[str, Any],
    member: str,
    deploy_on_success: bool,
) -> Export:
    types = list(options["gguf_types"])
    # the engine's checks: each type one of GGUF_TYPES, no PTQ beside it
    _engine_checks(
        run, {"export_format": "gguf", "gguf_types": types, "quantization": options["quantization"]}
    )
    export = Export(
        run_id=run.id,
        elastic_member=member,
        gpas_gates=options["gpas_gates"],
        layout="gguf",
        export_format="gguf",
        gguf_types=",".join(types),
        status=RunStatus.QUEUED,
        export_dir=str(settings.models_dir / f"run-{run.id}{f'-{member}' if member else ''}-gguf"),
        deploy_on_success=deploy_on_success,
    )
    return _queue(session, settings, export, f"GGUF export of run {run.id} ({', '.join(types)}) queued")


def _queue(session: Session, settings: Settings, export: Export, message: str) -> Export:
    session.add(export)
    session.flush()
    add_event(session, "export.queued", message, run_id=export.run_id, data={"export_id": export.id})
    session.commit()
    dispatch_export(session, settings, export)
    return export


def family_of(session: Session, run_id: int) -> dict[str, Any] | None:
    """The family an elastic run wrote when it finished (engine.train.elastic.read_family), else None."""
    run = get_or_404(session, Run, run_id, "run")
    from engine.models.elastic_family import read_family

    family = read_family(run.output_dir)
    return None if family is None else {"run_id": run.id, **family}


def elastic_family(session: Session, run_id: int) -> dict[str, Any]:
    """``family_of``, or NotFound for a run without one."""
    family = family_of(session, run_id)
    if family is None:
        raise NotFound(
            f"run {run_id} has no elastic family: it was trained without elastic: true, or has not finished"
        )
    return family


def check_member(run: Run, member: str, field: str = "elastic_member") -> None:
    """``member`` must be one of the run's family (the members it trained and evaluated); errors name
    ``field``."""
    from engine.models.elastic_family import read_family

    family = read_family(run.output_dir)
    if family is None:
        raise InvalidInput(f"{field}: run {run.id} was not trained with elastic: true (or has not finished)")
    names = [m["member"] for m in family["members"]]
    if member not in names:
        raise InvalidInput(f"{field}: {member!r} is not in run {run.id}'s family ({', '.join(names)})")


# An export on its way to a deployment: a second click on the same member would only race it.
DEPLOY_BUSY = ("exporting", "deploying", "running")


def deploy_member(session: Session, settings: Settings, run_id: int, member: str) -> Export:
    """One click on an elastic run's family: export ``member`` (Paddle layout, the engine's default dtype)
    and deploy it once it is written; the export worker (or the reconciler) starts the deployment."""
    member = (member or "").strip()
    if not member:
        raise InvalidInput(f"member: name one of run {run_id}'s family (GET /api/v1/runs/{run_id}/elastic)")
    run = get_or_404(session, Run, run_id, "run")
    if run.status == RunStatus.SUCCEEDED:
        check_member(run, member, field="member")
    for e in list_exports(session, run_id):
        if e.elastic_member == member and e.deploy_state in DEPLOY_BUSY:
            what = f"deployment {e.deployment_id}" if e.deployment_id else f"export {e.id}"
            then = "stop that deployment to deploy it again" if e.deployment_id else "wait for it"
            raise Conflict(f"member: {member} of run {run_id} is already {e.deploy_state} ({what}); {then}")
    return create_export(session, settings, run_id, elastic_member=member, deploy_on_success=True)


def deploy_exported(session: Session, settings: Settings, export_id: int) -> Deployment | None:
    """Start the deployment a succeeded export was asked to make, once: the export is marked deployed in
    the same transaction that adds the deployment, so the worker and a reconciler never both make one. A
    deployment that cannot be made is recorded as a failed one, with the reason."""
    marked = session.execute(
        update(Export)
        .where(
            Export.id == export_id,
            Export.status == RunStatus.SUCCEEDED,
            Export.deploy_on_success.is_(True),
            Export.deployed_at.is_(None),
        )
        .values(deployed_at=utcnow())
    ).rowcount
    if not marked:  # not asked, not succeeded, or made already (nothing changed: no rollback of others' work)
        return None
    export = session.get(Export, export_id, populate_existing=True)
    spec = deployments.DeploymentSpec(export_id=export_id)
    try:
        dep = deployments.new_deployment(session, settings, spec)
    except ServiceError as e:
        dep = deployments.failed_deployment(
            session, Path(export.export_dir).name, export.run_id, export.export_dir, e.message
        )
    session.execute(update(Export).where(Export.id == export_id).values(deployment_id=dep.id))
    add_event(
        session, "export.deploying", f"export {export_id} deployed as deployment {dep.id}",
        run_id=export.run_id, data={"export_id": export_id, "deployment_id": dep.id},
    )  # fmt: skip
    session.commit()
    session.refresh(export)
    if dep.status == DeploymentStatus.STARTING:
        deployments.send_deployment(settings, dep.id)
    return dep


def deploy_finished_exports(session: Session, settings: Settings) -> int:
    """The reconciler's part: succeeded exports to deploy whose deployment was never made (the worker died
    between finishing the export and making it)."""
    pending = session.scalars(
        select(Export.id).where(
            Export.status == RunStatus.SUCCEEDED,
            Export.deploy_on_success.is_(True),
            Export.deployed_at.is_(None),
        )
    ).all()
    return sum(deploy_exported(session, settings, i) is not None for i in pending)


def dispatch_export(session: Session, settings: Settings, export: Export) -> None:
    jobs.dispatch(session, settings, jobs.EXPORTS, export)


def list_exports(session: Session, run_id: int | None = None) -> list[Export]:
    q = select(Export).order_by(Export.id.desc())
    if run_id is not None:
        q = q.where(Export.run_id == run_id)
    return list(session.scalars(q).all())


def get_export(session: Session, export_id: int) -> Export:
    return get_or_404(session, Export, export_id, "export")


def export_config(run: Run, export: Export) -> dict[str, Any]:
    """The `ernie-studio export` config: the run's own config (export tolerates training keys) plus the
    export choices; PTQ reports perplexity on the run's training data."""
    cfg: dict[str, Any] = {
        **run.config,
        "lora": run.fine_tuning == "LoRA",
        "layout": export.layout,
        "quantization": export.quantization,
        "dtype": export.dtype,
        "max_shard_size": export.max_shard_size,
        "gpas_gates": export.gpas_gates,
        "export_dir": export.export_dir,
    }
    if export.elastic_member:
        from engine.models.elastic_family import member_export_keys, read_family

        family = read_family(run.output_dir) or {}
        cfg.update(member_export_keys(export.elastic_member))
        cfg["elastic_depth_pattern"] = family.get("depth_pattern", "")
    if run.fine_tuning != "LoRA":
        cfg["model_name_or_path"] = run.model_dir or run.output_dir
    if export.export_format == "gguf":
        cfg.update(export_format="gguf", gguf_types=export.gguf_types.split(","), layout="paddle")
        # the quality figures (llama.cpp's perplexity of each file): the run's eval set, else its data
        held_out = bool(run.config.get("eval_dataset_path"))
        prefix = "eval" if held_out else "train"
        for key in ("type", "path", "prob"):
            cfg[f"eval_dataset_{key}"] = run.config.get(
                f"{prefix}_dataset_{key}", cfg.get(f"eval_dataset_{key}")
            )
        cfg["eval_dataset_type"] = cfg["eval_dataset_type"] or "erniekit"
        return cfg
    if export.quantization:
        cfg["eval_dataset_type"] = run.config.get("train_dataset_type", "erniekit")
        cfg["eval_dataset_path"] = run.config.get("train_dataset_path", "")
        cfg["eval_dataset_prob"] = run.config.get("train_dataset_prob", "1.0")
    return cfg


# ---- state transitions made by the worker (studio.services.jobs holds the life cycle) --------------------


def claim_export(session: Session, export_id: int, worker: str) -> Export | None:
    return jobs.claim(session, jobs.EXPORTS, export_id, worker)


def finish_export(
    session: Session,
    settings: Settings,
    export_id: int,
    status: RunStatus,
    *,
    error: str | None = None,
    perplexity: dict | None = None,
    gguf_files: list | None = None,
) -> None:
    export = session.get(Export, export_id)
    message = error or f"exported to {Path(export.export_dir).name}"
    finished = jobs.finish(
        session,
        jobs.EXPORTS,
        export_id,
        status,
        message,
        error=error,
        perplexity=perplexity,
        gguf_files=gguf_files,
    )
    if finished and status == RunStatus.SUCCEEDED:
        deploy_exported(session, settings, export_id)
