"""Every key of ERNIEKit's example configs (tests/engine/data/erniekit_keys.json, a snapshot that names its
source, ERNIEKit's version and each file's commit and keys; tools/erniekit_keys.py rewrites it) is
honoured by the engine, announced with a reason, or refused by name; and each honoured key changes what the
trainer builds or does. Train, export and eval configs are loaded as their commands load them; run_chat.yaml
has no loader (`serve` / `chat` take flags), so each of its keys names the flag that takes its value or the
reason there is none.

An effect is seen downstream of the config: in the objects the trainer builds from it (``setup_run``: model,
optimizer, data, notices) or in what a tiny run writes (metrics rows, checkpoints, logs, files). Each key is
given two values that must be seen to differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from engine.cli import build_parser
from engine.eval import EvalConfig, load_eval_config, run_eval
from engine.models.lora import LoRALinear
from engine.serve.cli import ERNIEKIT_CHAT_FLAGS, ERNIEKIT_CHAT_REASONS
from engine.train.config import TrainConfig
from engine.train.config_load import load_config, load_export_config
from engine.train.erniekit_keys import ERNIEKIT_ALIASES
from engine.train.export import run_export
from engine.train.export_config import ExportConfig
from engine.train.options import ConfigError
from engine.train.parallel import DataParallel
from engine.train.quant import FP8Linear
from engine.train.run_dir import list_checkpoints
from engine.train.trainer import run_training, set_dropout, setup_run

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"
SNAPSHOT = json.loads((Path(__file__).parent / "data" / "erniekit_keys.json").read_text())


def keys_read_by(command: str) -> dict[str, list[str]]:
    """Key -> the snapshot's files read by ``command`` (train, export, eval, chat) that use it."""
    found: dict[str, list[str]] = {}
    for path, entry in SNAPSHOT["files"].items():
        if entry["command"] == command:
            for key in entry["keys"]:
                found.setdefault(key, []).append(path)
    return found


TRAIN_KEYS = keys_read_by("train")
EXPORT_KEYS = keys_read_by("export")
EVAL_KEYS = keys_read_by("eval")
CHAT_KEYS = keys_read_by("chat")


def honoured(cls: type, key: str) -> bool:
    """A key the config schema has a field for, under its own name or ERNIEKit's."""
    return ERNIEKIT_ALIASES.get(key, key) in {f.name for f in dataclasses.fields(cls)}


# ---- the snapshot and its classification ---------------------------------------------------------------


def test_snapshot_names_its_source_and_every_file():
    assert SNAPSHOT["source"] == "https://github.com/PaddlePaddle/ERNIE"
    assert SNAPSHOT["erniekit_version"] and "erniekit/version/env.py" in SNAPSHOT["version_file"]
    commands = {"run_export.yaml": "export", "run_eval.yaml": "eval", "run_chat.yaml": "chat"}
    for path, entry in SNAPSHOT["files"].items():
        assert path.startswith("examples/configs/") and len(entry["commit"]) == 40 and entry["keys"], path
        assert entry["command"] == commands.get(Path(path).name, "train"), path


LOADERS = {
    "train": (load_config, {"model_name_or_path": "m", "train_dataset_path": "d.jsonl"}),
    "export": (load_export_config, {"model_name_or_path": "m"}),
    "eval": (load_eval_config, {"model_name_or_path": "m", "eval_dataset_path": "d.jsonl"}),
}


def _announced(tmp_path: Path, key: str, value: Any, command: str = "train") -> dict[str, str]:
    """The notices loading a config with ``key: value`` produces (key -> reason)."""
    load, base = LOADERS[command]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**base, key: value}))
    return {n.key: n.message for n in load(path).notices}


@pytest.mark.parametrize("key", sorted(TRAIN_KEYS))
def test_every_erniekit_training_key_is_honoured_or_announced(tmp_path, key):
    if honoured(TrainConfig, key):
        assert key in EFFECTS, f"{key} is honoured, but no test shows what it does (add it to EFFECTS)"
        return
    reason = _announced(tmp_path, key, 1).get(key)
    assert reason, f"{key} (used by {TRAIN_KEYS[key][0]}) is neither honoured nor announced"
    assert len(reason) > 20  # a reason a person can act on, not a bare "ignored"


@pytest.mark.parametrize("key", sorted(EXPORT_KEYS))
def test_every_erniekit_export_key_is_honoured_or_announced(tmp_path, key):
    if honoured(ExportConfig, key):
        assert f"export:{key}" in EFFECTS, f"export key {key} is honoured, but no test shows what it does"
        return
    assert _announced(tmp_path, key, None, "export").get(key), f"export key {key} is not announced"


@pytest.mark.parametrize("key", sorted(EVAL_KEYS))
def test_every_erniekit_eval_key_is_honoured_or_announced(tmp_path, key):
    if honoured(EvalConfig, key):
        assert f"eval:{key}" in EFFECTS, f"eval key {key} is honoured, but no test shows what it does"
        return
    assert _announced(tmp_path, key, 1, "eval").get(key), f"eval key {key} is not announced"


# Two values of each run_chat.yaml key's flag; parsing shows the flag takes the value (what serve and chat
# then do with it is tests/engine/test_serve.py's and test_chat_cli.py's).
FLAG_VALUES = {
    "--model": ("a", "b"),
    "--tensor-parallel-size": ("1", "2"),
    "--port": ("8188", "8189"),
    "--max-model-len": ("4096", "8192"),
    "--max-num-seqs": ("8", "32"),
    "--quantization": ("wint4", "wint8"),
    "--max-tokens": ("64", "128"),
    "--temperature": ("0.7", "0.9"),
    "--top-p": ("0.7", "0.9"),
}


@pytest.mark.parametrize("key", sorted(CHAT_KEYS))
def test_every_erniekit_chat_key_names_its_flag_or_why_there_is_none(key):
    assert not (key in ERNIEKIT_CHAT_FLAGS and key in ERNIEKIT_CHAT_REASONS), key
    if key not in ERNIEKIT_CHAT_FLAGS:
        reason = ERNIEKIT_CHAT_REASONS.get(key, "")
        assert len(reason) > 20, f"{key} (used by {CHAT_KEYS[key][0]}) has neither a flag nor a reason"
        return
    command, flag = ERNIEKIT_CHAT_FLAGS[key].split()
    required = ["--model", "m"] if command == "serve" and flag != "--model" else []
    seen = [vars(build_parser().parse_args([command, *required, flag, value])) for value in FLAG_VALUES[flag]]
    assert seen[0] != seen[1], f"{command} {flag} does not take {key}'s value"


def test_the_chat_tables_cover_only_snapshot_keys():
    assert set(ERNIEKIT_CHAT_FLAGS) | set(ERNIEKIT_CHAT_REASONS) == set(CHAT_KEYS)


def test_model_parallel_degrees_are_announced_at_one_and_refused_above(tmp_path):
    refused = []
    for key in TRAIN_KEYS:
        if honoured(TrainConfig, key):
            continue
        try:
            _announced(tmp_path, key, 4)
        except ConfigError as e:
            assert "set it to 1" in str(e)
            refused.append(key)
    assert sorted(refused) == ["pipeline_parallel_degree", "tensor_parallel_degree"]


@pytest.mark.parametrize("stage", ["OCR-SFT", "OCR-VL-SFT"])
def test_paddleocr_vl_stages_are_honoured(tmp_path, stage):
    """ERNIEKit's PaddleOCR-VL stage, and its earlier name announced as that stage (what each trains is
    tests/engine/test_ocr_train.py's)."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**LOADERS["train"][1], "stage": stage}))
    cfg = load_config(path)
    assert cfg.stage == "OCR-VL-SFT"
    assert [n.key for n in cfg.notices] == (["stage"] if stage == "OCR-SFT" else [])


# ---- what each honoured key does ----------------------------------------------------------------------


@dataclass
class Context:
    """Model directories and a fresh directory per observation."""

    models: dict[str, Path]
    root: Path
    count: int = 0

    def fresh(self) -> Path:
        self.count += 1
        out = self.root / f"o{self.count}"
        out.mkdir()
        return out


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, tiny_model_dir, tiny_moe_model_dir, tiny_vl_model_dir) -> Context:
    models = {"@tiny": tiny_model_dir, "@moe": tiny_moe_model_dir, "@vl": tiny_vl_model_dir}
    return Context(models, tmp_path_factory.mktemp("effects"))


BASE = {
    "model_name_or_path": "@tiny",
    "train_dataset_path": str(DATA / "sft_demo.jsonl"),
    "max_seq_len": 64,
    "max_steps": 2,
    "seed": 23,
    "save_steps": 1000,
    "report_to": "none",
}
EVAL = {"eval_dataset_path": str(DATA / "sft_demo.jsonl"), "max_evaluate_steps": 1, "eval_steps": 0}
MIX = f"{DATA / 'sft_demo.jsonl'},{DATA / 'chatml_demo.jsonl'}"


def _config(ctx: Context, values: dict[str, Any], out: Path) -> TrainConfig:
    """The ERNIEKit-named values written as a YAML file and loaded as the CLI loads it."""
    values = {"output_dir": str(out), **values}
    for k, v in values.items():
        if isinstance(v, str) and v.startswith("@"):
            values[k] = str(ctx.models[v]) if v in ctx.models else str(out / v[1:])
    path = out / "run.yaml"
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return load_config(path)


def _setup(ctx: Context, values: dict[str, Any]):
    out = ctx.fresh()
    cfg = _config(ctx, values, out)
    return cfg, setup_run(cfg, DataParallel(), out, lambda event: None)


def _train(ctx: Context, values: dict[str, Any]) -> Path:
    out = ctx.fresh()
    summary = run_training(_config(ctx, values, out))
    assert summary.status == "succeeded"
    return out


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def outcome(observe: Callable) -> Callable:
    """What ``observe`` sees, or the refusal's kind when the engine refuses the value."""

    def wrapped(ctx: Context, values: dict[str, Any]) -> Any:
        try:
            return observe(ctx, values)
        except (ConfigError, ValueError) as e:  # EvalDataError is a ValueError
            return f"refused: {type(e).__name__}"

    return wrapped


def first_batches(ctx, values, n: int = 3):
    """input_ids and labels of the first training batches, as the trainer draws them."""
    _, run = _setup(ctx, values)
    it = iter(run.data)
    return [
        (np.asarray(b["input_ids"]).tolist(), np.asarray(b["labels"]).tolist())
        for b in (next(it) for _ in range(n))
    ]


def batch_shape(ctx, values):
    _, run = _setup(ctx, values)
    return np.asarray(next(iter(run.data))["input_ids"]).shape


def total_steps(ctx, values):
    return _setup(ctx, values)[1].total


def trainable_shapes(ctx, values):
    return sorted((n, tuple(p.shape)) for n, p in _setup(ctx, values)[1].trainable.items())


def optimizer_settings(ctx, values):
    """AdamW's hyper-parameters and its groups' learning-rate multipliers, from the built optimizer."""
    opt = _setup(ctx, values)[1].optimizer
    groups = sorted({float(g.get("learning_rate", 1.0)) for g in opt._param_groups if isinstance(g, dict)})
    return type(opt).__name__, opt._beta1, opt._beta2, opt._epsilon, opt._weight_decay, groups


def lora_scales(ctx, values):
    model = _setup(ctx, values)[1].model
    return sorted({round(layer.scale, 6) for layer in model.sublayers() if isinstance(layer, LoRALinear)})


def model_flags(ctx, values):
    """Recompute settings, a decoder weight's dtype, FP8 Hadamard blocks and step-5 hidden dropout."""
    cfg, run = _setup(ctx, values)
    ernie = run.model.ernie
    set_dropout(run.model, cfg, 5)
    return {
        "recompute": ernie.gradient_checkpointing,
        "granularity": ernie.recompute_granularity if ernie.gradient_checkpointing else None,
        "recompute_moe": sorted({bool(getattr(layer, "recompute_moe", False)) for layer in ernie.layers}),
        "dtype": next(str(p.dtype) for n, p in ernie.named_parameters() if p.ndim == 2 and "lora" not in n),
        "hadamard": sorted({layer.block for layer in run.model.sublayers() if isinstance(layer, FP8Linear)}),
        "dropout": [round(layer.hidden_dropout, 6) for layer in ernie.layers],
    }


def notice_keys(ctx, values):
    return sorted(n.key for n in _setup(ctx, values)[1].notices)


def metrics_rows(ctx, values):
    """(step, learning rate, evaluated) of each metrics row a tiny run writes."""
    return [
        (r["step"], round(r.get("learning_rate", -1.0), 12), "eval_loss" in r)
        for r in _rows(_train(ctx, values))
    ]


def eval_losses(ctx, values):
    return [round(r["eval_loss"], 6) for r in _rows(_train(ctx, values)) if "eval_loss" in r]


def grad_norms(ctx, values):
    return [round(r["grad_norm"], 6) for r in _rows(_train(ctx, values))]


def checkpoints(ctx, values):
    return [p.name for p in list_checkpoints(_train(ctx, values))]


def final_model(ctx, values):
    """The final model's config.json form and the first part of its tensor names (Paddle or HF layout)."""
    from safetensors.numpy import load_file

    out = _train(ctx, values)
    names = {k.split(".")[0] for f in sorted(out.glob("*.safetensors")) for k in load_file(f)}
    return sorted(json.loads((out / "config.json").read_text())["architectures"]), sorted(names)


def correction_biases(ctx, values):
    """The MoE routers' aux-free correction biases in the final model of a tiny Full run."""
    from safetensors.numpy import load_file

    out = _train(ctx, values)
    tensors = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    return [np.round(v, 6).tolist() for k, v in sorted(tensors.items()) if "moe_statics" in k]


def run_directories(ctx, values):
    """Which of the observation's directories hold the run's files and its VisualDL logs."""
    out = _train(ctx, values)
    return sorted(
        str(p.relative_to(out))
        for p in out.rglob("*")
        if p.name in ("metrics.jsonl", "vdlrecords") or p.name.startswith("vdlrecords")
    )


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def progress_lines(ctx, values):
    """Whether a run on a terminal prints plain step lines (disable_tqdm) or draws a tqdm bar."""
    stdout, stderr = _Terminal(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        _train(ctx, values)
    return "step 1/2 loss" in stdout.getvalue(), "it/s" in stderr.getvalue() or "step/s" in stderr.getvalue()


def _config_file(ctx, values: dict, name: str) -> tuple[Path, Path]:
    """A fresh output directory and the config ``values`` written in it as ``name``; "@tiny"-style values
    name a session model, other "@x" values a path ``x`` under the directory."""
    out = ctx.fresh()
    values = {
        k: (str(ctx.models[v]) if v in ctx.models else str(out / v[1:])) if str(v).startswith("@") else v
        for k, v in values.items()
    }
    path = out / name
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return out, path


def evaluated(ctx, values):
    """What `ernie-studio eval` writes and scores: its files, the notices, the metrics, the predictions."""
    out, path = _config_file(ctx, values, "eval.yaml")
    summary = run_eval(load_eval_config(path))
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p != path)
    scores = json.loads(json.dumps([d["metrics"] for d in summary.datasets.values()]), parse_float=_round)
    samples = out.rglob("eval_samples.jsonl")
    predictions = [json.loads(line).get("prediction") for f in samples for line in f.read_text().splitlines()]
    return files, sorted(n["key"] for n in summary.notices), scores, predictions


def _round(text: str) -> float:
    return round(float(text), 6)


def exported(ctx, values):
    """The files an export writes and the model type it writes, for ExportConfig keys."""
    out, path = _config_file(ctx, values, "export.yaml")
    summary = run_export(load_export_config(path))
    where = Path(summary.export_dir)
    config = json.loads((where / "config.json").read_text())
    return str(where.relative_to(out)), sorted(summary.files), config.get("moe_num_experts")


@dataclass
class Effect:
    """Two values of a key and how their difference shows; ``base`` is the rest of the config."""

    a: Any
    b: Any
    observe: Callable[[Context, dict[str, Any]], Any]
    base: dict[str, Any] = field(default_factory=lambda: dict(BASE))


def _with(*parts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """BASE with ``parts`` and ``extra`` over it (later wins)."""
    out = dict(BASE)
    for part in (*parts, extra):
        out.update(part)
    return out


# a few records scored by loss only (no generation); a small bootstrap for the generated metrics
EVAL_BASE = {
    "model_name_or_path": "@tiny",
    "output_dir": "@run",
    "eval_dataset_path": str(DATA / "sft_demo.jsonl"),
    "metrics": "loss",
    "max_samples": 4,
    "max_seq_len": 64,
    "bootstrap_samples": 20,
    "report_to": "none",
}
LORA = {"fine_tuning": "LoRA"}
FULL = {"fine_tuning": "Full"}
MOE_FULL = {"model_name_or_path": "@moe", **FULL}
VL_FULL = {
    "model_name_or_path": "@vl",
    "stage": "VL-SFT",
    "train_dataset_path": str(DATA / "vl_demo.jsonl"),
    **FULL,
}

EFFECTS: dict[str, Effect] = {
    # data: which records are drawn, how they are encoded and batched
    "train_dataset_path": Effect(
        str(DATA / "sft_demo.jsonl"), str(DATA / "chatml_demo.jsonl"), first_batches
    ),
    "train_dataset_type": Effect("erniekit", "chatml", outcome(first_batches)),
    "train_dataset_prob": Effect("0.9,0.1", "0.1,0.9", first_batches, _with(train_dataset_path=MIX)),
    "text_dataset_path": Effect("", str(DATA / "chatml_demo.jsonl"), total_steps, _with(max_steps=-1)),
    "text_dataset_prob": Effect(
        "0.9,0.1", "0.1,0.9", first_batches, _with(train_dataset_path="", text_dataset_path=MIX)
    ),
    "eval_dataset_path": Effect(
        str(DATA / "sft_demo.jsonl"), str(DATA / "chatml_demo.jsonl"), eval_losses, _with(EVAL)
    ),
    "eval_dataset_type": Effect(
        "chatml",
        "erniekit",
        outcome(eval_losses),
        _with(EVAL, eval_dataset_path=str(DATA / "chatml_demo.jsonl")),
    ),
    "eval_dataset_prob": Effect("1.0,1.0", "0.9,0.1", notice_keys, _with(EVAL, eval_dataset_path=MIX)),
    "max_seq_len": Effect(32, 64, batch_shape),
    "batch_size": Effect(1, 2, batch_shape),
    "seed": Effect(1, 2, first_batches),
    # packing fixed: PT packs by default, which alone would tell the two apart
    "stage": Effect("SFT", "PT", outcome(first_batches), _with(packing=False)),
    "model_name_or_path": Effect("@tiny", "@moe", trainable_shapes),
    # how long the run is
    "max_steps": Effect(2, 3, total_steps),
    "num_train_epochs": Effect(1, 2, total_steps, _with(max_steps=-1)),
    "num_samples_each_epoch": Effect(0, 50, total_steps, _with(max_steps=-1)),
    "gradient_accumulation_steps": Effect(1, 2, total_steps, _with(max_steps=-1)),
    # the learning-rate schedule the trainer set at each step
    "learning_rate": Effect(1e-4, 2e-4, metrics_rows, _with(max_steps=3)),
    "warmup_steps": Effect(0, 2, metrics_rows, _with(max_steps=3)),
    "lr_scheduler_type": Effect("cosine", "linear", metrics_rows, _with(max_steps=4, min_lr=1e-5)),
    "min_lr": Effect(0.0, 1e-5, metrics_rows, _with(max_steps=3)),
    # the optimizer the trainer built
    "optim": Effect("adamw_custom", "adafactor", outcome(optimizer_settings)),
    "weight_decay": Effect(0.0, 0.1, optimizer_settings),
    "adam_beta1": Effect(0.9, 0.8, optimizer_settings),
    "adam_beta2": Effect(0.999, 0.95, optimizer_settings),
    "adam_epsilon": Effect(1e-8, 1e-6, optimizer_settings),
    "lora_plus_scale": Effect(1.0, 4.0, optimizer_settings, _with(LORA)),
    "moe_gate_lr_ratio": Effect(1.0, 0.01, optimizer_settings, _with(MOE_FULL)),
    "vit_lr_ratio": Effect(1.0, 0.9, optimizer_settings, _with(VL_FULL)),
    "tensorwise_offload_optimizer": Effect(False, True, notice_keys),
    "sharding": Effect("", "stage1", outcome(total_steps)),
    "sharding_parallel_degree": Effect(1, -1, outcome(total_steps), _with(sharding="stage1")),
    # what trains, and how the model computes
    "fine_tuning": Effect("Full", "LoRA", trainable_shapes),
    "lora_rank": Effect(4, 8, trainable_shapes, _with(LORA)),
    "lora_alpha": Effect(8, 32, lora_scales, _with(LORA, lora_rank=8)),
    "rslora": Effect(False, True, lora_scales, _with(LORA, lora_rank=16)),
    "freeze_config": Effect("", "freeze_vision", trainable_shapes, _with(VL_FULL)),
    "compute_type": Effect("fp32", "bf16", model_flags),
    "apply_hadamard": Effect(True, False, model_flags, _with(FULL, compute_type="fp8")),
    "recompute": Effect(False, True, model_flags),
    "recompute_granularity": Effect("full", "core_attn", model_flags, _with(recompute=True)),
    "use_recompute_moe": Effect(True, False, model_flags, _with(model_name_or_path="@moe", recompute=True)),
    "dropout_warmup_steps": Effect(0, 10, model_flags, _with(hidden_dropout_prob=0.2)),
    "moe_group": Effect("dp", "mp", notice_keys, _with(model_name_or_path="@moe")),
    "moe_aux_loss_lambda": Effect(0.0, 1.0, grad_norms, _with(MOE_FULL, max_steps=1, max_grad_norm=0)),
    "moe_use_aux_free": Effect(False, True, correction_biases, _with(MOE_FULL, max_steps=1)),
    "moe_use_aux_free_update_coef": Effect(
        0.001, 0.1, correction_biases, _with(MOE_FULL, max_steps=1, moe_use_aux_free=True)
    ),
    # what a run writes and when
    "do_train": Effect(True, False, metrics_rows, _with(EVAL)),
    "do_eval": Effect(True, False, metrics_rows, _with(EVAL)),
    "eval_steps": Effect(0, 1, metrics_rows, _with(EVAL)),
    "evaluation_strategy": Effect("steps", "no", metrics_rows, _with(EVAL, eval_steps=1)),
    "max_evaluate_steps": Effect(1, 3, eval_losses, _with(EVAL)),
    "eval_iters": Effect(
        1, 3, eval_losses, _with({k: v for k, v in EVAL.items() if k != "max_evaluate_steps"})
    ),
    "logging_steps": Effect(1, 2, metrics_rows),
    "save_steps": Effect(1, 2, checkpoints),
    "save_total_limit": Effect(0, 1, checkpoints, _with(save_steps=1)),
    "save_strategy": Effect("steps", "no", checkpoints, _with(save_steps=1)),
    "output_dir": Effect("@a", "@b", run_directories),
    "logging_dir": Effect("", "@logs", run_directories, _with(report_to="visualdl")),
    "disable_tqdm": Effect(True, False, progress_lines),
    "mix_strategy": Effect(
        "random", "concat", first_batches, _with(train_dataset_path=MIX, train_dataset_prob="0.5,0.5")
    ),
    "packing": Effect(False, True, first_batches),
    "packing_size": Effect(0, 1, first_batches, _with(packing=True)),
    "save_to_hf": Effect(False, True, final_model, _with(FULL)),
    # `ernie-studio eval` (run_eval.yaml)
    "eval:model_name_or_path": Effect("@tiny", "@moe", evaluated, EVAL_BASE),
    "eval:output_dir": Effect("@a", "@b", evaluated, EVAL_BASE),
    "eval:logging_dir": Effect("", "@logs", evaluated, {**EVAL_BASE, "report_to": "visualdl"}),
    "eval:do_eval": Effect(True, False, evaluated, EVAL_BASE),
    "eval:eval_dataset_path": Effect(
        str(DATA / "sft_demo.jsonl"), str(DATA / "chatml_demo.jsonl"), evaluated, EVAL_BASE
    ),
    "eval:eval_dataset_type": Effect(
        "chatml",
        "erniekit",
        outcome(evaluated),
        {**EVAL_BASE, "eval_dataset_path": str(DATA / "chatml_demo.jsonl")},
    ),
    "eval:eval_dataset_prob": Effect("1.0", "0.5", evaluated, EVAL_BASE),
    "eval:max_seq_len": Effect(24, 64, evaluated, EVAL_BASE),
    "eval:batch_size": Effect(1, 4, evaluated, {**EVAL_BASE, "max_evaluate_steps": 1}),
    # sampled answers (temperature 1) draw from the seed
    "eval:seed": Effect(
        1, 2, evaluated, {**EVAL_BASE, "metrics": "rouge_l", "max_new_tokens": 4, "temperature": 1.0}
    ),
    # `ernie-studio export` (run_export.yaml)
    "export:model_name_or_path": Effect("@tiny", "@moe", exported, {"output_dir": "@run"}),
    "export:output_dir": Effect("@a", "@b", exported, {"model_name_or_path": "@tiny"}),
    "export:max_shard_size": Effect(
        5, "100KB", exported, {"model_name_or_path": "@tiny", "output_dir": "@run"}
    ),
}


@pytest.mark.parametrize("name", sorted(EFFECTS))
def test_each_honoured_key_changes_what_the_engine_does(ctx, name):
    effect = EFFECTS[name]
    key = name.split(":")[-1]
    seen = [effect.observe(ctx, {**effect.base, key: value}) for value in (effect.a, effect.b)]
    assert seen[0] != seen[1], f"{name}: {effect.a!r} and {effect.b!r} look the same: {seen[0]!r}"
    refusals = [s for s in seen if isinstance(s, str) and s.startswith("refused")]
    assert len(refusals) < 2, f"{name}: the base config itself is refused"


def test_the_effects_table_covers_only_snapshot_keys():
    known = {"train": TRAIN_KEYS, "export": EXPORT_KEYS, "eval": EVAL_KEYS}
    strays = [n for n in EFFECTS if n.split(":")[-1] not in known[n.split(":")[0] if ":" in n else "train"]]
    assert not strays, strays
