"""``ernie-studio eval`` config: ERNIEKit's run_eval.yaml keys plus the scorers', read like training configs.

An ERNIEKit run_eval.yaml works unchanged: its training keys (fine_tuning, lora_rank, recompute, ...) are
accepted and announced as notices, since evaluation does not train. Errors name the file and line.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from engine.train.config import TrainConfig
from engine.train.config_load import _load
from engine.train.erniekit_keys import Notice
from engine.train.options import (
    DATASET_TYPE_NAMES,
    MAX_BATCH_SIZE,
    MAX_SEQ_LEN,
    MAX_STEPS,
    ConfigError,
    check_fields,
    comma_list,
    option,
    weights_draws,
)
from engine.train.scalars import REPORT_TO, report_to_problems

# eval_dataset_type values: chat records are generated and scored (and give eval_loss / eval_ppl),
# benchmark files are scored by option log-likelihood (multiple_choice) or by the final number (gsm8k).
CHAT_TYPES = ("erniekit", "alpaca", "chatml")
BENCHMARK_TYPES = ("multiple_choice", "gsm8k")
# OCR sets (images with the text they show: OCR pairs, or ERNIEKit's image_info / text_info records) are read
# by a PaddleOCR-VL model and scored by character error rate and exact match (engine.eval.ocr); a text model
# cannot read them, nor a PaddleOCR-VL model the others.
OCR_TYPES = ("ocr", "erniekit_vl")
OCR_METRICS = ("cer", "exact_match")
DATASET_TYPES = ("auto", *CHAT_TYPES, *BENCHMARK_TYPES, *OCR_TYPES)
METRICS = ("loss", "exact_match", "contains", "regex", "rouge_l", "bleu", "judge", "cer")
NORMALIZATIONS = ("lower", "punctuation", "whitespace", "articles")
TEXT_UNITS = ("auto", "words", "chars")
JUDGE_MODES = ("score", "pairwise")
BENCHMARK_PROMPTS = ("plain", "chat")
CONTINUATIONS = ("letter", "text")

# Training keys an ERNIEKit run_eval.yaml carries; evaluation reads the model as it is.
TRAINING_KEY = "a training key; evaluation does not train"


@dataclass
class EvalConfig:
    """One evaluation of one model on one or more eval files."""

    model_name_or_path: str = option(
        "", "The model to evaluate: a model directory, a training run (Full or LoRA) or an export."
    )
    output_dir: str = option(
        "./output", "Where eval_results.json and eval_samples.jsonl go (a rerun continues there)."
    )
    logging_dir: str = option("", "Where report_to's logs go; empty means output_dir.")
    report_to: list[str] | None = option(  # noqa: RUF009 (a field with a default_factory)
        help="Scalar logs of the aggregate metrics: visualdl, tensorboard, all (both), mlflow (with the "
        "tracking extra), or none.",
        choices=REPORT_TO,
        factory=lambda: ["none"],
    )
    eval_dataset_type: str = option(
        "auto",
        "Kind of each eval file (comma-separated): erniekit / alpaca / chatml records are generated and "
        "scored, multiple_choice and gsm8k files are benchmarks, ocr / erniekit_vl sets (images with their "
        "text) are read by a PaddleOCR-VL model; auto detects all of them.",
    )
    eval_dataset_path: str = option(
        "", "Eval files, comma-separated (JSONL, JSON array; CSV for benchmarks)."
    )
    eval_dataset_prob: str = option(
        "1.0",
        "Accepted for ERNIEKit configs; every record of every file is scored (other values are announced).",
    )
    max_samples: int = option(0, "Score at most this many records per file; 0 scores all.", minimum=0)
    metrics: list[str] = option(  # noqa: RUF009 (a field with a default_factory)
        help="What chat files are scored by: loss (eval_loss / eval_ppl), exact_match, contains, regex, "
        "rouge_l, bleu, judge. OCR sets are scored by cer (character error rate) and exact_match; name only "
        "those (or leave the default) when evaluating a PaddleOCR-VL model.",
        choices=METRICS,
        factory=lambda: ["loss", "exact_match", "rouge_l", "bleu"],
    )
    normalize: list[str] = option(  # noqa: RUF009
        help="Text normalisation before exact_match / contains / regex: lower, punctuation, whitespace, articles.",
        choices=NORMALIZATIONS,
        factory=lambda: ["whitespace"],
    )
    answer_regex: str = option(
        "", "regex metric: the answer is this pattern's first match in the prediction (group 1 if any)."
    )
    text_units: str = option(
        "auto",
        "Units of ROUGE-L and BLEU: auto (words, each CJK character its own unit), words, or chars.",
        choices=TEXT_UNITS,
    )
    # generation
    max_new_tokens: int = option(128, "Longest generated answer, in tokens.", minimum=1, maximum=MAX_SEQ_LEN)
    temperature: float = option(0.0, "0 is greedy decoding; above 0 samples.", minimum=0, maximum=2)
    top_p: float = option(1.0, "Nucleus sampling mass when temperature > 0.", minimum=0, maximum=1)
    max_num_seqs: int = option(
        16, "Sequences generated together (continuous batching).", minimum=1, maximum=MAX_BATCH_SIZE
    )
    max_seq_len: int = option(
        2048, "Longest prompt + answer (and loss sequence).", minimum=8, maximum=MAX_SEQ_LEN
    )
    # loss / perplexity (ERNIEKit's keys)
    batch_size: int = option(1, "Loss batch size (samples per forward).", minimum=1, maximum=MAX_BATCH_SIZE)
    per_device_eval_batch_size: int = option(
        0, "ERNIEKit's loss batch size; 0 means batch_size.", minimum=0, maximum=MAX_BATCH_SIZE
    )
    max_evaluate_steps: int = option(
        -1, "Loss batches; -1 (or 0) covers every eval file.", minimum=-1, maximum=MAX_STEPS
    )
    do_eval: bool = option(True, "ERNIEKit's switch; false evaluates nothing.")
    # benchmarks
    benchmark_prompt: str = option(
        "plain", "Benchmark prompts as plain text or in the chat template.", choices=BENCHMARK_PROMPTS
    )
    choice_continuation: str = option(
        "letter",
        "multiple_choice: score the option letters (MMLU style) or the option texts (ARC style).",
        choices=CONTINUATIONS,
    )
    # LLM as judge
    judge_url: str = option("", "OpenAI-compatible base URL of the judge, e.g. http://127.0.0.1:8188/v1.")
    judge_model: str = option("default", "Model name the judge endpoint serves.")
    judge_api_key: str = option(
        "",
        "Judge API key; empty sends the operator's ERNIE_STUDIO_JUDGE_API_KEY (else OPENAI_API_KEY) only when "
        "judge_url is listed in ERNIE_STUDIO_JUDGE_URLS, and no key otherwise.",
    )
    judge_mode: str = option(
        "score",
        "score: rate each answer 1-10; pairwise: compare with judge_baseline both ways round.",
        choices=JUDGE_MODES,
    )
    judge_baseline: str = option(
        "reference", "pairwise: the reference answers, or another eval's eval_samples.jsonl (same eval file)."
    )
    judge_max_tokens: int = option(512, "Longest judge reply, in tokens.", minimum=1, maximum=MAX_SEQ_LEN)
    judge_timeout: float = option(60.0, "Seconds to wait for one judge answer.", minimum=1)
    # statistics
    bootstrap_samples: int = option(
        1000, "Resamples of the bootstrap confidence intervals; 0 = none.", minimum=0
    )
    confidence: float = option(0.95, "Confidence level of the intervals.", minimum=0.5, maximum=0.999)
    seed: int = option(42, "Seed of sampling and of the bootstrap.", minimum=0, maximum=2**32 - 1)

    notices: typing.ClassVar[list[Notice]]
    # "file:line" of each key given in the config file (judge errors point at judge_url's line)
    locations: typing.ClassVar[dict[str, str]]

    def __post_init__(self) -> None:
        self.notices, self.locations = [], {}
        if not self.logging_dir:
            self.logging_dir = self.output_dir
        for key in ("report_to", "metrics", "normalize"):
            value = getattr(self, key)
            if isinstance(value, str) or value is None:
                setattr(self, key, comma_list(value or "none"))
        if self.per_device_eval_batch_size:
            self.batch_size = self.per_device_eval_batch_size

    @property
    def paths(self) -> list[str]:
        return comma_list(self.eval_dataset_path)

    @property
    def types(self) -> list[str]:
        """One type per eval file (a single type applies to all)."""
        types = [DATASET_TYPE_NAMES.get(t, t) for t in comma_list(self.eval_dataset_type)] or ["auto"]
        return types * len(self.paths) if len(types) == 1 else types

    def where(self, key: str) -> str:
        return self.locations.get(key, key)

    def validate(self) -> list[str]:
        problems = check_fields(self)
        if not self.model_name_or_path:
            problems.append("model_name_or_path is required: the model directory (or run) to evaluate")
        if self.do_eval and not self.paths:
            problems.append("eval_dataset_path is required: the eval files, comma-separated")
        if len(self.types) != len(self.paths):
            problems.append(
                f"eval_dataset_type names {len(self.types)} types for {len(self.paths)} eval_dataset_path files"
            )
        for t in self.types:
            if t not in DATASET_TYPES:
                problems.append(f"eval_dataset_type {t!r} is not one of {', '.join(DATASET_TYPES)}")
        if "regex" in self.metrics and not self.answer_regex:
            problems.append("the regex metric needs answer_regex (the pattern that finds the answer)")
        if "judge" in self.metrics and not self.judge_url:
            problems.append("the judge metric needs judge_url (an OpenAI-compatible endpoint, .../v1)")
        return problems + report_to_problems(self.report_to)


def run_notices(cfg: EvalConfig) -> list[Notice]:
    """Values an ERNIEKit run_eval.yaml may give that change nothing here, announced when a run starts."""
    if weights_draws(cfg.eval_dataset_prob):
        message = "every record of every eval_dataset_path file is scored; probabilities draw no sample here"
        return [Notice("eval_dataset_prob", message)]
    return []


def option_problems(cfg: EvalConfig, ocr_model: bool) -> list[str]:
    """Options that would score nothing: text-metric settings for a PaddleOCR-VL model (its sets are scored
    by cer and exact_match as read), cer for a text model. The defaults pass for either."""

    def at(key: str) -> str:
        return f"{cfg.locations[key]}: {key}" if key in cfg.locations else key

    default = EvalConfig()
    if not ocr_model:
        if "cer" in cfg.metrics:
            return [
                f"{at('metrics')}: cer scores OCR sets read by a PaddleOCR-VL model, and "
                f"{cfg.model_name_or_path} is not one; score its answers by exact_match, rouge_l or bleu"
            ]
        return []
    problems = []
    extra = [m for m in cfg.metrics if m not in OCR_METRICS]
    if extra and cfg.metrics != default.metrics:
        problems.append(
            f"{at('metrics')}: {', '.join(extra)} {'is a text metric' if len(extra) == 1 else 'are text metrics'}"
            f"; a PaddleOCR-VL model's readings are scored by {' and '.join(OCR_METRICS)}: name only those, or "
            "leave metrics out"
        )
    for key in ("normalize", "answer_regex", "text_units"):
        if getattr(cfg, key) != getattr(default, key):
            problems.append(
                f"{at(key)}: it shapes text metrics, and a PaddleOCR-VL model's readings are compared with "
                f"their references as read (cer counts every character); leave {key} out"
            )
    return problems


def load_eval_config(path: str | Path | None, overrides: list[str] | None = None) -> EvalConfig:
    """Read an eval YAML (ERNIEKit's run_eval.yaml works as it is) and ``key=value`` overrides."""
    eval_fields = {f.name for f in dataclasses.fields(EvalConfig)}
    tolerated = {f.name: TRAINING_KEY for f in dataclasses.fields(TrainConfig) if f.name not in eval_fields}
    config = _load(EvalConfig, path, overrides or [], tolerated=tolerated)
    config.locations = _locations(path) if path is not None else {}
    return config


def eval_config_from_dict(values: dict[str, Any], source: str = "<dict>") -> EvalConfig:
    """The same checks for a form's values (the studio's REST / UI)."""
    from engine.train.config_load import config_from_dict

    return config_from_dict(EvalConfig, values, source)


def _locations(path: str | Path) -> dict[str, str]:
    try:
        node = yaml.compose(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:  # _load read it already; this only adds line numbers
        raise ConfigError(f"{path}: {e}") from e
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(k.value): f"{path}:{k.start_mark.line + 1}" for k, _ in node.value}
