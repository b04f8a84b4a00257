"""ERNIE 4.5 models in plain Paddle.

Names are resolved lazily so that light users (config parsing, the CLI's argument parser, the studio's
dataset checks and parameter counts) do not pay for importing Paddle: ``engine.models.config`` and
``engine.models.presets`` never import it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CheckpointError": "engine.models.checkpoint",
    "ErnieConfig": "engine.models.config",
    "VisionConfig": "engine.models.config",
    "CausalLMOutput": "engine.models.ernie",
    "DynamicCache": "engine.models.ernie",
    "ErnieForCausalLM": "engine.models.ernie",
    "load_model": "engine.models.loading",
    "load_plain_model": "engine.models.loading",
    "preset_config": "engine.models.presets",
    "preset_names": "engine.models.presets",
    "save_model": "engine.models.saving",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
