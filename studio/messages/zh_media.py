"""The Chinese of the media messages (engine.messages catalogs), by key."""

from __future__ import annotations

ZH: dict[str, str] = {}
