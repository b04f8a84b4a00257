"""Datasets tab: upload (a data file, or a .zip with its images), detected format, problems by line,
paginated raw / rendered preview with a VL record's images, token lengths."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd
from PIL import Image

from engine.messages import Message
from studio.services import datasets as datasets_svc
from studio.services import models as models_svc
from studio.services.errors import ServiceError
from studio.ui import charts
from studio.ui.context import UIContext, fmt_time, model_choices, parse_id, refusal
from studio.ui.i18n import DEFAULT_LANGUAGE, Texts, current_language, localize_message, text

# "auto" lets the studio detect the format; the rest are the engine's readers and benchmark files.
FORMATS = ["auto", *datasets_svc.DATASET_FORMATS]
DATASET_COLUMNS = ["id", "name", "format", "kind", "records", "valid", "problems", "uploaded"]
PROBLEM_COLUMNS = ["line", "problem"]
TRAINED_COLOR = "#f97316"


def trained_label(lang: str = DEFAULT_LANGUAGE) -> str:
    """The legend's name for the part that carries loss."""
    return text("ds.span.trained", lang)


def span_colors(lang: str = DEFAULT_LANGUAGE) -> dict[str, str]:
    """The legend lists every colour-mapped category, so only the trained part is mapped; DPO previews'
    "chosen" and "rejected" answers get Gradio's own colours and show in the legend only when present."""
    return {trained_label(lang): TRAINED_COLOR}


@dataclass
class DatasetsTab:
    tab: gr.Tab
    selected: gr.Dropdown
    table: gr.Dataframe
    refresh: gr.Button


def dataset_rows(datasets: list[Any]) -> pd.DataFrame:
    rows = [
        [
            d.id,
            d.name,
            d.format,
            d.kind,
            d.num_records,
            d.num_valid,
            len(d.problems or []),
            fmt_time(d.created_at),
        ]
        for d in datasets
    ]
    return pd.DataFrame(rows, columns=DATASET_COLUMNS)


def dataset_choices(datasets: list[Any]) -> list[tuple[str, int]]:
    return [(f"#{d.id} {d.name} ({d.format}, {d.num_records})", d.id) for d in datasets]


PROBLEM_RE = re.compile(r"^(?P<file>.*?):(?P<line>\d+): (?P<message>.*)$", re.S)


def problem_rows(problems: list[Any], lang: str = DEFAULT_LANGUAGE) -> pd.DataFrame:
    """``file:line: message`` problems (keyed messages, strings or dicts) -> one row per problem, line number
    in its own column, the message in ``lang``."""
    rows = []
    for p in problems or []:
        if isinstance(p, Message) and p.key == "media.at_line":
            rows.append([p.fields["line"], localize_message(p.fields["msg"], lang)])
            continue
        if isinstance(p, dict):
            rows.append([p.get("line", ""), localize_message(str(p.get("message", "")), lang)])
            continue
        m = PROBLEM_RE.match(str(p))
        rows.append(
            [int(m["line"]), localize_message(m["message"], lang)]
            if m
            else ["", localize_message(p if isinstance(p, str) else str(p), lang)]
        )
    return pd.DataFrame(rows, columns=PROBLEM_COLUMNS)


def summary_markdown(d: Any, lang: str = DEFAULT_LANGUAGE) -> str:
    bad = d.num_records - d.num_valid
    verdict = (
        text("ds.msg.all_valid", lang)
        if not (d.problems or [])
        else text("ds.msg.some_invalid", lang, bad=bad, records=d.num_records)
    )
    head = text(
        "ds.msg.summary",
        lang,
        name=d.name,
        filename=d.filename,
        kib=d.size_bytes / 1024,
        format=d.format,
        kind=d.kind,
        records=d.num_records,
        valid=d.num_valid,
    )
    media = _media_line(getattr(d, "media_fetch", None), lang)
    return f"{head}  \n{verdict}" + (f"  \n{media}" if media else "")


def _media_line(fetch: Any, lang: str) -> str:
    """Where the worker's fetch of the images the records name by URL stands (empty when they name none)."""
    if fetch is None:
        return ""
    if fetch.status in ("queued", "running"):
        return text("ds.msg.media_pending", lang, done=fetch.urls_done, total=fetch.urls_total)
    if fetch.status == "succeeded":
        fetched = fetch.urls_total - len(fetch.failed or {})
        return text("ds.msg.media_done", lang, fetched=fetched, total=fetch.urls_total)
    return text("ds.msg.media_failed", lang, error=localize_message(fetch.error or "", lang))


def rendered_spans(spans: list[dict[str, Any]], lang: str = DEFAULT_LANGUAGE) -> list[tuple[str, str | None]]:
    """``render_record`` spans -> HighlightedText value: the trained (loss) part highlighted."""
    trained = trained_label(lang)
    return [(s["text"], s.get("label") or (trained if s.get("trained") else None)) for s in spans]


def stats_markdown(stats: dict[str, Any], max_seq_len: int, lang: str = DEFAULT_LANGUAGE) -> str:
    """Summary of ``dataset_stats``: lengths, truncated share at ``max_seq_len``, trained share, turns."""
    share = 100.0 * float(stats.get("truncated_share") or 0.0)
    parts = [text("ds.msg.stats_samples", lang, n=stats.get("num_valid", stats.get("num_records", 0)))]
    for key in ("mean", "p50", "p95", "max"):
        value = stats.get(f"{key}_length")
        if isinstance(value, int | float):
            parts.append(f"{text(f'ds.stat.{key}', lang)} **{value:.0f}**")
    lines = [" · ".join(parts) + text("ds.msg.stats_tokens", lang)]
    lines.append(text("ds.msg.stats_truncated", lang, share=share, max_seq_len=max_seq_len))
    if isinstance(stats.get("trained_share"), int | float):
        lines.append(text("ds.msg.stats_trained", lang, share=100 * stats["trained_share"]))
    turns = stats.get("turns_per_sample")
    if isinstance(turns, dict) and turns:
        shown = ", ".join(f"{k}: {v}" for k, v in turns.items())
        lines.append(text("ds.msg.stats_turns", lang, turns=shown))
    return "  \n".join(lines)


def _open_image(path: Path) -> Image.Image:
    with Image.open(path) as im:
        return im.convert("RGB")


def _pending_image() -> Image.Image:
    """The gallery's stand-in for an image not fetched yet."""
    return Image.new("RGB", (64, 64), (200, 200, 200))


def record_view(
    page: dict[str, Any], index: int, lang: str = DEFAULT_LANGUAGE
) -> tuple[str, list[tuple[str, str | None]], str]:
    """A ``preview_dataset`` page of one record -> (position line, highlighted template, raw JSON)."""
    total = page.get("total")
    if not page["records"]:
        return text("ds.msg.no_record", lang, n=index + 1, total=total), [], ""
    spans = (page.get("rendered") or [None])[0]
    position = text("ds.msg.position", lang, n=index + 1, total=total if total is not None else "?")
    if spans:
        highlighted = rendered_spans(spans, lang)
    else:
        highlighted = [(page.get("render_error") or text("ds.msg.pick_tokenizer", lang), None)]
    return position, highlighted, json.dumps(page["records"][0], ensure_ascii=False, indent=2)


def rejected_upload(
    filename: str, err: ServiceError, lang: str = DEFAULT_LANGUAGE
) -> tuple[str, pd.DataFrame]:
    """A refused upload's headline and its problems, one row per line, shown next to the upload."""
    details = err.details if isinstance(err.details, dict) else {}
    found = details.get("problems") or [err.message]
    head = text("ds.msg.not_added", lang, filename=filename, n=len(found))
    if details.get("format"):
        head += text(
            "ds.msg.not_added_format", lang, format=details["format"], kind=details.get("kind") or "?"
        )
    return head, problem_rows(found, lang)


def previous_record(index: Any) -> int:
    return max(int(index or 0) - 1, 0)


def next_record(index: Any) -> int:
    return max(int(index or 0) + 1, 0)


class DatasetsHandlers:
    """The Datasets tab's event handlers: component values in, plain values out."""

    def __init__(self, ctx: UIContext):
        self.ctx = ctx

    def refresh_list(self, current: Any) -> tuple[Any, pd.DataFrame]:
        """Dataset choices (keeping ``current``, else the newest) and the table rows."""
        items = self.ctx.read(datasets_svc.list_datasets, default=[])
        keep = parse_id(current)
        value = keep if keep in {d.id for d in items} else (items[0].id if items else None)
        return gr.update(choices=dataset_choices(items), value=value), dataset_rows(items)

    def relabel_list(self, current: Any) -> tuple[Any, pd.DataFrame]:
        """The table and choices again (after a language switch), the picked dataset kept."""
        update, rows = self.refresh_list(current)
        update.pop("value", None)
        return update, rows

    def on_select(self, current: Any) -> tuple[Any, pd.DataFrame]:
        update, rows = self.refresh_list(current)
        if parse_id(current) is not None:
            update.pop("value", None)  # may land after the person picked another dataset
        return update, rows

    def show_dataset(self, dataset_id: Any) -> tuple[Any, ...]:
        """(summary, problems, record offset, browser state, stats, histogram) of the picked dataset."""
        did = parse_id(dataset_id)
        if did is None:
            return "", problem_rows([]), 0, did, "", charts.empty_histogram()
        d, err = self.ctx.attempt(datasets_svc.get_dataset, did)
        if err is not None:
            shown = localize_message(err.message, current_language())
            return f"⚠️ {shown}", problem_rows([]), 0, None, "", charts.empty_histogram()
        lang = current_language()
        return summary_markdown(d, lang), problem_rows(d.problems, lang), 0, did, "", charts.empty_histogram()

    def show_summary(self, dataset_id: Any) -> str:
        """The picked dataset's summary alone (after a language switch)."""
        did = parse_id(dataset_id)
        d = self.ctx.read(datasets_svc.get_dataset, did, default=None) if did is not None else None
        return summary_markdown(d, current_language()) if d is not None else gr.skip()

    def show_record(self, dataset_id: Any, index: Any, model: str | None) -> tuple[Any, ...]:
        """(position, rendered template, raw JSON, images) of record ``index``."""
        lang = current_language()
        did = parse_id(dataset_id)
        colors = span_colors(lang)
        if did is None:
            return "", gr.update(value=[], color_map=colors), "", gr.update(value=None, visible=False)
        idx = max(int(index or 0), 0)
        page = self._preview_page(did, idx, model)
        position, highlighted, raw = record_view(page, idx, lang)
        rendered = gr.update(value=highlighted, color_map=colors)
        if not page["records"]:
            return position, rendered, raw, gr.update(value=None, visible=False)
        return position, rendered, raw, self._record_gallery(did, page["records"][0])

    def _preview_page(self, did: int, idx: int, model: str | None) -> dict[str, Any]:
        ctx = self.ctx
        ds = ctx.read(datasets_svc.get_dataset, did, default=None)
        if ds is not None and ds.kind == datasets_svc.BENCHMARK:  # nothing to render: the raw question
            page = ctx.call(datasets_svc.preview_dataset, ctx.settings, did, offset=idx, limit=1)
            page["render_error"] = text("ds.msg.benchmark_render", current_language(), format=ds.format)
            return page
        page, err = ctx.attempt(
            datasets_svc.preview_dataset, ctx.settings, did, offset=idx, limit=1, render_with=model or None
        )
        if err is not None:
            # Rendering needs the tokenizer; show the raw record even when the model cannot be loaded.
            page = ctx.call(datasets_svc.preview_dataset, ctx.settings, did, offset=idx, limit=1)
            page["render_error"] = localize_message(err.message, current_language())
        return page

    def _record_gallery(self, did: int, record: Any) -> Any:
        ds = self.ctx.read(datasets_svc.get_dataset, did, default=None)
        images = datasets_svc.record_images(self.ctx.settings, ds, record) if ds is not None else []
        # Opened here and handed over as images: Gradio only serves files from its own allowed folders. An
        # image named by URL that the dataset's fetch job has not fetched yet is shown as such, never fetched.
        lang = current_language()
        shown = [
            (_open_image(p), name)
            if p is not None
            else (_pending_image(), text("ds.msg.not_fetched", lang, url=name))
            for p, name in images
        ]
        return gr.update(value=shown or None, visible=bool(shown))

    def upload(self, path: str | None, name_value: str, format_value: str) -> tuple[Any, ...]:
        """(result, problems, summary, dropdown, table, file, name, stored pick) after validating an upload.

        The page stores the new dataset as the open one in this response: a reload right after the upload
        reopens it (the dropdown's change event stores it too, but a round trip later)."""
        lang = current_language()
        if not path:
            raise refusal(text("ds.err.no_file", lang))
        ctx = self.ctx
        filename = Path(path).name
        d, err = ctx.attempt(
            datasets_svc.upload_dataset,
            ctx.settings,
            path,
            filename,
            name=name_value or None,
            format=None if format_value in (None, "", "auto") else format_value,
        )
        items = ctx.read(datasets_svc.list_datasets, default=[])
        if err is not None:
            head, problems = rejected_upload(filename, err, lang)
            choices = gr.update(choices=dataset_choices(items))
            return head, problems, "", choices, dataset_rows(items), gr.update(), gr.update(), gr.update()
        gr.Info(text("ds.msg.added_info", lang, name=d.name, records=d.num_records, format=d.format))
        return (
            text("ds.msg.added", lang, name=d.name, format=d.format, kind=d.kind, records=d.num_records),
            problem_rows(d.problems, lang),
            summary_markdown(d, lang),
            gr.update(choices=dataset_choices(items), value=d.id),
            dataset_rows(items),
            None,
            "",
            d.id,
        )

    def compute_stats(self, dataset_id: Any, model: str, seq_len: Any) -> tuple[str, pd.DataFrame]:
        lang = current_language()
        did = parse_id(dataset_id)
        if did is None:
            raise refusal(text("ds.err.no_dataset", lang))
        if not model:
            raise refusal(text("ds.err.no_model", lang))
        seq = int(seq_len or 512)
        stats = self.ctx.call(
            datasets_svc.dataset_stats, self.ctx.settings, did, model=model, max_seq_len=seq
        )
        return stats_markdown(stats, seq, lang), charts.histogram_frame(stats)

    def auto_stats(self, dataset_id: Any, model: str | None, seq_len: Any) -> Iterator[tuple[Any, Any]]:
        """Token lengths of the dataset just shown or uploaded, without a click: a line saying they are being
        counted first (a large file takes a while; the page stays usable), then the numbers. A failure (say,
        the tokenizer's model is missing) is shown in the stats box instead of as an error."""
        lang = current_language()
        did = parse_id(dataset_id)
        d = self.ctx.read(datasets_svc.get_dataset, did, default=None) if did is not None else None
        if d is None or not model:
            yield gr.skip(), gr.skip()
            return
        if d.kind == datasets_svc.BENCHMARK:
            yield text("ds.msg.benchmark_stats", lang, format=d.format), charts.empty_histogram()
            return
        seq = int(seq_len or 512)
        yield text("ds.msg.stats_counting", lang, records=d.num_records, model=model), gr.skip()
        stats, err = self.ctx.attempt(
            datasets_svc.dataset_stats, self.ctx.settings, did, model=model, max_seq_len=seq
        )
        if err is not None:
            yield f"⚠️ {localize_message(err.message, lang)}", charts.empty_histogram()
            return
        yield stats_markdown(stats, seq, lang), charts.histogram_frame(stats)

    def delete(self, dataset_id: Any) -> tuple[Any, ...]:
        lang = current_language()
        did = parse_id(dataset_id)
        if did is None:
            raise refusal(text("ds.err.no_dataset_delete", lang))
        self.ctx.call(datasets_svc.delete_dataset, self.ctx.settings, did)
        gr.Info(text("ds.msg.deleted", lang, id=did))
        return self.refresh_list(None)

    def refresh_models(self, current: str | None) -> Any:
        models = self.ctx.read(models_svc.list_models, self.ctx.settings, default=[])
        choices = model_choices(models, current_language())
        return gr.update(choices=choices, value=current or (choices[0][1] if choices else None))


# ---- layout ----------------------------------------------------------------------------------------------


def _upload_column(t: Texts) -> dict[str, Any]:
    """Upload form, the dataset picker and the list of datasets."""
    upload = t.make(
        gr.File,
        "ds.upload",
        file_types=[".jsonl", ".json", ".zip", ".csv", ".tsv"],
        elem_id="ds-upload",
        height=120,
    )
    with gr.Row():
        name = t.make(gr.Textbox, "ds.name", elem_id="ds-name")
        fmt = t.make(gr.Dropdown, "ds.format", choices=FORMATS, value="auto", elem_id="ds-format")
    upload_btn = t.make(gr.Button, "ds.upload_btn", prop="value", variant="primary", elem_id="ds-upload-btn")
    upload_result = gr.Markdown("", elem_id="ds-upload-result")
    with gr.Row(equal_height=True):
        selected = t.make(gr.Dropdown, "ds.select", choices=[], elem_id="ds-select", scale=4)
        refresh = t.make(gr.Button, "ds.refresh", prop="value", size="sm", scale=1, elem_id="ds-refresh")
    table = t.make(
        gr.Dataframe,
        "ds.list",
        headers=DATASET_COLUMNS,
        interactive=False,
        elem_id="ds-table",
        wrap=True,
        max_height=260,
    )
    delete = t.make(gr.Button, "ds.delete", prop="value", variant="stop", size="sm", elem_id="ds-delete")
    return {
        "upload": upload,
        "name": name,
        "fmt": fmt,
        "upload_btn": upload_btn,
        "upload_result": upload_result,
        "selected": selected,
        "refresh": refresh,
        "table": table,
        "delete": delete,
    }


def _record_browser(t: Texts) -> dict[str, Any]:
    """Tokenizer picker, record paging, and the rendered / raw views of one record."""
    tokenizer_model = t.make(
        gr.Dropdown, "ds.tokenizer", choices=[], value="tiny", allow_custom_value=True, elem_id="ds-tokenizer"
    )
    with gr.Row(equal_height=True):
        prev_btn = t.make(gr.Button, "ds.prev", prop="value", size="sm", elem_id="ds-prev")
        offset = t.make(gr.Number, "ds.offset", value=0, precision=0, minimum=0, elem_id="ds-offset")
        next_btn = t.make(gr.Button, "ds.next", prop="value", size="sm", elem_id="ds-next")
    position = gr.Markdown("", elem_id="ds-position")
    with gr.Tabs():
        with t.make(gr.Tab, "ds.view.rendered", id="rendered"):
            rendered = gr.HighlightedText(
                show_label=False,
                color_map=span_colors(),
                show_legend=True,
                combine_adjacent=True,
                elem_id="ds-rendered",
            )
            # A VL record's images (from a .zip upload), next to the template that names them.
            images = t.make(
                gr.Gallery,
                "ds.images",
                columns=4,
                height=180,
                object_fit="contain",
                visible=False,
                elem_id="ds-images",
            )
        with t.make(gr.Tab, "ds.view.raw", id="raw"):
            raw = gr.Code(language="json", show_label=False, elem_id="ds-raw", lines=8)
    return {
        "tokenizer_model": tokenizer_model,
        "prev_btn": prev_btn,
        "offset": offset,
        "next_btn": next_btn,
        "position": position,
        "rendered": rendered,
        "images": images,
        "raw": raw,
    }


def _stats_box(t: Texts) -> dict[str, Any]:
    with t.make(gr.Accordion, "ds.stats", open=True):
        with gr.Row(equal_height=True):
            max_seq_len = t.make(
                gr.Number,
                "ds.max_seq_len",
                value=512,
                precision=0,
                minimum=16,
                elem_id="ds-max-seq-len",
            )
            stats_btn = t.make(gr.Button, "ds.stats_btn", prop="value", elem_id="ds-stats-btn")
        stats_md = gr.Markdown("", elem_id="ds-stats")
        histogram = t.make(
            gr.BarPlot,
            "ds.histogram",
            x="tokens",
            y="samples",
            sort=None,
            height=260,
            x_label_angle=-45,
            elem_id="ds-histogram",
            also={"x_title": "plot.tokens", "y_title": "plot.samples"},
        )
    return {"max_seq_len": max_seq_len, "stats_btn": stats_btn, "stats_md": stats_md, "histogram": histogram}


def _inspect_column(t: Texts) -> dict[str, Any]:
    """Summary and problems of the picked dataset, its records, and its token lengths."""
    summary = gr.Markdown("", elem_id="ds-summary")
    problems = t.make(
        gr.Dataframe,
        "ds.problems",
        headers=PROBLEM_COLUMNS,
        interactive=False,
        elem_id="ds-problems",
        max_height=220,
        wrap=True,
        column_widths=["70px", "100%"],
    )
    return {"summary": summary, "problems": problems, **_record_browser(t), **_stats_box(t)}


def build_datasets_tab(ctx: UIContext, selected_state: gr.BrowserState) -> DatasetsTab:
    """Lay out the Datasets tab and wire its events."""
    t = ctx.texts
    with t.make(gr.Tab, "tab.datasets", id="datasets") as tab, gr.Row():
        with gr.Column(scale=2):
            c = _upload_column(t)
        with gr.Column(scale=3):
            c |= _inspect_column(t)
    h = DatasetsHandlers(ctx)
    selected, table = c["selected"], c["table"]
    record_io = (
        [selected, c["offset"], c["tokenizer_model"]],
        [c["position"], c["rendered"], c["raw"], c["images"]],
    )
    c["upload_btn"].click(
        h.upload,
        [c["upload"], c["name"], c["fmt"]],
        [
            c["upload_result"],
            c["problems"],
            c["summary"],
            selected,
            table,
            c["upload"],
            c["name"],
            selected_state,
        ],
        concurrency_limit=2,
        api_name="upload_dataset",  # a stable name for Gradio API clients (and the security tests)
    )
    c["refresh"].click(h.refresh_list, selected, [selected, table])
    shown = [c["summary"], c["problems"], c["offset"], selected_state, c["stats_md"], c["histogram"]]
    stats_io = ([selected, c["tokenizer_model"], c["max_seq_len"]], [c["stats_md"], c["histogram"]])
    # Token lengths follow every dataset shown (a pick, an upload, a restore) without a click.
    selected.change(h.show_dataset, selected, shown).then(h.show_record, *record_io).then(
        h.auto_stats, *stats_io, show_progress="hidden"
    )
    c["tokenizer_model"].input(h.show_record, *record_io)
    c["offset"].submit(h.show_record, *record_io)
    c["prev_btn"].click(previous_record, c["offset"], c["offset"]).then(h.show_record, *record_io)
    c["next_btn"].click(next_record, c["offset"], c["offset"]).then(h.show_record, *record_io)
    c["stats_btn"].click(h.compute_stats, *stats_io)
    # After a language switch, the text made at run time is made again in the new language.
    ctx.on_language(h.relabel_list, selected, [selected, table])
    ctx.on_language(h.show_summary, selected, c["summary"])
    ctx.on_language(h.show_record, *record_io)
    ctx.on_language(h.auto_stats, *stats_io)
    ctx.on_language(h.refresh_models, c["tokenizer_model"], c["tokenizer_model"], needs_selection=False)
    c["delete"].click(h.delete, selected, [selected, table])
    tab.select(h.on_select, selected, [selected, table], show_progress="hidden")
    # On page load the dataset the person had open before a refresh (browser state) comes back.
    ctx.demo.load(h.refresh_list, selected_state, [selected, table]).then(
        h.refresh_models, c["tokenizer_model"], c["tokenizer_model"]
    )
    return DatasetsTab(tab=tab, selected=selected, table=table, refresh=c["refresh"])
