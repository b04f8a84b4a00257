"""Rewrite the key tables in docs/training.md and docs/evaluation.md from the config schemas
(engine/train/config.py, engine/train/export_config.py, engine/eval/config.py; engine/train/config_docs.py
makes the tables) and the run_chat.yaml table (engine/serve/cli.py).

    .venv/bin/python tools/make_config_docs.py

tests/engine/test_config.py fails when the tables and the schema differ; this brings them back in line.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.eval.config import EvalConfig  # noqa: E402
from engine.serve.cli import erniekit_chat_table  # noqa: E402
from engine.train.config import TrainConfig  # noqa: E402
from engine.train.config_docs import erniekit_keys_table, keys_table, stage_defaults_table  # noqa: E402
from engine.train.export_config import ExportConfig  # noqa: E402

TABLES = {
    "training.md": {
        "train": lambda: keys_table(TrainConfig),
        "stage": stage_defaults_table,
        "export": lambda: keys_table(ExportConfig),
        "erniekit": erniekit_keys_table,
        "chat": erniekit_chat_table,
    },
    "evaluation.md": {"eval": lambda: keys_table(EvalConfig)},
}


def main() -> int:
    for doc, tables in TABLES.items():
        if rewrite(ROOT / "docs" / doc, tables):
            return 1
    return 0


def rewrite(path: Path, tables: dict) -> int:
    text = path.read_text(encoding="utf-8")
    for name, make in tables.items():
        pattern = rf"(<!-- keys:{name} -->\n).*?(\n<!-- /keys:{name} -->)"
        text, n = re.subn(pattern, lambda m, t=make(): m.group(1) + t + m.group(2), text, flags=re.S)
        if n != 1:
            print(f"{path}: no <!-- keys:{name} --> block", file=sys.stderr)
            return 1
    path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
