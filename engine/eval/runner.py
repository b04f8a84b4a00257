"""``run_eval(config)``: one model on every eval file, scored batch by batch into the output directory.

Order of work: read and check every file (all problems at once), check the judge answers, load the model,
then per file score the samples eval_samples.jsonl does not hold yet, a chunk at a time (generate the chunk
together, judge it, append its lines), add eval_loss / eval_ppl for chat files, and write eval_results.json
from every line of the file, so a killed and restarted evaluation ends with the same results.
"""

from __future__ import annotations

import itertools
import json
import re
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from engine.eval.config import CHAT_TYPES, OCR_METRICS, OCR_TYPES, EvalConfig, option_problems, run_notices
from engine.eval.items import ChatItem, ChoiceItem, EvalDataError, EvalFile, NumberItem, read_eval_file
from engine.eval.judge import Judge, JudgeSettings, api_key
from engine.eval.results import RESULTS_FILE, SAMPLES_FILE, SampleLog, aggregate, headline
from engine.train.run_dir import write_json

# Samples generated (and judged) together before their lines are written: a kill loses at most one chunk.
CHUNK_PER_SEQ = 4


@dataclass
class EvalSummary:
    status: str
    output_dir: str
    model: str
    metrics: dict[str, float] = field(default_factory=dict)  # headline numbers, "<file stem>/<metric>"
    datasets: dict[str, Any] = field(default_factory=dict)
    notices: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None
    started_at: str = ""
    ended_at: str = ""

    @property
    def exit_code(self) -> int:
        return 0 if self.status == "succeeded" else 1


def sample_id(f: EvalFile, line: int) -> str:
    return f"{f.name}:{line}"


def read_files(cfg: EvalConfig) -> list[EvalFile]:
    """Every eval file's items; the problems of all files in one EvalDataError. A PaddleOCR-VL model reads
    OCR sets only, and a text model every other kind."""
    ocr_model = model_reads_images(cfg.model_name_or_path)
    files, problems = [], option_problems(cfg, ocr_model)
    tokenizer = None
    for path, type_ in zip(cfg.paths, cfg.types, strict=True):
        if not Path(path).is_file():
            problems.append(f"{path}: eval file does not exist")
            continue
        kind = file_type(path, type_)
        mismatch = family_problem(cfg.model_name_or_path, path, kind, ocr_model)
        if mismatch:
            problems.append(mismatch)
            continue
        try:
            if kind in OCR_TYPES:
                if tokenizer is None:
                    import engine

                    tokenizer = engine.load_tokenizer(cfg.model_name_or_path)
                files.append(read_ocr_file(path, kind, tokenizer, cfg.max_samples))
            else:
                files.append(read_eval_file(path, type_, cfg.max_samples))
        except EvalDataError as e:
            problems += e.problems
    names = [f.name for f in files]
    problems += [
        f"{f.path}: another eval file is also named {f.name}; rename one"
        for f in files
        if names.count(f.name) > 1
    ]
    if problems:
        raise EvalDataError(problems)
    return files


def model_reads_images(model: str) -> bool:
    """Whether ``model`` (a model directory, or a LoRA run of one) is a PaddleOCR-VL model."""
    from engine.models.paddleocr_vl_config import is_paddleocr_vl_dir
    from engine.models.paths import architecture_dir

    try:
        return is_paddleocr_vl_dir(architecture_dir(model))
    except FileNotFoundError:  # the loader says what is missing
        return False


def file_type(path: str, type_: str) -> str:
    """``type_``, with ``auto`` resolved to the OCR format of an OCR set (others resolve as they are read)."""
    if type_ != "auto":
        return type_
    found = data_format(path)
    return found if found in OCR_TYPES else type_


def data_format(path: str) -> str | None:
    """The dataset format of a file (a zip's or a labels file's as training reads it), None when unknown."""
    from engine.data.archive import dataset_file
    from engine.data.formats import detect_format

    try:
        return detect_format(dataset_file(path)[0])[0]
    except (OSError, ValueError):
        return None


def family_problem(model: str, path: str, kind: str, ocr_model: bool) -> str | None:
    """Why ``model`` cannot be scored on the file, when it cannot: OCR sets for PaddleOCR-VL, the rest for
    text models."""
    if kind in OCR_TYPES and not ocr_model:
        return (
            f"{path}: an OCR set (images with the text they show) is read by a PaddleOCR-VL model, and {model} "
            "is not one; evaluate a PaddleOCR-VL model (or a run fine-tuned from one) on it"
        )
    if ocr_model and kind not in OCR_TYPES:
        what = "chat or benchmark" if kind == "auto" else kind
        return (
            f"{path}: holds {what} records, and {model} is a PaddleOCR-VL model, which reads images; evaluate "
            "it on an OCR set (image + text pairs), and this file with a text model"
        )
    return None


def read_ocr_file(path: str, kind: str, tokenizer, max_samples: int) -> EvalFile:
    """An OCR set's records (engine.eval.ocr, which reads the format from the file), every problem by line."""
    from engine.data.archive import dataset_file
    from engine.data.formats import detect_format
    from engine.eval.ocr import read_ocr_set

    try:
        found = detect_format(dataset_file(path)[0])[0]
    except (OSError, ValueError) as e:
        raise EvalDataError([str(e)]) from None
    if found != kind:  # engine.eval.ocr reads what the file holds; a type saying otherwise is a mistake
        raise EvalDataError([f"{path}: eval_dataset_type says {kind}, and the file holds {found} records"])
    return EvalFile(path, kind, read_ocr_set(path, tokenizer, max_samples))


class Evaluation:
    """The pieces of one evaluation (model, tokenizer, engines, logs) and the scorers of each file kind."""

    def __init__(self, cfg: EvalConfig, emit: Callable[[dict], None]):
        import engine
        from engine.data.encode import SampleEncoder

        self.cfg, self.emit = cfg, emit
        self.out = Path(cfg.output_dir)
        self.samples = SampleLog(self.out / SAMPLES_FILE)
        self.judge = self._judge()
        self.baseline = self._baseline() if self.judge and cfg.judge_mode == "pairwise" else None
        # the tokenizer first: a chat template the sandbox refuses stops the eval before the model loads
        self.tok = engine.load_tokenizer(cfg.model_name_or_path)
        self.model = engine.load_model(cfg.model_name_or_path)
        self.encoder = SampleEncoder(self.tok, cfg.max_seq_len)
        self.pattern = re.compile(cfg.answer_regex) if cfg.answer_regex else None
        self._engine = None
        self._ocr_reader = None

    # -- setup --
    def _judge(self) -> Judge | None:
        cfg = self.cfg
        if "judge" not in cfg.metrics:
            return None
        key, key_note = api_key(cfg.judge_api_key, cfg.judge_url)
        settings = JudgeSettings(
            cfg.judge_url,
            cfg.judge_model,
            key,
            cfg.judge_timeout,
            where=cfg.where("judge_url"),
            key_note=key_note,
        )
        judge = Judge(settings)
        judge.check()
        return judge

    def _baseline(self) -> dict[str, str] | None:
        """pairwise against another eval's predictions: its eval_samples.jsonl, by sample id."""
        if self.cfg.judge_baseline == "reference":
            return None
        path = Path(self.cfg.judge_baseline)
        if path.is_dir():
            path = path / SAMPLES_FILE
        if not path.is_file():
            raise EvalDataError(
                [f"{self.cfg.where('judge_baseline')}: {path} does not exist (an eval_samples.jsonl)"]
            )
        return {r["id"]: r["prediction"] for r in SampleLog(path).rows.values() if "prediction" in r}

    @property
    def generator(self):
        from engine.serve.generate import GenerationEngine

        if self._engine is None:
            self._engine = GenerationEngine(self.model, self.tok, self.cfg.max_num_seqs, self.cfg.max_seq_len)
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()

    # -- scoring --
    def score_file(self, f: EvalFile) -> dict[str, Any]:
        pending = [it for it in f.items if sample_id(f, it.line) not in self.samples]
        chunk = self.cfg.max_num_seqs * CHUNK_PER_SEQ
        for start in range(0, len(pending), chunk):
            part = pending[start : start + chunk]
            if f.type == "multiple_choice":
                rows = self.score_choices(f, part)
            elif f.type in OCR_TYPES:
                rows = self.score_readings(f, part)
            else:
                rows = self.score_generations(f, part)
            self.samples.write(rows)
            done = len(f.items) - len(pending) + start + len(part)
            print(f"eval {f.name}: {done}/{len(f.items)} samples", flush=True)
            self.emit({"type": "progress", "dataset": f.name, "done": done, "total": len(f.items)})
        rows = [self.samples.rows[sample_id(f, it.line)] for it in f.items]
        metrics = aggregate(rows, self.cfg.bootstrap_samples, self.cfg.confidence, self.cfg.seed)
        if f.type in CHAT_TYPES and "loss" in self.cfg.metrics:
            metrics.update(self.loss(f))
        return {"type": f.type, "path": f.path, "samples": len(rows), "metrics": metrics}

    def score_choices(self, f: EvalFile, items: list[ChoiceItem]) -> list[dict[str, Any]]:
        from engine.eval.likelihood import choose, continuation_logprobs
        from engine.eval.prompts import benchmark_context, continuations

        cfg = self.cfg
        requests, conts, contexts = [], [], []
        for it in items:
            ctx = benchmark_context(self.encoder, it, cfg.benchmark_prompt)
            opts = continuations(it, cfg.choice_continuation, cfg.benchmark_prompt)
            ctx_ids = self.tok.encode(ctx)
            requests += [(ctx_ids, self.tok.encode(o)) for o in opts]
            conts.append(opts)
            contexts.append(ctx)
        scored = continuation_logprobs(self.model, requests, cfg.batch_size * 4, cfg.max_seq_len)
        rows, k = [], 0
        for it, opts, ctx in zip(items, conts, contexts, strict=True):
            lps = [lp for lp, _ in scored[k : k + len(opts)]]
            k += len(opts)
            raw, norm = choose(lps, opts)
            rows.append(
                {
                    "id": sample_id(f, it.line), "dataset": f.name, "line": it.line, "task": "multiple_choice",
                    "subject": it.subject, "prompt": ctx, "choices": it.choices, "reference": opts[it.answer].strip(),
                    "prediction": opts[raw].strip(), "option_logprobs": lps,
                    "scores": {"acc": float(raw == it.answer), "acc_norm": float(norm == it.answer)},
                }
            )  # fmt: skip
        return rows

    def score_generations(self, f: EvalFile, items: list[ChatItem | NumberItem]) -> list[dict[str, Any]]:
        from engine.eval.generation import generate_batch
        from engine.eval.prompts import benchmark_context, chat_prompt_ids
        from engine.serve.sampling import SamplingParams

        cfg = self.cfg
        prompts, params = [], []
        for it in items:
            if isinstance(it, ChatItem):
                ids = chat_prompt_ids(self.encoder, it.conversation)
            else:
                ids = self.tok.encode(benchmark_context(self.encoder, it, cfg.benchmark_prompt))
            prompts.append(ids[-(cfg.max_seq_len - 1) :])
            stop = ["\nQuestion:"] if isinstance(it, NumberItem) and cfg.benchmark_prompt == "plain" else []
            seed = (cfg.seed + zlib.crc32(sample_id(f, it.line).encode())) % 2**32
            params.append(
                SamplingParams(
                    max_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    seed=seed,
                    stop=stop,
                )
            )
        predictions = generate_batch(self.generator, prompts, params)
        rows = [
            self._generation_row(f, it, ids, p)
            for it, ids, p in zip(items, prompts, predictions, strict=True)
        ]
        if self.judge is not None and isinstance(items[0], ChatItem):
            self._judge_rows(rows)
        return rows

    def score_readings(self, f: EvalFile, items: list) -> list[dict[str, Any]]:
        """A PaddleOCR-VL model's readings of OCR records (images in the training prompt form), each scored by
        its character error rate and exact match as engine.eval.ocr scores them."""
        from engine.data.paddleocr_vl_processor import preprocess_image
        from engine.eval.generation import generate_batch
        from engine.eval.ocr import edit_distance, prompt_ids
        from engine.serve.sampling import SamplingParams

        cfg = self.cfg
        encoder, settings = self.ocr_reader
        prompts = [prompt_ids(encoder, it) for it in items]
        images = [[preprocess_image(p, settings) for p in it.images] for it in items]
        params = [
            SamplingParams(
                max_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                seed=(cfg.seed + zlib.crc32(sample_id(f, it.line).encode())) % 2**32,
            )
            for it in items
        ]
        # both by default; a metrics list of OCR metrics (option_problems refuses others) picks among them
        wanted = OCR_METRICS if cfg.metrics == EvalConfig().metrics else cfg.metrics
        predictions = generate_batch(self.generator, prompts, params, images)
        rows = []
        for it, ids, pred in zip(items, prompts, predictions, strict=True):
            edits, chars = edit_distance(pred.text, it.reference), max(len(it.reference), 1)
            scores = {"cer": edits / chars, "exact_match": float(pred.text == it.reference)}
            rows.append(
                {
                    "id": sample_id(f, it.line), "dataset": f.name, "line": it.line, "task": "ocr",
                    "prompt": self.tok.decode(ids, skip_special_tokens=False),
                    "images": [str(p) for p in it.images], "reference": it.reference, "prediction": pred.text,
                    "finish_reason": pred.finish_reason, "prompt_tokens": pred.prompt_tokens,
                    "completion_tokens": pred.completion_tokens, "edits": edits, "reference_chars": chars,
                    "scores": {k: v for k, v in scores.items() if k in wanted},
                }
            )  # fmt: skip
        return rows

    @property
    def ocr_reader(self):
        """PaddleOCR-VL's prompt encoder and the model's image processor settings (a run's: what it trained
        with)."""
        if self._ocr_reader is None:
            from engine.data.ocr import OCRSampleEncoder
            from engine.data.paddleocr_vl_processor import OCRProcessorSettings
            from engine.train.build import processor_dir

            settings = OCRProcessorSettings.from_model_dir(processor_dir(self.cfg.model_name_or_path))
            self._ocr_reader = OCRSampleEncoder(self.tok, self.cfg.max_seq_len, settings), settings
        return self._ocr_reader

    def _generation_row(self, f: EvalFile, it, ids: list[int], pred) -> dict[str, Any]:
        from engine.eval.answers import final_number
        from engine.eval.text_metrics import reference_scores

        cfg = self.cfg
        row = {
            "id": sample_id(f, it.line), "dataset": f.name, "line": it.line,
            "task": "generation" if isinstance(it, ChatItem) else "gsm8k",
            "prompt": self.tok.decode(ids, skip_special_tokens=False),
            "reference": it.reference if isinstance(it, ChatItem) else it.answer,
            "prediction": pred.text, "finish_reason": pred.finish_reason,
            "prompt_tokens": pred.prompt_tokens, "completion_tokens": pred.completion_tokens,
        }  # fmt: skip
        if isinstance(it, NumberItem):
            row["extracted"] = final_number(pred.text)
            row["scores"] = {"accuracy": float(row["extracted"] == it.answer)}
        else:
            metrics = [m for m in cfg.metrics if m not in ("loss", "judge")]
            row["scores"] = reference_scores(
                pred.text, it.reference, metrics, cfg.normalize, cfg.text_units, self.pattern
            )
            row["question"] = it.conversation.turns[-1].user
        return row

    def _judge_rows(self, rows: list[dict[str, Any]]) -> None:
        cases = [
            {"question": r["question"], "reference": r["reference"], "answer": r["prediction"]} for r in rows
        ]
        if self.cfg.judge_mode == "score":
            verdicts = self.judge.score_all(cases)
        else:
            for case, r in zip(cases, rows, strict=True):
                case["baseline"] = self._baseline_answer(r)
            verdicts = self.judge.compare_all(cases)
        for r, v in zip(rows, verdicts, strict=True):
            r["scores"]["judge"] = v.pop("judge")
            r.update(v)

    def _baseline_answer(self, row: dict[str, Any]) -> str:
        if self.baseline is None:
            return row["reference"]
        if row["id"] not in self.baseline:
            raise EvalDataError(
                [f"{self.cfg.where('judge_baseline')}: the baseline has no prediction for sample {row['id']} "
                 "(evaluate the baseline model on the same eval file first)"]
            )  # fmt: skip
        return self.baseline[row["id"]]

    def loss(self, f: EvalFile) -> dict[str, Any]:
        """eval_loss / eval_ppl / eval_tokens as training's evaluation computes them (engine.train.sft)."""
        from engine.data import build_train_data
        from engine.train.sft import evaluate_lm
        from engine.train.stages import SFT

        cfg = self.cfg
        data = build_train_data(
            {"train_dataset_path": f.path, "train_dataset_type": f.type},
            self.tok, stage=SFT.name, max_seq_len=cfg.max_seq_len, packing=False, seed=cfg.seed,
            batch_size=cfg.batch_size, shuffle=False,
        )  # fmt: skip
        limit = cfg.max_evaluate_steps if cfg.max_evaluate_steps > 0 else None
        batches = itertools.islice(data.one_pass(), limit)
        if cfg.max_samples:  # the same records the other metrics scored
            batches = itertools.islice(batches, max(1, -(-cfg.max_samples // cfg.batch_size)))
        return evaluate_lm(self.model, list(batches))


def run_eval(cfg: EvalConfig, on_event: Callable[[dict], None] | None = None) -> EvalSummary:
    """Evaluate as configured; writes eval_samples.jsonl and eval_results.json in output_dir."""
    from engine.train.scalars import ScalarWriters, run_name

    emit = on_event or (lambda event: None)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = EvalSummary("running", str(out), cfg.model_name_or_path, started_at=_now())
    for n in [*getattr(cfg, "notices", []), *run_notices(cfg)]:
        summary.notices.append({"key": n.key, "message": n.message})
        print(n.line(), flush=True)
        emit({"type": "notice", "key": n.key, "message": n.message})
    if not cfg.do_eval:
        summary.status = "succeeded"
        return _finish(summary, cfg, out)
    evaluation = None
    try:
        files = read_files(cfg)
        evaluation = Evaluation(cfg, emit)
        for f in files:
            summary.datasets[f.name] = evaluation.score_file(f)
        summary.metrics = headline(summary.datasets)
        summary.status = "succeeded"
    except Exception as e:
        summary.status, summary.error = "failed", str(e)
        _finish(summary, cfg, out)
        raise
    finally:
        if evaluation is not None:
            evaluation.close()
    writers = ScalarWriters(cfg.logging_dir, cfg.report_to, run_name(out))
    writers.write({"step": 0, **{f"eval_{k}": v for k, v in summary.metrics.items()}})
    writers.close()
    emit({"type": "results", "metrics": summary.metrics})
    return _finish(summary, cfg, out)


def _finish(summary: EvalSummary, cfg: EvalConfig, out: Path) -> EvalSummary:
    summary.ended_at = _now()
    config = json.loads(json.dumps(asdict(cfg), default=str))
    if config.get("judge_api_key"):  # the results are shared; the key is not
        config["judge_api_key"] = "***"
    write_json(out / RESULTS_FILE, {**asdict(summary), "config": config})
    return summary


def _now() -> str:
    return datetime.now(UTC).isoformat()
