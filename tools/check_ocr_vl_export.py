"""Check an engine PaddleOCR-VL export with transformers itself (run in the reference environment,
tools/build_reference_env.sh; never a project dependency):

    "$(tools/build_reference_env.sh)" tools/check_ocr_vl_export.py [--expected CASE.npz] EXPORT_DIR [...]

Loads each EXPORT_DIR with ``PaddleOCRVLForConditionalGeneration.from_pretrained`` and prints, per golden
case of tests/engine/golden/paddleocr_vl/expected.npz, ``<dir name> <case> <max |logit difference|>``; exits 1
above 1e-4. ``--expected`` takes the case from another file instead (``input_ids``, optionally
``pixel_values`` and ``image_grid_thw``, and the ``logits`` our engine computed), printed as case ``expected``.
tests/engine/test_paddleocr_vl.py runs it on our ``hf`` and ``official`` exports of the golden model,
tests/engine/test_ocr_export.py on merged LoRA exports of a trained tiny model.
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


def check(export_dir: str, expected: str | None = None) -> float:
    model = PaddleOCRVLForConditionalGeneration.from_pretrained(export_dir).eval()
    if expected is not None:  # one case under the keys without a "<case>/" prefix
        d = {f"expected/{k}": v for k, v in np.load(expected).items()}
        cases: tuple[str, ...] = ("expected",)
    else:
        d = np.load(GOLDEN)
        cases = ("text", "image", "two_images")
    worst = 0.0
    for case in cases:
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
    args = sys.argv[1:]
    expected = None
    if args[:1] == ["--expected"]:
        expected, args = args[1], args[2:]
    sys.exit(1 if max(check(d, expected) for d in args) > 1e-4 else 0)
