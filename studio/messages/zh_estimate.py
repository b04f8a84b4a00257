"""The Chinese of the estimate messages (engine.messages catalogs), by key."""

from __future__ import annotations

ZH: dict[str, str] = {}
