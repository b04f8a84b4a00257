"""The Train tab's recipes and templates without a browser (studio.ui.train_templates): a template keeps every
option of the form, folded ones too, and fills the form again; a dataset deleted since is named and left out;
refusals and verdicts are Chinese in Chinese."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr
import pytest
from studio_helpers import DEMO_SFT, upload
from test_estimate_api import cpu_node, gpu_node

from studio.services import recipes as recipes_svc
from studio.services import templates as templates_svc
from studio.ui import i18n
from studio.ui.context import UIContext
from studio.ui.i18n import Texts
from studio.ui.text_check import untranslated_words
from studio.ui.train_form import folded_groups
from studio.ui.train_tab import TrainHandlers, build_train_tab, form_values
from studio.ui.train_templates import StartHandlers


@pytest.fixture(scope="module")
def tab():
    with gr.Blocks() as demo:
        return build_train_tab(UIContext(settings=None, texts=Texts(), demo=demo))


@pytest.fixture
def starts(tab, settings) -> StartHandlers:
    ctx = UIContext(settings=settings, texts=Texts(), demo=None)
    return StartHandlers(ctx, tab.handlers.keys, TrainHandlers(ctx, tab.handlers.keys).spec, form_values)


@pytest.fixture
def chinese():
    token = i18n.LocalContext.request.set(SimpleNamespace(session_hash="zh-templates"))
    i18n.remember_language("zh")
    yield
    i18n.LocalContext.request.reset(token)


def _values(tab, **changed) -> tuple:
    values = {k: tab.fields[k].value for k in tab.handlers.keys} | changed
    return tuple(values[k] for k in tab.handlers.keys)


def _form(keys: list[str], filled: list) -> dict:
    """Handler output -> the values the form holds (an update's value; a skip keeps nothing)."""
    out = {}
    for key, value in zip(keys, filled, strict=True):
        if isinstance(value, dict) and value.get("__type__") == "update":
            if "value" in value:
                out[key] = value["value"]
            continue
        out[key] = value
    return out


FOLDED = {o.key for _, options in folded_groups() for o in options}


def test_a_template_keeps_folded_options_and_fills_the_form_again(tab, starts, client, session):
    assert {"adam_beta2", "max_grad_norm"} <= FOLDED  # options under "More options"
    dataset = upload(client, DEMO_SFT).json()["id"]
    values = _values(
        tab, base_model="tiny", dataset_ids=[dataset], name="mine", lora_rank=24, adam_beta2=0.97,
        max_grad_norm=0.5, max_steps=3,
    )  # fmt: skip
    status, choices = starts.save_template("  kept  ", *values)
    assert status.startswith("Saved template `kept`"), status
    [saved] = templates_svc.list_templates(session)
    assert choices["value"] == saved.id
    hyper = saved.spec["hyperparameters"]
    assert (hyper["adam_beta2"], hyper["max_grad_norm"], hyper["lora_rank"]) == (0.97, 0.5, 24)

    filled = starts.load_template(saved.id)
    form = _form(tab.handlers.keys, filled[:-1])
    assert (form["adam_beta2"], form["max_grad_norm"], form["lora_rank"], form["max_steps"]) == (
        0.97,
        0.5,
        24,
        3,
    )
    assert (form["name"], form["base_model"], form["dataset_ids"]) == ("mine", "tiny", [dataset])
    assert filled[-1] == "Form filled from template `kept`."

    # the dataset deleted: named, and left out of the form (Launch then asks for one)
    client.delete(f"/api/v1/datasets/{dataset}")
    filled = starts.load_template(saved.id)
    assert _form(tab.handlers.keys, filled[:-1])["dataset_ids"] == []
    assert f"#{dataset}" in filled[-1] and "deleted since the template was saved" in filled[-1]

    status, choices = starts.delete_template(saved.id)
    assert status == f"Deleted template #{saved.id}." and choices["choices"] == []
    assert (
        starts.load_template(saved.id)[-1]
        == f"template {saved.id} not found; GET /api/v1/templates lists them"
    )


def test_a_form_that_cannot_run_is_not_saved_and_says_why(tab, starts, session):
    status, _ = starts.save_template("x", *_values(tab, base_model="tiny", dataset_ids=[]))
    assert "Not saved" in status and "dataset_ids" in status
    status, _ = starts.save_template("x", *_values(tab, base_model="tiny", dataset_ids=[99999]))
    assert "Not saved" in status and "99999" in status
    assert templates_svc.list_templates(session) == []


def test_a_recipe_fills_the_form_and_its_verdict_names_its_source(tab, starts, session, settings):
    recipe = "ernie-4.5-0.3b-sft-lora-8k"
    filled = starts.load_recipe(recipe)
    form = _form(tab.handlers.keys, filled[:-1])
    assert (form["stage"], form["fine_tuning"], form["lora_rank"], form["learning_rate"]) == (
        "SFT",
        "LoRA",
        32,
        1e-4,
    )
    assert form["base_model"] == "ernie-4.5-0.3b" and "Missing datasets (2)" in filled[-1]
    assert "No node has reported yet" in starts.verdict(recipe)
    gpu_node(session, "train@gpu1", gpus=8)
    session.commit()
    shown = starts.verdict(recipe)
    assert "examples/configs/ERNIE-4.5-0.3B/sft/run_sft_lora_8k.yaml" in shown
    assert "Not as written" in shown and "sharding: stage1" in shown and "The planner proposes" in shown
    assert recipes_svc.recipe_verdict(session, settings, recipe)["status"] == "proposal"


@pytest.mark.parametrize("node", ["gpu", "cpu"])
def test_refusals_and_verdicts_are_chinese_in_chinese(tab, starts, session, chinese, node):
    for name in ("", "x" * 101, "a\u200bb"):
        status, _ = starts.save_template(name, *_values(tab))
        assert untranslated_words(status) == [], status
    assert untranslated_words(starts.load_template(424242)[-1]) == []
    if node == "gpu":
        gpu_node(session, "train@gpu1", gpus=8)
    else:
        cpu_node(session, "train@laptop", ram_gib=16)
    session.commit()
    # names: the node, its GPU, values and the planner's setting keys (shown as code, as the Train tab does)
    data = ["gpu1", "laptop", "H800", "stage1", "True", "nodes"]
    statuses = set()
    for recipe in recipes_svc.list_recipes():
        shown = starts.verdict(recipe.id)
        assert untranslated_words(shown, [recipe.source_path, recipe.shape, *data]) == [], shown
        statuses.add(recipes_svc.recipe_verdict(session, starts.ctx.settings, recipe.id)["status"])
    assert statuses == ({"fits", "proposal"} if node == "gpu" else {"does_not_fit"})


def test_a_refused_template_recipe_and_name_are_chinese_in_chinese(tab, starts, client, chinese):
    dataset = upload(client, DEMO_SFT).json()["id"]
    values = _values(tab, base_model="tiny", dataset_ids=[dataset], max_steps=3)
    assert starts.save_template("kept", *values)[0].startswith("已保存模板")
    refused = {
        "": "name：为空；请给模板起个名字（最多 100 个字符）",
        "x" * 101: "name：101 个字符；模板名称最多 100 个字符",
        "a\u200bb": "name：含有控制字符或不可见的格式字符；请使用可打印的文字",
        "kept": "name：已有名为 'kept' 的模板；请换个名字，或先删除那个模板",
    }
    for name, zh in refused.items():
        status, _ = starts.save_template(name, *values)
        assert status.endswith(f"\n\n- {zh}"), status
    # a run of it would be refused: the head, then each problem on a line of its own, all in Chinese
    status, _ = starts.save_template(
        "ocr", *_values(tab, base_model="tiny", dataset_ids=[dataset], stage="OCR-VL-SFT")
    )
    lines = status.split("\n\n", 1)[1].splitlines()
    assert lines[0] == "- spec：以此模板启动的任务会被拒绝：" and len(lines) >= 2, status
    assert "- stage：OCR-VL-SFT 用于微调 PaddleOCR-VL 模型，而 base_model 'tiny' 不是" in status, status
    assert untranslated_words(status, ["OCR-VL-SFT", "PaddleOCR-VL", "tiny", "tiny-ocr-vl", "sft"]) == [], (
        status
    )
    assert starts.load_template(424242)[-1] == "模板 424242 不存在；GET /api/v1/templates 列出全部模板"
    assert starts.verdict("no-such").startswith("recipe：没有名为 'no-such' 的配方；现有配方：")
    assert starts.load_recipe("no-such")[-1].startswith("recipe：没有名为 'no-such' 的配方")
