"""The Train tab's "Start from": an ERNIEKit recipe (with the planner's verdict for the studio's nodes) or a
template saved from the form; and saving the form as a template, or deleting one.

A recipe fills the form as an import does (``studio.services.recipes`` reads it through the import service;
``train_import`` turns it into form values). A template is the run spec the form would launch
(``studio.services.templates``); it fills the form as Clone into Train does. The Train tab hands in its own
spec and form-value conversions (``spec_of``, ``values_of``) so both stay one function each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr

from studio.services import datasets as datasets_svc
from studio.services import recipes as recipes_svc
from studio.services import templates as templates_svc
from studio.services.runs import RunSpec
from studio.ui.context import UIContext, parse_id, refusal_lines
from studio.ui.datasets_tab import dataset_choices
from studio.ui.i18n import Texts, current_language, localize_message, text
from studio.ui.train_import import import_summary, imported_form_values


@dataclass
class StartBox:
    recipe: gr.Dropdown
    recipe_load: gr.Button
    verdict: gr.Markdown
    template: gr.Dropdown
    template_load: gr.Button
    template_delete: gr.Button
    template_name: gr.Textbox
    template_save: gr.Button
    status: gr.Markdown


def recipe_choices() -> list[str]:
    """The recipes by id (model, stage, fine-tuning, length: the same in every language)."""
    return [r.id for r in recipes_svc.list_recipes()]


def build_start_box(t: Texts) -> StartBox:
    """A folded box: recipes with their verdict, templates to load or delete, and saving the form as one."""
    with t.make(gr.Accordion, "tr.start", open=False, elem_id="tr-start"):
        with gr.Row():
            recipe = t.make(gr.Dropdown, "tr.recipe", choices=recipe_choices(), elem_id="tr-recipe", scale=3)
            recipe_load = t.make(
                gr.Button, "tr.recipe.load", prop="value", size="sm", elem_id="tr-recipe-load"
            )
        verdict = gr.Markdown("", elem_id="tr-recipe-verdict")
        with gr.Row():
            template = t.make(gr.Dropdown, "tr.template", choices=[], elem_id="tr-template", scale=3)
            template_load = t.make(
                gr.Button, "tr.template.load", prop="value", size="sm", elem_id="tr-template-load"
            )
            template_delete = t.make(
                gr.Button, "tr.template.delete", prop="value", size="sm", variant="stop",
                elem_id="tr-template-delete",
            )  # fmt: skip
        with gr.Row():
            name = t.make(
                gr.Textbox, "tr.template.name", max_lines=1, max_length=templates_svc.MAX_TEMPLATE_NAME,
                elem_id="tr-template-name", scale=3,
            )  # fmt: skip
            save = t.make(gr.Button, "tr.template.save", prop="value", size="sm", elem_id="tr-template-save")
        status = gr.Markdown("", elem_id="tr-start-status")
    return StartBox(
        recipe, recipe_load, verdict, template, template_load, template_delete, name, save, status
    )


def shown_name(name: str) -> str:
    """A person's template name inside Markdown: a code span, so no character of it is read as markup."""
    return "`" + name.replace("`", "'") + "`"


def format_verdict(recipe: recipes_svc.Recipe, verdict: dict[str, Any], lang: str) -> str:
    """The recipe's source and the planner's verdict for the studio's nodes, in ``lang``."""
    source = text(
        "tr.recipe.source",
        lang,
        path=recipe.source_path,
        commit=recipe.source_commit[:10],
        version=recipe.erniekit_version,
        shape=recipe.shape,
        seq=verdict["seq_len"],
    )
    status = verdict["status"]
    plan = verdict.get("plan") or {}
    node = (verdict.get("node") or {}).get("name") or ""
    fields: dict[str, Any] = {"node": node, "peak": verdict.get("peak_gib") or 0.0}
    lines = [source, ""]
    if status in ("fits", "proposal", "does_not_fit"):
        fields["cap"] = plan.get("device_memory_gib") or 0.0
    lines.append(text(f"tr.verdict.{status}", lang, **fields))
    shown = [*verdict.get("problems", [])]
    if status == "cannot_plan":
        shown.append(verdict["reason"])
    lines += [f"- {localize_message(message, lang)}" for message in shown]
    proposal = plan.get("proposal")
    if proposal and status != "fits":
        keys = ", ".join(f"{k}: {v}" for k, v in proposal["settings"].items())
        lines.append(
            text("tr.verdict.proposed", lang, keys=keys, peak=proposal["memory_gib"]["peak"],
                 cap=proposal["capacity_gib"])
        )  # fmt: skip
    rejected = plan.get("rejected") or []
    if (
        status == "does_not_fit" and rejected
    ):  # the planner's closest setting, as the Train tab's plan shows it
        closest = rejected[-1]
        devices = closest["settings"]["num_devices"]
        peak, cap = closest["memory_gib"]["peak"], closest["capacity_gib"]
        lines.append("- " + text("tr.plan.none", lang, devices=devices, peak=peak, cap=cap))
        option = plan.get("tensor_parallel_option")
        if option:
            lines.append("- " + what_if_text(plan, option, lang))
    return "\n".join(lines)


def what_if_text(plan: dict[str, Any], option: dict[str, Any], lang: str) -> str:
    """The parallelism a plan that does not fit would need (tensor, and pipeline where that alone is not
    enough), which this engine does not run."""
    tp, pp, peak = (
        plan["needs_tensor_parallel"],
        plan.get("needs_pipeline_parallel"),
        option["memory_gib"]["peak"],
    )
    if pp:
        return text("tr.plan.tp_pp", lang, tp=tp, pp=pp, peak=peak)
    return text("tr.plan.tp", lang, tp=tp, peak=peak)


class StartHandlers:
    """Recipe and template events: a recipe or template id in, one value per form field (``keys`` order) and
    what happened out."""

    def __init__(
        self,
        ctx: UIContext,
        keys: list[str],
        spec_of: Callable[[tuple[Any, ...]], RunSpec],
        values_of: Callable[[RunSpec, list[str]], list[Any]],
    ):
        self.ctx, self.keys, self.spec_of, self.values_of = ctx, keys, spec_of, values_of

    # ---- recipes

    def verdict(self, recipe_id: str | None) -> str:
        if not recipe_id:
            return ""
        lang = current_language()
        verdict, err = self.ctx.attempt(recipes_svc.recipe_verdict, self.ctx.settings, str(recipe_id))
        if err is not None:
            return localize_message(err.message, lang)
        return format_verdict(recipes_svc.get_recipe(str(recipe_id)), verdict, lang)

    def load_recipe(self, recipe_id: str | None) -> list[Any]:
        lang = current_language()
        if not recipe_id:
            return self._unchanged(text("tr.recipe.none", lang))
        imported, err = self.ctx.attempt(recipes_svc.load_recipe, self.ctx.settings, str(recipe_id))
        if err is not None:
            return self._unchanged(localize_message(err.message, lang))
        datasets = self.ctx.read(datasets_svc.list_datasets, default=[])
        return [*imported_form_values(imported, self.keys, datasets), import_summary(imported, lang)]

    # ---- templates

    def template_choices(self, chosen: Any = None) -> Any:
        items = self.ctx.read(templates_svc.list_templates, default=[])
        ids = {t.id for t in items}
        keep = parse_id(chosen) if chosen else None
        return gr.update(choices=[(t.name, t.id) for t in items], value=keep if keep in ids else None)

    def save_template(self, name: str | None, *values: Any) -> tuple[str, Any]:
        lang = current_language()
        try:
            spec = self.spec_of(values)
        except gr.Error as e:  # the form cannot make a run spec yet (no training data picked)
            return f"**{text('tr.template.failed', lang)}**\n\n- {e.message}", gr.skip()
        template, err = self.ctx.attempt(templates_svc.create_template, self.ctx.settings, name, spec)
        if err is not None:
            problems = "\n".join(f"- {localize_message(m, lang)}" for m in refusal_lines(err))
            return f"**{text('tr.template.failed', lang)}**\n\n{problems}", gr.skip()
        saved = text("tr.template.saved", lang, name=shown_name(template.name), id=template.id)
        return saved, self.template_choices(template.id)

    def load_template(self, template_id: Any) -> list[Any]:
        lang = current_language()
        tid = parse_id(template_id)
        if tid is None:
            return self._unchanged(text("tr.template.none", lang))
        view, err = self.ctx.attempt(templates_svc.get_template, tid)
        if err is not None:
            return self._unchanged(localize_message(err.message, lang))
        gone = {i for ids in view.missing_datasets.values() for i in ids}
        spec = view.spec
        kept = {
            "dataset_ids": [i for i in spec.dataset_ids if i not in gone],
            "eval_dataset_ids": [i for i in spec.eval_dataset_ids or [] if i not in gone] or None,
        }
        if spec.evaluate is not None:
            evals = [i for i in spec.evaluate.dataset_ids or [] if i not in gone] or None
            kept["evaluate"] = spec.evaluate.model_copy(update={"dataset_ids": evals})
        values = self.values_of(spec.model_copy(update=kept), self.keys)
        values[self.keys.index("name")] = spec.name or ""  # a template's run name, not a clone's
        choices = dataset_choices(self.ctx.read(datasets_svc.list_datasets, default=[]))
        for key in ("dataset_ids", "eval_dataset_ids"):
            values[self.keys.index(key)] = gr.update(choices=choices, value=kept[key] or [])
        lines = [text("tr.template.loaded", lang, name=shown_name(view.template.name))]
        if gone:
            lines.append(text("tr.template.missing", lang, ids=", ".join(f"#{i}" for i in sorted(gone))))
        return [*values, "\n\n".join(lines)]

    def delete_template(self, template_id: Any) -> tuple[str, Any]:
        lang = current_language()
        tid = parse_id(template_id)
        if tid is None:
            return text("tr.template.none", lang), gr.skip()
        _, err = self.ctx.attempt(templates_svc.delete_template, tid)
        if err is not None:
            return localize_message(err.message, lang), self.template_choices()
        return text("tr.template.deleted", lang, id=tid), self.template_choices()

    def _unchanged(self, status: str) -> list[Any]:
        return [*(gr.skip() for _ in self.keys), status]


def wire_start_box(box: StartBox, handlers: StartHandlers, inputs: list[Any], review: dict) -> None:
    """Recipes and templates fill the form (then the form is checked once, as after an import)."""
    filled = [*inputs, box.status]
    box.recipe.change(handlers.verdict, box.recipe, box.verdict, show_progress="hidden")
    box.recipe_load.click(handlers.load_recipe, box.recipe, filled).then(**review).then(
        handlers.verdict, box.recipe, box.verdict, show_progress="hidden"
    )
    box.template_load.click(handlers.load_template, box.template, filled).then(**review)
    box.template_save.click(handlers.save_template, [box.template_name, *inputs], [box.status, box.template])
    box.template_delete.click(handlers.delete_template, box.template, [box.status, box.template])
    # the template list and the first recipe's verdict are refreshed when the tab opens (train_tab._wire_open)
