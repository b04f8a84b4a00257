"""The facts an estimate reads beside the model and the config: the data's token statistics and the node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DatasetTokens:
    """Token-length statistics of one dataset (``engine.data.stats.dataset_stats`` keys)."""

    num_samples: int
    mean_length: float
    p95_length: float
    max_length: int
    truncated_share: float = 0.0

    @classmethod
    def from_stats(cls, stats: dict[str, Any]) -> DatasetTokens:
        return cls(
            num_samples=int(stats.get("num_valid") or stats.get("num_records") or 0),
            mean_length=float(stats.get("mean_length") or 0.0),
            p95_length=float(stats.get("p95_length") or stats.get("mean_length") or 0.0),
            max_length=int(stats.get("max_length") or 0),
            truncated_share=float(stats.get("truncated_share") or 0.0),
        )


@dataclass(frozen=True)
class NodeFacts:
    """What the run's node offers (from its doctor report): device kind, memory, speed."""

    device: str = "cpu"  # "cpu" | "gpu"
    name: str = ""  # the node's or worker's name, for messages
    memory_bytes: int | None = None  # RAM (CPU node) or memory of one device (GPU node)
    ram_bytes: int | None = None  # host RAM of a GPU node (where the fp32 load happens)
    gpu_name: str = ""
    probe_tokens_per_second: float | None = None  # the doctor's throughput probe
    devices: int = 1  # GPUs of a GPU node; processes a CPU node's training worker runs a run on
    # measured / modelled seconds per step of the node's recent runs (the studio keeps both), and how many
    step_time_ratio: float | None = None
    step_time_runs: int = 0

    @classmethod
    def from_doctor(cls, report: dict[str, Any] | None, name: str = "") -> NodeFacts:
        """The facts of an ``ernie-studio doctor --json`` report (as the node registry stores it)."""
        report = report or {}
        facts = report.get("facts") or {}
        ram = (facts.get("memory") or {}).get("total_bytes")
        gpus = [d for d in facts.get("devices") or [] if d.get("total_memory_bytes")]
        probe = None
        for check in report.get("checks") or []:
            if check.get("name") == "throughput":
                probe = (check.get("values") or {}).get("tokens_per_second")
        if gpus:
            smallest = min(gpus, key=lambda d: d["total_memory_bytes"])
            return cls(
                "gpu",
                name,
                int(smallest["total_memory_bytes"]),
                ram,
                str(smallest.get("name", "")),
                probe,
                len(gpus),
            )
        return cls("cpu", name, ram, ram, "", probe)
