"""Stage names live in one registry (engine/train/stages.py); code elsewhere asks it, never spells a name.

A string literal equal to a stage name or an ERNIEKit alias of one (``"DPO"``, ``"OCR-SFT"``) outside the
registry is a branch or a table joined to the stages by a string: a new stage would have to find it.
Tests, docs and ERNIEKit's YAML recipes are not Python under the checked folders, so they are not read.
"""

from __future__ import annotations

import ast
from pathlib import Path

from engine.train.stages import REGISTRY, STAGE_ALIASES

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("engine", "studio", "workers", "tools", "bench")
REGISTRY_FILE = "engine/train/stages.py"
# Files that may still spell a stage name, each with the reason.
ALLOWED = {
    # the locale table: display texts ("DPO" in both languages, the option group's title) are words a
    # person reads, translated at the edge, not stage names the code branches on
    "studio/ui/i18n/forms.py": "i18n translation table",
}
NAMES = {s.name for s in REGISTRY} | set(STAGE_ALIASES)


def _sources() -> list[Path]:
    return [p for part in CHECKED for p in sorted((ROOT / part).rglob("*.py"))]


def stage_literals(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each string constant in ``source`` that is exactly a stage name or alias."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES
    ]


def test_the_registry_names_every_stage():
    source = (ROOT / REGISTRY_FILE).read_text(encoding="utf-8")
    assert {name for _, name in stage_literals(source)} == NAMES


def test_the_check_finds_a_stage_name_put_back():
    assert stage_literals('if cfg.stage == "DPO":\n    rows = 2\n') == [(1, "DPO")]
    assert stage_literals('KINDS = {"VL-SFT": "sft", "OCR-SFT": "sft"}\n') == [(1, "VL-SFT"), (1, "OCR-SFT")]


def test_every_allowed_file_exists():
    assert all((ROOT / path).is_file() for path in ALLOWED)


def test_no_stage_name_outside_the_registry():
    found = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == REGISTRY_FILE or rel in ALLOWED:
            continue
        found += [
            f"{rel}:{line}: {name!r}" for line, name in stage_literals(path.read_text(encoding="utf-8"))
        ]
    assert not found, (
        "stage names spelled outside engine/train/stages.py; ask the registry (stage_info(stage)."
        "needs_reference, .data_kind, .objective, ...) instead:\n" + "\n".join(found)
    )
