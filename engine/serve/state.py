"""What the routes share: the engine, tokenizer, served name, limits and metrics, and how a request
becomes prompt token ids and sampling parameters (checked, with errors that name the field)."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
from pathlib import Path
from urllib.parse import urlsplit

from engine.models.paddleocr_vl_config import MODEL_TYPE as PADDLEOCR_VL
from engine.serve.generate import GenerationEngine
from engine.serve.metrics import ServerMetrics
from engine.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    SamplingFields,
)
from engine.serve.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_CHOICES = 16


def read_generation_defaults(model_dir: str | Path | None) -> dict[str, float]:
    """Sampling defaults from the model's generation_config.json (what FastDeploy applies too)."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        log.warning("%s:%d: ignoring invalid generation_config.json: %s", path, e.lineno, e.msg)
        return {}
    keys = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty")
    return {k: cfg[k] for k in keys if isinstance(cfg.get(k), int | float)}


class ServingState:
    """What the routes need: the engine, tokenizer, served name, limits and metrics."""

    def __init__(
        self,
        engine: GenerationEngine,
        served_model_name: str,
        max_concurrent_requests: int,
        model_dir=None,
        media_dir=None,
    ):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.name = served_model_name
        self.model_dir = str(model_dir) if model_dir else None
        self.max_concurrent = max_concurrent_requests
        self.in_flight = 0
        self.defaults = read_generation_defaults(model_dir)
        self.metrics = ServerMetrics(engine.stats, served_model_name)
        self.created = int(time.time())
        self.vision_config = getattr(engine.model.config, "vision_config", None)
        # PaddleOCR-VL: its own image processor and chat template (images first in a user turn, no "Picture N:")
        self.ocr = getattr(engine.model.config, "model_type", None) == PADDLEOCR_VL
        self.processor = None
        # VL: the one folder whose pictures a chat may name by path (none: data: URLs only)
        self.media_dir = Path(media_dir).resolve() if media_dir else None
        if self.ocr:
            from engine.data.paddleocr_vl_processor import CHAT_TEMPLATE, OCRProcessorSettings

            self.processor = (
                OCRProcessorSettings.from_model_dir(model_dir) if model_dir else OCRProcessorSettings()
            )
            # The published chat_template.jinja when the directory has one; else the built-in copy of it, not a
            # tokenizer_config.json template (copied tokenizers carry ERNIE's text-only one there).
            if model_dir is None or not (Path(model_dir) / "chat_template.jinja").is_file():
                self.tokenizer = self.tokenizer.with_chat_template(
                    CHAT_TEMPLATE, "PaddleOCR-VL's chat template"
                )
        elif self.vision_config is not None:
            # the model directory's preprocessor_config.json (Baidu ships one), with the model's patch sizes
            from engine.data.vl_processor import ProcessorSettings

            self.processor = ProcessorSettings.for_model(model_dir, self.vision_config)

    def check_model(self, name: str) -> None:
        if name != self.name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.name!r}",
                param="model",
                code="model_not_found",
            )

    def sampling_params(self, req: SamplingFields, prompt_len: int) -> SamplingParams:
        """The request's sampling fields, with the model's generation_config.json filling what it omits."""
        if req.n > MAX_CHOICES:
            raise APIError(400, f"n={req.n}: at most {MAX_CHOICES} choices per request", param="n")
        logprobs = requested_logprobs(req)
        max_tokens = completion_budget(req, prompt_len, self.engine.max_model_len)
        stop = stop_strings(req)
        check_stop_token_ids(req, self.engine.model.config.vocab_size)
        d = self.defaults
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_setting(req, d, "temperature", 1.0),
            top_p=_setting(req, d, "top_p", 1.0),
            top_k=int(_setting(req, d, "top_k", 0)),
            min_p=_setting(req, d, "min_p", 0.0),
            repetition_penalty=_setting(req, d, "repetition_penalty", 1.0),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
        try:
            params.validate()
        except ValueError as e:
            raise APIError(400, str(e)) from e
        return params

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], list]:
        """Prompt token ids of the chat template over the messages, and the decoded images in order."""
        reject_unsupported_chat_fields(req)
        images: list = []
        content = self.ocr_message_parts if self.ocr else self.message_text
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": content(m, i, images)}
            for i, m in enumerate(req.messages)
        ]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, **(req.chat_template_kwargs or {})
            )
        except Exception as e:  # a template error is the request's fault (bad kwargs, unsupported roles)
            raise APIError(
                400, f"the chat template could not render these messages: {e}", param="messages"
            ) from e
        if self.ocr:
            text = self.expand_ocr_images(text, images)
        return self.tokenizer.encode(text), images

    def message_text(self, m: ChatMessage, i: int, images: list) -> str:
        """A message's content as prompt text; image parts become placeholders and append their pixels."""
        if not isinstance(m.content, list):
            return self.checked_text(m.content or "", f"messages.{i}.content")
        return "".join(self.part_text(part, i, j, images) for j, part in enumerate(m.content))

    def part_text(self, part: ContentPart, i: int, j: int, images: list) -> str:
        where = f"messages.{i}.content.{j}"
        if part.type == "image_url" and self.vision_config is not None:
            return self.image_part(part, images, where)
        if part.type != "text" or part.text is None:
            raise self.wrong_part(part, i, j)
        return self.checked_text(part.text, where)

    def wrong_part(self, part: ContentPart, i: int, j: int) -> APIError:
        kinds = "text and image_url parts" if self.vision_config is not None else "only text parts"
        where = f"messages.{i}.content.{j}"
        return APIError(
            400, f"messages[{i}].content[{j}]: this model takes {kinds}, got type {part.type!r}", param=where
        )

    def checked_text(self, text: str, where: str) -> str:
        """Text that holds no image token: written as text, it would claim pixels no part sent."""
        if self.vision_config is not None:
            from engine.tokenizer import IMAGE_END, IMAGE_PLACEHOLDER, IMAGE_START

            for token in (IMAGE_PLACEHOLDER, IMAGE_START, IMAGE_END):
                if token in text:
                    raise APIError(
                        400,
                        f"{where}: text may not contain the image token {token}; send each image as an "
                        "image_url part",
                        param=where,
                    )
        return text

    def image_part(self, part: ContentPart, images: list, where: str) -> str:
        """An ERNIE 4.5 VL image part's prompt text, numbered through the conversation as its chat template
        numbers pictures; the decoded image joins ``images``."""
        from engine.tokenizer import IMAGE_PLACEHOLDER, picture_text

        item = self.decode_image(part, where)
        images.append(item)
        return picture_text(len(images), IMAGE_PLACEHOLDER * item.num_tokens)

    def ocr_message_parts(self, m: ChatMessage, i: int, images: list) -> list[dict]:
        """A message as PaddleOCR-VL's chat template reads it: ``{"type": "image"}`` and ``{"type": "text"}``
        parts (the template places a user turn's images before its text); decoded images join ``images``."""
        if not isinstance(m.content, list):
            return [{"type": "text", "text": self.checked_text(m.content or "", f"messages.{i}.content")}]
        parts: list[dict] = []
        for j, part in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if part.type == "image_url":
                images.append(self.decode_image(part, where))
                parts.append({"type": "image"})
            elif part.type == "text" and part.text is not None:
                parts.append({"type": "text", "text": self.checked_text(part.text, where)})
            else:
                raise self.wrong_part(part, i, j)
        return parts

    def expand_ocr_images(self, text: str, images: list) -> str:
        """The rendered prompt with each image's placeholder repeated once per decoder token of the image."""
        from engine.data.paddleocr_vl_processor import IMAGE_PLACEHOLDER, expand_image_placeholders

        placed = text.count(IMAGE_PLACEHOLDER)
        if placed != len(images):  # the template renders images of user turns only
            raise APIError(
                400,
                f"messages: {len(images)} image_url parts, but the chat template placed {placed}; "
                "PaddleOCR-VL reads images in user messages only",
                param="messages",
            )
        return expand_image_placeholders(text, [item.grid_thw for item in images], self.processor.merge_size)

    def decode_image(self, part: ContentPart, where: str):
        """An image part's picture through the model's image processor: a base64 ``data:`` URL, or a path
        inside ``--media-dir``; remote URLs are refused (this server fetches nothing)."""
        if self.ocr:
            from engine.data.paddleocr_vl_processor import preprocess_image
        else:
            from engine.data.vl_processor import preprocess_image
        from engine.data.vl_processor import VisionInputError

        image_url = getattr(part, "image_url", None)
        url = image_url.get("url") if isinstance(image_url, dict) else None
        if not isinstance(url, str) or not url:
            raise APIError(400, f"{where}: image_url.url is missing", param=where)
        scheme = urlsplit(url).scheme.lower() if ":" in url else ""
        if scheme not in ("", "data", "file"):
            raise APIError(
                400,
                f"{where}: {scheme}: URLs are not fetched (this server fetches nothing); send the image inline "
                "as a data:image/...;base64,... URL",
                param=where,
            )
        if scheme == "data" and ";base64," not in url:
            raise APIError(
                400, f"{where}: a data: URL must be base64 (data:image/png;base64,...)", param=where
            )
        try:
            if scheme == "data":
                raw = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
                return preprocess_image(raw, self.processor)
            return preprocess_image(self.media_path(url, where), self.processor)
        except (binascii.Error, VisionInputError) as e:
            raise APIError(400, f"{where}: not a readable image: {e}", param=where) from e

    def media_path(self, url: str, where: str) -> Path:
        """A picture named by path (``file://`` or plain): only inside ``--media-dir``."""
        if self.media_dir is None:
            raise APIError(
                400,
                f"{where}: send images inline as data:image/...;base64,... URLs (this server fetches nothing "
                "and reads files only from a --media-dir, which it was not given)",
                param=where,
            )
        raw = url[len("file://") :] if url.startswith("file://") else url
        path = (self.media_dir / raw).resolve()  # an absolute path replaces media_dir here, then is checked
        if path != self.media_dir and self.media_dir not in path.parents:
            raise APIError(400, f"{where}: {raw!r} is outside the server's --media-dir", param=where)
        return path

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise APIError(400, f"prompt: send one prompt per request (got {len(p)})", param="prompt")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise APIError(400, "prompt: must not be empty", param="prompt")
            return self.tokenizer.encode(p)
        vocab = self.engine.model.config.vocab_size
        if not p:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        return list(p)


# ---- request checks ---------------------------------------------------------------------------------
def reject_unsupported_chat_fields(req: ChatCompletionRequest) -> None:
    # Said plainly rather than ignored: a client relying on these would silently get plain text.
    if req.tools:
        raise APIError(400, "tools: tool calling is not supported by the Paddle backend", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise APIError(
            400,
            f"response_format: only type 'text' is supported, not {req.response_format.get('type')!r}",
            param="response_format",
        )


def requested_logprobs(req: SamplingFields) -> int | None:
    """Top log-probabilities to return per token (0 = only the chosen token's), or None for none."""
    if isinstance(req, ChatCompletionRequest):
        if isinstance(req.logprobs, int) and not isinstance(req.logprobs, bool):
            raise APIError(
                400,
                "logprobs: must be true or false for chat (use top_logprobs for a count)",
                param="logprobs",
            )
        return (req.top_logprobs or 0) if req.logprobs else None
    logprobs = None if req.logprobs is None or req.logprobs is False else int(req.logprobs)
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise APIError(400, "logprobs: must be between 0 and 20", param="logprobs")
    return logprobs


def completion_budget(req: SamplingFields, prompt_len: int, limit: int) -> int:
    """max_tokens for the request: as asked, or what the context leaves; too long a request is a 400."""
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if prompt_len >= limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens, but the prompt has {prompt_len} tokens",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return limit - prompt_len
    if prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens, but you asked for {prompt_len + max_tokens} "
            f"({prompt_len} in the prompt, {max_tokens} in the completion); lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def stop_strings(req: SamplingFields) -> list[str]:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", param="stop")
    return stop


def check_stop_token_ids(req: SamplingFields, vocab: int) -> None:
    for t in req.stop_token_ids or []:
        if not 0 <= t < vocab:
            raise APIError(
                400, f"stop_token_ids: {t} is outside the vocabulary [0, {vocab})", param="stop_token_ids"
            )


def _setting(req: SamplingFields, defaults: dict[str, float], name: str, default: float) -> float:
    """The request's value, else the model's generation_config.json value, else the OpenAI default."""
    value = getattr(req, name)
    return value if value is not None else defaults.get(name, default)
