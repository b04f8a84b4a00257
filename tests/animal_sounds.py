"""A learnable toy task shared by the fine-tuning eval test and the forgetting test: the answer (an animal's
sound) follows from one word of the prompt, and the item number keeps seeds' prompts apart."""

from __future__ import annotations

import json
import random
from pathlib import Path

SOUNDS = {"cat": "meow", "dog": "woof", "cow": "moo", "duck": "quack"}


def sound_records(n: int, seed: int) -> list[dict]:
    """``n`` ERNIEKit SFT records asking an animal's sound, the four animals in turn."""
    rng = random.Random(seed)
    return [
        {"src": [f"Item {rng.randint(100, 999)}: what does the {a} say?"], "tgt": [SOUNDS[a]]}
        for a in (list(SOUNDS)[i % 4] for i in range(n))
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
