"""The training stages, one registry: what each reads, optimises, holds and starts from.

Every place that behaves per stage (config checks, trainer, data loader, estimate, the studio's services
and form) asks the stage's entry here instead of comparing its name, so a new stage is one entry below.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# Model families a stage may train: ERNIE 4.5 text models, ERNIE 4.5 VL, PaddleOCR-VL.
TEXT, ERNIE_VL, PADDLEOCR_VL = "text", "ernie-vl", "paddleocr-vl"
# What a stage optimises: the language-model loss or the DPO preference loss (engine.train.objectives
# builds it for a run).
LM, PREFERENCE = "lm", "dpo"


def _defaults(full: dict[str, Any], lora: dict[str, Any]) -> Mapping[str, Mapping[str, Any]]:
    return MappingProxyType({"Full": MappingProxyType(full), "LoRA": MappingProxyType(lora)})


@dataclass(frozen=True)
class Stage:
    """One training stage: its data, objective, models, form group, estimate terms and starting values."""

    name: str
    data_kind: str  # the records it trains on (engine.data.formats.KINDS): sft, dpo, pt
    objective: str  # LM or PREFERENCE
    families: tuple[str, ...]  # the model families it trains
    # starting values per fine_tuning (Full / LoRA) of the keys whose schema default is None
    defaults: Mapping[str, Mapping[str, Any]]
    option_group: str = ""  # the Train form's group of keys that apply to this stage only
    # a reference model beside the policy: a frozen copy on Full runs, the adapters switched off on LoRA
    # ones; the estimate adds its memory and one more forward pass (unless reference_free)
    needs_reference: bool = False
    rows_per_sample: int = 1  # the estimate's rows per sample: DPO's chosen and rejected are two
    reads_images: bool = False
    mixes_text_data: bool = False  # text-only files mixed into image data (text_dataset_path)
    gpas: bool = True  # GPAS gates go into its decoder (Full runs)
    evaluated_after_training: bool = False  # "evaluate after training" scores its runs
    aliases: tuple[str, ...] = field(default=())  # ERNIEKit's other names of it

    @property
    def trains_paddleocr_vl(self) -> bool:
        """PaddleOCR-VL's prompt form and image processor (its own encoder in the loader)."""
        return PADDLEOCR_VL in self.families

    def trains(self, family: str) -> bool:
        return family in self.families


SFT = Stage(
    "SFT",
    data_kind="sft",
    objective=LM,
    families=(TEXT, ERNIE_VL),
    defaults=_defaults({"learning_rate": 1e-5, "packing": False}, {"learning_rate": 1e-4, "packing": False}),
    evaluated_after_training=True,
)
# ERNIEKit's example configs: DPO an order lower than SFT
DPO = Stage(
    "DPO",
    data_kind="dpo",
    objective=PREFERENCE,
    families=(TEXT, ERNIE_VL),
    defaults=_defaults({"learning_rate": 5e-7, "packing": False}, {"learning_rate": 1e-5, "packing": False}),
    option_group="dpo",
    needs_reference=True,
    rows_per_sample=2,
)
# PT packs documents
PT = Stage(
    "PT",
    data_kind="pt",
    objective=LM,
    families=(TEXT, ERNIE_VL),
    defaults=_defaults({"learning_rate": 3e-5, "packing": True}, {"learning_rate": 1e-4, "packing": True}),
)
VL_SFT = Stage(
    "VL-SFT",
    data_kind="sft",
    objective=LM,
    families=(ERNIE_VL,),
    defaults=_defaults({"learning_rate": 1e-5, "packing": False}, {"learning_rate": 1e-4, "packing": False}),
    reads_images=True,
    mixes_text_data=True,
)
# ERNIEKit's PaddleOCR-VL fine-tuning (engine.data.ocr, engine.models.paddleocr_vl); its config: 5e-6, packed.
# PaddleOCR-VL's decoder takes no GPAS gates (TrainConfig._ocr_problems).
OCR_VL_SFT = Stage(
    "OCR-VL-SFT",
    data_kind="sft",
    objective=LM,
    families=(PADDLEOCR_VL,),
    defaults=_defaults({"learning_rate": 5e-6, "packing": True}, {"learning_rate": 1e-4, "packing": True}),
    reads_images=True,
    gpas=False,
    evaluated_after_training=True,
    aliases=("OCR-SFT",),
)

REGISTRY: tuple[Stage, ...] = (SFT, DPO, PT, VL_SFT, OCR_VL_SFT)
STAGES = tuple(s.name for s in REGISTRY)
DEFAULT_STAGE = SFT.name
# Elastic training runs these (ERNIEKit's elastic recipes), in the order its messages name them.
ELASTIC_STAGES = (PT.name, SFT.name)
# Stage names ERNIEKit also used, and the stage each is here (announced when a config says them).
STAGE_ALIASES = {alias: s.name for s in REGISTRY for alias in s.aliases}
# Starting values that depend on the stage and on Full vs LoRA (ERNIEKit's example configs: full SFT 1e-5,
# LoRA 1e-4). A field whose default is None takes its value from here, so `ernie-studio train`, the REST
# API and the studio's form all start from the same numbers.
STAGE_DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    (s.name, ft): dict(values) for s in REGISTRY for ft, values in s.defaults.items()
}
_BY_NAME = {**{s.name: s for s in REGISTRY}, **{a: s for s in REGISTRY for a in s.aliases}}


def find_stage(name: str) -> Stage | None:
    """The stage called ``name`` (or one of its ERNIEKit aliases), None when there is none."""
    return _BY_NAME.get(name)


def stage_info(name: str) -> Stage:
    """The stage called ``name`` (or one of its ERNIEKit aliases); KeyError names the choices."""
    stage = _BY_NAME.get(name)
    if stage is None:
        raise KeyError(f"unknown stage {name!r}; choose one of: {', '.join(STAGES)}")
    return stage


def stage_names(where: Callable[[Stage], bool]) -> tuple[str, ...]:
    """The names of the stages ``where`` holds for, in registry order."""
    return tuple(s.name for s in REGISTRY if where(s))


def family_stage(family: str) -> str:
    """The one stage that trains ``family`` alone (PaddleOCR-VL's, ERNIE 4.5 VL's)."""
    return next(s.name for s in REGISTRY if s.families == (family,))
