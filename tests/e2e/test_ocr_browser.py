"""PaddleOCR-VL in a real browser: on the Train tab, tiny-ocr-vl with stage SFT shows the service's refusal
beside the stage and Launch stays off, and the Document OCR stage turns Launch on; on Deploy & Chat, a
tiny-ocr-vl deployment offers its task prompts, and an attached text-line image sent with "OCR:" is answered
through PaddleOCR-VL's prompt form (the server's own prompt-token count equals the same image and prompt sent
through REST). A random tiny model reads nonsense: the reply's text is not checked, only that it came."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import httpx
import pytest
from gradio_page import StudioPage
from ocr_demo import ocr_demo_zip
from playwright.sync_api import expect
from test_studio import api, wait_until
from test_vl_chat import PROMPT_TOKENS, SAMPLING, server_count, set_sampling, user_bubbles

pytestmark = pytest.mark.e2e

OCR_DEMO = Path(__file__).resolve().parents[2] / "examples" / "data" / "ocr_demo"
# One of the demo's text lines, drawn by tools/make_ocr_demo_data.py.
LINE = OCR_DEMO / "images" / "line_006.png"


def upload_ocr_lines(studio: str) -> dict:
    """The demo's evaluation lines and their images as one zip (an OCR set)."""
    data = ocr_demo_zip(("lines_eval.jsonl",), "ocr_lines")
    r = httpx.post(f"{studio}/api/v1/datasets", files={"file": ("ocr_lines.zip", data)}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()


def rest_chat(studio: str, dep_id: int, content: list[dict]) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], **SAMPLING}
    return httpx.post(f"{studio}/api/v1/deployments/{dep_id}/chat", json=body, timeout=120)


def test_ocr_stage_check_on_train_and_an_ocr_prompt_on_deploy(page, studio, artifacts):
    # The deployment starts while the Train tab is checked.
    r = httpx.post(f"{studio}/api/v1/deployments", json={"model": "tiny-ocr-vl"}, timeout=30)
    assert r.status_code == 201, r.text
    dep_id = r.json()["id"]
    try:
        check_train_and_chat(page, studio, artifacts, dep_id)
    finally:
        httpx.post(f"{studio}/api/v1/deployments/{dep_id}/stop", timeout=10)


def check_train_and_chat(page, studio: str, artifacts: Path, dep_id: int) -> None:
    upload_ocr_lines(studio)
    ui = StudioPage(page, studio, artifacts / "ocr")
    ui.open("?tab=train")
    ui.choose("tr-base-model", "tiny-ocr-vl")
    ui.choose("tr-datasets", "ocr_lines")
    expect(ui.el("tr-problems")).not_to_contain_text(
        "dataset_ids"
    )  # the data is in: Launch waits on the stage
    # stage SFT (the form's start): the service's refusal beside the stage, Launch off
    ui.expect_text("tr-stage", "is a PaddleOCR-VL model, which trains with stage OCR-VL-SFT")
    expect(ui.el("tr-launch")).to_be_disabled()
    ui.shot("ocr-model-with-sft")
    page.locator("#tr-stage label", has_text="Document OCR (PaddleOCR-VL)").click()
    expect(ui.el("tr-launch")).to_be_enabled(timeout=30_000)
    expect(ui.el("tr-stage")).not_to_contain_text("is a PaddleOCR-VL model")
    ui.shot("ocr-stage")

    dep = wait_until(
        lambda: (d := api(studio, f"/deployments/{dep_id}"))["status"] in ("running", "failed") and d,
        300,
        "the tiny-ocr-vl deployment to start",
    )
    assert dep["status"] == "running", dep["error"]
    ui.open(f"?tab=deploy&deployment={dep_id}")
    ui.expect_text("dep-status", re.compile(rf"#{dep_id} .*— running"))  # not the line shown before
    expect(ui.el("dep-task-prompt")).to_be_visible()
    set_sampling(ui)
    page.set_input_files("#dep-message input[type=file]", str(LINE))
    expect(ui.el("dep-message").locator("img")).to_have_count(1, timeout=15_000)
    page.locator("#dep-task-prompt label", has_text="OCR:").first.click()
    expect(ui.el("dep-message").locator("textarea")).to_have_value("OCR:")
    expect(ui.el("dep-message").locator("img")).to_have_count(1)  # the image stays with the prompt
    expect(ui.el("dep-task-prompt").locator("input:checked")).to_have_count(0)  # ready for the next pick
    before = server_count(dep, PROMPT_TOKENS)
    ui.click("dep-send")
    ui.idle(timeout=120_000)
    expect(user_bubbles(ui).last).to_contain_text("OCR:")
    reply = ui.el("dep-chat").locator("[data-testid=bot]").last.inner_text()
    assert reply.strip() and "⚠️" not in reply, reply
    ui.shot("ocr-reply")

    # The page's request was the image and "OCR:" in PaddleOCR-VL's prompt form: the server counted as many
    # prompt tokens as for the same turn sent through REST (the image's placeholders included).
    asked = wait_until(lambda: server_count(dep, PROMPT_TOKENS) - before, 30, "the OCR prompt's count")
    image_url = "data:image/png;base64," + base64.b64encode(LINE.read_bytes()).decode()
    turn = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "OCR:"}]
    same = rest_chat(studio, dep_id, turn)
    assert same.status_code == 200, same.text
    assert same.json()["usage"]["prompt_tokens"] == asked
    words_only = rest_chat(studio, dep_id, turn[1:]).json()["usage"]["prompt_tokens"]
    assert asked > words_only + 2  # the image's start, placeholders and end

    # The server's refusals reach a person as its messages (what a REST client sends; the page sends data URLs).
    remote = rest_chat(studio, dep_id, [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}])
    assert remote.status_code == 400
    assert remote.json()["message"] == (
        f"deployment {dep_id} answered 400: messages.0.content.0: https: URLs are not fetched (this server "
        "fetches nothing); send the image inline as a data:image/...;base64,... URL"
    )
    plain = rest_chat(studio, dep_id, [{"type": "image_url", "image_url": {"url": "data:image/png,abc"}}])
    assert plain.status_code == 400 and plain.json()["message"] == (
        f"deployment {dep_id} answered 400: messages.0.content.0: a data: URL must be base64 "
        "(data:image/png;base64,...)"
    )
