"""Check an engine -PT export of a VL model with transformers itself (run in the reference environment,
never a project dependency):

    /tmp/refvenv/bin/python tools/check_vl_export.py EXPORT_DIR
    /tmp/refvenv/bin/python tools/check_vl_export.py EXPORT_DIR CASE.npz LOGITS.npy

Loads EXPORT_DIR with ``Ernie4_5_VLMoeForConditionalGeneration.from_pretrained``. With the export of the VL
golden model alone, prints, per golden case, the largest difference of its logits from
tests/engine/golden/vl_moe/expected.npz and exits 1 above 1e-5 (the parity tests' bound). With a case (``input_ids``,
``pixel_values``, ``image_grid_thw``), writes transformers' logits on it to LOGITS.npy for the caller to
compare. tests/engine/test_vl_parity.py and test_train.py run it when ERNIE_STUDIO_REFERENCE_PYTHON names
such a Python.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import Ernie4_5_VLMoeForConditionalGeneration

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "engine" / "golden" / "vl_moe" / "expected.npz"


def inputs(d, case: str, ids_of: dict) -> dict:
    """transformers' keyword arguments for one case; ``ids_of`` is the export's config.json (token ids)."""
    ids = torch.tensor(d[f"{case}input_ids"])
    kw: dict = {"input_ids": ids}
    for kind, grid in (("", "image_grid_thw"), ("_videos", "video_grid_thw")):
        if f"{case}pixel_values{kind}" in d:
            kw[f"pixel_values{kind}"] = torch.tensor(d[f"{case}pixel_values{kind}"])
            kw[grid] = torch.tensor(d[f"{case}{grid}"])
    if len(kw) > 1:
        image, video = ids == ids_of["image_token_id"], ids == ids_of["video_token_id"]
        mm = torch.zeros_like(ids)
        mm[image], mm[video] = 1, 2
        moe = mm.clone()  # start / end marks route to the vision experts, but count as text for positions
        moe[(ids == ids_of["image_start_token_id"]) | (ids == ids_of["image_end_token_id"])] = 1
        moe[(ids == ids_of["video_start_token_id"]) | (ids == ids_of["video_end_token_id"])] = 2
        kw.update(mm_token_type_ids=mm, moe_mm_token_type_ids=moe)
    return kw


def main(export_dir: str, case_file: str = "", logits_file: str = "") -> int:
    model = Ernie4_5_VLMoeForConditionalGeneration.from_pretrained(export_dir).eval()
    ids_of = json.loads((Path(export_dir) / "config.json").read_text())
    if case_file:
        with torch.no_grad():
            logits = model(**inputs(np.load(case_file), "", ids_of)).logits.numpy()
        np.save(logits_file, logits)
        return 0
    d = np.load(GOLDEN)
    worst = 0.0
    for case in ("text", "image", "two_images", "image_video"):
        with torch.no_grad():
            logits = model(**inputs(d, f"{case}/", ids_of)).logits.numpy()
        diff = float(np.abs(logits - d[f"{case}/logits"]).max())
        print(case, diff)
        worst = max(worst, diff)
    return 1 if worst > 1e-5 else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
