"""The generated document lines (examples/data/ocr_demo, tools/make_ocr_demo_data.py) as one uploadable OCR
set: a zip of a JSON Lines file and the images its records name."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "data" / "ocr_demo"


def ocr_demo_zip(
    parts: tuple[str, ...] = ("lines_train.jsonl", "lines_eval.jsonl"), name: str = "lines"
) -> bytes:
    """The records of ``parts`` as ``<name>.jsonl`` in a zip, with every image they name."""
    lines = [line for part in parts for line in (DEMO / part).read_text(encoding="utf-8").splitlines()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"{name}.jsonl", "\n".join(lines) + "\n")
        for image in sorted({json.loads(line)["image"] for line in lines}):
            z.write(DEMO / image, image)
    return buf.getvalue()
