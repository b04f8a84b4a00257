"""ERNIE 4.5 models in plain Paddle."""

from engine.models.checkpoint import CheckpointError, load_model, save_model
from engine.models.config import ErnieConfig, VisionConfig
from engine.models.ernie import CausalLMOutput, DynamicCache, ErnieForCausalLM
from engine.models.presets import preset_config, preset_names

__all__ = [
    "CausalLMOutput",
    "CheckpointError",
    "DynamicCache",
    "ErnieConfig",
    "ErnieForCausalLM",
    "VisionConfig",
    "load_model",
    "preset_config",
    "preset_names",
    "save_model",
]
