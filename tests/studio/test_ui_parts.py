"""The UI's pure parts without a browser: text tables, plot frames, form -> RunSpec, problem rows."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pandas as pd
import pytest
import yaml
from PIL import Image
from studio_helpers import DEMO_SFT

from engine.eval.config import EvalConfig
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict, load_config
from engine.train.options import FINE_TUNING, MAX_DEVICES, SCHEDULERS, field_info
from engine.train.stages import STAGE_DEFAULTS, STAGES
from studio.api.body_limits import MAX_JSON_BYTES
from studio.models import Deployment
from studio.services import datasets as datasets_svc
from studio.services import deployments as deployments_svc
from studio.services import runs as runs_svc
from studio.services.errors import InvalidInput
from studio.ui import charts
from studio.ui.chat_messages import MAX_IMAGE_BYTES, chat_messages, image_problem, thinking_fields, user_turn
from studio.ui.compare_tab import diff_frame, metric_names, pick_metric, series_legend
from studio.ui.context import UIContext
from studio.ui.datasets_tab import problem_rows, record_view, rejected_upload, rendered_spans
from studio.ui.deploy_tab import DeployHandlers
from studio.ui.i18n import STRINGS, Texts, text
from studio.ui.run_views import run_rows
from studio.ui.runs_tab import VIEW_PARTS, RunsHandlers
from studio.ui.sampling import sampling_params
from studio.ui.train_form import OPTION_KEYS
from studio.ui.train_tab import (
    CONFIG_KEYS,
    DEFAULT_FINE_TUNING,
    DEFAULT_STAGE,
    EVALUATE_FIELDS,
    STAGE_DEPENDENT_KEYS,
    TrainHandlers,
    build_train_tab,
    choice_changed,
    choice_changed_js,
    form_defaults,
    form_values,
    run_spec,
)


def test_every_text_has_english_and_chinese():
    for key, (en, zh) in STRINGS.items():
        assert en.strip() and zh.strip(), key
    # Every hyperparameter field has a label (and the tab names are translated, not copied).
    for key in OPTION_KEYS:
        assert f"tr.{key}" in STRINGS
    assert text("tab.datasets", "zh") == "数据集" and text("tab.datasets", "en") == "Datasets"


def test_config_tooltips_are_the_engines_help_in_english():
    # The schema holds the English; i18n only adds the Chinese. A key with help in both languages is one
    # the engine documents.
    for key in [*OPTION_KEYS, "compute_type"]:
        if f"tr.{key}.info" in STRINGS:
            assert text(f"tr.{key}.info", "en") == field_info(TrainConfig, key)["help"], key
    assert text("tr.max_steps.info") == "Optimizer steps; -1 (or 0) trains num_train_epochs."
    assert "text" in text("ds.format.info") and "text" in text("ds.format.info", "zh")


def test_language_switch_relabels_every_registered_component():
    texts = Texts()
    with gr.Blocks():
        box = texts.make(gr.Number, "tr.learning_rate")
        button = texts.make(gr.Button, "ds.upload_btn", prop="value")
    assert box.label == "learning_rate"
    assert box.info == "Peak learning rate after warm-up; default per stage and fine-tuning."
    updates = texts.updates("zh")
    assert texts.components == [box, button]
    assert updates[0]["label"] == "learning_rate"
    assert updates[0]["info"] == "预热后的峰值学习率；默认值随阶段和微调方式而定。"
    assert updates[1] == {"__type__": "update", "value": "上传并校验"}
    assert texts.updates("fr")[1]["value"] == "Upload and validate"  # unknown language -> English


def test_metric_frame_keeps_finite_points_in_step_order():
    rows = [
        {"step": 2, "loss": 1.5, "learning_rate": 2e-4},
        {"step": 1, "loss": 2.0, "learning_rate": 1e-4},
        {"step": 3, "loss": math.nan, "learning_rate": 3e-4},
        {"step": 4, "loss": None},
        {"loss": 9.0},
    ]
    frame = charts.metric_frame(rows, ["loss"])
    assert frame["step"].tolist() == [1, 2] and frame["value"].tolist() == [2.0, 1.5]
    assert set(frame["series"]) == {"loss"}


def test_empty_frames_are_typed_so_plots_start_with_numeric_axes():
    # Gradio picks quantitative vs nominal axes from the first frame; object columns made loss categorical.
    for frame in (charts.empty_frame(), charts.metric_frame([], ["loss"]), charts.compare_frame({}, "loss")):
        assert frame.empty
        assert pd.api.types.is_integer_dtype(frame["step"]) and pd.api.types.is_float_dtype(frame["value"])


def test_compare_frame_labels_each_run_and_aligns_by_step():
    frame = charts.compare_frame(
        {"#1 a": [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}], "#2 b": [{"step": 2, "loss": 2.5}]},
        "loss",
    )
    assert frame.groupby("series")["step"].apply(list).to_dict() == {"#1 a": [1, 2], "#2 b": [2]}


def test_stage_metrics_prefer_dpo_and_moe_keys_and_fall_back_to_grad_norm():
    dpo = [{"step": 1, "loss": 0.7, "rewards/accuracy": 0.5, "rewards/margin": 0.1, "grad_norm": 1.0}]
    moe = [{"step": 1, "loss": 2.0, "aux_loss": 0.01, "z_loss": 0.1, "grad_norm": 1.0}]
    dense = [{"step": 1, "loss": 2.0, "grad_norm": 1.0, "tokens_per_second": 10.0}]
    assert charts.extra_metric_names(dpo) == ["rewards/accuracy", "rewards/margin"]
    assert charts.extra_metric_names(moe) == ["aux_loss", "z_loss"]
    assert charts.extra_metric_names(dense) == ["grad_norm"]


def test_histogram_frame_labels_bins_by_their_edges():
    frame = charts.histogram_frame({"histogram": {"bins": [0, 8, 16, 24], "counts": [3, 0, 5]}})
    assert frame["tokens"].tolist() == [" 0-8", " 8-16", "16-24"] and frame["samples"].tolist() == [3, 0, 5]
    assert sorted(frame["tokens"]) == frame["tokens"].tolist()  # text order is numeric order
    assert charts.histogram_frame({}).empty


def test_problem_rows_split_file_line_message():
    rows = problem_rows(
        ["data.jsonl:2: src has 2 turns but tgt has 1", "data.jsonl:13: invalid JSON: x", "whole file: empty"]
    )
    assert rows.values.tolist() == [
        [2, "src has 2 turns but tgt has 1"],
        [13, "invalid JSON: x"],
        ["", "whole file: empty"],
    ]


def test_rendered_spans_mark_trained_and_dpo_answers():
    spans = [
        {"text": "User: hi\nAssistant: ", "trained": False},
        {"text": "yes", "trained": True, "label": "chosen"},
        {"text": "no", "trained": True, "label": "rejected"},
        {"text": "ok", "trained": True},
    ]
    assert rendered_spans(spans) == [
        ("User: hi\nAssistant: ", None),
        ("yes", "chosen"),
        ("no", "rejected"),
        ("ok", "trained"),
    ]


def _form(**over):
    values = {
        "base_model": "tiny",
        "stage": "SFT",
        "fine_tuning": "LoRA",
        "compute_type": "fp32",
        "dataset_ids": [3, "4"],
        "name": "",
        "learning_rate": 0.001,
        "max_steps": 40.0,
        "lora_rank": 8.0,
        "lora_alpha": -1.0,
        "beta": 0.1,
        "loss_type": "sigmoid",
        "packing": False,
    }
    values.update(over)
    return values


def test_form_becomes_the_run_spec_the_api_takes():
    spec = run_spec(_form())
    assert spec.base_model == "tiny" and spec.dataset_ids == [3, 4] and spec.name is None
    assert spec.stage == "SFT" and spec.fine_tuning == "LoRA"
    hp = spec.hyperparameters
    assert hp["max_steps"] == 40 and isinstance(hp["max_steps"], int) and hp["learning_rate"] == 0.001
    assert hp["compute_type"] == "fp32" and hp["lora_rank"] == 8
    assert "beta" not in hp and "loss_type" not in hp  # DPO keys only for DPO


def test_full_fine_tuning_drops_lora_keys_and_dpo_keeps_beta():
    full = run_spec(_form(fine_tuning="Full")).hyperparameters
    assert "lora_rank" not in full and "lora_alpha" not in full
    dpo = run_spec(_form(stage="DPO")).hyperparameters
    assert dpo["beta"] == 0.1 and dpo["loss_type"] == "sigmoid"
    # A quantized base trains LoRA adapters even when "Full" is picked, so LoRA keys stay.
    assert run_spec(_form(fine_tuning="Full", compute_type="wint8")).hyperparameters["lora_rank"] == 8


def test_missing_dataset_is_a_readable_error():
    with pytest.raises(gr.Error, match="dataset_ids: pick at least one dataset"):
        run_spec(_form(dataset_ids=[]))


def test_clone_fills_the_form_from_a_spec():
    spec = run_spec(_form(name="lr-1e-3"))
    keys = ["base_model", "stage", "fine_tuning", "dataset_ids", "name", "learning_rate", "max_steps", "seed"]
    values = form_values(spec, keys)
    assert values[:7] == ["tiny", "SFT", "LoRA", [3, 4], "lr-1e-3-clone", 0.001, 40]
    # "Clone into Train" keeps every option: one the run left out is the engine's default for its stage,
    # not what the form held before.
    spec.hyperparameters.pop("seed", None)
    assert form_values(spec, keys)[7] == 42
    assert form_values(spec, ["eval_after"]) == [{"__type__": "update"}]  # not a choice of this run


def test_chat_messages_flatten_gradio6_content_parts():
    history = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "13 - 1?"}],
        },
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": [{"type": "file", "file": {}}]},
    ]
    assert chat_messages("Be brief.", history) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 13 - 1?"},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": ""},
    ]
    assert chat_messages("  ", history[:1])[0]["role"] == "user"


# ---- images in the Deploy tab's chat ---------------------------------------------------------------------


def _picture(path: Path, colour: tuple[int, int, int] = (255, 0, 0), fmt: str = "PNG") -> str:
    Image.new("RGB", (56, 56), colour).save(path, format=fmt)
    return str(path)


def _as_chatbot_returns_it(history: list[dict]) -> list[dict]:
    """The history as the Chatbot hands it to the next callback (Gradio 6 normalises every message)."""
    chatbot = gr.Chatbot()
    return chatbot.preprocess(chatbot.postprocess(history))


def test_a_history_with_images_becomes_openai_messages_with_data_urls_before_the_text(tmp_path):
    red = _picture(tmp_path / "red.png")
    blue = _picture(tmp_path / "blue.jpg", (0, 0, 255), "JPEG")
    box, history = user_turn({"text": "What colour is this?", "files": [red]}, [], reads_images=True)
    assert box == {"text": "", "files": []}
    # The user's bubble shows the picture (an image file part) and then the question.
    assert history == [
        {
            "role": "user",
            "content": [
                {
                    "type": "file",
                    "file": {"path": red, "mime_type": "image/png", "orig_name": "red.png"},
                    "alt_text": "red.png",
                },
                {"type": "text", "text": "What colour is this?"},
            ],
        }
    ]
    history = [*history, {"role": "assistant", "content": "Red."}]
    _, history = user_turn({"text": "And this one?", "files": [blue]}, history, reads_images=True)
    _, history = user_turn({"text": "Thanks.", "files": []}, history, reads_images=True)
    history = _as_chatbot_returns_it(history)

    def url(path: str, mime: str) -> str:
        return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()

    # The next request carries the earlier turns' pictures again, in their turns, as OpenAI clients do.
    assert chat_messages("Be brief.", history) == [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url(red, "image/png")}},
                {"type": "text", "text": "What colour is this?"},
            ],
        },
        {"role": "assistant", "content": "Red."},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url(blue, "image/jpeg")}},
                {"type": "text", "text": "And this one?"},
            ],
        },
        {"role": "user", "content": "Thanks."},
    ]
    sent = chat_messages("", history)[0]["content"][0]["image_url"]["url"]
    assert base64.b64decode(sent.split(";base64,", 1)[1]) == Path(red).read_bytes()
    # A picture sent without words is a message of its own.
    _, alone = user_turn({"text": " ", "files": [red]}, [], reads_images=True)
    assert chat_messages("", alone) == [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url(red, "image/png")}}]}
    ]


def test_a_text_model_refuses_images_and_says_why(tmp_path):
    red = _picture(tmp_path / "red.png")
    with pytest.raises(gr.Error, match=r"model takes text only, so red\.png cannot be sent") as refused:
        user_turn({"text": "What colour?", "files": [red]}, [], reads_images=False)
    assert "ERNIE 4.5 VL" in refused.value.message
    with pytest.raises(gr.Error, match="仅支持文本"):
        user_turn({"text": "什么颜色？", "files": [red]}, [], reads_images=False, lang="zh")
    # Pictures from earlier turns (a VL deployment picked before) are not dropped either.
    _, history = user_turn({"text": "What colour?", "files": [red]}, [], reads_images=True)
    with pytest.raises(gr.Error, match=r"holds images from earlier turns.*takes text only"):
        user_turn({"text": "And now?", "files": []}, history, reads_images=False)
    # Plain text to a text model goes through as before, and an empty box is refused.
    assert user_turn({"text": "Hi", "files": []}, [], reads_images=False)[1] == [
        {"role": "user", "content": "Hi"}
    ]
    with pytest.raises(gr.Error, match="Type a message first"):
        user_turn({"text": "  ", "files": []}, [], reads_images=True)


def test_images_over_the_size_limit_and_other_files_are_refused(tmp_path):
    big = tmp_path / "huge.png"
    _picture(big)
    with open(big, "r+b") as f:
        f.truncate(MAX_IMAGE_BYTES + 2**20)  # a valid PNG header, then 21 MB
    assert image_problem(big) == (
        "huge.png is 21.0 MB; an attached image may be at most 20 MB. Downscale or compress it and attach it "
        "again."
    )
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture", encoding="utf-8")
    disguised = tmp_path / "photo.png"
    disguised.write_text("not a picture either", encoding="utf-8")
    for path in (notes, disguised):
        assert image_problem(path) == (
            f"{path.name} is not an image (a PNG, JPEG, WebP, GIF, BMP or TIFF file); only images can be "
            "attached."
        )
    assert image_problem(_picture(tmp_path / "fine.webp", fmt="WEBP")) is None
    with pytest.raises(gr.Error, match=r"huge\.png is 21\.0 MB"):
        user_turn({"text": "What is it?", "files": [str(big)]}, [], reads_images=True)
    with pytest.raises(gr.Error, match=r"photo\.png is not an image"):
        user_turn({"text": "What is it?", "files": [str(disguised)]}, [], reads_images=True)
    # One image at the limit, base64-encoded, still fits the REST API's chat body limit.
    assert math.ceil(MAX_IMAGE_BYTES / 3) * 4 < MAX_JSON_BYTES


def test_the_deploy_tab_offers_images_only_for_a_vl_deployment(ctx, tmp_path):
    from engine.models.paths import ADAPTER_CONFIG

    models = ctx.settings.models_dir
    (models / "my-vl").mkdir(parents=True)
    (models / "my-vl" / "config.json").write_text(json.dumps({"vision_config": {"depth": 2}}))
    (models / "my-text").mkdir()
    (models / "my-text" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    # A LoRA run of the VL model (no config.json of its own) reads images through its base.
    lora = tmp_path / "lora-run"
    lora.mkdir()
    (lora / ADAPTER_CONFIG).write_text(json.dumps({"base_model": str(models / "my-vl"), "r": 8}))
    assert deployments_svc.model_reads_images(lora)
    assert not deployments_svc.model_reads_images(tmp_path / "missing")

    def deploy(name: str) -> int:
        spec = deployments_svc.DeploymentSpec(model=str(models / name))
        return ctx.call(deployments_svc.create_deployment, ctx.settings, spec).id

    def serving(dep) -> None:  # as the serving worker records a started model server
        dep.status, dep.url = "running", "http://127.0.0.1:9/v1"

    vl, plain = deploy("my-vl"), deploy("my-text")
    handlers = DeployHandlers(ctx)
    # A deployment that is not running yet keeps the message in the box, saying why.
    with pytest.raises(gr.Error, match=f"deployment {vl} is starting; chat once it is running"):
        handlers.check_turn({"text": "hi", "files": []}, [], vl)
    for did in (vl, plain):
        ctx.call(lambda session, did=did: (serving(session.get(Deployment, did)), session.commit()))
    box, on, off = handlers.image_input(vl)
    assert (box["sources"], on["visible"], off["visible"]) == (["upload"], True, False)
    box, on, off = handlers.image_input(plain)
    assert (box["sources"], on["visible"], off["visible"]) == ([], False, True)
    box, on, off = handlers.image_input(None)
    assert (box["sources"], on["visible"], off["visible"]) == ([], False, False)
    red = _picture(tmp_path / "red.png")
    message = {"text": "What colour?", "files": [red]}
    assert handlers.take_turn(message, [], vl)[1][0]["content"][0]["file"]["path"] == red
    with pytest.raises(gr.Error, match="takes text only"):
        handlers.take_turn(message, [], plain)
    handlers.check_turn(message, [], vl)  # the check the UI runs first, with no outputs
    with pytest.raises(gr.Error, match="takes text only"):
        handlers.check_turn(message, [], plain)
    with pytest.raises(gr.Error, match="Pick a running deployment first") as refused:
        handlers.take_turn(message, [], None)
    assert refused.value.duration is None  # the notice stays until the person closes it


def test_opening_the_deploy_tab_shows_a_deployment_just_started_from_the_runs_tab(ctx, tiny_model_dir):
    """A deploy button of the Runs tab remembers the new deployment and opens Deploy & Chat; the tab's select
    event, which still sees the dropdown's earlier pick, must show the new one (it kept the earlier one, and
    test_gguf_deploy waited 180 s on deployment #2 while #3 started)."""

    import shutil

    model = ctx.settings.models_dir / "tiny"
    shutil.copytree(tiny_model_dir, model)

    def deploy() -> int:
        spec = deployments_svc.DeploymentSpec(model=str(model))
        return ctx.call(deployments_svc.create_deployment, ctx.settings, spec).id

    earlier, new = deploy(), deploy()
    handlers = DeployHandlers(ctx)
    _, _, dropdown, status = handlers.on_select(None, earlier, new, None)
    assert dropdown["value"] == new and f"#{new} " in status
    # the tab opened by hand: the remembered deployment is the shown one
    _, _, dropdown, status = handlers.on_select(None, earlier, earlier, None)
    assert dropdown["value"] == earlier and f"#{earlier} " in status
    # a remembered deployment that was deleted meanwhile: the shown one stays
    _, _, dropdown, _ = handlers.on_select(None, earlier, new + 100, None)
    assert dropdown["value"] == earlier


def test_a_page_opened_on_a_deployment_link_shows_it_whatever_an_earlier_visit_stored(ctx, tiny_model_dir):
    """?tab=deploy&deployment=N: the load's restore and the load-time tab select both show N, in either order,
    though browser storage holds the deployment an earlier visit showed (the select used to prefer storage:
    test_ocr_browser's page showed #2 for a link to #3); the page's later selects prefer storage again."""
    import shutil

    model = ctx.settings.models_dir / "tiny"
    shutil.copytree(tiny_model_dir, model)
    spec = deployments_svc.DeploymentSpec(model=str(model))
    stored, linked = (ctx.call(deployments_svc.create_deployment, ctx.settings, spec).id for _ in range(2))

    def page(session: str) -> SimpleNamespace:
        return SimpleNamespace(
            session_hash=session, query_params={"tab": "deploy", "deployment": str(linked)}
        )

    handlers = DeployHandlers(ctx)
    # restore first, then the select (which sees the stored deployment and an empty dropdown)
    assert handlers.restore(None, stored, page("a"))[2]["value"] == linked
    assert handlers.on_select(None, None, stored, page("a"))[2]["value"] == linked
    # a later select of the same page: storage wins (a Runs-tab deploy button stores what to open)
    assert handlers.on_select(None, linked, stored, page("a"))[2]["value"] == stored
    # the select first: it shows storage's, and the restore that lands after it shows the link; a tick then
    # ends the link's say, so the page's next select prefers storage
    assert handlers.on_select(None, None, stored, page("b"))[2]["value"] == stored
    assert handlers.restore(None, stored, page("b"))[2]["value"] == linked
    handlers.tick(None, linked, stored, None, page("b"))
    assert handlers.on_select(None, linked, stored, page("b"))[2]["value"] == stored


def test_the_deploy_tab_offers_thinking_only_for_a_thinking_model(ctx, tiny_model_dir, tmp_path):
    """A model whose vocabulary holds </think> gets the thinking choice, unticked; ticked, the request asks
    the chat template for it (unticked, FastDeploy VL deployments get thinking off: fit_chat_request)."""
    import shutil

    models = ctx.settings.models_dir
    models.mkdir(parents=True, exist_ok=True)
    thinker = models / "thinker"
    shutil.copytree(tiny_model_dir, thinker)
    added = json.loads((thinker / "added_tokens.json").read_text())
    added["</think>"] = max(added.values()) + 1
    (thinker / "added_tokens.json").write_text(json.dumps(added))
    shutil.copytree(tiny_model_dir, models / "plain")

    def deploy(name: str) -> int:
        spec = deployments_svc.DeploymentSpec(model=str(models / name))
        return ctx.call(deployments_svc.create_deployment, ctx.settings, spec).id

    thinks, plain = deploy("thinker"), deploy("plain")
    handlers = DeployHandlers(ctx)
    assert handlers.thinking_input(thinks) == gr.update(visible=True, value=False)
    assert handlers.thinking_input(plain) == gr.update(visible=False, value=False)
    assert handlers.thinking_input(None)["visible"] is False
    assert thinking_fields(True) == {"chat_template_kwargs": {"enable_thinking": True}}
    assert thinking_fields(False) == {}


# ---- the Train form starts where the engine starts ---------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("fine_tuning", FINE_TUNING)
def test_a_run_from_the_form_defaults_is_a_run_from_a_minimal_yaml(tmp_path, stage, fine_tuning):
    # The form may only send values the engine would pick itself, so the effective configs are equal.
    spec = run_spec(form_defaults(stage, fine_tuning) | {"base_model": "tiny", "dataset_ids": [1]})
    required = {
        "model_name_or_path": "/m",
        "train_dataset_path": "/d.jsonl",
        "train_dataset_type": "erniekit",
    }
    from_form = config_from_dict(
        TrainConfig,
        {**required, "stage": spec.stage, "fine_tuning": spec.fine_tuning, **spec.hyperparameters},
    )
    minimal = tmp_path / "train.yaml"
    minimal.write_text(
        yaml.safe_dump({**required, "stage": stage, "fine_tuning": fine_tuning}), encoding="utf-8"
    )
    assert dataclasses.asdict(from_form) == dataclasses.asdict(load_config(minimal))


def test_form_defaults_follow_stage_and_fine_tuning():
    sft_lora = form_defaults(DEFAULT_STAGE, DEFAULT_FINE_TUNING)
    assert (DEFAULT_STAGE, DEFAULT_FINE_TUNING) == ("SFT", "LoRA")  # the schema's defaults
    assert sft_lora["learning_rate"] == 1e-4 and sft_lora["packing"] is False
    assert (
        sft_lora["warmup_steps"] == 0 and sft_lora["max_steps"] == -1 and sft_lora["compute_type"] == "fp32"
    )
    assert form_defaults("SFT", "Full")["learning_rate"] == 1e-5
    assert (
        form_defaults("PT", "Full")["packing"] is True
        and form_defaults("DPO", "Full")["learning_rate"] == 5e-7
    )


def test_changing_stage_or_fine_tuning_restarts_the_dependent_fields_from_the_engine():
    assert STAGE_DEPENDENT_KEYS == ("learning_rate", "packing")
    assert choice_changed("DPO", "Full", "fp32") == (5e-7, False)
    assert choice_changed("PT", "LoRA", "fp32") == (1e-4, True)


def test_the_page_sets_the_dependent_fields_from_the_same_table():
    js = choice_changed_js()
    table = json.loads(re.search(r"const t = (\{.*?\});", js).group(1))
    assert table == {f"{s}|{f}": list(choice_changed(s, f, "")) for s, f in STAGE_DEFAULTS}
    assert len(table) == 10 and table["DPO|Full"] == [5e-7, False]
    # a pair the table lacks keeps the fields' values (the inputs after the three choice fields)
    assert "v.slice(3)" in js


def test_every_field_takes_choices_and_bounds_from_the_schema():
    with gr.Blocks() as demo:
        fields = build_train_tab(UIContext(settings=None, texts=Texts(), demo=demo)).fields
    picked = [
        "base_model",
        "stage",
        "fine_tuning",
        "compute_type",
        "dataset_ids",
        "name",
        "num_devices",
        "num_nodes",
        "dataset_probs",
        "eval_dataset_ids",
    ]
    head = [*picked, *EVALUATE_FIELDS]
    assert list(fields)[: len(head)] == head and sorted(list(fields)[len(head) :]) == sorted(OPTION_KEYS)
    assert fields["eval_max_new_tokens"].value == EvalConfig().max_new_tokens  # the engine's eval default
    assert (fields["num_devices"].minimum, fields["num_devices"].maximum) == (1, MAX_DEVICES)
    assert fields["stage"].value == "SFT" and fields["fine_tuning"].value == "LoRA"
    assert fields["lr_scheduler_type"].choices == [(c, c) for c in SCHEDULERS]
    # The bounds are shown and checked by the engine (Gradio's own check would hide the engine's message).
    assert "[-1 … 100000000]" in fields["max_steps"].info and fields["max_steps"].value == -1
    assert fields["learning_rate"].value == 1e-4 and fields["packing"].value is False


# ---- handlers against a real store -------------------------------------------------------------------------


@pytest.fixture
def ctx(settings) -> UIContext:
    return UIContext(settings=settings, texts=Texts(), demo=None)


def _upload_demo(ctx: UIContext) -> int:
    return ctx.call(datasets_svc.upload_dataset, ctx.settings, str(DEMO_SFT)).id


def test_yaml_preview_shows_the_config_the_run_would_get(ctx):
    keys = ["base_model", "dataset_ids", *CONFIG_KEYS]
    handlers = TrainHandlers(ctx, keys)
    form = {"base_model": "tiny", "dataset_ids": [], **form_defaults("SFT", "LoRA")}
    assert handlers.show_yaml(*form.values()) == ("# pick a base model and a dataset to see the config", None)
    form["dataset_ids"] = [_upload_demo(ctx)]
    text, path = handlers.show_yaml(*form.values())
    config = yaml.safe_load(text)
    assert config["learning_rate"] == 1e-4 and config["warmup_steps"] == 0 and config["lora_rank"] == 8
    assert config["output_dir"] == "<run dir>/output"
    assert Path(path).read_text(encoding="utf-8") == text
    form["learning_rate"] = -1.0
    assert handlers.show_yaml(*form.values())[0].startswith("# not valid yet: hyperparameters:")


def test_runs_handlers_list_and_show_a_queued_run(ctx):
    spec = run_spec(form_defaults("SFT", "LoRA") | {"base_model": "tiny", "dataset_ids": [_upload_demo(ctx)]})
    run = ctx.call(runs_svc.create_run, ctx.settings, spec)
    handlers = RunsHandlers(ctx)
    dropdown, rows = handlers.refresh_table(run.id)
    assert dropdown["value"] == run.id and dropdown["choices"] == [(f"#{run.id} {run.name} · queued", run.id)]
    assert rows.values.tolist()[0][:6] == [run.id, run.name, "SFT", "LoRA", "⏳ queued", ""]
    view = dict(zip(VIEW_PARTS, handlers.run_view(run.id), strict=True))
    assert view["status"].startswith(f"### ⏳ #{run.id} {run.name} — queued")
    assert view["cancel"]["interactive"] is True and view["deploy"]["interactive"] is False
    assert json.loads(view["config"])["learning_rate"] == 1e-4
    assert handlers.run_view(run.id + 1)[0] == f"run #{run.id + 1} no longer exists"
    assert handlers.cancel(run.id) == f"Cancelling run #{run.id}."
    with pytest.raises(gr.Error, match="Pick a run first"):
        handlers.resume(None)


def test_opening_the_runs_tab_keeps_a_run_a_launch_selected_meanwhile(ctx):
    """The tab's select event read the dropdown when the click came; a launch's selection of its new run
    landing before the event's answer is not put back to the run shown before (a fresh clone's studio flow)."""
    spec = run_spec(form_defaults("SFT", "LoRA") | {"base_model": "tiny", "dataset_ids": [_upload_demo(ctx)]})
    first = ctx.call(runs_svc.create_run, ctx.settings, spec)
    second = ctx.call(runs_svc.create_run, ctx.settings, spec)
    handlers = RunsHandlers(ctx)
    dropdown, rows = handlers.on_select(first.id, first.id, None)  # read before the launch's answer landed
    assert "value" not in dropdown and [c[1] for c in dropdown["choices"]] == [second.id, first.id]
    assert rows.values.tolist()[0][0] == second.id
    # an empty dropdown is filled from browser storage; a run deleted meanwhile is cleared
    assert handlers.on_select(None, second.id, None)[0]["value"] == second.id
    assert handlers.on_select(second.id + 5, None, None)[0]["value"] is None


# ---- plain parts of the other tabs -------------------------------------------------------------------------


def test_a_running_run_row_shows_progress_loss_and_eta():
    run = SimpleNamespace(
        id=7, name="lr-1e-3", stage="SFT", fine_tuning="LoRA", status="running", created_at=None
    )
    rows = run_rows([run], {7: {"step": 10, "max_steps": 40, "loss": 1.23456, "eta_s": 3725}})
    assert rows.values.tolist() == [
        [7, "lr-1e-3", "SFT", "LoRA", "🏃 running", "10/40 (25%)", "1.2346", "1h02m", ""]
    ]


def test_compare_shows_only_differing_config_keys_one_column_per_run():
    result = {
        "runs": [{"id": 1, "name": "lr-1e-3"}, {"id": 2, "name": "lr-1e-4"}],
        "config_diff": {"learning_rate": {"1": 0.001, "2": 0.0001}, "lora_target_modules": {"1": ["q"]}},
        "metrics": {"step": {}, "loss": {}, "rewards/accuracy": {}, "elapsed_s": {}, "grad_norm": {}},
    }
    assert diff_frame(result).values.tolist() == [
        ["learning_rate", "0.001", "0.0001"],
        ["lora_target_modules", '["q"]', "—"],
    ]
    names = metric_names(result)
    assert names == ["loss", "grad_norm", "rewards/accuracy"]
    assert pick_metric(names, "grad_norm") == "grad_norm" and pick_metric(names, "gone") == "loss"
    colors, legend = series_legend(["#1 a", "#2 b"])
    assert colors == {"#1 a": "#f97316", "#2 b": "#3b82f6"} and legend == "🟧 #1 a  🟦 #2 b"


def test_sampling_values_become_request_parameters():
    full = {"temperature": 0, "top_p": 0.9, "max_tokens": 48.0, "seed": 7.0, "ignore_eos": True}
    assert sampling_params(full) == {
        "temperature": 0.0,
        "top_p": 0.9,
        "max_tokens": 48,
        "seed": 7,
        "ignore_eos": True,
    }
    # The A/B chat has no max_tokens, top_p or seed control; an unticked ignore_eos is left out.
    assert sampling_params({"temperature": 1, "ignore_eos": False}) == {"temperature": 1.0, "max_tokens": 128}


def test_a_refused_upload_lists_its_problems_by_line():
    err = InvalidInput(
        "data.jsonl has problems",
        details={
            "problems": ["data.jsonl:2: src has 2 turns but tgt has 1"],
            "format": "erniekit",
            "kind": "sft",
        },
    )
    head, rows = rejected_upload("data.jsonl", err)
    assert head == "❌ **data.jsonl was not added.** 1 problem(s) — detected format **erniekit** (sft)"
    assert rows.values.tolist() == [[2, "src has 2 turns but tgt has 1"]]
    assert record_view({"records": [], "total": 3}, 5) == ("no record #6 (the file has 3 records)", [], "")


def test_nodes_tab_shows_each_worker_its_checks_and_why_it_takes_no_runs(settings, session):
    from studio.services import nodes as nodes_svc
    from studio.ui.nodes_tab import NodesHandlers

    nodes_svc.register_node(
        session, name="train0@n1", node="n1", hostname="h", queues=["train", "gpu.n1.0", "cpu"]
    )
    report = {
        "passed": False,
        "facts": {"devices": [{"index": 0, "name": "L4", "total_memory_bytes": 24 * 2**30}], "cpu_count": 8},
        "checks": [
            {"name": "training_probe", "passed": True, "detail": "loss fell 80%", "duration_s": 0.8},
            {
                "name": "throughput",
                "passed": False,
                "detail": "9 tokens/s, below the floor",
                "duration_s": 0.4,
            },
        ],
    }
    nodes_svc.record_doctor(session, "train0@n1", report)
    ctx = UIContext(settings=settings, texts=None, demo=None)
    nodes, checks = NodesHandlers(ctx).refresh()
    row = nodes.iloc[0].to_dict()
    assert row["worker"] == "train0@n1" and row["state"] == "❌ failed" and row["busy"] == "free"
    assert (
        row["devices"] == "gpu:0 L4 24.0 GiB"
        and row["doctor"] == "❌ throughput: 9 tokens/s, below the floor"
    )
    assert row["queues"] == "train (held), gpu.n1.0 (held), cpu"
    assert checks.values.tolist() == [
        ["train0@n1", "training_probe", "✅ pass", "loss fell 80%", 0.8],
        ["train0@n1", "throughput", "❌ fail", "9 tokens/s, below the floor", 0.4],
    ]


def test_the_download_line_follows_an_official_models_download(ctx, settings):
    from studio.db import session_scope
    from studio.services import downloads as downloads_svc
    from studio.ui.model_download import download_text, follow_download, start_download

    assert download_text(ctx, "tiny") == ("", False)  # built here: nothing to download
    text, active = download_text(ctx, "ernie-4.5-0.3b")
    assert "not downloaded yet" in text and not active
    text, timer = start_download(ctx, "ernie-4.5-0.3b")  # no worker here: it stays queued
    assert "download queued" in text and timer.active
    with session_scope(settings) as session:
        (queued,) = downloads_svc.list_downloads(session)
        downloads_svc.claim_download(session, queued.id, "w")
        downloads_svc.download_heartbeat(session, queued.id, 3 * 2**20, 12 * 2**20, "abc")
    text, timer, _ = follow_download(ctx, "ernie-4.5-0.3b")
    assert "25% (3.0 MB of 12.0 MB)" in text and timer.active
    with session_scope(settings) as session:
        downloads_svc.finish_download(session, queued.id, downloads_svc.RunStatus.FAILED, error="hub offline")
    text, timer, picker = follow_download(ctx, "ernie-4.5-0.3b")
    assert "failed: hub offline" in text and not timer.active and picker["choices"]


def test_the_picker_shows_official_models_size_active_parameters_and_memory(ctx, settings):
    from studio.services import models as models_svc
    from studio.ui.context import model_choices

    models = ctx.read(models_svc.list_models, settings, default=[])
    moe = next(m for m in models if m["name"] == "ernie-4.5-21b-a3b")
    assert 21.5e9 < moe["num_parameters"] < 22.2e9 and 3.0e9 < moe["active_parameters"] < 3.6e9
    assert moe["weights_bf16_bytes"] == 2 * moe["num_parameters"]
    labels = dict((ref, label) for label, ref in model_choices(models))
    assert "21.8B (3.4B active) · 40.7 GB in bf16 · not downloaded" in labels["ernie-4.5-21b-a3b"]
    assert "active" not in labels["ernie-4.5-0.3b"]  # dense: every weight is active
