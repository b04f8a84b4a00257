"""A chat box's content as the OpenAI API takes it: text and attached images (checked, inlined as data URLs),
the thinking switch, a whole history as messages, and the checks of a turn before it is sent. Deploy & Chat
and Compare's A/B chat both use it."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

from studio.ui.context import refusal
from studio.ui.i18n import text

# An attached image's size limit. Its base64 (4/3 of it) still fits the REST API's JSON body limit
# (studio.api.body_limits.MAX_JSON_BYTES), so what the UI sends in one turn could be sent through REST too.
MAX_IMAGE_MB = 20
MAX_IMAGE_BYTES = MAX_IMAGE_MB * 2**20
# The message box's value once a turn is taken: no text, no attachments.
EMPTY_MESSAGE: dict[str, Any] = {"text": "", "files": []}


def message_text(content: Any) -> str:
    """A Chatbot message's content as plain text (Gradio 6 hands back a list of ``{type, text}`` parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def message_images(content: Any) -> list[str]:
    """The files (attached images) a Chatbot message shows, as server paths in their order."""
    if not isinstance(content, list):
        return []
    paths = []
    for part in content:
        file = part.get("file") if isinstance(part, dict) and part.get("type") == "file" else None
        path = file.get("path") if isinstance(file, dict) else None
        if isinstance(path, str) and path:
            paths.append(path)
    return paths


def image_mime(path: str | Path) -> str | None:
    """An image file's MIME type from its header (PIL raises ``OSError`` when the file is not an image)."""
    with Image.open(path) as image:
        return Image.MIME.get(image.format or "")


def image_problem(path: str | Path, lang: str = "en") -> str | None:
    """Why the file at ``path`` cannot be attached to a chat message (too large, not an image); None if fine."""
    name = Path(path).name
    size = Path(path).stat().st_size
    if size > MAX_IMAGE_BYTES:
        return text("dep.err.too_large", lang).format(name=name, size=size / 2**20, limit=MAX_IMAGE_MB)
    try:
        mime = image_mime(path)
    except Image.DecompressionBombError:
        return text("dep.err.too_many_pixels", lang).format(name=name)
    except (OSError, ValueError):  # PIL's UnidentifiedImageError is an OSError
        mime = None
    return None if mime else text("dep.err.not_image", lang).format(name=name)


def image_data_url(path: str | Path, lang: str = "en") -> str:
    """An image file as the ``data:`` URL OpenAI ``image_url`` parts carry (the model server fetches nothing)."""
    name = Path(path).name
    try:
        data = Path(path).read_bytes()
        mime = image_mime(path)
    except FileNotFoundError:
        raise refusal(text("dep.err.image_gone", lang).format(name=name)) from None
    except (OSError, ValueError, Image.DecompressionBombError):
        mime = None
    if not mime:
        raise refusal(text("dep.err.not_image", lang).format(name=name))
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def openai_content(content: Any, lang: str = "en") -> str | list[dict[str, Any]]:
    """A Chatbot message's content as OpenAI content: plain text, or its images as data URLs before its text."""
    words = message_text(content)
    images = message_images(content)
    if not images:
        return words
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_data_url(p, lang)}} for p in images
    ]
    return [*parts, {"type": "text", "text": words}] if words else parts


def thinking_fields(thinking: bool) -> dict[str, Any]:
    """The chat request fields of the thinking choice: asked for, it goes to the chat template; left off, the
    deployment's own default stays (the studio turns it off for FastDeploy's VL models)."""
    return {"chat_template_kwargs": {"enable_thinking": True}} if thinking else {}


def chat_messages(system: str, history: list[dict[str, Any]], lang: str = "en") -> list[dict[str, Any]]:
    """Chatbot history -> OpenAI messages (system prompt first when given); earlier turns keep their images."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system and system.strip() else []
    for m in history:
        if m.get("role") in ("user", "assistant"):
            msgs.append({"role": m["role"], "content": openai_content(m.get("content"), lang)})
    return msgs


def turn_problem(
    files: list[str], history: list[dict[str, Any]], reads_images: bool, lang: str
) -> str | None:
    """Why a turn with ``files`` attached cannot go to the deployment; None when it can."""
    if files and not reads_images:
        names = ", ".join(Path(f).name for f in files)
        return text("dep.err.text_only", lang).format(names=names)
    if not reads_images and any(message_images(m.get("content")) for m in history):
        return text("dep.err.history_images", lang)
    return next((p for p in (image_problem(f, lang) for f in files) if p), None)


def user_turn(
    message: dict[str, Any] | str | None,
    history: list[dict[str, Any]],
    reads_images: bool,
    lang: str = "en",
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The typed message and its attached images join the history, and the box empties.

    A turn the deployment cannot take (images for a text model, too large a file, not an image) is refused
    with a message saying why, and stays in the box.
    """
    if isinstance(message, dict):
        words, files = message.get("text") or "", list(message.get("files") or [])
    else:
        words, files = message or "", []
    if not words.strip() and not files:
        raise refusal(text("dep.err.empty", lang))
    problem = turn_problem(files, history, reads_images, lang)
    if problem:
        raise refusal(problem)
    if not files:
        return EMPTY_MESSAGE, [*history, {"role": "user", "content": words}]
    content: list[dict[str, Any]] = [
        {
            "type": "file",
            "file": {"path": f, "mime_type": image_mime(f), "orig_name": Path(f).name},
            "alt_text": Path(f).name,
        }
        for f in files
    ]
    if words.strip():
        content.append({"type": "text", "text": words})
    return EMPTY_MESSAGE, [*history, {"role": "user", "content": content}]


def with_task_prompt(prompt: str | None, message: dict[str, Any] | str | None) -> Any:
    """A task prompt was picked: it becomes the message's text (attached images stay); the model reads the
    prompt as it was trained with it, so nothing is added to it."""
    if not prompt:
        return gr.skip()
    files = list(message.get("files") or []) if isinstance(message, dict) else []
    return {"text": prompt, "files": files}


def clear_choice() -> Any:
    return gr.update(value=None)


def empty_chat() -> list[dict[str, Any]]:
    return []
