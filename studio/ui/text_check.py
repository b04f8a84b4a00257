"""The tests' check of a page shown in Chinese: English words that reached it without a translation.

Kept apart from the translation code (``studio.ui.i18n``, ``studio.messages``, which match nothing by
pattern): this reads what a page shows, word by word.
"""

from __future__ import annotations

import re
from typing import Any

from engine.data.paddleocr_vl_processor import TASK_PROMPTS
from engine.data.record_types import FORMATS, KINDS
from engine.eval.config import BENCHMARK_TYPES
from engine.train.options import COMPUTE_TYPES, FINE_TUNING, SCHEDULERS
from engine.train.stages import STAGES
from studio.messages import ZH as MESSAGE_ZH
from studio.ui.i18n import STRINGS

# A shown word: letters only (tokens with digits, "_", "/", ".", ":" or "@" are identifiers, paths, numbers).
_TOKEN = re.compile(r"[^\s,;()\[\]{}<>\"'`*|·—–:：，。；（）“”、!?！？…]+")
_WORD = re.compile(r"^[A-Za-z][A-Za-z'-]*[A-Za-z]$")
_URL = re.compile(r"[A-Za-z][A-Za-z+.-]*://\S+")
_FIELD = re.compile(r"\{[^{}]*\}")  # a str.format field of a text, filled at run time
_TAG = re.compile(r"</?[A-Za-z][^<>]*>")  # markup (a Markdown text's <details>) is not shown as text


def kept_words() -> set[str]:
    """Words every language shows as they are: what the Chinese texts keep in Latin letters (LoRA, Token,
    ERNIE, KiB, ...) and the engine's identifiers (formats, data kinds, stages, fine-tuning kinds, compute
    types, schedulers), lower-cased."""
    words: set[str] = set()
    for zh in [*(zh for _, zh in STRINGS.values()), *MESSAGE_ZH.values()]:
        words.update(w.lower() for w in _words(_FIELD.sub(" ", zh)))
    kinds = [k for ks in KINDS.values() for k in ks] + ["benchmark"]  # studio.services.datasets.BENCHMARK
    for names in (FORMATS, BENCHMARK_TYPES, kinds, STAGES, FINE_TUNING):
        words.update(n.lower() for n in names)
    words.update(n.lower() for n in (*COMPUTE_TYPES, *SCHEDULERS))
    # PaddleOCR-VL's task prompts (Deploy & Chat offers them): the words the model was trained with
    words.update(w.lower() for prompt in TASK_PROMPTS.values() for w in _words(prompt))
    return words


def _words(shown: str) -> list[str]:
    return [t for t in _TOKEN.findall(_URL.sub(" ", _TAG.sub(" ", shown))) if _WORD.match(t)]


def untranslated_words(shown: str, data: Any = ()) -> list[str]:
    """Words of ``shown`` (text a page in Chinese shows) that no Chinese text of the table keeps and that
    are not among ``data`` (names and values the person gave, such as dataset and run names): English
    that reached the page without a translation."""
    allowed = kept_words() | {w.lower() for value in data for w in _words(str(value))}
    return [w for w in _words(shown) if w.lower() not in allowed]
