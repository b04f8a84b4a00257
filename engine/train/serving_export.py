"""The form FastDeploy loads: what keeps a model directory from being served by it (`serving_problems`), and
the copy written in that form (`export_for_serving`: bf16 / fp16, Paddle layout, FastDeploy's quantization
names, its VL files). `ernie-studio serve --backend fastdeploy` and the export's `fastdeploy` format use it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.train.export import fold_gpas, tokenizer_source
from engine.train.export_config import ExportConfig

log = logging.getLogger(__name__)

# Read against FastDeploy's loader (fastdeploy/config.py ModelConfig, model_executor/layers/quantization,
# models/ernie4_5_moe.py and ernie4_5_vl/, input/ernie4_5_vl_processor): it sets Paddle's default dtype from
# config.json (its attention kernels take only float16 / bfloat16), refuses a config.json holding both
# `dtype` and `torch_dtype`, reads `dtype` as the Paddle layout (`ernie.*` keys, Linear weights [in, out];
# 2.3 looks at no transformers_version), and wants `quantization_config.quantization` naming one of its methods.

SERVING_DTYPES = ("bfloat16", "float16")
# Our PTQ methods -> FastDeploy's quantization of the same kind. The served weights are those our PTQ
# measured (dequantized); `is_quantized: false` has FastDeploy quantize them at load in its kernels' layout.
FASTDEPLOY_QUANTIZATION = {"wint8": "wint8", "wint4": "wint4", "fp8": "block_wise_fp8"}
# Kept in float32, as Baidu's -Paddle checkpoints store them: router gates and correction biases.
FLOAT32_TENSORS = ("mlp.gate.weight", "mlp.gate.weight_1", "moe_statics.e_score_correction_bias")
# The chat template FastDeploy's VL processor renders: each image / video part becomes the official
# "Picture N:" / "Video N:" marks around its placeholder, numbered through the conversation (as
# engine.data encodes them for training).
VL_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}{%- set video_count = namespace(value=0) -%}"
    "{%- macro render(content) -%}{%- if content is string -%}{{- content -}}{%- else -%}"
    "{%- for part in content -%}"
    "{%- if part['type'] in ['image', 'image_url'] -%}{%- set image_count.value = image_count.value + 1 -%}"
    "{{- 'Picture ' ~ image_count.value ~ ':<|IMAGE_START|><|image@placeholder|><|IMAGE_END|>' -}}"
    "{%- elif part['type'] in ['video', 'video_url'] -%}{%- set video_count.value = video_count.value + 1 -%}"
    "{{- 'Video ' ~ video_count.value ~ ':<|VIDEO_START|><|video@placeholder|><|VIDEO_END|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = true -%}{%- endif -%}"
    "{{- cls_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- render(message['content']) + '\\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- 'User: ' + render(message['content']) + '\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'Assistant: ' + render(message['content']) + sep_token -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
)


def serving_problems(model_dir: str | Path, dtype: str = "bfloat16") -> list[str]:
    """Why FastDeploy could not load ``model_dir`` as it is (empty: serve it unchanged)."""
    from engine.models.checkpoint import TensorStore
    from engine.models.loading import is_lora_dir

    d = Path(model_dir)
    if is_lora_dir(d):
        return ["a LoRA run (adapter only): merge it into its base"]
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"config.json unreadable: {e}"]
    problems = _config_problems(cfg)
    store = TensorStore(d)
    if not any(k.startswith("ernie.") for k in store):
        problems.append("not the Paddle layout (no ernie.* tensors)")
    stored = {store.dtype(k) for k in store if not k.endswith(FLOAT32_TENSORS)}
    if stored - {"bfloat16", "float16", "BF16", "F16"}:
        problems.append(f"weights stored as {', '.join(sorted(stored))}")
    if "vision_config" in cfg:
        pre = d / "preprocessor_config.json"
        if not pre.exists() or "min_pixels" not in json.loads(pre.read_text()):
            problems.append("no preprocessor_config.json with min_pixels / max_pixels")
    return problems


def _config_problems(cfg: dict) -> list[str]:
    problems = []
    if "torch_dtype" in cfg:
        problems.append("config.json has torch_dtype (FastDeploy takes it for the PyTorch layout)")
    if cfg.get("gpas"):
        problems.append("GPAS gates (FastDeploy's ERNIE 4.5 has none: they are folded into the weights)")
    if cfg.get("dtype") not in SERVING_DTYPES:
        problems.append(f"dtype {cfg.get('dtype')!r} (FastDeploy's attention takes float16 / bfloat16 only)")
    if "quantization_config" in cfg and "quantization" not in cfg["quantization_config"]:
        problems.append("quantization_config without FastDeploy's `quantization` key")
    if cfg.get("moe_num_experts") is not None:
        from engine.models.config import ErnieConfig

        if problem := moe_layout_problem(ErnieConfig.from_dict(cfg)):
            problems.append(problem)
    return problems


def fastdeploy_moe_layers(cfg: dict) -> list[int]:
    """The layers FastDeploy builds as MoE from ``cfg``: the text model every layer from
    ``moe_layer_start_index`` on (models/ernie4_5_moe.py Ernie4_5_DecoderLayer.__init__), the VL model those
    from start to end (ernie4_5_vl/ernie4_5_vl_moe.py); ``moe_layer_interval`` and ``mlp_layer_types`` unread."""
    if cfg.get("moe_num_experts") is None:
        return []
    n = int(cfg["num_hidden_layers"])
    start, end = cfg.get("moe_layer_start_index", 0), cfg.get("moe_layer_end_index")
    start = min(start) if isinstance(start, list | tuple) else int(start)
    end = max(end) if isinstance(end, list | tuple) else end
    if "vision_config" not in cfg or end is None or end < 0:
        end = n - 1
    return [i for i in range(n) if start <= i <= end]


def moe_layout_problem(config) -> str:
    """Why FastDeploy would build other MoE layers than ``config`` (an ErnieConfig) has; empty if none."""
    ours = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    theirs = fastdeploy_moe_layers(serving_config(config.to_dict(), ""))
    if not config.is_moe or ours == theirs:
        return ""
    return (
        f"MoE layers {ours} (moe_layer_start_index / end / interval, mlp_layer_types) but FastDeploy would "
        f"build MoE layers {theirs}: its text model makes every layer from moe_layer_start_index on MoE "
        f"and its VL model those from start to end, ignoring moe_layer_interval and mlp_layer_types; serve "
        f"this model with --backend paddle"
    )


def export_for_serving(
    src: str | Path, out: str | Path, dtype: str = "bfloat16", quantization: str = ""
) -> Path:
    """``src`` (a model dir, a LoRA run, a PTQ export; either layout) in the form FastDeploy loads: Paddle
    layout, ``dtype`` weights (router gates fp32), one dtype key, FastDeploy's ``quantization_config`` for a
    PTQ source or ``quantization`` (wint8 | wint4 | fp8), VL processor files and chat template. Returns
    ``src`` itself when it already is in that form, else ``out``."""
    from engine.models.checkpoint import write_tensors_streamed
    from engine.models.loading import TensorSource, is_quantized_dir, load_model
    from engine.models.quantized import QUANT_METHODS
    from engine.tokenizer import copy_tokenizer_files

    if dtype not in SERVING_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SERVING_DTYPES)} for FastDeploy, not {dtype!r}")
    if quantization and quantization not in FASTDEPLOY_QUANTIZATION:
        raise ValueError(
            f"quantization must be one of {', '.join(FASTDEPLOY_QUANTIZATION)}, not {quantization!r}"
        )
    src, out = Path(src), Path(out)
    if not quantization and not serving_problems(src, dtype):
        return src
    if is_quantized_dir(src):
        method = json.loads((src / "config.json").read_text())["quantization_config"].get("quant_method")
        quantization = {v: k for k, v in QUANT_METHODS.items()}.get(method, quantization)
    source = None if is_quantized_dir(src) else TensorSource(src)
    if source is not None and not source.config.gpas:
        # checkpoint -> file tensor by tensor (adapters folded in, weight-only leftovers dequantized)
        model_config, state, shapes = source.config, source, source.shapes
    else:  # a PTQ export (dequantized) or GPAS gates to fold: through the loaded model
        model = load_model(src, "float32")  # merges a LoRA run, reads a PTQ export quantized
        dequantize_linears(model)
        if model.config.gpas:
            fold_gpas(model, ExportConfig.gpas_fold_tolerance)
        model_config, state = model.config, {k: _numpy(v) for k, v in model.state_dict().items()}
        shapes = {k: list(v.shape) for k, v in state.items()}
    if problem := moe_layout_problem(model_config):
        raise ValueError(f"{src}: FastDeploy cannot serve this model as it is: {problem}")
    out.mkdir(parents=True, exist_ok=True)
    cfg = serving_config(model_config.replace(dtype=dtype).to_dict(), quantization)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    keep = {k for k in shapes if k.endswith(FLOAT32_TENSORS)}
    write_tensors_streamed(state, shapes, out, dtype, "5GB", keep_float32=keep)
    copy_tokenizer_files(tokenizer_source(src), out)
    if "vision_config" in cfg:
        write_vl_serving_files(src, out, model_config)
    log.info(
        "serving export of %s written to %s (%s%s)",
        src,
        out,
        dtype,
        f", {quantization}" if quantization else "",
    )
    return out


def serving_config(cfg: dict, quantization: str) -> dict:
    """config.json for FastDeploy: one dtype key, no training-only keys it would misread."""
    cfg = {
        k: v
        for k, v in cfg.items()
        if k not in ("torch_dtype", "transformers_version", "quantization_config")
    }
    if quantization == "wint4" and cfg.get("moe_num_experts") is not None:
        # what FastDeploy itself makes of `--quantization wint4` for ERNIE (parse_quant_config in
        # model_executor/layers/quantization/__init__.py): int8 dense layers, int4 experts
        cfg["quantization_config"] = {
            "quantization": "mix_quant",
            "dense_quant_type": "wint8",
            "moe_quant_type": "wint4",
            "is_quantized": False,
        }
    elif quantization:
        cfg["quantization_config"] = {
            "quantization": FASTDEPLOY_QUANTIZATION[quantization],
            "is_quantized": False,
        }
    if "vision_config" in cfg:
        # ERNIEKit's and FastDeploy's resampler input width (the vision tower's hidden size)
        cfg.setdefault("pixel_hidden_size", cfg["vision_config"].get("hidden_size"))
    return cfg


def dequantize_linears(model) -> int:
    """Swap every quantized / low-precision linear for a plain one holding its dequantized weight."""
    from engine.models.quantized import dequantized_linear

    n = 0
    for _, layer in list(model.named_sublayers(include_self=True)):
        for attr, child in list(layer.named_children()):
            if hasattr(child, "dequantized") and hasattr(child, "in_features"):
                setattr(layer, attr, dequantized_linear(child))
                n += 1
    return n


def _numpy(t):
    import paddle

    return t.astype("float32").numpy() if t.dtype != paddle.float32 else t.numpy()


def write_vl_serving_files(src: Path, out: Path, config) -> None:
    """preprocessor_config.json with the keys FastDeploy's AdaptiveImageProcessor reads (min_pixels,
    max_pixels, merge_size, temporal_conv_size) beside transformers' ones, and a chat template that puts
    FastDeploy's image / video placeholders where the official template does, in both places FastDeploy
    reads one: its tokenizer loader takes ``<model>/chat_template.jinja`` before tokenizer_config.json's
    ``chat_template``, so a source's own chat_template.jinja would otherwise win."""
    from dataclasses import asdict as as_dict

    from engine.data.vl_processor import ProcessorSettings, write_processor_configs

    settings = ProcessorSettings.for_model(tokenizer_source(src), config.vision_config)
    write_processor_configs(settings, out)
    pre = json.loads((out / "preprocessor_config.json").read_text())
    values = as_dict(settings)
    pre.update(
        min_pixels=values["min_pixels"],
        max_pixels=values["max_pixels"],
        merge_size=values["merge_size"],
        patch_size=values["patch_size"],
        temporal_conv_size=values["video_temporal_patch_size"],
    )
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2) + "\n")
    tok_cfg = out / "tokenizer_config.json"
    tok = json.loads(tok_cfg.read_text()) if tok_cfg.exists() else {}
    tok["chat_template"] = VL_CHAT_TEMPLATE
    tok_cfg.write_text(json.dumps(tok, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE, encoding="utf-8")
