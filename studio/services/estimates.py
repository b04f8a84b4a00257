"""The pre-flight estimate of a run spec (``engine.estimate``) with the studio's facts: the base model's
config and files, its datasets' token statistics, and the nodes serving the run's queue; and the check that
the run fits the node it will go to."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from engine.estimate import DatasetTokens, Estimate, NodeFacts, estimate_run, fit_warning
from engine.models.config import ErnieConfig
from engine.train.config import TrainConfig
from studio import queue
from studio.config import Settings
from studio.models import Dataset
from studio.services import datasets as datasets_svc
from studio.services.errors import ServiceError
from studio.services.models import model_dir_for
from studio.services.nodes import OFFLINE, NodeView, list_nodes

log = logging.getLogger(__name__)

# Datasets up to this many records get their token statistics computed when a run is queued (a pass of the
# tokenizer, then cached); larger ones use cached statistics only until someone asks for an estimate.
STATS_ON_QUEUE_MAX_RECORDS = 20_000


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
        est.assumptions.append(
            f"{missing} dataset(s) without token statistics yet: their samples count as long as the others'"
        )
    return with_fit(est, node, len(facts))


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
        out["assumptions"].append("no worker serving this queue has reported: not checked against a node")
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
