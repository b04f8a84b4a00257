"""What LoRA training adds to the LoRA layer of ``engine.models.lora``: LoRA+ parameter groups, the
adapters-off reference for DPO, and writing the adapter files of a run directory.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
from paddle import nn

from engine.models.lora import ADAPTER_CONFIG, ADAPTER_FILE, lora_layers
from engine.models.safetensors_io import save_file

__all__ = ["adapter_state", "adapters_disabled", "lora_parameter_groups", "save_adapter"]


@contextlib.contextmanager
def adapters_disabled(model: nn.Layer):
    """Run the base model (DPO's reference for a LoRA run) without copying it."""
    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        m.enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.enabled = True


def lora_parameter_groups(model: nn.Layer, plus_scale: float) -> list[dict]:
    """LoRA+: B matrices learn ``plus_scale`` times faster than A matrices."""
    a = [m.lora_A for _, m in lora_layers(model)]
    b = [m.lora_B for _, m in lora_layers(model)]
    if plus_scale == 1.0:
        return [{"params": a + b}]
    return [{"params": a}, {"params": b, "learning_rate": plus_scale}]


def adapter_state(model: nn.Layer) -> dict[str, np.ndarray]:
    out = {}
    for name, m in lora_layers(model):
        out[f"{name}.lora_A"] = m.lora_A.numpy()
        out[f"{name}.lora_B"] = m.lora_B.numpy()
    return out


def save_adapter(
    model: nn.Layer, directory: str | Path, config: dict, state: dict[str, np.ndarray] | None = None
) -> None:
    """``adapter_model.safetensors`` + ``adapter_config.json`` (rank, alpha, targets, base model path);
    ``state``: the adapter's tensors when not all of them are in ``model`` (expert parallelism)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(model) if state is None else state, d / ADAPTER_FILE)
    (d / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
