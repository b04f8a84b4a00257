"""ERNIE 4.5 tokenizer: SentencePiece plus ERNIE's special tokens and chat template."""

from __future__ import annotations

import copy
import json
import logging
import numbers
import re
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import sentencepiece as spm
from jinja2 import nodes

log = logging.getLogger(__name__)

CLS_TOKEN = "<|begin_of_sentence|>"
SEP_TOKEN = "<|end_of_sentence|>"
IMAGE_PLACEHOLDER = "<|IMAGE_PLACEHOLDER|>"
IMAGE_START = "<|IMAGE_START|>"
IMAGE_END = "<|IMAGE_END|>"
VIDEO_PLACEHOLDER = "<|VIDEO_PLACEHOLDER|>"
VIDEO_START = "<|VIDEO_START|>"
VIDEO_END = "<|VIDEO_END|>"
SPECIAL_TOKENS = [
    CLS_TOKEN,
    SEP_TOKEN,
    *[f"<mask:{i}>" for i in range(8)],
    IMAGE_PLACEHOLDER,
    IMAGE_START,
    IMAGE_END,
    VIDEO_PLACEHOLDER,
    VIDEO_START,
    VIDEO_END,
]


def picture_text(number: int, body: str) -> str:
    """Picture ``number`` of a conversation as ERNIE 4.5 VL's chat template writes it (``body`` is its
    placeholders, or a note in previews)."""
    return f"Picture {number}:{IMAGE_START}{body}{IMAGE_END}"


def video_text(number: int, body: str) -> str:
    """Video ``number`` of a conversation as ERNIE 4.5 VL's chat template writes it."""
    return f"Video {number}:{VIDEO_START}{body}{VIDEO_END}"


# ERNIE 4.5's function-call and reasoning parts, as Baidu's ERNIE template writes them (PaddleFormers
# datasets/template: the "ernie" template, ERNIEToolUtils and ThinkingFormatter, which ERNIEKit trains with).
# The encoder and the preview both render tools, tool calls, tool results and reasoning through these.
THINK_START, THINK_END = "<think>", "</think>"
EMPTY_THINK = THINK_START + THINK_END  # what ERNIE's Thinking template gives an answer that has no reasoning


def tool_definition(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as ERNIE lists it: ``{"type": "function", "function": {...}}`` (a bare function is wrapped)."""
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


def tool_list_text(tools: list[dict[str, Any]]) -> str:
    """The tool list that follows the system prompt: ``<tool_list>\n[{...}, {...}]\n</tool_list>``."""
    listed = ", ".join(json.dumps(tool_definition(t), ensure_ascii=False) for t in tools)
    return f"<tool_list>\n[{listed}]\n</tool_list>"


def tool_calls_text(calls: list[tuple[str, Any]]) -> str:
    """An assistant's tool calls, one ``<tool_call>{"name": ..., "arguments": {...}}\n</tool_call>`` each."""
    return "\n".join(
        "<tool_call>" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"
        for name, args in calls
    )


def tool_response_text(content: str) -> str:
    """A tool's result as the prompt carries it: ``<tool_response>\n...\n</tool_response>``."""
    return f"<tool_response>\n{content}\n</tool_response>"


def think_text(reasoning: str) -> str:
    """An answer's reasoning block: ``<think>\n...\n</think>\n`` (an empty one is ``<think></think>``)."""
    if not reasoning.strip():
        return EMPTY_THINK
    return f"{THINK_START}\n{reasoning.strip(chr(10))}\n{THINK_END}\n"


def split_reasoning(content: str) -> tuple[str | None, str]:
    """(reasoning, rest) of an answer that opens with ``<think>...</think>``; (None, content) otherwise."""
    head = content.lstrip()
    if not head.startswith(THINK_START) or THINK_END not in head:
        return None, content
    inner, rest = head[len(THINK_START) :].split(THINK_END, 1)
    return inner.strip("\n"), rest.lstrip("\n")


# The ERNIE 4.5 instruct template: system line, "User: ...\n", "Assistant: ...<|end_of_sentence|>".
DEFAULT_CHAT_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = true -%}{%- endif -%}"
    "{{- cls_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] + '\\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- 'User: ' + message['content'] + '\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'Assistant: ' + message['content'] + sep_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
)

TOKENIZER_FILES = [
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
]


def _id_list(ids: Any) -> tuple[list[int], bool]:
    """Token ids as a list of ints, and whether a single id was given (an int, a NumPy or Paddle scalar)."""
    if hasattr(ids, "tolist"):  # NumPy / Paddle arrays and scalars
        ids = ids.tolist()
    if isinstance(ids, numbers.Integral):
        return [int(ids)], True
    return [int(i) for i in ids], False


class ErnieTokenizer:
    """SentencePiece tokenizer that recognises ERNIE's special tokens anywhere in the text."""

    def __init__(
        self,
        model_file: str | Path,
        config: dict[str, Any] | None = None,
        added: dict[str, int] | None = None,
        template_source: str | None = None,
    ):
        self.model_file = Path(model_file)
        self.sp = spm.SentencePieceProcessor(model_file=str(self.model_file))
        self.config = dict(config or {})
        self.added_tokens: dict[str, int] = dict(added or {})
        for tok in SPECIAL_TOKENS:
            pid = self.sp.piece_to_id(tok)
            if tok not in self.added_tokens and pid != self.sp.unk_id():
                self.added_tokens[tok] = pid
        self.id_to_added = {v: k for k, v in self.added_tokens.items()}
        self._warned_unheld = False
        toks = sorted(self.added_tokens, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(t) for t in toks) + ")") if toks else None
        self.chat_template = self.config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        if template_source is None:
            template_source = "the chat template handed to ErnieTokenizer"
        self.template_source = (
            template_source if self.config.get("chat_template") else "ERNIE's built-in template"
        )
        self._template = compile_chat_template(self.chat_template, self.template_source)

    def with_chat_template(self, source_text: str, source: str) -> ErnieTokenizer:
        """This tokenizer (same vocabulary) rendering another chat template, compiled in the same sandbox."""
        other = copy.copy(self)
        other.chat_template, other.template_source = source_text, source
        other._template = compile_chat_template(source_text, source)
        return other

    # ---- ids ---------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return max(self.sp.get_piece_size(), max(self.added_tokens.values(), default=0) + 1)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token_id(self) -> int:
        return self.sp.bos_id()

    @property
    def eos_token_id(self) -> int:
        return self.sp.eos_id()

    @property
    def unk_token_id(self) -> int:
        return self.sp.unk_id()

    @property
    def pad_token_id(self) -> int:
        pad = self.sp.pad_id()
        return pad if pad >= 0 else self.unk_token_id

    @property
    def cls_token(self) -> str:
        return self._named_token("cls_token", CLS_TOKEN)

    @property
    def sep_token(self) -> str:
        return self._named_token("sep_token", SEP_TOKEN)

    def _named_token(self, key: str, default: str) -> str:
        """A token named in tokenizer_config.json, written either as a string or as {"content": ...}."""
        value = self.config.get(key, default)
        if isinstance(value, dict):
            value = value.get("content", default)
        return value if isinstance(value, str) and value else default

    @property
    def sep_token_id(self) -> int:
        return self.convert_tokens_to_ids(self.sep_token)

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end a generated turn: ``</s>`` and ``<|end_of_sentence|>``."""
        ids = [self.eos_token_id]
        if self.sep_token in self.added_tokens:
            ids.append(self.added_tokens[self.sep_token])
        return ids

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int]:
        """The id of one token, or the ids of a list of tokens (as transformers' tokenizers answer)."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> int:
        if token in self.added_tokens:
            return self.added_tokens[token]
        return self.sp.piece_to_id(token)

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        """The piece of one id, or the pieces of a list of ids (NumPy / Paddle integers and arrays too); an id
        the tokenizer does not hold (a padded official vocabulary is larger than its tokenizer) reads as the
        unknown token."""
        ids, one = _id_list(ids)
        pieces = [self._piece(i) for i in ids]
        return pieces[0] if one else pieces

    def _piece(self, token_id: int) -> str:
        if token_id in self.id_to_added:
            return self.id_to_added[token_id]
        if not self.holds(token_id):
            self._warn_unheld(token_id)
            return self.sp.id_to_piece(self.unk_token_id)
        return self.sp.id_to_piece(token_id)

    def holds(self, token_id: int) -> bool:
        """Whether ``token_id`` names a piece of this tokenizer (or one of its added tokens)."""
        return 0 <= token_id < self.sp.get_piece_size() or token_id in self.id_to_added

    def _warn_unheld(self, token_id: int) -> None:
        if not self._warned_unheld:
            log.warning(
                "token id %d is past this tokenizer's %d pieces (the model's vocabulary is larger, as padded "
                "official vocabularies are); such ids decode as nothing",
                token_id,
                self.sp.get_piece_size(),
            )
            self._warned_unheld = True

    def is_special(self, token_id: int) -> bool:
        if not self.holds(token_id):
            return False
        return token_id in self.id_to_added or self.sp.is_control(token_id) or token_id == self.unk_token_id

    # ---- text --------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for ``text``; special tokens written in the text become their own ids."""
        ids: list[int] = [self.bos_token_id] if add_special_tokens else []
        pieces = self._split.split(text) if self._split else [text]
        for piece in pieces:
            if not piece:
                continue
            if piece in self.added_tokens:
                ids.append(self.added_tokens[piece])
            else:
                ids.extend(self.sp.encode(piece))
        return ids

    __call__ = encode

    def decode(self, ids: int | list[int], skip_special_tokens: bool = True) -> str:
        """The text of a list of ids, or of one id (NumPy / Paddle integers and arrays too)."""
        out: list[str] = []
        run: list[int] = []
        for i in _id_list(ids)[0]:
            if not self.holds(i):
                self._warn_unheld(i)
                continue
            if i in self.id_to_added or self.sp.is_control(i):
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                if not skip_special_tokens:
                    out.append(self.id_to_added.get(i) or self.sp.id_to_piece(i))
            elif 0 <= i < self.sp.get_piece_size():
                run.append(i)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation with the model's chat template (``chat_template.jinja`` or the ERNIE default)."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                cls_token=self.cls_token,
                sep_token=self.sep_token,
                bos_token=self.sp.id_to_piece(self.bos_token_id),
                eos_token=self.sp.id_to_piece(self.eos_token_id),
                **kwargs,
            )
        except jinja2.sandbox.SecurityError as e:
            raise ChatTemplateRefused(
                f"{self.template_source}: the chat template tried to leave its sandbox ({e}); it is refused. "
                "Use the model's official chat template"
            ) from None
        return self.encode(text) if tokenize else text

    # ---- files -------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path) -> ErnieTokenizer:
        d = Path(path).expanduser()
        model_file = d / "tokenizer.model"
        if not model_file.exists():
            raise FileNotFoundError(f"{d}: no tokenizer.model (ERNIE 4.5 uses a SentencePiece tokenizer)")
        config = _read_json(d / "tokenizer_config.json")
        added = {k: int(v) for k, v in _read_json(d / "added_tokens.json").items()}
        for tid, info in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(info, dict) and "content" in info:
                added.setdefault(info["content"], int(tid))
        template_file = d / "chat_template.jinja"
        source = d / "tokenizer_config.json"
        if template_file.exists():  # FastDeploy and transformers read it before tokenizer_config.json
            config["chat_template"] = template_file.read_text(encoding="utf-8")
            source = template_file
        return cls(model_file, config, added, template_source=f"model {d}, {source.name}")

    def save_pretrained(self, path: str | Path) -> None:
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        if self.model_file.resolve() != (d / "tokenizer.model").resolve():
            shutil.copyfile(self.model_file, d / "tokenizer.model")
        config = {
            "tokenizer_class": "Ernie4_5_Tokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<unk>",
            "cls_token": CLS_TOKEN,
            "sep_token": SEP_TOKEN,
            "model_max_length": self.config.get("model_max_length", 131072),
            "chat_template": self.chat_template,
        }
        (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        special = {
            k: config[k]
            for k in ("bos_token", "eos_token", "unk_token", "pad_token", "cls_token", "sep_token")
        }
        (d / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        (d / "added_tokens.json").write_text(
            json.dumps(self.added_tokens, indent=2, ensure_ascii=False) + "\n"
        )


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy whichever tokenizer / generation files exist in ``src`` to ``dst``."""
    copied = []
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.exists():
            Path(dst).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, Path(dst) / name)
            copied.append(name)
    return copied


def train_tokenizer(corpus: str | Path, out_dir: str | Path, vocab_size: int = 1024) -> ErnieTokenizer:
    """Train a small SentencePiece tokenizer with ERNIE's special tokens (for presets and tests)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / "tokenizer"
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=SPECIAL_TOKENS,
        hard_vocab_limit=False,
        num_threads=1,
        split_digits=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    (out / "tokenizer.vocab").unlink(missing_ok=True)
    tok = ErnieTokenizer(out / "tokenizer.model")
    tok.save_pretrained(out)
    return tok


def load_tokenizer(path: str | Path) -> ErnieTokenizer:
    """The tokenizer of a model directory, with ``apply_chat_template``."""
    return ErnieTokenizer.from_pretrained(path)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from e


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class ChatTemplateRefused(ValueError):
    """A model's chat template that reaches for Python internals; the message names the model and file."""


# Attributes the sandbox refuses at render time (jinja2.sandbox.is_safe_attribute): anything starting with
# an underscore, and the frame / code handles of functions, methods, generators and coroutines.
_UNSAFE_NAMES = frozenset(
    {"mro"}
    | jinja2.sandbox.UNSAFE_FUNCTION_ATTRIBUTES
    | jinja2.sandbox.UNSAFE_METHOD_ATTRIBUTES
    | jinja2.sandbox.UNSAFE_GENERATOR_ATTRIBUTES
    | jinja2.sandbox.UNSAFE_COROUTINE_ATTRIBUTES
    | jinja2.sandbox.UNSAFE_ASYNC_GENERATOR_ATTRIBUTES
)


def _unsafe_name(name: Any) -> bool:
    return isinstance(name, str) and (name.startswith("_") or name in _UNSAFE_NAMES)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
) -> str:
    """transformers' ``tojson`` (no HTML escaping: a chat template's output is model text, not a web page)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplateSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandbox, except that reaching for an unsafe attribute fails at once (jinja's sandbox
    hands back an undefined value, which would surface later as a confusing undefined-name error)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.sandbox.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )


def compile_chat_template(source_text: str, source: str) -> jinja2.Template:
    """A chat template compiled in an immutable sandbox, as transformers renders them.

    A template that names a Python internal (``__globals__``, ``__class__``, ``mro``, ...) is refused here,
    before anything renders; one that reaches for it by a computed name is stopped by the sandbox at render
    time (``apply_chat_template`` raises ``ChatTemplateRefused``). Either way nothing it names runs.
    """
    env = ChatTemplateSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
        extensions=["jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        tree = env.parse(source_text)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateRefused(
            f"{source}:{e.lineno}: the chat template does not parse: {e.message}"
        ) from None
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node, nodes.Getitem):
            name = node.arg.value if isinstance(node.arg, nodes.Const) else None
        else:
            first = node.args[0] if node.name == "attr" and node.args else None
            name = first.value if isinstance(first, nodes.Const) else None
        if _unsafe_name(name):
            raise ChatTemplateRefused(
                f"{source}:{node.lineno}: the chat template reaches for {name!r}, a Python internal that "
                "templates may not touch (they render in a sandbox); it is refused. Use the model's official "
                "chat template"
            )
    return env.from_string(tree)
