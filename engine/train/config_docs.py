"""The docs' key tables, made from the schemas: docs/training.md and docs/evaluation.md carry them
(``tools/make_config_docs.py`` rewrites them; tests/engine/test_config.py keeps them equal to the schema).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.train.erniekit_keys import ERNIEKIT_ALIASES, ERNIEKIT_NOTICES, EXPORT_NOTICES
from engine.train.options import number
from engine.train.stages import STAGE_DEFAULTS


def keys_table(cls: type) -> str:
    """The config's keys as a Markdown table (key, default, allowed values, meaning) for the docs.

    docs/training.md carries this table for TrainConfig and ExportConfig; a test keeps it equal to the
    schema (`tools/make_config_docs.py` rewrites them).
    """
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        meta = f.metadata
        allowed = ", ".join(c or "''" for c in meta["choices"]) if meta.get("choices") else _range(meta)
        rows.append(f"| `{f.name}` | {_declared_default(f)} | {allowed} | {meta.get('help', '')} |")
    return "\n".join(rows)


def _declared_default(f: dataclasses.Field) -> str:
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if default is None and any(f.name in values for values in STAGE_DEFAULTS.values()):
        return "per stage (below)"
    if default is None:
        return "from the model's config.json"
    if isinstance(default, list):
        default = ",".join(default)
    return f"`{default}`" if default != "" else "(empty)"


def erniekit_keys_table() -> str:
    """ERNIEKit's other names for fields and the keys a run announces instead of using, for the docs."""
    rows = ["| ERNIEKit key | here |", "|---|---|"]
    rows += [f"| `{k}` | the same as `{v}` |" for k, v in ERNIEKIT_ALIASES.items()]
    notices = {**ERNIEKIT_NOTICES, **EXPORT_NOTICES}
    rows += [f"| `{k}` | announced: {notices[k]} |" for k in sorted(notices, key=str.lower)]
    return "\n".join(rows)


def stage_defaults_table() -> str:
    """STAGE_DEFAULTS as a Markdown table for the docs."""
    keys = sorted({k for values in STAGE_DEFAULTS.values() for k in values})
    rows = ["| stage | fine_tuning | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for (stage, ft), values in STAGE_DEFAULTS.items():
        rows.append(f"| {stage} | {ft} | " + " | ".join(f"`{values[k]}`" for k in keys) + " |")
    return "\n".join(rows)


def _range(meta: Mapping[str, Any]) -> str:
    lo, hi = meta.get("minimum"), meta.get("maximum")
    if lo is None and hi is None:
        return ""
    if hi is None:
        return f">= {number(lo)}"
    return f"{number(lo)} .. {number(hi)}" if lo is not None else f"<= {number(hi)}"
