"""GGUF in the browser: export a finished run as GGUF from the Runs tab, deploy the q8_0 file with llama.cpp in
one click, and chat with it in Deploy & Chat (streamed); the sampling parameters reach llama-server; the Deploy
box's engine choice serves the run itself with llama.cpp, as faithful as the built-in server.

Needs llama.cpp's tools (`make llamacpp`); trains its own tiny full fine-tune of 40 steps through REST, so
what it exports does not depend on which browser tests ran before it in the same studio.
"""

from __future__ import annotations

import re

import httpx
import pytest
from gradio_page import StudioPage, reply_streams
from playwright.sync_api import expect
from test_evaluate import write_animals
from test_studio import api, wait_until

from engine.llamacpp import TOOLS, find_tool

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        any(find_tool(t) is None for t in TOOLS),
        reason="llama.cpp's tools are not built (make llamacpp / tools/build_llamacpp.sh)",
    ),
]

RUN_NAME = "gguf-source"
# test_evaluate's task with item numbers its training data does not hold (they lie in 100..999)
HELD_OUT = [f"Item {k}: what does the {a} say?" for k, a in ((17, "cat"), (42, "dog"), (73, "duck"))]


def _finished_run(studio: str, tmp_path) -> dict:
    """A new 40-step full fine-tune of the tiny preset on test_evaluate's task (an animal's sound), which it
    learns in a few seconds."""
    data = write_animals(tmp_path / "animals.jsonl")
    with data.open("rb") as f:
        r = httpx.post(
            f"{studio}/api/v1/datasets", files={"file": f}, data={"name": "gguf_animals"}, timeout=60
        )
    r.raise_for_status()
    spec = {
        "name": RUN_NAME,
        "dataset_ids": [r.json()["id"]],
        "fine_tuning": "Full",
        "hyperparameters": {
            "max_steps": 40, "max_seq_len": 48, "per_device_train_batch_size": 8, "save_steps": 1000,
            "learning_rate": 0.003,
        },
    }  # fmt: skip
    r = httpx.post(f"{studio}/api/v1/runs", json=spec, timeout=60)
    r.raise_for_status()
    rid = r.json()["id"]
    return wait_until(
        lambda: (run := api(studio, f"/runs/{rid}"))["status"] in ("succeeded", "failed") and run,
        300,
        "the tiny run",
        interval=1,
    )


def test_export_gguf_deploy_with_llamacpp_and_chat(page, studio, artifacts, tmp_path):
    run = _finished_run(studio, tmp_path)
    assert run["status"] == "succeeded", run
    ui = StudioPage(page, studio, artifacts / "gguf")
    ui.open(f"?run={run['id']}")
    ui.expect_text("runs-status", f"#{run['id']} {run['name']}", timeout=20_000)

    # 1. Export as GGUF f16 + q8_0: each file's size and llama.cpp's perplexity show in the exports table.
    page.get_by_text("Export", exact=True).click()
    ui.choose("runs-export-kind", "GGUF f16 + q8_0")
    ui.click("runs-export-btn")
    ui.expect_text("runs-action", "queued")

    def gguf_export() -> dict | None:
        found = [e for e in api(studio, f"/exports?run_id={run['id']}") if e["export_format"] == "gguf"]
        return found[0] if found and found[0]["status"] in ("succeeded", "failed") else None

    export = wait_until(gguf_export, 300, "the GGUF export", interval=1)
    assert export["status"] == "succeeded", export["error"]
    ui.expect_text("runs-exports", re.compile(r"q8_0 [0-9.]+ MiB ppl [0-9.]+ \([+-][0-9.]+%\)"))
    files = {f["type"]: f for f in export["gguf_files"]}
    assert set(files) == {"f16", "q8_0"} and files["q8_0"]["size_bytes"] < files["f16"]["size_bytes"]
    assert abs(files["q8_0"]["relative_to_f16"]) < 0.01, files  # q8_0 within 1% of f16's perplexity
    ui.shot("gguf-exported")

    # 2. One click deploys the q8_0 file with llama.cpp and opens Deploy & Chat on it.
    ui.click("runs-gguf-deploy")
    deploy_tab = page.locator("button[role=tab][data-tab-id=deploy]")
    expect(deploy_tab).to_have_attribute("aria-selected", "true", timeout=30_000)
    # the new deployment's own status line, not the one picked before (an earlier test's deployment in this
    # studio, "running": the tab's select event used to keep it, DeployHandlers.on_select)
    ui.expect_text("dep-status", re.compile(r"#\d+ run-\d+-gguf-q8_0 — running"), timeout=180_000)
    dep = next(d for d in api(studio, "/deployments") if d["model_dir"].endswith("model-q8_0.gguf"))
    assert dep["backend"] == "llamacpp" and dep["status"] == "running", dep
    ui.expect_text("dep-table", "llamacpp")
    events = [e["message"] for e in api(studio, f"/deployments/{dep['id']}/events")]
    assert any(m.startswith("backend llamacpp") for m in events), events

    # 3. Chat: the reply streams in (a long reply with end-of-sentence ignored, stopped once it has streamed).
    lengths = reply_streams(ui, "What is 3 + 1?")
    assert lengths == sorted(lengths), lengths
    ui.shot("gguf-chat")

    # The chat proxy hands the sampling parameters to llama-server: max_tokens with ignore_eos is the reply's
    # length, and greedy decoding repeats itself.
    body = {"messages": [{"role": "user", "content": "What is 3 + 1?"}], "temperature": 0, "max_tokens": 12}
    url = f"{studio}/api/v1/deployments/{dep['id']}/chat"
    replies = [httpx.post(url, json={**body, "ignore_eos": True}, timeout=120).json() for _ in range(2)]
    assert replies[0]["usage"]["completion_tokens"] == 12, replies[0]
    assert replies[0]["choices"][0]["message"]["content"] == replies[1]["choices"][0]["message"]["content"]
    stopped = httpx.post(url, json={**body, "ignore_eos": True, "max_tokens": 3}, timeout=120).json()
    assert stopped["usage"]["completion_tokens"] == 3 and stopped["choices"][0]["finish_reason"] == "length"

    httpx.post(f"{studio}/api/v1/deployments/{dep['id']}/stop", timeout=30).raise_for_status()
    wait_until(lambda: api(studio, f"/deployments/{dep['id']}")["status"] == "stopped", 60, "the stop")

    # 4. The Deploy box's engine choice: the run itself deployed with llama.cpp (its q8_0 GGUF written on
    # deploy) answers held-out prompts of the task as the run's Paddle deployment does (greedy); the status
    # line shows the engine.
    ui.choose("dep-run", RUN_NAME)
    ui.choose("dep-backend", "llamacpp")
    ui.click("dep-btn")
    ui.expect_text("dep-status", re.compile(rf"#\d+ {RUN_NAME} — running · llamacpp"), timeout=180_000)
    by_box = next(
        d for d in api(studio, "/deployments")
        if d["run_id"] == run["id"] and d["status"] == "running" and d["backend"] == "llamacpp"
    )  # fmt: skip
    r = httpx.post(
        f"{studio}/api/v1/deployments", json={"run_id": run["id"], "backend": "paddle"}, timeout=30
    )
    assert r.status_code == 201, r.text
    served = {"llamacpp": by_box["id"], "paddle": r.json()["id"]}
    for did in served.values():
        wait_until(
            lambda did=did: api(studio, f"/deployments/{did}")["status"] in ("running", "failed"),
            180,
            "serving",
        )
        assert api(studio, f"/deployments/{did}")["status"] == "running", api(studio, f"/deployments/{did}")
    for prompt in HELD_OUT:
        body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 8}
        answers = {
            b: httpx.post(f"{studio}/api/v1/deployments/{did}/chat", json=body, timeout=120).json()
            for b, did in served.items()
        }
        # stripped: a reply's leading SentencePiece space is dropped by our decoder, kept by llama.cpp's
        text = {b: a["choices"][0]["message"]["content"].strip() for b, a in answers.items()}
        assert text["paddle"] and text["llamacpp"] == text["paddle"], (prompt, text)
    for did in served.values():
        httpx.post(f"{studio}/api/v1/deployments/{did}/stop", timeout=30).raise_for_status()
