"""Prompts of eval items, as token ids: chat records exactly as training encodes them, benchmark questions
as plain text or in the chat template (``benchmark_prompt``)."""

from __future__ import annotations

from engine.data.encode import SampleEncoder
from engine.data.record_types import Conversation
from engine.eval.items import LETTERS, ChoiceItem, NumberItem


def chat_prompt_ids(encoder: SampleEncoder, conv: Conversation) -> list[int]:
    """The conversation up to its last answer, token for token as ``SampleEncoder`` trains on it (the head and
    first prompt in one piece, then each answer and prompt), so a fine-tuned model sees its training format."""
    tok, turns = encoder.tok, conv.turns
    ids = tok.encode(encoder.head_text(conv.system) + encoder.prompt_text(turns[0]))
    for i, turn in enumerate(turns[:-1]):
        ids += tok.encode(encoder.answer_text(turn.assistant))
        ids += tok.encode(encoder.prompt_text(turns[i + 1]))
    return ids


def question_text(item: ChoiceItem | NumberItem) -> str:
    """MMLU's layout: the question, one ``A. text`` line per choice, then ``Answer:``."""
    if isinstance(item, NumberItem):
        return f"Question: {item.question}\nAnswer:"
    lines = [item.question] + [f"{LETTERS[i]}. {c}" for i, c in enumerate(item.choices)]
    return "\n".join(lines) + "\nAnswer:"


def benchmark_context(encoder: SampleEncoder, item: ChoiceItem | NumberItem, style: str) -> str:
    """The text a benchmark answer continues: plain, or the question as a chat turn (``User: ...\\nAssistant: ``)."""
    text = question_text(item)
    if style == "plain":
        return text
    body = text.removesuffix("\nAnswer:") if isinstance(item, ChoiceItem) else item.question
    return encoder.head_text(None) + "User: " + body + "\nAssistant: "


def continuations(item: ChoiceItem, style: str, prompt_style: str) -> list[str]:
    """One continuation per choice: its letter or its text; after a plain prompt they start with a space."""
    lead = " " if prompt_style == "plain" else ""
    if style == "letter":
        return [lead + LETTERS[i] for i in range(len(item.choices))]
    return [lead + c for c in item.choices]
