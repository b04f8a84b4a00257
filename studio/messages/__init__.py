"""Messages shown in the reader's language: the Chinese of every keyed message, by area, looked up by key.

The engine and the services build ``engine.messages.Message`` values (English text, key and fields). The CLI
prints the English; the UI (the session's language) and the REST API (``Accept-Language``) show
``localize(message, lang)``. Nothing here parses a sentence: a text that is not a Message (or whose key has
no Chinese yet) is shown as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.messages import Message, Word
from studio.messages.zh_estimate import ZH as _ESTIMATE
from studio.messages.zh_media import ZH as _MEDIA
from studio.messages.zh_services import ZH as _SERVICES

# the languages a reader can choose (the UI's switch shows these names), English when none is asked for
LANGUAGES = {"en": "English", "zh": "中文"}
DEFAULT_LANGUAGE = "en"

# key -> the Chinese text, its fields the English text's (tests/structure/test_messages.py holds both)
ZH: dict[str, str] = {**_ESTIMATE, **_SERVICES, **_MEDIA}

# Words of ours that messages carry as fields (engine.messages.Word), by language.
WORDS: dict[str, str] = {
    "dataset": "数据集",
    "run": "任务",
    "deployment": "部署",
    "export": "导出",
    "deploy": "部署",
    "eval": "评估",
    "evaluate": "评估",
    "sweep": "超参搜索",
    "download": "下载",
    "loopback": "回环",
    "private or reserved": "私有或保留",
    "translation or tunnelling": "地址转换或隧道",
}

# A run's, export's or deployment's status, and a sweep trial's Optuna state: a field named ``status`` is
# shown so, and the UI's tables show statuses from here too (studio.ui.i18n.status_text).
STATUS_ZH: dict[str, str] = {
    "queued": "排队中",
    "running": "运行中",
    "succeeded": "已完成",
    "failed": "失败",
    "cancelled": "已取消",
    "starting": "启动中",
    "stopping": "停止中",
    "stopped": "已停止",
    "complete": "已完成",
    "pruned": "已剪枝",
    "fail": "失败",
    "waiting": "等待中",
}


def localize(message: Any, lang: str = DEFAULT_LANGUAGE) -> str:
    """``message`` as a reader of ``lang`` sees it: a Message whose key has a Chinese text, with its fields
    shown in turn; anything else (and every message in English) as it is."""
    if lang != "zh" or not isinstance(message, Message) or message.key not in ZH:
        return message if isinstance(message, str) else str(message)
    return ZH[message.key].format(**{k: _field(k, v, lang) for k, v in message.fields.items()})


def _field(name: str, value: Any, lang: str) -> Any:
    if isinstance(value, Message):
        return localize(value, lang)
    if isinstance(value, Word):
        return WORDS.get(str(value), str(value))
    if name == "status" and isinstance(value, str):
        return STATUS_ZH.get(value, value)
    return value


def localize_all(value: Any, lang: str) -> Any:
    """Every message inside a JSON value (a refusal's details) localized; other values as they are."""
    if isinstance(value, str):
        return localize(value, lang)
    if isinstance(value, Mapping):
        return {k: localize_all(v, lang) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [localize_all(v, lang) for v in value]
    return value


def accepted_language(header: str | None) -> str:
    """The first of ``LANGUAGES`` an ``Accept-Language`` header names (by its q-values), else English."""
    best, best_q = DEFAULT_LANGUAGE, 0.0
    for i, part in enumerate((header or "").split(",")):
        tag, _, params = part.strip().partition(";")
        lang = tag.strip().lower().split("-")[0]
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        if lang in LANGUAGES and q > best_q:
            best, best_q = lang, q - i * 1e-6  # equal weights: the earlier tag wins
    return best
