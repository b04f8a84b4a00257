"""The training config's problems a person reads (the Train form shows them by key), as keyed messages.

The English is what ``TrainConfig.validate`` always said; ``studio/messages/zh_services.py`` holds the
Chinese by key.
"""

from __future__ import annotations

from engine.messages import Catalog

TRAIN = Catalog(
    "train",
    {
        "ocr_compute_type": (
            "compute_type {compute_type}: PaddleOCR-VL trains in fp32, bf16 or fp16 here (FP8 QAT and "
            "weight-only bases are ERNIE 4.5 decoders' only)"
        ),
        "ocr_gpas": "gpas: PaddleOCR-VL's decoder takes no GPAS gates here; leave gpas false",
    },
)
