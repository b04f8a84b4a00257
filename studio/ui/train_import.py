"""The Train tab's "Import a YAML": an ERNIEKit training config, uploaded or pasted, fills the form.

Reading and mapping the file is ``studio.services.config_import`` (the REST API's too); here its result
becomes form values, with the conversions Clone into Train uses (``train_form.form_value``), and a summary:
the datasets matched and missing, the model, the keys the engine announces, the ones without effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from studio.services import datasets as datasets_svc
from studio.services.config_import import MAX_IMPORT_BYTES, ImportedConfig, import_train_yaml
from studio.ui.context import UIContext, refusal_lines
from studio.ui.datasets_tab import dataset_choices
from studio.ui.i18n import DEFAULT_LANGUAGE, Texts, current_language, localize_message, text
from studio.ui.train_form import form_defaults, form_value, probs_text, unmet_text


@dataclass
class ImportBox:
    file: gr.File
    text: gr.Code
    button: gr.Button
    status: gr.Markdown


def build_import_box(t: Texts) -> ImportBox:
    """A folded box: a .yaml / .yml upload, a paste area and its button, and what the import did."""
    with t.make(gr.Accordion, "tr.import", open=False, elem_id="tr-import"):
        file = t.make(
            gr.File, "tr.import.file", file_types=[".yaml", ".yml"], type="filepath", elem_id="tr-import-file"
        )
        pasted = t.make(gr.Code, "tr.import.text", language="yaml", lines=6, elem_id="tr-import-text")
        button = t.make(gr.Button, "tr.import.btn", prop="value", size="sm", elem_id="tr-import-btn")
        status = gr.Markdown("", elem_id="tr-import-status")
    return ImportBox(file, pasted, button, status)


def imported_form_values(imported: ImportedConfig, keys: list[str], datasets: list[Any]) -> list[Any]:
    """An import -> one value per form field (``keys`` order): every training key at the file's value, the
    rest at the engine's defaults for its stage and fine-tuning (as Clone into Train fills them); the datasets
    matched, with fresh choices; the base model when one matched; run name, devices and the evaluation
    after training as they were."""
    values = form_defaults(imported.stage, imported.fine_tuning)
    values |= {k: form_value(k, v) for k, v in imported.hyperparameters.items() if k in values}
    choices = dataset_choices(datasets)
    values["dataset_ids"] = gr.update(choices=choices, value=imported.dataset_ids)
    values["eval_dataset_ids"] = gr.update(choices=choices, value=imported.eval_dataset_ids)
    values["dataset_probs"] = probs_text(imported.dataset_probs)
    if imported.base_model:
        values["base_model"] = imported.base_model
    return [values.get(k, gr.skip()) for k in keys]


def import_summary(imported: ImportedConfig, lang: str = DEFAULT_LANGUAGE) -> str:
    """What the import did, as the box shows it: choices, model, datasets (missing ones first), then the keys
    the studio sets itself, the ones without effect on this run and the ones the engine announces."""
    lines = [
        text(
            "tr.import.done",
            lang,
            n=len(imported.hyperparameters),
            stage=imported.stage,
            fine_tuning=imported.fine_tuning,
            compute_type=imported.compute_type,
        )
    ]
    if imported.model_path:
        key = "tr.import.model.found" if imported.base_model else "tr.import.model.missing"
        lines.append(f"- {text(key, lang, path=imported.model_path, name=imported.base_model)}")
    missing = imported.missing
    if missing:
        lines.append(f"\n**{text('tr.import.missing', lang, n=len(missing))}**")
        for m in missing:
            key = "tr.import.dataset.text" if m.key == "text_dataset_path" else "tr.import.dataset.missing"
            lines.append(f"- `{m.key}` {_line(m.line, lang)}`{m.path}`: {text(key, lang)}")
    found = [m for m in imported.datasets if m.dataset_id is not None]
    if found:
        lines.append(f"\n**{text('tr.import.found', lang)}**")
        for m in found:
            shown = f"- `{m.key}` `{m.path}` → #{m.dataset_id} {m.dataset_name}"
            if m.dataset_format and m.file_format and m.dataset_format != m.file_format:
                shown += " · " + text("tr.import.format", lang, file=m.file_format, detected=m.dataset_format)
            lines.append(shown)
    sections = [
        ("tr.import.studio", [(k, text(f"tr.import.set.{k}", lang)) for k, _, _ in imported.studio_set]),
        ("tr.import.na", [(k, unmet_text(reasons, lang)) for k, reasons in imported.not_applied]),
        ("tr.import.notices", [(k, localize_message(m, lang)) for k, m in imported.notices]),
    ]
    for title, items in sections:
        if items:
            lines.append(f"\n<details><summary>{text(title, lang, n=len(items))}</summary>\n")
            lines += [f"- `{k}`: {why}" for k, why in items]
            lines.append("\n</details>")
    return "\n".join(lines)


def _line(line: int | None, lang: str) -> str:
    return f"({text('tr.import.line', lang, line=line)}) " if line else ""


class ImportHandlers:
    """Import events: a file or pasted text in, one value per form field and the summary out."""

    def __init__(self, ctx: UIContext, keys: list[str]):
        self.ctx = ctx
        self.keys = keys

    def import_text(self, pasted: str | None) -> list[Any]:
        return self._import(pasted or "", "pasted YAML")

    def import_file(self, path: str | None) -> list[Any]:
        if not path:
            return self._unchanged("")
        # Gradio's own copy of the upload; read one byte past the limit so the service names the size.
        with open(path, "rb") as f:
            data = f.read(MAX_IMPORT_BYTES + 1)
        return self._import(data, Path(path).name)

    def _import(self, data: str | bytes, source: str) -> list[Any]:
        lang = current_language()
        imported, err = self.ctx.attempt(import_train_yaml, self.ctx.settings, data, source)
        if err is not None:
            message = "\n".join(f"- {localize_message(m, lang)}" for m in refusal_lines(err))
            return self._unchanged(f"**{text('tr.import.failed', lang)}**\n\n{message}")
        datasets = self.ctx.read(datasets_svc.list_datasets, default=[])
        return [*imported_form_values(imported, self.keys, datasets), import_summary(imported, lang)]

    def _unchanged(self, status: str) -> list[Any]:
        return [*(gr.skip() for _ in self.keys), status]
