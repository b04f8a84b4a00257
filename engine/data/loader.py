"""Training batches from one or more datasets mixed by probability, packed or padded, resumable."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.data.archive import dataset_file
from engine.data.encode import EncodedPair, EncodedSample, SampleEncoder
from engine.data.formats import detect_format
from engine.data.ocr import OCRSampleEncoder
from engine.data.packing import collate_packed, collate_padded, collate_pairs, pack_sequences
from engine.data.paddleocr_vl_processor import OCRProcessorSettings
from engine.data.record_types import KINDS, RecordError
from engine.data.validate import DatasetError, Problem, ValidationReport, read_examples
from engine.data.vl_processor import ProcessorSettings
from engine.models.config import VisionConfig
from engine.tokenizer import ErnieTokenizer
from engine.train.stages import REGISTRY, STAGE_ALIASES, find_stage

log = logging.getLogger(__name__)

# A packed batch is cut from a pool of drawn samples this many rows deep, so rows can be filled tightly.
POOL_ROWS = 8
# "random" draws a dataset by train_dataset_prob for every sample; the interleave strategies are ERNIEKit /
# LLaMA-Factory names for the same probability-weighted interleaving of an endless stream; "concat"
# reads the datasets one after another and ignores the probabilities.
MIX_STRATEGIES = ("random", "interleave_under", "interleave_over", "concat")
# A drawn sample waits at most this many batches in the pool before its row is emitted regardless of fill.
MAX_WAIT_BATCHES = 16


@dataclass
class DatasetSource:
    path: str
    format: str | None = None
    prob: float = 1.0


@dataclass
class DataSpec:
    """ERNIEKit's comma-separated ``train_dataset_type / _path / _prob`` as a list of sources."""

    sources: list[DatasetSource]

    @classmethod
    def from_erniekit(
        cls, types: str | list | None, paths: str | list, probs: str | list | None = None
    ) -> DataSpec:
        def split(v: Any) -> list[str]:
            if v is None:
                return []
            items = v if isinstance(v, list | tuple) else str(v).split(",")
            return [str(x).strip() for x in items if str(x).strip()]

        path_list, type_list, prob_list = split(paths), split(types), split(probs)
        if not path_list:
            raise ValueError("train_dataset_path is empty; give one or more comma-separated dataset files")
        if type_list and len(type_list) == 1 < len(path_list):
            type_list = type_list * len(path_list)
        if type_list and len(type_list) != len(path_list):
            raise ValueError(
                f"train_dataset_type lists {len(type_list)} types but train_dataset_path lists {len(path_list)} files"
            )
        if prob_list and len(prob_list) != len(path_list):
            raise ValueError(
                f"train_dataset_prob lists {len(prob_list)} values but train_dataset_path lists {len(path_list)} files"
            )
        probs_f = []
        for p in prob_list or ["1"] * len(path_list):
            try:
                probs_f.append(float(p))
            except ValueError:
                raise ValueError(f"train_dataset_prob value {p!r} is not a number") from None
        if any(p < 0 for p in probs_f) or sum(probs_f) <= 0:
            raise ValueError(f"train_dataset_prob must be >= 0 and not all zero, got {probs_f}")
        fmts = [None if t in ("", "auto") else t for t in type_list] or [None] * len(path_list)
        return cls([DatasetSource(p, f, pr) for p, f, pr in zip(path_list, fmts, probs_f, strict=True)])


def parse_spec(spec: DataSpec | Mapping[str, Any] | Any) -> DataSpec:
    """A DataSpec from a DataSpec, a mapping or a config object with ERNIEKit's dataset keys."""
    if isinstance(spec, DataSpec):
        return spec
    if isinstance(spec, str | Path):
        return DataSpec([DatasetSource(str(spec))])
    get = spec.get if isinstance(spec, Mapping) else lambda k, d=None: getattr(spec, k, d)
    return DataSpec.from_erniekit(
        get("train_dataset_type", None), get("train_dataset_path", None), get("train_dataset_prob", None)
    )


def load_items(
    path: str | Path, fmt: str | None, kind: str, encoder: SampleEncoder, tokenizer: ErnieTokenizer
) -> tuple[list[EncodedSample | EncodedPair], int]:
    """Every trainable item of one file (or zip of images and a labels file) and the number of records
    that had nothing trainable left; any record's problem raises ``DatasetError`` listing them all."""
    items, dropped, report = encode_file(path, fmt, kind, encoder, tokenizer)
    if report.problems:
        raise DatasetError(report)
    if not items:
        raise ValueError(
            f"{path}: no record fits max_seq_len={encoder.max_seq_len} with tokens left to train on"
        )
    if dropped:
        log.warning(
            "%s: %d records had nothing trainable within max_seq_len=%d and were skipped",
            path,
            dropped,
            encoder.max_seq_len,
        )
    return items, dropped


def encode_file(
    path: str | Path, fmt: str | None, kind: str, encoder: SampleEncoder, tokenizer: ErnieTokenizer
) -> tuple[list[EncodedSample | EncodedPair], int, ValidationReport]:
    """(items, records with nothing trainable, the report of every record's problems) of one file: the
    format checks, then the encoder's (``RecordError``: the OCR encoder's). Unusable files raise."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: dataset file not found")
    p, label = dataset_file(path)
    try:
        found_fmt, found_kind = detect_format(p)
    except ValueError:
        if fmt is None:
            raise
        found_fmt, found_kind = fmt, kind  # the per-record checks below will say what is wrong
    if fmt == "erniekit" and found_fmt in ("erniekit_vl", "ocr"):
        fmt = found_fmt  # ERNIEKit names VL (and OCR) data "erniekit" too; its records decide
    fmt = fmt or found_fmt
    if fmt not in KINDS:
        raise ValueError(f"{path}: unknown dataset type {fmt!r}; choose one of: {', '.join(KINDS)}")
    if found_fmt == fmt and found_kind != kind:
        if (fmt, found_kind) == ("erniekit", "pt"):
            raise ValueError(
                f"{path}: holds ERNIEKit pretraining text ({{'tgt': [...]}} records without 'src'), but this stage "
                f"trains on {kind} data; train it with stage PT, or give each record its prompts as 'src'"
            )
        raise ValueError(f"{path}: holds {found_kind} data ({fmt}), but this stage trains on {kind} data")
    if kind not in KINDS[fmt]:
        raise ValueError(f"{path}: format {fmt!r} holds {'/'.join(KINDS[fmt])} data, not {kind}")
    report = ValidationReport(label, fmt, kind)
    items: list[EncodedSample | EncodedPair] = []
    dropped = 0
    decode = getattr(encoder, "decode_images", False)
    # A run fetches the images its records name by URL that are not kept yet (a worker, never a request).
    for line, ex, problems in read_examples(p, fmt, kind, tokenizer, fetch_urls=True, decode_images=decode):
        report.num_records += 1
        encoded = []
        if not problems:
            try:
                encoded = encoder.encode(ex)
            except RecordError as e:
                problems = e.problems
        if problems:
            report.problems.extend(Problem(label, line, m) for m in problems)
            continue
        report.num_valid += 1
        if not encoded:
            dropped += 1
        items.extend(encoded)
    return items, dropped, report


class TrainData:
    """An endless, seeded stream of batches; ``state_dict()`` / ``load_state_dict()`` resume it exactly.

    Every draw picks a dataset by probability and takes its next item (each dataset is reshuffled every
    epoch). Packed mode keeps a small pool of drawn items and emits the ``batch_size`` fullest rows that
    first-fit-decreasing packing makes of it; the rest stay in the pool for the next batch.
    """

    def __init__(
        self,
        spec: DataSpec | Mapping[str, Any] | Any,
        tokenizer: ErnieTokenizer,
        stage: str,
        max_seq_len: int,
        packing: bool = True,
        seed: int = 42,
        batch_size: int = 1,
        vision_config: VisionConfig | None = None,
        max_prompt_len: int | None = None,
        shuffle: bool = True,
        vision: ProcessorSettings | OCRProcessorSettings | None = None,
        mix_strategy: str = "random",
        repeat: bool = True,
        packing_size: int = 0,
    ):
        stage_key = stage.upper().replace("_", "-")
        info = find_stage(stage_key)
        if info is None:
            names = [*(s.name for s in REGISTRY), *STAGE_ALIASES]
            raise ValueError(f"unknown stage {stage!r}; choose one of: {', '.join(names)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if mix_strategy not in MIX_STRATEGIES:
            raise ValueError(
                f"unknown mix_strategy {mix_strategy!r}; choose one of: {', '.join(MIX_STRATEGIES)}"
            )
        self.spec = parse_spec(spec)
        self.mix_strategy, self.repeat = mix_strategy, repeat
        self.stage, self.kind = stage_key, info.data_kind
        self.tokenizer = tokenizer
        self.max_seq_len, self.seed = max_seq_len, seed
        # DPO keeps one pair per row: the loss sums log-probabilities per row.
        self.packing = packing and self.kind != "dpo"
        self.packing_size = packing_size  # at most this many samples in a packed row (0: as many as fit)
        self.batch_size, self.shuffle = batch_size, shuffle
        self.encoder: SampleEncoder
        if info.trains_paddleocr_vl:  # PaddleOCR-VL's prompt form and image processor
            vision = vision if isinstance(vision, OCRProcessorSettings) else ocr_settings(vision_config)
            self.encoder = OCRSampleEncoder(tokenizer, max_seq_len, vision, max_prompt_len)
        else:
            vision = vision or ProcessorSettings.from_vision_config(vision_config)
            self.encoder = SampleEncoder(tokenizer, max_seq_len, vision_config, max_prompt_len, vision)
        self.pad_id = tokenizer.pad_token_id
        self.vision = vision if info.reads_images else None
        self.items: list[list[EncodedSample | EncodedPair]] = []
        self.dropped = 0
        for src in self.spec.sources:
            items, dropped = load_items(src.path, src.format, self.kind, self.encoder, tokenizer)
            self.items.append(items)
            self.dropped += dropped
        probs = np.asarray([s.prob for s in self.spec.sources], dtype=np.float64)
        self.probs = probs / probs.sum()
        self._rng = np.random.default_rng(seed)
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        self._cursor = [[0, 0] for _ in self.items]  # per source: [epoch, position]
        self._pool: list[tuple[int, int, int]] = []  # (source, item, batch index when drawn)
        self.batches_yielded = 0
        self.items_drawn = 0
        self.source_counts = [0] * len(self.items)  # draws per dataset, to check the mixing
        self._finite: Iterator[dict[str, Any]] | None = None

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def num_items(self) -> int:
        return sum(len(x) for x in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(len(it) for items in self.items for it in items)

    @property
    def steps_per_epoch(self) -> int:
        """Batches that cover every item about once (packed: by tokens, padded: by samples)."""
        if self.packing:
            by_tokens = -(-self.num_tokens // (self.max_seq_len * self.batch_size))
            by_count = -(-self.num_items // (self.packing_size * self.batch_size)) if self.packing_size else 0
            return max(1, by_tokens, by_count)
        return max(1, -(-self.num_items // self.batch_size))

    @property
    def epoch(self) -> float:
        """Items drawn so far divided by the number of items."""
        return self.items_drawn / max(self.num_items, 1)

    # ---- drawing ----------------------------------------------------------------------------------
    def _order(self, src: int, epoch: int) -> np.ndarray:
        key = (src, epoch)
        if key not in self._orders:
            n = len(self.items[src])
            order = (
                np.random.default_rng([self.seed, src, epoch]).permutation(n)
                if self.shuffle
                else np.arange(n)
            )
            self._orders = {k: v for k, v in self._orders.items() if k[0] != src}
            self._orders[key] = order
        return self._orders[key]

    def _draw(self) -> tuple[int, int]:
        if len(self.items) == 1:
            src = 0
        elif self.mix_strategy == "concat":
            src = self._concat_source()
        else:
            src = int(self._rng.choice(len(self.items), p=self.probs))
        epoch, pos = self._cursor[src]
        idx = int(self._order(src, epoch)[pos])
        pos += 1
        if pos == len(self.items[src]):
            epoch, pos = epoch + 1, 0
        self._cursor[src] = [epoch, pos]
        self.items_drawn += 1
        self.source_counts[src] += 1
        return src, idx

    def _concat_source(self) -> int:
        """The first dataset that has not finished the current pass; all finished -> the next pass."""
        least = min(c[0] for c in self._cursor)
        return next(i for i, c in enumerate(self._cursor) if c[0] == least)

    def _item(self, ref: tuple[int, ...]) -> EncodedSample | EncodedPair:
        return self.items[ref[0]][ref[1]]

    @property
    def num_batches(self) -> int:
        """Batches per epoch (what ``num_train_epochs`` multiplies)."""
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """``repeat=True``: the endless stream itself; ``repeat=False``: one pass over every item."""
        return self if self.repeat else self.one_pass()

    def __next__(self) -> dict[str, Any]:
        if not self.repeat:
            if self._finite is None:
                self._finite = self.one_pass()
            return next(self._finite)
        if self.packing:
            refs_rows = self._next_packed_rows()
            rows = [[self._item(r) for r in row] for row in refs_rows]
            batch = self._collate_rows(rows)
        else:
            items = [self._item(self._draw()) for _ in range(self.batch_size)]
            batch = self._collate_flat(items)
        self.batches_yielded += 1
        return batch

    def _next_packed_rows(self) -> list[list[tuple[int, int]]]:
        target = max(POOL_ROWS, 2 * self.batch_size) * self.max_seq_len
        tokens = sum(len(self._item(r)) for r in self._pool)
        while tokens < target:
            src, idx = self._draw()
            self._pool.append((src, idx, self.batches_yielded))
            tokens += len(self.items[src][idx])
        lengths = [len(self._item(r)) for r in self._pool]
        rows = pack_sequences(lengths, self.max_seq_len, self.packing_size)
        fill = [sum(lengths[i] for i in row) for row in rows]
        overdue = self.batches_yielded - MAX_WAIT_BATCHES

        # The fullest rows go out, except that a row holding a sample that waited too long goes first:
        # without that, long samples that never fill a row well would linger while short ones overtake.
        def priority(r: int) -> tuple[bool, int, int]:
            waited = any(self._pool[i][2] <= overdue for i in rows[r])
            return (not waited, -fill[r], min(rows[r]))

        chosen = sorted(range(len(rows)), key=priority)[: self.batch_size]
        chosen.sort(key=lambda r: min(rows[r]))
        out = [[self._pool[i][:2] for i in sorted(rows[r])] for r in chosen]
        used = {i for r in chosen for i in rows[r]}
        self._pool = [ref for i, ref in enumerate(self._pool) if i not in used]
        return out  # type: ignore[return-value]

    def _collate_rows(self, rows: list[list[EncodedSample | EncodedPair]]) -> dict[str, Any]:
        if self.kind == "dpo":
            return collate_pairs(rows, self.pad_id, packed=True)  # type: ignore[arg-type]
        return collate_packed(rows, self.pad_id, self.vision)  # type: ignore[arg-type]

    def _collate_flat(self, items: list[EncodedSample | EncodedPair]) -> dict[str, Any]:
        if self.kind == "dpo":
            return collate_pairs(items, self.pad_id, packed=False)  # type: ignore[arg-type]
        return collate_padded(items, self.pad_id, self.vision)  # type: ignore[arg-type]

    def one_pass(self) -> Iterator[dict[str, Any]]:
        """Every item exactly once (file order, or shuffled by ``seed``); does not move the endless stream."""
        flat = [it for items in self.items for it in items]
        if self.shuffle:
            flat = [flat[i] for i in np.random.default_rng([self.seed, 1 << 20]).permutation(len(flat))]
        if not self.packing:
            for i in range(0, len(flat), self.batch_size):
                yield self._collate_flat(flat[i : i + self.batch_size])
            return
        rows = pack_sequences([len(x) for x in flat], self.max_seq_len, self.packing_size)
        rows.sort(key=min)
        for i in range(0, len(rows), self.batch_size):
            yield self._collate_rows([[flat[j] for j in sorted(r)] for r in rows[i : i + self.batch_size]])

    # ---- resume -----------------------------------------------------------------------------------
    def _fingerprint(self) -> list[list[Any]]:
        return [[s.path, len(items)] for s, items in zip(self.spec.sources, self.items, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position in the stream (saved in checkpoints)."""
        return {
            "version": 1,
            "seed": self.seed,
            "sources": self._fingerprint(),
            "rng": copy.deepcopy(self._rng.bit_generator.state),
            "cursor": [list(c) for c in self._cursor],
            "pool": [list(r) for r in self._pool],
            "batches_yielded": self.batches_yielded,
            "items_drawn": self.items_drawn,
            "source_counts": list(self.source_counts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where ``state`` was taken; refuses a state from different data."""
        if state.get("version") != 1:
            raise ValueError(f"unsupported data state version {state.get('version')!r}")
        if [list(x) for x in state["sources"]] != self._fingerprint() or state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's data position belongs to other data ({state['sources']}, seed {state['seed']}); "
                f"this run reads {self._fingerprint()} with seed {self.seed}"
            )
        self._rng.bit_generator.state = copy.deepcopy(dict(state["rng"]))
        self._cursor = [list(c) for c in state["cursor"]]
        self._pool = [(int(a), int(b), int(c)) for a, b, c in state["pool"]]
        self.batches_yielded = int(state["batches_yielded"])
        self.items_drawn = int(state["items_drawn"])
        self.source_counts = [int(x) for x in state["source_counts"]]


def ocr_settings(vision_config: Any = None) -> OCRProcessorSettings:
    """PaddleOCR-VL's image processor defaults with a vision config's patch and merge sizes."""
    if vision_config is None:
        return OCRProcessorSettings()
    return OCRProcessorSettings(
        patch_size=int(vision_config.patch_size), merge_size=int(vision_config.spatial_merge_size)
    )


def build_train_data(
    spec: DataSpec | Mapping[str, Any] | Any,
    tokenizer: ErnieTokenizer,
    stage: str,
    max_seq_len: int,
    packing: bool = True,
    seed: int = 42,
    **kwargs: Any,
) -> TrainData:
    """The batch stream of a training run (see ``TrainData`` for the keyword options)."""
    return TrainData(spec, tokenizer, stage, max_seq_len, packing, seed, **kwargs)


def check_ocr_file(
    path: str | Path,
    tokenizer: ErnieTokenizer,
    max_seq_len: int,
    settings: OCRProcessorSettings | None = None,
    fmt: str | None = None,
) -> ValidationReport:
    """Every problem of an OCR dataset file (or zip) as a PaddleOCR-VL run reads it, by line and field: what
    the studio shows before it queues a run. Never raises for bad records."""
    encoder = OCRSampleEncoder(tokenizer, max_seq_len, settings)
    _, _, report = encode_file(path, fmt, "sft", encoder, tokenizer)
    return report
