"""CPU deployments on the fastest engine by default: on a CPU node with llama.cpp built (`make llamacpp`, which
`make test` runs), a one-click deployment of a text run (`auto`, the studio's default settings) is served by
llama.cpp from a q8_0 GGUF written at the first deployment and kept in the run's folder; its greedy answers to
held-out prompts equal the built-in Paddle server's; the next deployment of the run reuses the file.

The run is a 40-step full fine-tune of the tiny preset on the animal-sound task (tests/animal_sounds.py): its
greedy answers are peaked, so a mismatch would be a real one, not a near-tie of a flat random model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from animal_sounds import sound_records, write_jsonl
from worker_helpers import start_deployment, wait_for

from engine.llamacpp import TOOLS, find_tool

pytestmark = pytest.mark.skipif(
    any(find_tool(t) is None for t in TOOLS),
    reason="llama.cpp's tools are not built (make llamacpp / tools/build_llamacpp.sh)",
)

# item numbers the training records never use (they draw 100..999)
HELD_OUT = [
    f"Item {k}: what does the {a} say?" for k, a in ((17, "cat"), (42, "dog"), (73, "duck"), (5, "cow"))
]


def _answers(api, dep: dict) -> list[str]:
    out = []
    for prompt in HELD_OUT:
        body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 8}
        r = api.post(f"/deployments/{dep['id']}/chat", json=body)
        assert r.status_code == 200, r.text
        # stripped: a reply's leading SentencePiece space is dropped by our decoder, kept by llama.cpp's
        out.append(r.json()["choices"][0]["message"]["content"].strip())
    return out


def _stop(api, dep: dict) -> None:
    api.post(f"/deployments/{dep['id']}/stop").raise_for_status()
    wait_for(lambda: api.get(f"/deployments/{dep['id']}").json()["status"] == "stopped", 60, "the stop")


def test_one_click_deploy_of_a_text_run_serves_through_llamacpp_and_keeps_its_gguf(studio_factory, tmp_path):
    studio = studio_factory(cpu_serving=None)  # the studio's own default, as `make run` starts it
    studio.start_api()
    studio.start_workers()
    api = studio.client()
    data = write_jsonl(tmp_path / "animals.jsonl", sound_records(160, seed=1))
    with data.open("rb") as f:
        r = api.post("/datasets", files={"file": ("animals.jsonl", f)}, data={"name": "animals"})
    assert r.status_code == 201, r.text
    spec = {
        "name": "animals", "base_model": "tiny", "fine_tuning": "Full", "dataset_ids": [r.json()["id"]],
        "hyperparameters": {
            "max_steps": 40, "max_seq_len": 48, "per_device_train_batch_size": 8, "save_steps": 1000,
            "learning_rate": 0.003,
        },
    }  # fmt: skip
    r = api.post("/runs", json=spec)
    assert r.status_code == 201, r.text
    run = studio.wait_status(api, r.json()["id"], {"succeeded", "failed"}, 300)
    assert run["status"] == "succeeded", run["error"]

    # one click: the run, backend auto
    dep = start_deployment(api, {"run_id": run["id"]}, timeout=240)
    assert dep["status"] == "running", dep["error"]
    assert dep["backend"] == "llamacpp", dep
    events = [e["message"] for e in api.get(f"/deployments/{dep['id']}/events").json()]
    chosen = [m for m in events if m.startswith("backend ")]
    assert chosen and chosen[0].startswith("backend llamacpp: FastDeploy is not installed; llama.cpp ("), (
        events
    )
    assert chosen[0].endswith("is installed on this CPU node and serves this model (q8_0 GGUF)"), chosen
    run_dir = (studio.home / "runs" / str(run["id"])).resolve()
    inside = Path(run["model_dir"]).resolve().relative_to(run_dir)  # the run's model, e.g. output
    gguf = run_dir / "serving-gguf" / inside / "model-q8_0.gguf"
    assert gguf.is_file(), sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*.gguf"))
    assert [p.name for p in gguf.parent.iterdir()] == ["model-q8_0.gguf"]  # no f16 or half-written file left
    written = gguf.stat().st_mtime_ns
    by_llamacpp = _answers(api, dep)
    _stop(api, dep)

    paddle = start_deployment(api, {"run_id": run["id"], "backend": "paddle"}, timeout=240)
    assert paddle["status"] == "running" and paddle["backend"] == "paddle", paddle
    by_paddle = _answers(api, paddle)
    _stop(api, paddle)
    print(f"held-out answers: llama.cpp q8_0 {by_llamacpp}, built-in {by_paddle}")
    assert all(by_paddle) and by_llamacpp == by_paddle

    # the next deployment of the run serves the same file, not a new one
    again = start_deployment(api, {"run_id": run["id"]}, timeout=240)
    assert again["status"] == "running" and again["backend"] == "llamacpp", again
    assert gguf.stat().st_mtime_ns == written
    log = (studio.home / "deployments" / str(again["id"]) / "server.log").read_text()
    assert f"llama.cpp serves {gguf}" in log, log[-2000:]
    _stop(api, again)
