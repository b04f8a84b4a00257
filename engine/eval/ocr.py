"""Character error rate and exact match of a PaddleOCR-VL model's readings of a held-out set, and a base
model against a fine-tuned one on the same set: what the studio's Evaluate tab shows side by side.

The held-out set is any OCR dataset a run trains on (OCR pairs, ERNIEKit VL records, a labels file, a zip):
each record's last answer is the reference, its prompt (image and task prompt, earlier turns) is what the
model reads, in the training prompt form (``engine.data.ocr``). Readings are greedy, generated through the
serving engine's continuous batching (``engine.serve.generate``) until the model's stop token.

- CER: the Levenshtein distance between the reading and the reference, in characters (insertions,
  deletions and substitutions count 1), summed over the set and divided by the references' characters
  (corpus CER; can exceed 1 when readings are longer than the references).
- exact match: the share of readings equal to their reference.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.eval.items import EvalDataError

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 256


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance between two strings, in characters."""
    if len(a) < len(b):
        a, b = b, a
    if not b:
        return len(a)
    target = np.frombuffer(b.encode("utf-32-le"), dtype=np.uint32)
    previous = np.arange(len(b) + 1, dtype=np.int64)
    for i, ch in enumerate(a, start=1):
        substitute = previous[:-1] + (target != ord(ch))
        current = np.empty_like(previous)
        current[0] = i
        current[1:] = np.minimum(previous[1:] + 1, substitute)
        # insertions run along the row: a running minimum of (cell - column) + column
        current = np.minimum.accumulate(current - np.arange(len(b) + 1)) + np.arange(len(b) + 1)
        previous = current
    return int(previous[-1])


def character_error_rate(prediction: str, reference: str) -> float:
    """One reading's CER: edits / reference characters (1.0 per character when the reference is empty)."""
    return edit_distance(prediction, reference) / max(len(reference), 1)


@dataclass
class OCRItem:
    """One held-out record: where it is, its conversation up to the last prompt, and the reference."""

    line: int
    conversation: Any  # engine.data.formats.Conversation; its last turn's answer is the reference
    reference: str

    @property
    def images(self) -> list[Path]:
        return [m for turn in self.conversation.turns for m in turn.media]


@dataclass
class OCRScores:
    """The scores of one model on one set, and each reading."""

    model: str
    cer: float
    exact_match: float
    samples: int
    readings: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def score_readings(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus CER and exact match of readings against their references."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} readings for {len(references)} references")
    edits = sum(edit_distance(p, r) for p, r in zip(predictions, references, strict=True))
    chars = sum(max(len(r), 1) for r in references)
    exact = sum(p == r for p, r in zip(predictions, references, strict=True))
    n = max(len(references), 1)
    return {"cer": edits / max(chars, 1), "exact_match": exact / n}


def read_ocr_set(path: str | Path, tokenizer, max_samples: int = 0) -> list[OCRItem]:
    """The records of a held-out OCR set; every problem of the file at once (``EvalDataError``, by line)."""
    from engine.data.archive import dataset_file
    from engine.data.formats import detect_format
    from engine.data.validate import read_examples

    p, label = dataset_file(path)
    fmt, kind = detect_format(p)
    if kind != "sft":
        raise EvalDataError([f"{label}: holds {kind} data ({fmt}); an OCR set holds image + text records"])
    items, problems = [], []
    for line, ex, found in read_examples(p, fmt, kind, tokenizer, fetch_urls=True, decode_images=True):
        if found:
            problems += [f"{label}:{line}: {m}" for m in found]
        elif not any(t.media for t in ex.turns):
            problems.append(f"{label}:{line}: the record has no image; an OCR set pairs images with text")
        else:
            items.append(OCRItem(line, ex, ex.turns[-1].assistant))
        if max_samples and len(items) >= max_samples:
            break
    if problems:
        raise EvalDataError(problems)
    if not items:
        raise EvalDataError([f"{label}: no records"])
    return items


def prompt_ids(encoder, item: OCRItem) -> list[int]:
    """The ids the model reads before its answer, in the training prompt form: the head, earlier turns with
    their answers, the last prompt and ``Assistant: ``."""
    conv = item.conversation
    ids = encoder.tok.encode(encoder.head_text(conv.system) + encoder.prompt_text(conv.turns[0]))
    for k, turn in enumerate(conv.turns[1:], start=1):
        ids += encoder.reply_ids(conv.turns[k - 1]) + encoder.tok.encode(encoder.prompt_text(turn))
    return ids


def read_set(
    model,
    tokenizer,
    settings,
    items: list[OCRItem],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    max_num_seqs: int = 8,
) -> list[str]:
    """The model's greedy reading of every item (batched through the serving engine)."""
    from engine.data.ocr import OCRSampleEncoder
    from engine.data.paddleocr_vl_processor import preprocess_image
    from engine.eval.generation import generate_batch
    from engine.serve.generate import GenerationEngine
    from engine.serve.sampling import SamplingParams

    encoder = OCRSampleEncoder(tokenizer, 1 << 20, settings)
    prompts = [prompt_ids(encoder, item) for item in items]
    images = [[preprocess_image(path, settings) for path in item.images] for item in items]
    longest = max(len(p) for p in prompts) + max_new_tokens
    engine = GenerationEngine(model, tokenizer, max_num_seqs=max_num_seqs, max_model_len=longest)
    params = [SamplingParams(max_tokens=max_new_tokens) for _ in items]
    try:
        return [p.text for p in generate_batch(engine, prompts, params, images)]
    finally:
        engine.shutdown()


def evaluate_ocr(
    model_dir: str | Path,
    data_path: str | Path,
    max_samples: int = 0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> OCRScores:
    """CER and exact match of one PaddleOCR-VL model directory (a LoRA run reads merged) on a held-out set,
    with its own tokenizer and image processor settings (a run's: what it trained with)."""
    import engine
    from engine.data.paddleocr_vl_processor import OCRProcessorSettings

    tokenizer = engine.load_tokenizer(str(model_dir))
    items = read_ocr_set(data_path, tokenizer, max_samples)
    model = engine.load_model(str(model_dir))
    settings = OCRProcessorSettings.from_model_dir(model_dir)
    predictions = read_set(model, tokenizer, settings, items, max_new_tokens)
    return scores_of(str(model_dir), items, predictions)


def scores_of(model: str, items: list[OCRItem], predictions: list[str]) -> OCRScores:
    references = [item.reference for item in items]
    totals = score_readings(predictions, references)
    readings = [
        {
            "line": item.line,
            "images": [str(p) for p in item.images],
            "reference": ref,
            "prediction": pred,
            "cer": character_error_rate(pred, ref),
            "exact_match": pred == ref,
        }
        for item, ref, pred in zip(items, references, predictions, strict=True)
    ]
    log.info(
        "%s: CER %.4f, exact match %.4f on %d samples",
        model,
        totals["cer"],
        totals["exact_match"],
        len(items),
    )
    return OCRScores(model, totals["cer"], totals["exact_match"], len(items), readings)


def compare_ocr(
    base_dir: str | Path,
    tuned_dir: str | Path,
    data_path: str | Path,
    max_samples: int = 0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> dict[str, Any]:
    """The base model and a fine-tuned one on the same held-out set: both scores and, per record, the
    reference with both readings side by side."""
    base = evaluate_ocr(base_dir, data_path, max_samples, max_new_tokens)
    tuned = evaluate_ocr(tuned_dir, data_path, max_samples, max_new_tokens)
    rows = [
        {
            "line": b["line"],
            "images": b["images"],
            "reference": b["reference"],
            "base": b["prediction"],
            "tuned": t["prediction"],
            "base_cer": b["cer"],
            "tuned_cer": t["cer"],
        }
        for b, t in zip(base.readings, tuned.readings, strict=True)
    ]
    return {"base": base.as_dict(), "tuned": tuned.as_dict(), "rows": rows}
