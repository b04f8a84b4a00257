"""The base-model picker's Download action: fetch an official checkpoint into home/models on a worker and
follow its progress (the same service functions as `POST /api/v1/models/downloads`)."""

from __future__ import annotations

from typing import Any

import gradio as gr

from studio.services import downloads as downloads_svc
from studio.services import models as models_svc
from studio.ui.context import UIContext, model_choices, refusal
from studio.ui.i18n import Texts, current_language, localize_message, status_text, text

POLL_SECONDS = 2.0


def _size(n: int | None) -> str:
    if not n:
        return "0 MB"
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.1f} MB"


def _selected(ctx: UIContext, base_model: str | None) -> dict[str, Any] | None:
    """The /models entry of the picked model, when it is an official one."""
    models = ctx.read(models_svc.list_models, ctx.settings, default=[])
    return next((m for m in models if m["name"] == base_model and m["kind"] == "official"), None)


def _latest(ctx: UIContext, model: dict[str, Any]) -> Any:
    downloads = ctx.read(downloads_svc.list_downloads, default=[])
    return next((d for d in downloads if d.model_dir == model["path"]), None)


def download_text(ctx: UIContext, base_model: str | None) -> tuple[str, bool]:
    """What the picker says of the picked model's download, and whether one is under way."""
    model = _selected(ctx, base_model)
    if model is None:
        return "", False
    lang, name = current_language(), model["name"]
    params = model.get("num_parameters")
    size = text("dl.msg.params", lang, n=params / 1e9) if params else text("dl.msg.official", lang)
    if model["available"]:
        return text("dl.msg.downloaded", lang, name=name, size=size, path=model["path"]), False
    active = model.get("download")
    if active:
        done, total = active.get("bytes_done") or 0, active.get("bytes_total")
        if active["status"] == "queued" or not total:
            return text("dl.msg.listing", lang, name=name, status=status_text(active["status"], lang)), True
        shown = text(
            "dl.msg.progress", lang, name=name, share=done / total, done=_size(done), total=_size(total)
        )
        return shown, True
    last = _latest(ctx, model)
    if last is not None and last.status == "failed":
        return text("dl.msg.failed", lang, name=name, error=localize_message(last.error or "", lang)), False
    return text("dl.msg.missing", lang, name=name, size=size), False


def show_download(ctx: UIContext, base_model: str | None) -> tuple[str, Any]:
    """The progress line for the picked model, with the timer on while its download runs."""
    text, active = download_text(ctx, base_model)
    return text, gr.Timer(active=active)


def start_download(ctx: UIContext, base_model: str | None) -> tuple[str, Any]:
    """Queue the download of the picked official model; the timer follows it."""
    model = _selected(ctx, base_model)
    if model is None:
        raise refusal(text("dl.err.not_official", current_language()))
    if not model["available"] and not model.get("download"):
        ctx.call(downloads_svc.create_download, ctx.settings, model["name"])
        gr.Info(text("dl.msg.started", current_language(), name=model["name"]))
    return show_download(ctx, base_model)


def follow_download(ctx: UIContext, base_model: str | None) -> tuple[str, Any, Any]:
    """A timer tick: the progress text, the timer kept on while it runs, fresh picker choices when done."""
    text, active = download_text(ctx, base_model)
    if active:
        return text, gr.Timer(active=True), gr.update()
    choices = model_choices(ctx.read(models_svc.list_models, ctx.settings, default=[]), current_language())
    return text, gr.Timer(active=False), gr.update(choices=choices)


def build_download_row(ctx: UIContext, t: Texts, base_model: gr.Dropdown) -> None:
    """The Download button and its progress line under the base-model picker, wired."""
    with gr.Row():
        button = t.make(gr.Button, "tr.download", prop="value", size="sm", elem_id="tr-download", scale=1)
        status = gr.Markdown("", elem_id="tr-download-status")
    timer = gr.Timer(POLL_SECONDS, active=False)
    button.click(lambda m: start_download(ctx, m), base_model, [status, timer])
    timer.tick(
        lambda m: follow_download(ctx, m), base_model, [status, timer, base_model], show_progress="hidden"
    )
    base_model.change(lambda m: show_download(ctx, m), base_model, [status, timer], show_progress="hidden")
