"""Shared fixtures: tiny model directories built once per session with ``ernie-studio init-model``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("FLAGS_call_stack_level", "0")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def _init(models_dir: Path, preset: str) -> Path:
    from engine.models.initialize import init_model

    out = models_dir / preset
    if not (out / "config.json").exists():
        init_model(preset, out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(models_dir) -> Path:
    return _init(models_dir, "tiny")


@pytest.fixture(scope="session")
def tiny_moe_model_dir(models_dir) -> Path:
    return _init(models_dir, "tiny-moe")


@pytest.fixture(scope="session")
def tiny_vl_model_dir(models_dir) -> Path:
    return _init(models_dir, "tiny-vl")
