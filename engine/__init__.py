"""ERNIE Studio's engine: ERNIE 4.5 models, data, training stages, export and serving on PaddlePaddle."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.models.ernie import ErnieForCausalLM
    from engine.tokenizer import ErnieTokenizer

__version__ = "0.1.0"


def load_model(path: str, dtype: str = "float32") -> ErnieForCausalLM:
    """Load an ERNIE 4.5 model directory (Paddle or PyTorch layout) in eval mode."""
    from engine.models.checkpoint import load_model as _load

    return _load(path, dtype)


def load_tokenizer(path: str) -> ErnieTokenizer:
    """Load the tokenizer of a model directory (``tokenizer.model`` + config files)."""
    from engine.tokenizer import load_tokenizer as _load

    return _load(path)


__all__ = ["__version__", "load_model", "load_tokenizer"]
