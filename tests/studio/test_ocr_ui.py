"""PaddleOCR-VL in the browser's handlers (no browser): the Train form names the OCR stage for what it trains,
shows the service's stage / model-family refusal beside the stage (with and without data picked) and keeps
Launch off until they agree, names the compute types the stage refuses beside compute_type and turns GPAS off
for it; Deploy & Chat offers a PaddleOCR-VL deployment the task prompts it was trained with, and a model
server's refusal reaches the person as its own message."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from types import SimpleNamespace

import gradio as gr
import pytest
from test_ocr_api import upload_lines

from engine.data.paddleocr_vl_processor import TASK_PROMPTS
from engine.models.paths import ADAPTER_CONFIG
from engine.serve.protocol import APIError
from studio.services import deployments as deployments_svc
from studio.services import runs as runs_svc
from studio.ui import i18n
from studio.ui.chat_messages import with_task_prompt
from studio.ui.context import UIContext
from studio.ui.deploy_tab import DeployHandlers
from studio.ui.i18n import Texts, localize_message
from studio.ui.text_check import untranslated_words
from studio.ui.train_form import OPTION_KEYS
from studio.ui.train_tab import CHOICE_KEYS, build_train_tab, stage_choices

FAMILY = (
    "stage: base_model 'tiny-ocr-vl' is a PaddleOCR-VL model, which trains with stage OCR-VL-SFT (its prompt "
    "form and image processor), not SFT"
)


@pytest.fixture
def form(client, settings):
    """A built Train tab on the test's store, and its starting values with tiny-ocr-vl and an OCR set picked."""
    lines = upload_lines(client)["id"]
    with gr.Blocks() as demo:
        built = build_train_tab(UIContext(settings=settings, texts=Texts(), demo=demo))
    values = {k: c.value for k, c in built.fields.items()}
    return built, values | {"base_model": "tiny-ocr-vl", "dataset_ids": [lines]}


@contextlib.contextmanager
def chinese_session() -> Iterator[None]:
    """The handlers run for a browser session that switched to Chinese."""
    token = i18n.LocalContext.request.set(SimpleNamespace(session_hash="zh-ocr"))
    i18n.remember_language("zh")
    try:
        yield
    finally:
        i18n.LocalContext.request.reset(token)


def review(built, values) -> tuple[dict, dict, dict, str]:
    """(option updates by key, choice-field updates by key, Launch, the problems beside Launch)."""
    out = built.handlers.review(*(values[k] for k in built.handlers.keys))
    choices = dict(zip(CHOICE_KEYS, out[-5 - len(CHOICE_KEYS) : -5], strict=True))
    return dict(zip(OPTION_KEYS, out, strict=False)), choices, out[-5], out[-4]


def test_the_stage_and_the_base_models_family_are_checked_beside_the_stage(form):
    built, values = form
    _, choices, launch, problems = review(built, values)
    assert choices["stage"]["info"] == f"⚠️ {FAMILY}" and "tr-invalid" in choices["stage"]["elem_classes"]
    assert launch["interactive"] is False and FAMILY in problems
    # before any data is picked, the same refusal (the data's own check is not the only one shown)
    _, choices, launch, problems = review(built, values | {"dataset_ids": []})
    assert choices["stage"]["info"] == f"⚠️ {FAMILY}" and launch["interactive"] is False
    assert "dataset_ids" in problems

    _, choices, launch, problems = review(built, values | {"stage": "OCR-VL-SFT"})
    assert launch["interactive"] is True and problems == ""
    assert choices["stage"]["info"] == "Training stage." and choices["stage"]["elem_classes"] == []
    # a text model with the OCR stage: the other side of the same check
    _, choices, launch, _ = review(built, values | {"stage": "OCR-VL-SFT", "base_model": "tiny"})
    assert choices["stage"]["info"].startswith(
        "⚠️ stage: OCR-VL-SFT fine-tunes PaddleOCR-VL models, and base_model 'tiny' is not one"
    )
    assert launch["interactive"] is False
    # in Chinese the refusals are Chinese, beside the stage and beside Launch
    with chinese_session():
        _, choices, _, problems = review(built, values)
        _, other, _, _ = review(built, values | {"stage": "OCR-VL-SFT", "base_model": "tiny"})
    assert choices["stage"]["info"].startswith("⚠️ stage：base_model 'tiny-ocr-vl' 是 PaddleOCR-VL 模型"), (
        choices
    )
    assert "须用 OCR-VL-SFT 阶段训练（它的提示词格式和图像处理器），而不是 SFT" in problems, problems
    assert other["stage"]["info"].startswith(
        "⚠️ stage：OCR-VL-SFT 用于微调 PaddleOCR-VL 模型，而 base_model 'tiny' 不是"
    ), other


def test_the_ocr_stage_says_what_it_trains_and_what_it_does_not_train_with(form):
    built, values = form
    assert ("OCR-VL-SFT · Document OCR (PaddleOCR-VL)", "OCR-VL-SFT") in stage_choices("en")
    assert ("OCR-VL-SFT · 文档 OCR（PaddleOCR-VL）", "OCR-VL-SFT") in stage_choices("zh")
    assert ("SFT", "SFT") in stage_choices("en")
    assert built.fields["stage"].choices == [(label, value) for label, value in stage_choices("en")]

    ocr = values | {"stage": "OCR-VL-SFT", "fine_tuning": "Full"}
    _, choices, launch, problems = review(built, ocr | {"compute_type": "fp8"})
    assert "compute_type fp8" in problems
    assert choices["compute_type"]["info"].startswith(
        "⚠️ compute_type fp8: PaddleOCR-VL trains in fp32, bf16 or fp16 here"
    )
    assert launch["interactive"] is False
    with chinese_session():
        _, choices, _, _ = review(built, ocr | {"compute_type": "fp8"})
    assert choices["compute_type"]["info"].startswith(
        "⚠️ compute_type fp8：PaddleOCR-VL 在此只以 fp32、bf16 或 fp16 训练"
    )
    # what the form never sends (its GPAS field is off for the stage) the engine still refuses, by key
    [gpas] = runs_svc.config_problems("OCR-VL-SFT", "Full", {"gpas": True})
    assert gpas == "gpas: PaddleOCR-VL's decoder takes no GPAS gates here; leave gpas false"
    assert (
        localize_message(gpas, "zh")
        == "gpas：PaddleOCR-VL 的解码器在此不接受 GPAS 门控；请保持 gpas 为 false"
    )
    # GPAS does not apply to the OCR stage: the field is off with the reason, and nothing of it is sent
    options, _, launch, _ = review(built, ocr | {"gpas": True})
    assert options["gpas"]["interactive"] is False
    assert "applies to stage SFT, DPO, PT, VL-SFT only" in options["gpas"]["info"]
    assert launch["interactive"] is True
    options, _, _, _ = review(built, values | {"stage": "SFT", "base_model": "tiny", "fine_tuning": "Full"})
    assert options["gpas"]["interactive"] is True


def test_a_paddleocr_vl_deployment_offers_its_task_prompts(settings, tiny_ocr_model_dir, tiny_vl_model_dir):
    ctx = UIContext(settings=settings, texts=Texts(), demo=None)
    models = settings.models_dir
    shutil.copytree(tiny_ocr_model_dir, models / "ocr")
    shutil.copytree(tiny_vl_model_dir, models / "vl")

    def deploy(name: str) -> int:
        spec = deployments_svc.DeploymentSpec(model=str(models / name))
        return ctx.call(deployments_svc.create_deployment, settings, spec).id

    ocr, vl = deploy("ocr"), deploy("vl")
    handlers = DeployHandlers(ctx)
    prompts = ["OCR:", "Table Recognition:", "Formula Recognition:", "Chart Recognition:"]
    assert list(TASK_PROMPTS.values()) == prompts  # the engine's, which its data and server read
    assert handlers.task_prompt_input(ocr) == gr.update(choices=prompts, value=None, visible=True)
    assert handlers.task_prompt_input(vl)["visible"] is False
    assert handlers.task_prompt_input(None)["visible"] is False
    # a finished OCR LoRA run (its adapter and the base's path) is offered them through its base
    lora = settings.home / "runs" / "9" / "output"
    lora.mkdir(parents=True)
    (lora / ADAPTER_CONFIG).write_text(json.dumps({"base_model": str(models / "ocr"), "r": 8}))
    assert deployments_svc.model_task_prompts(lora) == prompts
    assert deployments_svc.model_task_prompts(settings.home / "missing") == []
    # it reads images too: the box offers 📎
    assert handlers.image_input(ocr)[0]["sources"] == ["upload"]
    # one click: the prompt is the message's text, the attached image stays
    picked = with_task_prompt("Table Recognition:", {"text": "what is it", "files": ["/tmp/x.png"]})
    assert picked == {"text": "Table Recognition:", "files": ["/tmp/x.png"]}
    assert with_task_prompt(None, {"text": "kept", "files": []}) == gr.skip()
    # the prompts are the model's words, shown as they are in Chinese too (not untranslated text)
    assert untranslated_words(" ".join(prompts)) == []


def test_a_model_servers_refusal_reaches_the_person_as_its_message():
    refusal = APIError(
        400,
        "messages.0.content.0: https: URLs are not fetched (this server fetches nothing); send the image "
        "inline as a data:image/...;base64,... URL",
        param="messages.0.content.0",
    )
    shown = deployments_svc.answered_message(3, 400, refusal.response().body)
    assert shown == f"deployment 3 answered 400: {refusal.message}"
    # a body that is not OpenAI's error shape is shown as it came
    assert (
        deployments_svc.answered_message(3, 502, b"Bad Gateway") == "deployment 3 answered 502: Bad Gateway"
    )
