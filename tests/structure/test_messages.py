"""Messages are keys with fields, translated by key (issue 31): no regex over sentences in the translation
code, every catalog message has its Chinese, and each Chinese text fills exactly its English text's fields."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from engine.messages import CATALOGS, field_names
from studio.messages import ZH

ROOT = Path(__file__).resolve().parents[2]
TRANSLATION_CODE = ("studio/messages", "studio/ui/i18n")


def _modules_with_catalogs() -> list[str]:
    """Every module that builds an ``engine.messages.Catalog`` (found in the source, so none is missed)."""
    found = []
    for part in ("engine", "studio", "workers"):
        for path in sorted((ROOT / part).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            calls = [
                n
                for n in ast.walk(tree)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Catalog"
            ]
            if calls:
                found.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


def _catalog_keys() -> dict[str, str]:
    for module in _modules_with_catalogs():
        importlib.import_module(module)
    return {key: text for catalog in CATALOGS.values() for key, text in catalog.keys().items()}


def test_the_translation_code_holds_no_regex():
    users = []
    for part in TRANSLATION_CODE:
        for path in sorted((ROOT / part).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n == "re" or n.startswith(("re.", "regex")) for n in names):
                    users.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not users, f"regexes in the translation code: {users}"


def test_every_message_has_its_chinese_with_the_same_fields():
    english = _catalog_keys()
    assert len(CATALOGS) >= 3 and len(english) >= 70  # the areas the patterns covered (issue 31)
    missing = sorted(set(english) - set(ZH))
    assert not missing, f"messages without Chinese (studio/messages/zh_*.py): {missing}"
    unknown = sorted(set(ZH) - set(english))
    assert not unknown, f"Chinese for no message (a key renamed or removed?): {unknown}"
    differ = [
        f"{key}: English {sorted(field_names(english[key]))}, Chinese {sorted(field_names(zh))}"
        for key, zh in ZH.items()
        if field_names(zh) != field_names(english[key])
    ]
    assert not differ, "fields that differ:\n" + "\n".join(differ)
