"""GGUF export for llama.cpp and Ollama: ERNIE 4.5 dense (``ernie4_5``) and MoE (``ernie4_5-moe``).

The tensor mapping follows llama.cpp's own ERNIE 4.5 support (convert_hf_to_gguf's Ernie4_5Model /
Ernie4_5MoeModel, gguf-py's MODEL_TENSORS and src/models/ernie4-5*.cpp, vendored in llama-cpp-python 0.3.36):

- GGUF holds a matrix as numpy [out, in] (ggml's ne = [in, out]); our Paddle layout stores Linear weights
  [in, out], so every matrix is transposed. The fused ``qkv_proj`` splits into ``attn_q/k/v`` (Q, K, V in that
  order on the output axis) and ``up_gate_proj`` into ``ffn_gate`` (first half) and ``ffn_up``.
- RoPE: llama.cpp runs ERNIE 4.5 with LLAMA_ROPE_TYPE_NORM, which rotates adjacent pairs (x[2i], x[2i+1]), as
  our model does; so Q and K are written unpermuted (the HF converter does not permute them either).
- MoE: experts stacked into ``ffn_{gate,up,down}_exps`` [E, out, in]; the router ``ffn_gate_inp`` [E, H] and
  the correction bias ``exp_probs_b.bias`` [E] (llama.cpp selects by softmax + bias and weighs by the unbiased
  softmax, renormalised, as ERNIE does) stay float32; shared experts ``ffn_*_shexp``. llama.cpp's MoE layer rule
  is ``i >= leading_dense_block_count and (i + 1) % interleave_moe_layer_step == 0`` with no end index, so a
  model whose MoE layers differ from that is refused.
- Tokenizer: SentencePiece ("llama") pieces, scores and types from tokenizer.model, ERNIE's added tokens as
  control tokens, the vocabulary padded to the model's with unused ``[PADn]`` tokens (they decode as nothing),
  ``<|end_of_sentence|>`` as end-of-turn, and the chat template (llama-server --jinja renders it).
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# gguf_types -> llama.cpp file type names (llama-quantize's type argument)
QUANTIZE_NAMES = {"q4_K_M": "Q4_K_M"}


class GGUFExportError(ValueError):
    """A model llama.cpp cannot hold as it is; the message says what and why."""


@dataclass
class GGUFFile:
    type: str
    path: str
    size_bytes: int
    perplexity: float | None = None


def gguf_problems(config) -> list[str]:
    """Why llama.cpp could not run ``config`` (an ErnieConfig) as ERNIE 4.5; empty when it can."""
    problems = []
    if config.vision_config is not None or config.model_type == "ernie4_5_moe_vl":
        problems.append(
            f"{config.model_type}: llama.cpp has no ERNIE 4.5 VL architecture; its vision tower, resampler, "
            "vision experts and 3-D RoPE cannot be written to GGUF (export a text-only ERNIE 4.5 model)"
        )
        return problems
    if config.use_bias:
        problems.append("use_bias: llama.cpp's ERNIE 4.5 graph has no Q/K/V or FFN biases")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r}: llama.cpp's ERNIE 4.5 FFN is SwiGLU (silu)")
    if config.is_moe:
        ours = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        lead, step = _lead_and_step(config)
        theirs = [i for i in range(config.num_hidden_layers) if i >= lead and (i + 1) % step == 0]
        loaded = [i for i in range(config.num_hidden_layers) if i >= lead]  # llama.cpp's tensor loader
        if ours != theirs or ours != loaded:
            problems.append(
                f"MoE layers {ours}: llama.cpp makes every layer from leading_dense_block_count on an MoE "
                f"layer (it has no moe_layer_end_index and loads expert tensors for each), which would be {loaded}"
            )
    return problems


def _lead_and_step(config) -> tuple[int, int]:
    sparse = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    return (sparse[0] if sparse else config.num_hidden_layers), max(config.moe_layer_interval, 1)


def architecture(config) -> str:
    return "ernie4_5-moe" if config.is_moe else "ernie4_5"


def gguf_tensors(config, state: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array in GGUF orientation) for every tensor llama.cpp loads, from a Paddle-layout
    state dict (``ernie.*`` keys, Linear weights [in, out])."""
    nh, nkv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim

    def w(key: str) -> np.ndarray:
        if key not in state:
            raise GGUFExportError(f"tensor {key} missing from the model's weights")
        return np.asarray(state[key], dtype=np.float32)

    yield "token_embd.weight", w("ernie.embed_tokens.weight")
    yield "output_norm.weight", w("ernie.norm.weight")
    if not config.tie_word_embeddings:
        yield "output.weight", w("lm_head.weight").T  # [H, V] -> [V, H]
    for i in range(config.num_hidden_layers):
        p, b = f"ernie.layers.{i}.", f"blk.{i}."
        yield b + "attn_norm.weight", w(p + "input_layernorm.weight")
        yield b + "ffn_norm.weight", w(p + "post_attention_layernorm.weight")
        qkv = w(p + "self_attn.qkv_proj.weight")  # [H, (nh + 2 nkv) hd], Q | K | V
        q, k, v = np.split(qkv, [nh * hd, (nh + nkv) * hd], axis=1)
        yield b + "attn_q.weight", q.T
        yield b + "attn_k.weight", k.T
        yield b + "attn_v.weight", v.T
        yield b + "attn_output.weight", w(p + "self_attn.o_proj.weight").T
        if not config.is_moe_layer(i):
            yield from _ffn(b, "", w(p + "mlp.up_gate_proj.weight"), w(p + "mlp.down_proj.weight"))
            continue
        n_exp = config.expert_counts[0]
        yield b + "ffn_gate_inp.weight", w(p + "mlp.gate.weight").T  # [H, E] -> [E, H]
        bias = p + "mlp.moe_statics.e_score_correction_bias"
        if bias in state:
            yield b + "exp_probs_b.bias", w(bias).reshape(-1)[:n_exp]
        gates, ups, downs = [], [], []
        for e in range(n_exp):
            up_gate = w(f"{p}mlp.experts.{e}.up_gate_proj.weight")
            half = up_gate.shape[1] // 2
            gates.append(up_gate[:, :half].T)
            ups.append(up_gate[:, half:].T)
            downs.append(w(f"{p}mlp.experts.{e}.down_proj.weight").T)
        yield b + "ffn_gate_exps.weight", np.stack(gates)
        yield b + "ffn_up_exps.weight", np.stack(ups)
        yield b + "ffn_down_exps.weight", np.stack(downs)
        if config.moe_num_shared_experts:
            yield from _ffn(
                b,
                "_shexp",
                w(p + "mlp.shared_experts.up_gate_proj.weight"),
                w(p + "mlp.shared_experts.down_proj.weight"),
            )


def _ffn(b: str, suffix: str, up_gate: np.ndarray, down: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    half = up_gate.shape[1] // 2  # gate half first, then up (Paddle layout)
    yield f"{b}ffn_gate{suffix}.weight", up_gate[:, :half].T
    yield f"{b}ffn_up{suffix}.weight", up_gate[:, half:].T
    yield f"{b}ffn_down{suffix}.weight", down.T


# Kept float32 whatever the type: norms, biases and the router (as llama.cpp's converter keeps them).
_FLOAT32 = re.compile(r"(_norm\.weight|\.bias|ffn_gate_inp\.weight)$")


def _stored(name: str, arr: np.ndarray, gguf_type: str):
    """(data, raw GGML type or None) for one tensor in a file of ``gguf_type`` (f32 / f16 / q8_0)."""
    import gguf

    if gguf_type == "f32" or arr.ndim == 1 or _FLOAT32.search(name):
        return np.ascontiguousarray(arr, dtype=np.float32), None
    if gguf_type == "q8_0" and arr.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        qt = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qt), qt
    return np.ascontiguousarray(arr, dtype=np.float16), None


# ---- tokenizer and chat template ------------------------------------------------------------------------


def vocab_metadata(tokenizer, vocab_size: int) -> dict:
    """Pieces, scores and token types (gguf.TokenType values) of a SentencePiece tokenizer, padded to
    ``vocab_size`` with unused ``[PADn]`` tokens; ERNIE's added tokens are control tokens."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(tokenizer.model_file).read_bytes())
    n_pieces = len(proto.pieces)
    if n_pieces > vocab_size:
        raise GGUFExportError(
            f"the tokenizer holds {n_pieces} pieces but the model's vocabulary is {vocab_size}: ids past "
            f"{vocab_size - 1} would have no embedding"
        )
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [5] * vocab_size  # UNUSED
    for i, piece in enumerate(proto.pieces):
        tokens[i], scores[i], types[i] = piece.piece.encode(), float(piece.score), int(piece.type)
    for text, tid in tokenizer.added_tokens.items():
        if tid >= vocab_size:
            log.warning("added token %r has id %d past the model's vocabulary; left out", text, tid)
            continue
        tokens[tid], scores[tid], types[tid] = text.encode(), -1000.0, 3  # CONTROL
    return {
        "tokens": tokens,
        "scores": scores,
        "types": types,
        "add_space_prefix": bool(proto.normalizer_spec.add_dummy_prefix),
    }


def chat_template(tokenizer) -> str:
    """The tokenizer's chat template made self-contained for llama.cpp's Jinja renderer (which passes
    bos_token / eos_token but not ERNIE's cls_token / sep_token)."""
    sets = (
        f"{{%- set cls_token = {json.dumps(tokenizer.cls_token)} -%}}"
        f"{{%- set sep_token = {json.dumps(tokenizer.sep_token)} -%}}"
    )
    return sets + tokenizer.chat_template


def modelfile(gguf_name: str, tokenizer) -> str:
    """An Ollama Modelfile for ``gguf_name`` (beside it): ERNIE's chat template in Ollama's Go template
    syntax and the end-of-turn tokens as stops."""
    cls, sep = tokenizer.cls_token, tokenizer.sep_token
    template = (
        cls + "{{- range .Messages }}"
        '{{- if eq .Role "system" }}{{ .Content }}\n'
        '{{ else if eq .Role "user" }}User: {{ .Content }}\n'
        '{{ else if eq .Role "assistant" }}Assistant: {{ .Content }}' + sep + "{{ end }}"
        "{{- end }}Assistant: "
    )
    return (
        f"# Ollama: ollama create NAME -f {gguf_name}.Modelfile  (ERNIE 4.5 chat template)\n"
        f"FROM ./{gguf_name}\n"
        f'TEMPLATE """{template}"""\n'
        f'PARAMETER stop "{sep}"\n'
        'PARAMETER stop "</s>"\n'
    )


# ---- writing ---------------------------------------------------------------------------------------------


def write_gguf(model, tokenizer, path: str | Path, gguf_type: str, name: str = "ERNIE 4.5") -> Path:
    """Write ``model`` (an ErnieForCausalLM, or a ``loading.TensorSource`` reading the checkpoint tensor by
    tensor) and ``tokenizer`` as one GGUF file of ``gguf_type`` (f32, f16 or q8_0). Each tensor is converted
    when it is written and spooled to a temporary file (gguf's ``use_temp_file``), so no fp32 copy of the
    whole model is made."""
    import gguf

    config = model.config
    problems = gguf_problems(config)
    if problems:
        raise GGUFExportError("cannot export to GGUF: " + "; ".join(problems))
    file_types = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }
    if gguf_type not in file_types:
        raise ValueError(f"write_gguf writes {', '.join(file_types)}; {gguf_type} comes from llama-quantize")
    state = model if isinstance(model, Mapping) else FloatState(model)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), architecture(config), use_temp_file=True)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_file_type(file_types[gguf_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if config.is_moe:
        lead, step = _lead_and_step(config)
        writer.add_expert_count(config.expert_counts[0])
        writer.add_expert_used_count(config.moe_k)
        writer.add_interleave_moe_layer_step(step)
        writer.add_leading_dense_block_count(lead)
        writer.add_expert_feed_forward_length(config.expert_intermediate_sizes[0])
        writer.add_expert_shared_count(config.moe_num_shared_experts)
        # the shared experts are one SwiGLU of width n_shared * moe_intermediate_size (engine.models.moe)
        writer.add_expert_shared_feed_forward_length(
            config.moe_num_shared_experts * config.expert_intermediate_sizes[0]
        )
    _add_tokenizer(writer, tokenizer, config.vocab_size)
    for tname, arr in gguf_tensors(config, state):
        data, raw = _stored(tname, arr, gguf_type)
        writer.add_tensor(tname, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(path)
    return path


class FloatState(Mapping):
    """A model's state dict as fp32 numpy arrays, each converted when it is read (not all at once)."""

    def __init__(self, model):
        self.state = model.state_dict()

    def __getitem__(self, key: str) -> np.ndarray:
        v = self.state[key]
        return v.astype("float32").numpy() if str(v.dtype) != "paddle.float32" else v.numpy()

    def __contains__(self, key: object) -> bool:
        return key in self.state

    def __iter__(self):
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)


def _add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    meta = vocab_metadata(tokenizer, vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(meta["tokens"])
    writer.add_token_scores(meta["scores"])
    writer.add_token_types(meta["types"])
    writer.add_add_space_prefix(meta["add_space_prefix"])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    if tokenizer.sep_token in tokenizer.added_tokens:
        writer.add_eot_token_id(tokenizer.sep_token_id)  # <|end_of_sentence|> ends an assistant turn
    # ERNIE's prompts open with <|begin_of_sentence|> from the template, never with <s>
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(chat_template(tokenizer))


def quantize_gguf(src: str | Path, dst: str | Path, gguf_type: str, threads: int = 0) -> Path:
    """``dst`` as llama.cpp's llama-quantize makes it from ``src`` (an f16 / f32 GGUF)."""
    from engine.llamacpp import require_tool

    tool = require_tool("llama-quantize")
    cmd = [str(tool), str(src), str(dst), QUANTIZE_NAMES[gguf_type]]
    if threads:
        cmd.append(str(threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"llama-quantize {gguf_type} failed (exit {proc.returncode}):\n{tail}")
    return Path(dst)


_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")
_RUNNING = re.compile(r"\[(\d+)\]([0-9.]+)")


def perplexity_series(
    path: str | Path, text_file: str | Path, n_ctx: int, threads: int = 2
) -> tuple[list[float], int]:
    """llama-perplexity's running estimates (the perplexity over chunks 1..k, for each k it printed) and its
    chunk count. Its output has been seen to end early with exit code 0, in a studio worker and in the e2e
    suite (the last chunk's estimate and the final figure missing, twice in a row on one file): the
    estimates it printed stand, and a caller compares files over the chunks all of them reached."""
    from engine.llamacpp import repack_args, require_tool

    tool = require_tool("llama-perplexity")
    cmd = [str(tool), "-m", str(path), "-f", str(text_file), "-c", str(n_ctx), "-b", str(n_ctx)]
    cmd += ["-t", str(threads), "--no-warmup", *repack_args()]
    best: tuple[list[float], int] = ([], 0)
    for _ in range(2):  # once more when its output ended early
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        out = proc.stdout + proc.stderr
        chunks = _CHUNKS.search(out)
        if proc.returncode != 0 or not chunks:
            tail = "\n".join(out.strip().splitlines()[-15:])
            raise RuntimeError(f"llama-perplexity on {path} failed (exit {proc.returncode}):\n{tail}")
        total = int(chunks.group(1))
        running = [float(v) for _, v in sorted((int(k), v) for k, v in _RUNNING.findall(out))]
        final = _PPL.search(out)
        if final and len(running) == total:
            running[-1] = float(final.group(1))
        if len(running) > len(best[0]):
            best = (running, total)
        if len(running) == total:
            break
        log.warning(
            "llama-perplexity on %s ended after chunk %d of %d; running it again", path, len(running), total
        )
    if not best[0]:
        raise RuntimeError(f"llama-perplexity on {path} printed no estimate")
    return best
