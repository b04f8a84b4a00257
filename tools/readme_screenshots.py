"""Copy the browser tests' screenshots that the README shows into docs/screenshots.

The e2e tests (`make test`, or `pytest tests/e2e`) write every step's full-page screenshot under
test-artifacts/e2e/; this picks the ones the README names, so the README shows the studio as the last
browser run saw it. Usage: `.venv/bin/python tools/readme_screenshots.py` after the browser tests passed.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts" / "e2e"
# README image -> the screenshot a browser test takes (tests/e2e/*.py, StudioPage.shot)
SHOTS = {
    "datasets.png": "flow/01-dataset-preview.png",  # test_studio.py
    "validation.png": "validation/01-validation-error.png",  # test_studio.py
    "train.png": "flow/02-train-form.png",  # test_studio.py
    "runs.png": "flow/04-run-finished.png",  # test_studio.py
    "compare.png": "flow/07-compare.png",  # test_studio.py
    "sweeps.png": "sweep/01-sweep-leaderboard.png",  # test_sweep_browser.py
    "evaluate.png": "evaluate/02-evaluate-samples.png",  # test_evaluate.py
    "chat.png": "flow/05-chat.png",  # test_studio.py
    "nodes.png": "nodes/01-nodes.png",  # test_nodes_view.py
}


def main() -> int:
    missing = [src for src in SHOTS.values() if not (ARTIFACTS / src).is_file()]
    if missing:
        print(f"no screenshot yet for {', '.join(missing)}: run the browser tests first", file=sys.stderr)
        return 1
    out = REPO / "docs" / "screenshots"
    for name, src in SHOTS.items():
        shutil.copyfile(ARTIFACTS / src, out / name)
        print(f"{out / name} <- {ARTIFACTS / src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
