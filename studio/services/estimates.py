"""The pre-flight estimate of a run spec (``engine.estimate``) with the studio's facts: the base model's
config and files, its datasets' token statistics, and the nodes serving the run's queue; and the check that
the run fits the node it will go to."""

from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from engine.estimate import (
    ETA_WINDOW,
    DatasetTokens,
    Estimate,
    NodeFacts,
    PlanError,
    check_settings,
    estimate_run,
    fit_warning,
    plan_config,
    recent_step_seconds,
)
from engine.estimate.messages import ESTIMATE
from engine.models.config import ErnieConfig
from engine.train.config import TrainConfig
from studio import queue
from studio.config import Settings
from studio.models import Dataset, NodeStatus, Run, RunMetric, RunStatus
from studio.services import datasets as datasets_svc
from studio.services.errors import InvalidInput, ServiceError
from studio.services.models import model_dir_for
from studio.services.nodes import OFFLINE, NodeView, list_nodes

log = logging.getLogger(__name__)

# Datasets up to this many records get their token statistics computed when a run is queued (a pass of the
# tokenizer, then cached); larger ones use cached statistics only until someone asks for an estimate.
STATS_ON_QUEUE_MAX_RECORDS = 20_000
# A node's last runs whose measured step time corrects the modelled one.
STEP_RECORD_RUNS = 5


def estimate_spec(
    session: Session,
    settings: Settings,
    *,
    model: ErnieConfig,
    train: TrainConfig,
    base_model: str,
    dataset_ids: list[int],
    eval_dataset_ids: list[int] | None,
    queue_name: str,
    compute_stats: bool = True,
) -> dict[str, Any]:
    """The estimate of one run as JSON, checked against the nodes serving ``queue_name``: ``fits`` (None
    when no node has reported), ``warning`` (a sentence, or None) and the node it was checked against."""
    model_dir = _model_dir(session, settings, base_model)
    stats = [
        _tokens(session, settings, i, base_model, model_dir, train.max_seq_len, compute_stats)
        for i in dataset_ids
    ]
    evals = [
        _tokens(session, settings, i, base_model, model_dir, train.max_seq_len, compute_stats)
        for i in eval_dataset_ids or []
    ]
    devices = queue.devices_of(queue_name)
    nodes = serving_nodes(session, settings, queue_name)
    facts = [NodeFacts.from_doctor(n.doctor, n.name) for n in nodes]
    # the most constrained node the run may land on decides whether it fits
    node = min(facts, key=lambda f: f.memory_bytes or float("inf")) if facts else None
    if node is not None:
        node = with_step_record(session, node)
    est = estimate_run(
        model,
        train,
        [s for s in stats if s is not None],
        [s for s in evals if s is not None],
        node=node,
        num_devices=devices,
    )
    missing = sum(not s.mean_length for s in stats if s is not None)
    if 0 < missing < len(stats):
        est.assumptions.append(ESTIMATE("datasets_without_stats", n=missing))
    out = with_fit(est, node, len(facts))
    out["plan"] = plan_for(session, settings, model, train, base_model, devices)
    return out


def plan_for(
    session: Session,
    settings: Settings,
    model: ErnieConfig,
    train: TrainConfig,
    base_model: str,
    num_devices: int = 1,
) -> dict[str, Any] | None:
    """The planner's proposal for this model, stage, fine-tuning and max_seq_len on the studio's nodes (the
    settings that fit, best first, and why the others do not); None when no node has reported."""
    nodes = studio_nodes(session, settings)
    if not nodes:
        return None
    try:
        plan = plan_config(model, train, nodes, model_name=base_model)
        # the run's own parallel choices, where its config has those keys (sharding, expert parallelism)
        check_settings(
            model,
            nodes,
            num_devices,
            getattr(train, "expert_parallel_degree", None),
            getattr(train, "sharding", None) or None,
        )
    except PlanError as e:
        raise InvalidInput(str(e)) from None
    return plan.to_dict()


def studio_nodes(session: Session, settings: Settings) -> list[NodeFacts]:
    """The nodes the studio knows (workers that reported a doctor and are not offline), one per machine:
    a GPU node's devices are its GPUs, a CPU node's the processes its largest training worker runs."""
    by_node: dict[str, NodeFacts] = {}
    for view in list_nodes(session, settings):
        if view.state in (OFFLINE, NodeStatus.FAILED) or view.doctor is None:  # a failed doctor takes no work
            continue
        facts = NodeFacts.from_doctor(view.doctor, view.node or view.name)
        if facts.device == "cpu":
            facts = replace(facts, devices=max([1, *(queue.devices_of(q) for q in view.queues)]))
        seen = by_node.get(facts.name)
        if seen is None or facts.devices > seen.devices:
            by_node[facts.name] = facts
    return list(by_node.values())


def check_known_devices(session: Session, settings: Settings, num_devices: int) -> None:
    """Refuse a run on more devices than the studio's nodes hold together (it would wait forever); nothing
    is checked before a node has reported."""
    nodes = studio_nodes(session, settings)
    known = sum(n.devices for n in nodes)
    if nodes and num_devices > known:
        held = ", ".join(
            f"{n.name}: {n.devices} {'GPU(s)' if n.device == 'gpu' else 'process(es)'}" for n in nodes
        )
        raise InvalidInput(
            f"num_devices: {num_devices} devices are more than the studio's nodes hold ({known} in all: "
            f"{held}); ask for at most {known}, or start workers on more nodes"
        )


def with_step_record(session: Session, node: NodeFacts) -> NodeFacts:
    """``node`` with the measured / modelled step time of its worker's last runs (``STEP_RECORD_RUNS``
    that succeeded with an estimate and logged steps): the median ratio, which corrects what a throughput
    probe taken once at the worker's start cannot know (the node's load since, its real kernels)."""
    runs = session.scalars(
        select(Run)
        .where(Run.worker == node.name, Run.status == RunStatus.SUCCEEDED, Run.estimate.is_not(None))
        .order_by(Run.ended_at.desc())
        .limit(STEP_RECORD_RUNS)
    ).all()
    ratios = []
    for run in runs:
        time = (run.estimate or {}).get("time") or {}
        modelled = time.get("step_s_model") or time.get("step_s")
        points = session.scalars(
            select(RunMetric.values)
            .where(RunMetric.run_id == run.id)
            .order_by(RunMetric.step.desc())
            .limit(ETA_WINDOW + 1)
        ).all()
        measured = recent_step_seconds([float(v.get("step_s") or 0.0) for v in reversed(points)])
        if modelled and measured:
            ratios.append(measured / modelled)
    if not ratios:
        return node
    return replace(node, step_time_ratio=statistics.median(ratios), step_time_runs=len(ratios))


def with_fit(est: Estimate, node: NodeFacts | None, candidates: int = 1) -> dict[str, Any]:
    out = est.to_dict()
    warning = fit_warning(est, node)
    out["warning"] = warning
    out["fits"] = (
        None if node is None or not node.memory_bytes else not (warning or "").startswith("will not")
    )
    out["node"] = (
        None
        if node is None
        else {
            "name": node.name,
            "device": node.device,
            "memory_gib": (node.memory_bytes or 0) / 1024**3 or None,
            "gpu": node.gpu_name or None,
            "probe_tokens_per_second": node.probe_tokens_per_second,
            "candidates": candidates,
        }
    )
    if node is None:
        out["assumptions"].append(ESTIMATE("not_checked"))
    return out


def serving_nodes(session: Session, settings: Settings, queue_name: str) -> list[NodeView]:
    """Workers that serve ``queue_name`` (or were started for it) and are not offline, with their doctor."""
    return [
        n
        for n in list_nodes(session, settings)
        if n.state != OFFLINE and queue_name in n.queues and n.doctor is not None
    ]


def _model_dir(session: Session, settings: Settings, ref: str) -> Path | None:
    try:
        return model_dir_for(session, settings, ref)
    except ServiceError:
        return None


def _tokens(
    session: Session,
    settings: Settings,
    dataset_id: int,
    base_model: str,
    model_dir: Path | None,
    max_seq_len: int,
    compute: bool,
) -> DatasetTokens | None:
    """The dataset's token statistics with the base model's tokenizer: computed (and cached) when the model
    is on disk, else any cached statistics of the dataset (lengths before truncation), else None."""
    ds = session.get(Dataset, dataset_id)
    if ds is None:
        return None
    key = f"{base_model}@{max_seq_len}"
    cached = ds.stats or {}
    if key in cached:
        return DatasetTokens.from_stats(cached[key])
    small = (ds.num_records or 0) <= STATS_ON_QUEUE_MAX_RECORDS
    if model_dir is not None and (model_dir / "tokenizer.model").is_file() and (compute or small):
        try:
            stats = datasets_svc.dataset_stats(
                session, settings, dataset_id, model=base_model, max_seq_len=max_seq_len
            )
            return DatasetTokens.from_stats(stats)
        except (ServiceError, OSError, ValueError) as e:
            log.info("token statistics of dataset %s: %s", dataset_id, e)
    if cached:
        return DatasetTokens.from_stats(next(iter(cached.values())))
    # lengths unknown (the estimate assumes max_seq_len), the number of samples still counts the steps
    return DatasetTokens(num_samples=ds.num_valid or 0, mean_length=0.0, p95_length=0.0, max_length=0)
