"""What a run tells about keys it accepts without effect, once each: the notices of the config, of this
machine (recompute under expert parallelism, precision, saving, evaluation, the vision tower), announced as a
`notice` event, a line in train.log and notices.json in the run directory."""

from __future__ import annotations

from pathlib import Path

from engine.train.config import TrainConfig
from engine.train.erniekit_keys import Notice
from engine.train.options import MOE_GROUPS_TENSOR, weights_draws
from engine.train.parallel import DataParallel
from engine.train.precision import (
    Precision,
    PrecisionMode,
)
from engine.train.run_dir import (
    write_json,
)
from engine.train.run_state import RunSummary
from engine.train.sharding import (
    gpu_sharding_problem,
)
from engine.train.stages import stage_info

# Accepted config keys without effect here, written at the start of a run (see `announce`).
NOTICES_FILE = "notices.json"


def announce(notices: list[Notice], summary: RunSummary, emit, dp: DataParallel) -> None:
    """Each accepted key without effect, once: a ``notice`` event, a line in train.log, and
    ``notices.json`` in the run directory as soon as it is known (run_summary.json repeats them at the end;
    the studio's worker turns the file into run events while the run trains)."""
    for n in notices:
        summary.notices.append({"key": n.key, "message": n.message})
        emit({"type": "notice", "key": n.key, "message": n.message})
        if dp.main:
            print(n.line(), flush=True)
    if notices and dp.main:
        write_json(Path(summary.output_dir) / NOTICES_FILE, {"notices": summary.notices})


EP_RECOMPUTE_NOTE = (
    "with expert parallelism the MoE blocks are recomputed in part: the routed experts each rank runs and "
    "the shared experts are, the router and the expert exchange are not (their collectives are never "
    "replayed in backward), so the dispatched and combined rows keep their activations"
)


def runtime_notices(cfg: TrainConfig, model, precision: Precision | None = None) -> list[Notice]:
    """What this node and this model make of the config (known only once the model is loaded)."""
    out = []
    if precision is not None and precision.mode is PrecisionMode.EMULATED:
        out.append(
            Notice(
                "compute_type",
                f"{cfg.compute_type} is emulated: {precision.reason}; AdamW keeps float32 master weights",
            )
        )
    if cfg.frozen and cfg.lora:
        out.append(Notice("freeze_config", "a LoRA run trains adapters only; the base stays frozen anyway"))
    elif "freeze_vision" in cfg.frozen and not model.config.is_vl:
        out.append(Notice("freeze_config", "freeze_vision: this model has no vision encoder"))
    if cfg.vit_lr_ratio != 1.0 and (cfg.lora or not model.config.is_vl):
        out.append(Notice("vit_lr_ratio", "the vision encoder does not train in this run"))
    if cfg.moe_group in MOE_GROUPS_TENSOR and cfg.expert_parallel_degree == 1 and model.config.is_moe:
        out.append(
            Notice(
                "moe_group",
                f"{cfg.moe_group}: the experts split over the tensor-parallel group, which is one rank here "
                "(tensor_parallel_degree 1), so every rank holds them all; expert_parallel_degree N (or "
                "moe_group: dp) splits them over N ranks",
            )
        )
    if cfg.recompute and cfg.use_recompute_moe and getattr(model, "expert_group", None) is not None:
        out.append(Notice("recompute", EP_RECOMPUTE_NOTE))
    if cfg.moe_gate_lr_ratio != 1.0 and (cfg.lora or not model.config.is_moe):
        out.append(Notice("moe_gate_lr_ratio", "no MoE router trains in this run"))
    if cfg.sharding_stage and not cfg.do_train:
        out.append(
            Notice("sharding", "an evaluation-only run (do_train: false) has no optimizer state to split")
        )
    if cfg.tensorwise_offload_optimizer and gpu_sharding_problem("") is not None:
        out.append(
            Notice("tensorwise_offload_optimizer", "on CPU the optimizer state lives in host memory already")
        )
    return out + eval_notices(cfg) + vision_notices(cfg, model) + save_notices(cfg)


def save_notices(cfg: TrainConfig) -> list[Notice]:
    """save_to_hf on a LoRA run, whose final files are the adapter."""
    if cfg.save_to_hf and cfg.lora:
        why = "a LoRA run writes its adapter; `ernie-studio export` with layout: hf merges it"
        return [Notice("save_to_hf", why)]
    return []


def eval_notices(cfg: TrainConfig) -> list[Notice]:
    """Evaluation reads each eval file whole (one pass), so probabilities other than 1 change nothing."""
    if cfg.eval_dataset_path and weights_draws(cfg.eval_dataset_prob):
        message = (
            "evaluation reads every record of each eval_dataset_path file once; probabilities weight the "
            "training draws only"
        )
        return [Notice("eval_dataset_prob", message)]
    return []


def vision_notices(cfg: TrainConfig, model) -> list[Notice]:
    """VL-only keys given for a model without a vision encoder, and the vision parts one VL family lacks."""
    if model.config.is_vl:
        ocr = stage_info(cfg.stage).trains_paddleocr_vl
        lacks = {"resampler": "PaddleOCR-VL has no resampler (its projector is 'projector')"} if ocr else {}
        if not ocr:
            lacks["projector"] = "ERNIE 4.5 VL has no projector (its resampler is 'resampler')"
        out = [
            Notice("lora_target_modules", why)
            for g, why in lacks.items()
            if cfg.lora and g in cfg.lora_target_modules
        ]
        if ocr and cfg.recompute:
            out.append(
                Notice(
                    "recompute", "recomputes the decoder's layers; the vision encoder keeps its activations"
                )
            )
        return out
    out = []
    groups = [g for g in ("vision", "resampler") if g in cfg.lora_target_modules]
    if cfg.lora and groups:
        out.append(Notice("lora_target_modules", f"{', '.join(groups)}: this model has no vision encoder"))
    for key in ("min_pixels", "max_pixels"):
        if getattr(cfg, key):
            out.append(Notice(key, "this model reads no images"))
    return out
