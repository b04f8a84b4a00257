"""The stage registry: every stage's facts in one entry, and the tables older code read built from it."""

from __future__ import annotations

import pytest

from engine.data.record_types import KINDS
from engine.train.config import TrainConfig
from engine.train.objectives import OBJECTIVES
from engine.train.run_checks import defaults_for
from engine.train.stages import (
    ELASTIC_STAGES,
    REGISTRY,
    STAGE_ALIASES,
    STAGE_DEFAULTS,
    STAGES,
    family_stage,
    find_stage,
    stage_info,
)


def test_the_registry_keeps_the_stages_their_order_and_defaults():
    assert STAGES == ("SFT", "DPO", "PT", "VL-SFT", "OCR-VL-SFT")
    assert STAGE_ALIASES == {"OCR-SFT": "OCR-VL-SFT"}
    assert ELASTIC_STAGES == ("PT", "SFT")
    assert STAGE_DEFAULTS[("DPO", "Full")] == {"learning_rate": 5e-7, "packing": False}
    assert STAGE_DEFAULTS[("OCR-VL-SFT", "Full")] == {"learning_rate": 5e-6, "packing": True}
    assert list(STAGE_DEFAULTS) == [(s, ft) for s in STAGES for ft in ("Full", "LoRA")]


@pytest.mark.parametrize("stage", REGISTRY, ids=lambda s: s.name)
def test_each_stage_starts_a_config_from_its_own_defaults(stage):
    for fine_tuning, values in stage.defaults.items():
        assert {k: defaults_for(stage.name, fine_tuning)[k] for k in values} == dict(values)
    assert stage.objective in OBJECTIVES
    assert stage.data_kind in {k for kinds in KINDS.values() for k in kinds}


def test_a_name_or_an_alias_finds_its_stage():
    assert stage_info("OCR-SFT") is stage_info("OCR-VL-SFT")
    assert find_stage("KTO") is None
    with pytest.raises(KeyError, match="unknown stage 'KTO'; choose one of: SFT, DPO"):
        stage_info("KTO")
    assert family_stage("paddleocr-vl") == "OCR-VL-SFT"
    assert family_stage("ernie-vl") == "VL-SFT"


def test_only_a_stage_with_a_reference_holds_one():
    assert TrainConfig(stage="DPO").holds_reference
    assert not TrainConfig(stage="DPO", reference_free=True).holds_reference
    assert not TrainConfig(stage="SFT").holds_reference
