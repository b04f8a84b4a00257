"""Training stages (SFT, DPO, PT, VL-SFT), LoRA, quantization and export: one loop, small stage modules."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.train.config import TrainConfig
    from engine.train.export import ExportSummary
    from engine.train.export_config import ExportConfig
    from engine.train.run_state import RunSummary


def run_training(config: TrainConfig, on_event=None) -> RunSummary:
    """Run one training stage; see ``engine.train.trainer``."""
    from engine.train.trainer import run_training as _run

    return _run(config, on_event)


def run_export(config: ExportConfig) -> ExportSummary:
    """LoRA merge, layout conversion, PTQ and sharding; see ``engine.train.export``."""
    from engine.train.export import run_export as _run

    return _run(config)


__all__ = ["run_export", "run_training"]
