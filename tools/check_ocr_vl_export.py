"""Check an engine PaddleOCR-VL export with transformers itself (run in the reference environment,
tools/build_reference_env.sh; never a project dependency):

    "$(tools/build_reference_env.sh)" tools/check_ocr_vl_export.py EXPORT_DIR [EXPORT_DIR ...]

Loads each EXPORT_DIR with ``PaddleOCRVLForConditionalGeneration.from_pretrained`` and prints, per golden
case of tests/engine/golden/paddleocr_vl/expected.npz, ``<dir name> <case> <max |logit difference|>``; exits 1
above 1e-4.
tests/engine/test_paddleocr_vl.py runs it on our ``hf`` and ``official`` exports of the golden model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from transformers import PaddleOCRVLForConditionalGeneration

GOLDEN = (
    Path(__file__).resolve().parent.parent / "tests" / "engine" / "golden" / "paddleocr_vl" / "expected.npz"
)


def check(export_dir: str) -> float:
    model = PaddleOCRVLForConditionalGeneration.from_pretrained(export_dir).eval()
    d = np.load(GOLDEN)
    worst = 0.0
    for case in ("text", "image", "two_images"):
        ids = torch.tensor(d[f"{case}/input_ids"])
        kw: dict = {"input_ids": ids}
        if f"{case}/pixel_values" in d:
            kw.update(
                pixel_values=torch.tensor(d[f"{case}/pixel_values"]),
                image_grid_thw=torch.tensor(d[f"{case}/image_grid_thw"]),
                mm_token_type_ids=(ids == model.config.image_token_id).long(),
            )
        with torch.no_grad():
            logits = model(**kw).logits.numpy()
        diff = float(np.abs(logits - d[f"{case}/logits"]).max())
        print(Path(export_dir).name, case, diff)
        worst = max(worst, diff)
    return worst


if __name__ == "__main__":
    sys.exit(1 if max(check(d) for d in sys.argv[1:]) > 1e-4 else 0)
