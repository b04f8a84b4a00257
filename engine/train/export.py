"""``ernie-studio export``: merge a LoRA run into its base, write Paddle or HF layout, shard, copy the
tokenizer, and optionally apply post-training quantization with a perplexity report before and after.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.models.lora import ADAPTER_CONFIG
from engine.train import quant
from engine.train.export_config import ExportConfig

log = logging.getLogger(__name__)


@dataclass
class ExportSummary:
    export_dir: str
    layout: str
    files: list[str]
    merged_lora: bool
    quantization: str = ""
    perplexity: dict[str, float] = field(default_factory=dict)
    notices: list[dict[str, str]] = field(default_factory=list)
    export_format: str = "safetensors"
    # export_format gguf: one entry per file {type, path, size_bytes, perplexity, relative_to_f16}
    gguf: list[dict] = field(default_factory=list)
    elastic_member: str = ""  # d<depth>-e<experts>-k<topk> when an elastic member was cut out
    gpas: str = ""  # "kept" / "folded" for a GPAS model
    gpas_fold_deviation: float | None = None  # max |logit change| / max |logit| of the fold on a probe


def source_dir(cfg: ExportConfig) -> tuple[Path, bool]:
    """The directory to export and whether it is a LoRA run (merged into its base): the trained model of
    the run in ``output_dir``, else ``model_name_or_path``."""
    from engine.models.loading import is_lora_dir, is_quantized_dir

    run_dir = Path(cfg.output_dir) if cfg.output_dir else None
    if cfg.lora and not (run_dir / ADAPTER_CONFIG).exists():
        raise FileNotFoundError(
            f"{run_dir}: no {ADAPTER_CONFIG}; lora=True exports the LoRA run in output_dir "
            "(train with fine_tuning: LoRA first)"
        )
    for src in (run_dir, Path(cfg.model_name_or_path) if cfg.model_name_or_path else None):
        if src is None:
            continue
        if is_quantized_dir(src):
            # Its linears hold int8 / e4m3 values and scales: neither layout nor a second PTQ can take them.
            raise ValueError(
                f"{src}: already a quantized export (quantization_config in config.json); "
                "export from the unquantized model it was made from"
            )
        if is_lora_dir(src):
            log.info("exporting the LoRA run %s merged into its base", src)
            return src, True
        if (src / "config.json").exists():
            log.info("exporting %s", src)
            return src, False
    raise FileNotFoundError(
        f"nothing to export: output_dir {cfg.output_dir!r} holds no trained model and model_name_or_path "
        f"{cfg.model_name_or_path!r} is not a model directory"
    )


def source_model(cfg: ExportConfig):
    """(the model to export loaded in fp32, its directory, whether a LoRA run was merged)."""
    from engine.models.loading import load_model

    src, merged = source_dir(cfg)
    return load_model(src, "float32"), src, merged


def source_streams(source) -> bool:
    """Whether a checkpoint (a ``loading.TensorSource``) can be written tensor by tensor as it is read: no
    GPAS gates (a fold rewrites the model) and no linear left quantized by a weight-only adapter (its buffers
    are what the model-based path writes). The export and llama.cpp serving's GGUF both ask."""
    return not (source.config.gpas or source.left_quantized)


def streams(cfg: ExportConfig, source) -> bool:
    """Whether the export can go tensor by tensor from the checkpoint to the output file (a
    ``loading.TensorSource``) without the model in memory: the Paddle layout or GGUF, PTQ without an eval
    set (its perplexity report runs the whole model), no elastic member (it rewrites the model), and a
    source that streams (``source_streams``)."""
    if (cfg.quantization and cfg.eval_dataset_path) or not source_streams(source):
        return False
    if elastic_member(cfg, source.config) is not None:
        return False
    return cfg.export_format == "gguf" or cfg.layout == "paddle"


def perplexity(model, batches: list[dict]) -> float:
    from engine.train.sft import evaluate_lm

    return float(evaluate_lm(model, batches)["eval_ppl"])


def eval_batches(cfg: ExportConfig, tokenizer) -> list[dict]:
    from engine.data import build_train_data

    spec = {
        "train_dataset_type": cfg.eval_dataset_type,
        "train_dataset_path": cfg.eval_dataset_path,
        "train_dataset_prob": cfg.eval_dataset_prob,
    }
    data = build_train_data(
        spec,
        tokenizer,
        stage=cfg.stage,
        max_seq_len=cfg.max_seq_len,
        packing=False,
        seed=cfg.seed,
        batch_size=cfg.batch_size,
        shuffle=False,
    )
    return list(data.one_pass())


def run_export(cfg: ExportConfig) -> ExportSummary:
    """Write the exported model to ``cfg.export_dir`` and return what was written.

    The export is written into a hidden directory beside it and renamed into place once complete, so
    export_dir never holds a partial export: readers (the studio's model list, a deployment of the run) take
    a directory with a config.json for a whole model, and an exporter killed mid-write leaves only the hidden
    directory, which the next export of the same name removes first."""
    final = Path(cfg.export_dir)
    check_export_dir(final)
    staging = _beside(final, "partial")
    shutil.rmtree(staging, ignore_errors=True)  # a killed attempt's leftovers
    staging.mkdir(parents=True)
    try:
        summary = _write_export(cfg, staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _move_into_place(staging, final)
    return summary


def check_export_dir(final: Path) -> None:
    """export_dir may be new, empty, or an earlier export (which the new one replaces whole); anything else
    is refused before any work, since replacing it would delete files that are not an export's."""
    if final.exists() and not final.is_dir():
        raise NotADirectoryError(f"export_dir {final} is a file; name a directory for the export")
    if final.is_dir() and any(final.iterdir()) and not (final / "export_summary.json").exists():
        raise FileExistsError(
            f"export_dir {final} holds files that are not an earlier export (no export_summary.json); name a "
            "new or empty directory, or remove it"
        )


def _beside(final: Path, what: str) -> Path:
    resolved = final.resolve()
    return resolved.parent / f".{resolved.name}.{what}"


def _move_into_place(staging: Path, final: Path) -> None:
    """``staging`` becomes ``final``; an earlier export there is moved aside first (a rename cannot replace
    a non-empty directory) and removed after, so ``final`` is at every moment absent or a whole export."""
    old = _beside(final, "old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.rename(final, old)
    os.rename(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def _write_export(cfg: ExportConfig, out: Path, final: Path) -> ExportSummary:
    """``run_export``'s work: the export written into ``out``, its summary naming ``final``."""
    notices = getattr(cfg, "notices", [])
    for n in notices:  # accepted keys without effect (training keys, hf_hub_id), said once
        print(n.line(), flush=True)
    src, merged = source_dir(cfg)
    if is_paddleocr_vl_source(src):
        return _export_paddleocr_vl(cfg, out, final, src, merged, notices)
    return _export_ernie(cfg, out, final, src, merged, notices)


def _export_ernie(
    cfg: ExportConfig, out: Path, final: Path, tokenizer_src: Path, merged: bool, notices
) -> ExportSummary:
    """An ERNIE 4.5 model or LoRA run: streamed where it can be, else through the loaded model."""
    from engine.models.checkpoint import write_tensors_streamed
    from engine.models.loading import TensorSource, load_model
    from engine.models.saving import save_model
    from engine.tokenizer import load_tokenizer

    source = TensorSource(tokenizer_src)
    if streams(cfg, source) and cfg.export_format != "gguf":  # checkpoint -> file, tensor by tensor
        if cfg.quantization:
            quant.save_quantized_streamed(
                source, out, cfg.quantization, cfg.weight_quant_group_size, cfg.max_shard_size
            )
        else:
            source.config.replace(dtype=cfg.dtype).save(out)
            write_tensors_streamed(source, source.shapes, out, cfg.dtype, cfg.max_shard_size)
        return _finish_export(cfg, out, final, tokenizer_src, merged, notices, {}, None, ("", None))
    # GGUF writes from the source as well; the rest rewrites or measures the whole model
    model = source if streams(cfg, source) else load_model(tokenizer_src, "float32")
    member = elastic_member(cfg, model.config)
    if member is not None:
        from engine.models.elastic import extract_submodel

        model = extract_submodel(model, member)
        log.info("elastic member %s: %d layers", member.name, model.config.num_hidden_layers)
    gpas_action, deviation = gpas_for_export(cfg, model)
    if cfg.export_format == "gguf":
        summary = _export_gguf(cfg, model, tokenizer_src, merged, notices, out, final)
        summary.elastic_member = member.name if member is not None else ""
        summary.gpas, summary.gpas_fold_deviation = gpas_action, deviation
        (out / "export_summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
        return summary
    ppl: dict[str, float] = {}
    if cfg.quantization:
        batches = eval_batches(cfg, load_tokenizer(tokenizer_src)) if cfg.eval_dataset_path else []
        if batches:
            ppl["fp32"] = perplexity(model, batches)
        n = quant.quantize_for_export(model, cfg.quantization, cfg.weight_quant_group_size)
        if batches:
            ppl[cfg.quantization] = perplexity(model, batches)
            ppl["relative_change"] = ppl[cfg.quantization] / ppl["fp32"] - 1
            log.info(
                "PTQ %s on %d linears: perplexity %.4f -> %.4f (%+.2f%%)",
                cfg.quantization,
                n,
                ppl["fp32"],
                ppl[cfg.quantization],
                100 * ppl["relative_change"],
            )
        if cfg.layout != "paddle":
            raise ValueError("quantized exports are written in the Paddle layout; set layout: paddle")
        quant.save_quantized(model, out, cfg.quantization, cfg.weight_quant_group_size, cfg.max_shard_size)
    else:
        save_model(model, out, dtype=cfg.dtype, max_shard_size=cfg.max_shard_size, layout=cfg.layout)
    return _finish_export(
        cfg, out, final, tokenizer_src, merged, notices, ppl, member, (gpas_action, deviation)
    )


def is_paddleocr_vl_source(src: Path) -> bool:
    """A PaddleOCR-VL directory, or a LoRA run (of runs) on one."""
    from engine.models.loading import lora_chain
    from engine.models.paddleocr_vl_config import is_paddleocr_vl_dir

    return is_paddleocr_vl_dir(lora_chain(src)[0])


def paddleocr_vl_export_problems(cfg: ExportConfig) -> list[str]:
    """The export keys a PaddleOCR-VL export does not take, by name."""
    problems = []
    if cfg.quantization:
        problems.append(
            f"quantization {cfg.quantization}: post-training quantization of PaddleOCR-VL is not done here"
        )
    if cfg.export_format != "safetensors":
        problems.append(
            f"export_format {cfg.export_format}: PaddleOCR-VL exports as safetensors only (no GGUF)"
        )
    if cfg.elastic_depth or cfg.elastic_experts or cfg.elastic_topk:
        problems.append("elastic_*: PaddleOCR-VL is no elastic MoE family")
    return problems


def _export_paddleocr_vl(
    cfg: ExportConfig, out: Path, final: Path, src: Path, merged: bool, notices
) -> ExportSummary:
    """A PaddleOCR-VL model or LoRA run, merged, in its published form (``layout: paddle``) or transformers'
    (``layout: hf``), tensor by tensor; with the image processor settings it trained with."""
    from engine.models.loading import lora_chain
    from engine.models.paddleocr_vl_checkpoint import export_paddleocr_vl

    problems = paddleocr_vl_export_problems(cfg)
    if problems:
        raise ValueError(f"{src} is PaddleOCR-VL: " + "; ".join(problems))
    base, chain = lora_chain(src)
    form = "official" if cfg.layout == "paddle" else cfg.layout
    export_paddleocr_vl(base, out, chain, form, cfg.dtype, cfg.max_shard_size)
    processor = next(
        (d / "preprocessor_config.json" for d in (src, base) if (d / "preprocessor_config.json").is_file()),
        None,
    )
    if processor is not None:
        shutil.copyfile(processor, out / "preprocessor_config.json")
    log.info("PaddleOCR-VL %s exported (%s form%s)", src, form, ", LoRA merged" if merged else "")
    return _finish_export(cfg, out, final, src, merged, notices, {}, None, ("", None))


def _finish_export(
    cfg: ExportConfig, out: Path, final: Path, tokenizer_src, merged, notices, ppl, member, gpas
) -> ExportSummary:
    """Copy the tokenizer and write export_summary.json (into ``out``, naming ``final``)."""
    from engine.tokenizer import copy_tokenizer_files

    if cfg.copy_tokenizer:
        copy_tokenizer_files(tokenizer_src, out)
    summary = ExportSummary(
        export_dir=str(final),
        layout=cfg.layout,
        files=sorted(p.name for p in out.iterdir()),
        merged_lora=merged,
        quantization=cfg.quantization,
        perplexity={k: float(v) for k, v in ppl.items() if not math.isnan(v)},
        notices=[{"key": n.key, "message": n.message} for n in notices],
        elastic_member=member.name if member is not None else "",
        gpas=gpas[0],
        gpas_fold_deviation=gpas[1],
    )
    (out / "export_summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    return summary


def _export_gguf(
    cfg: ExportConfig, model, tokenizer_src: Path, merged: bool, notices: list, out: Path, final: Path
) -> ExportSummary:
    """One GGUF per ``cfg.gguf_types`` plus an Ollama Modelfile each, written into ``out`` and named as in
    ``final``; with an eval set, the perplexity of every file measured by llama.cpp on its text (the quality
    figure of each type)."""
    from engine.tokenizer import load_tokenizer
    from engine.train import gguf_export as G

    problems = G.gguf_problems(model.config)
    if problems:  # before anything is written
        raise G.GGUFExportError("cannot export to GGUF: " + "; ".join(problems))
    tokenizer = load_tokenizer(tokenizer_source(tokenizer_src))
    stem = "model"
    written: dict[str, Path] = {}
    for t in ("f32", "f16", "q8_0"):
        if t in cfg.gguf_types or (t == "f16" and "q4_K_M" in cfg.gguf_types):
            written[t] = G.write_gguf(model, tokenizer, out / f"{stem}-{t}.gguf", t)
            log.info("wrote %s", written[t])
    if "q4_K_M" in cfg.gguf_types:  # llama.cpp's k-quants come from its own quantizer, from the f16 file
        written["q4_K_M"] = G.quantize_gguf(written["f16"], out / f"{stem}-q4_K_M.gguf", "q4_K_M")
    ppl = _gguf_perplexities(cfg, tokenizer, written, out) if cfg.eval_dataset_path else {}
    files = []
    for t in cfg.gguf_types:
        path = written[t]
        (out / f"{path.name}.Modelfile").write_text(G.modelfile(path.name, tokenizer))
        entry = {
            "type": t,
            "path": str(final / path.name),
            "size_bytes": path.stat().st_size,
            "perplexity": ppl.get(t),
        }
        if t in ppl and "f16" in ppl:
            entry["relative_to_f16"] = ppl[t] / ppl["f16"] - 1
        files.append(entry)
    if "f16" in written and "f16" not in cfg.gguf_types:
        written["f16"].unlink()  # made for q4_K_M and as the quality figures' reference only
    # `ollama create NAME` reads ./Modelfile: the first listed type
    (out / "Modelfile").write_text(G.modelfile(written[cfg.gguf_types[0]].name, tokenizer))
    summary = ExportSummary(
        export_dir=str(final),
        layout="gguf",
        files=sorted(p.name for p in out.iterdir()),
        merged_lora=merged,
        perplexity={k: float(v) for k, v in ppl.items()},
        notices=[{"key": n.key, "message": n.message} for n in notices],
        export_format="gguf",
        gguf=files,
    )
    (out / "export_summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    return summary


def _gguf_perplexities(cfg: ExportConfig, tokenizer, written: dict[str, Path], out: Path) -> dict[str, float]:
    """llama.cpp's perplexity of each written GGUF on the eval set's text (decoded from its samples)."""
    from engine.train import gguf_export as G

    rows = [[int(i) for i in ids] for batch in eval_batches(cfg, tokenizer) for ids in batch["input_ids"]]
    text = "\n".join(tokenizer.decode([i for i in r if i != tokenizer.pad_token_id]) for r in rows)
    n_tokens = len(tokenizer.encode(text))
    n_ctx = min(cfg.max_seq_len, n_tokens // 2)
    if n_ctx < 16:
        log.warning("eval set too short for llama-perplexity (%d tokens); no GGUF quality figures", n_tokens)
        return {}
    text_file = out / ".perplexity.txt"
    text_file.write_text(text)
    try:
        series = {t: G.perplexity_series(p, text_file, n_ctx) for t, p in written.items()}
    finally:
        text_file.unlink(missing_ok=True)
    # Every file over the same chunks: all of them, unless llama-perplexity's output ended early for one
    # (see perplexity_series); then the chunks every file reached, said in the log.
    total = min(n for _, n in series.values())
    reached = min(len(r) for r, _ in series.values())
    if reached < total:
        log.warning(
            "llama-perplexity's output ended early (chunk %d of %d); GGUF perplexities over the first %d chunks",
            reached, total, reached,
        )  # fmt: skip
    ppl = {t: running[reached - 1] for t, (running, _) in series.items()}
    for t, v in ppl.items():
        log.info("GGUF %s: perplexity %.4f (llama.cpp, n_ctx %d, %d chunks)", t, v, n_ctx, reached)
    return ppl


def elastic_member(cfg: ExportConfig, config):
    """The member ``elastic_depth`` / ``elastic_experts`` / ``elastic_topk`` name (None: the whole model).

    Unset numbers keep the model's; top-k defaults to min(moe_k, experts). The depth pattern is the
    config's, else the training run's (train_config.json in output_dir), else contiguous."""
    from engine.models.elastic import SubModel, check_member

    if not (cfg.elastic_depth or cfg.elastic_experts or cfg.elastic_topk):
        return None
    pattern = cfg.elastic_depth_pattern or _run_depth_pattern(cfg) or "contiguous"
    full = SubModel.full(config, pattern) if config.is_moe else SubModel(config.num_hidden_layers, 0, 0)
    experts = cfg.elastic_experts or full.experts
    member = SubModel(
        cfg.elastic_depth or full.depth, experts, cfg.elastic_topk or min(full.k, experts), pattern
    )
    check_member(config, member)
    return member


def _run_depth_pattern(cfg: ExportConfig) -> str:
    path = Path(cfg.output_dir, "train_config.json") if cfg.output_dir else None
    if path is None or not path.exists():
        return ""
    return json.loads(path.read_text()).get("elastic_depth_pattern", "")


def gpas_for_export(cfg: ExportConfig, model) -> tuple[str, float | None]:
    """Keep a GPAS model's gates where the written model can hold them, fold them on request; refuse the
    formats that would drop them (the hf layout, PTQ) unless folded. Returns (action, fold deviation)."""
    if not model.config.gpas:
        return "", None
    if cfg.gpas_gates == "fold":
        return "folded", fold_gpas(model, cfg.gpas_fold_tolerance)
    if cfg.layout == "hf" or cfg.quantization or cfg.export_format == "gguf":
        if cfg.export_format == "gguf":
            what = "a GGUF file (llama.cpp's ERNIE 4.5)"
        elif cfg.layout == "hf":
            what = "the hf layout (transformers' ERNIE 4.5)"
        else:
            what = "a PTQ export"
        raise ValueError(
            f"gpas: this model was trained with GPAS gates, which {what} cannot hold; set gpas_gates=fold to fold "
            "them into the weights (exact up to RMSNorm's eps; the deviation is checked and reported), or "
            "export layout=paddle without quantization to keep them"
        )
    return "kept", None


def fold_gpas(model, tolerance: float) -> float:
    """``engine.models.gpas.fold_gates`` with its deviation measured on a probe batch; refuses past
    ``tolerance`` (the share of the largest logit the fold may move any logit by)."""
    import numpy as np
    import paddle

    from engine.models.gpas import fold_gates

    rng = np.random.default_rng(0)
    ids = paddle.to_tensor(rng.integers(3, model.config.vocab_size, (2, 64)), dtype="int64")
    with paddle.no_grad():
        before = model(ids).logits.numpy()
        fold_gates(model)
        after = model(ids).logits.numpy()
    deviation = float(np.abs(after - before).max() / max(np.abs(before).max(), 1e-12))
    if deviation > tolerance:
        raise ValueError(
            f"gpas_gates=fold: folding the GPAS gates moves the logits by {deviation:.2e} of the largest logit on a "
            f"probe batch, above gpas_fold_tolerance ({tolerance:g}): the stream is scaled so far down that "
            "RMSNorm's eps matters; keep the gates (layout=paddle, gpas_gates=keep) and serve with this engine"
        )
    log.info("GPAS gates folded; logits moved by %.2e of the largest", deviation)
    return deviation


def tokenizer_source(src: Path) -> Path:
    """Where a model directory's tokenizer is: its own, or a LoRA run's base's."""
    from engine.models.loading import is_lora_dir

    if (src / "tokenizer.model").exists() or not is_lora_dir(src):
        return src
    base = Path(json.loads((src / ADAPTER_CONFIG).read_text())["base_model"])
    return base if base.is_absolute() else (src / base).resolve()
