"""End to end through the REST API on Redis + PostgreSQL with real Celery worker processes: upload the demo
data, a LoRA SFT run on the tiny preset goes queued -> running -> succeeded, its metrics and checkpoints
are listed, and a deployment of it answers chat (plain and streamed) until it is stopped; one request
exports a member of an elastic run and deploys it, and the member answers the `openai` client. Through all
of it, neither worker process loads Paddle: the trainers, exports and servers it starts do."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from worker_helpers import wait_for


def test_upload_train_deploy_chat(studio_factory, pg_url, shared_redis_url):
    studio = studio_factory(database_url=pg_url, broker_url=shared_redis_url)
    studio.start_api()
    studio.start_worker("train@testnode")
    studio.start_worker("serve@testnode", serve=True)
    api = studio.client()

    ds = studio.upload_demo(api)
    assert (ds["format"], ds["kind"], ds["num_valid"]) == ("erniekit", "sft", 400)
    run = studio.create_run(api, ds["id"], max_steps=6, save_steps=2, logging_steps=1)
    # An elastic run of tiny-moe trains after it (its member is exported and deployed at the end).
    elastic = {
        "max_steps": 4, "save_steps": 100, "eval_steps": 4, "max_evaluate_steps": 1, "elastic": True,
        "elastic_depth_choices": "2", "elastic_experts_choices": "4", "elastic_topk_choices": "1",
    }  # fmt: skip
    body = {
        "dataset_ids": [ds["id"]],
        "fine_tuning": "Full",
        "base_model": "tiny-moe",
        "hyperparameters": elastic,
    }
    elastic_run = api.post("/runs", json=body)
    assert elastic_run.status_code == 201, elastic_run.text
    elastic_run = elastic_run.json()
    seen = [run["status"]]
    final = None

    def progressed():
        nonlocal final
        r = api.get(f"/runs/{run['id']}").json()
        if r["status"] != seen[-1]:
            seen.append(r["status"])
        final = r
        return r["status"] in ("succeeded", "failed", "cancelled")

    wait_for(progressed, 180, "the run to finish", interval=0.1)
    assert seen == ["queued", "running", "succeeded"], (seen, final["error"])
    assert final["attempt"] == 1 and final["worker"] == "train@testnode" and final["queue"] == "train"
    assert final["started_at"] <= final["ended_at"]
    kinds = [e["kind"] for e in api.get(f"/runs/{run['id']}/events").json()]
    assert kinds == ["run.queued", "run.running", "run.succeeded"]

    metrics = api.get(f"/runs/{run['id']}/metrics").json()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(isinstance(m["loss"], float) and m["loss"] > 0 for m in metrics)
    on_disk = [json.loads(x) for x in (Path(final["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics] == [row["loss"] for row in on_disk]
    checkpoints = api.get(f"/runs/{run['id']}/checkpoints").json()
    assert [c["step"] for c in checkpoints] == [2, 4, 6]
    assert all(Path(c["path"]).is_dir() for c in checkpoints)
    assert final["final_metrics"]["step"] == 6
    logs = api.get(f"/runs/{run['id']}/logs").json()
    assert "training finished: 6 steps" in logs["text"] and logs["next_offset"] == logs["size"]

    # Export (LoRA merge, Paddle layout): the merged model appears among the base models.
    export = api.post(f"/runs/{run['id']}/export", json={"layout": "paddle"}).json()
    export = wait_for(
        lambda: (e := api.get(f"/exports/{export['id']}").json())["status"] in ("succeeded", "failed") and e,
        120,
        "the export",
        interval=0.2,
    )
    assert export["status"] == "succeeded", export["error"]
    merged = {m["name"]: m for m in api.get("/models").json()}[f"run-{run['id']}-paddle"]
    assert merged["kind"] == "local" and merged["available"] and merged["model_type"] == "ernie4_5"

    from worker_helpers import start_deployment

    dep = start_deployment(api, {"run_id": run["id"]})
    assert dep["status"] == "running", dep["error"]
    assert dep["backend"] == "paddle" and dep["url"] == f"http://127.0.0.1:{dep['port']}/v1"

    ask = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8, "temperature": 0}
    answer = api.post(f"/deployments/{dep['id']}/chat", json=ask)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1
    text = body["choices"][0]["message"]["content"]

    # `stream_options` passes through the studio's proxy: the last chunk is OpenAI's usage chunk.
    streamed_ask = {**ask, "stream": True, "stream_options": {"include_usage": True}}
    with api.stream("POST", f"/deployments/{dep['id']}/chat", json=streamed_ask) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    usage_chunk = json.loads(events[-2])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == body["usage"]
    streamed = "".join(
        (c["choices"][0]["delta"].get("content") or "") for c in map(json.loads, events[:-1]) if c["choices"]
    )
    assert streamed == text  # greedy decoding: the streamed answer is the same answer

    stopped = api.post(f"/deployments/{dep['id']}/stop").json()
    assert stopped["status"] in ("stopping", "stopped")
    wait_for(lambda: api.get(f"/deployments/{dep['id']}").json()["status"] == "stopped", 30, "the stop")
    try:
        httpx.get(f"http://127.0.0.1:{dep['port']}/health", timeout=2)
        raise AssertionError("the model server still answers after the deployment stopped")
    except httpx.ConnectError:
        pass
    gone = api.post(f"/deployments/{dep['id']}/chat", json=ask)
    assert gone.status_code == 409 and "stopped" in gone.json()["message"]

    # One request exports an elastic run's member and deploys it once written; the worker chains the two.
    elastic_run = studio.wait_status(api, elastic_run["id"], {"succeeded", "failed"}, 240)
    assert elastic_run["status"] == "succeeded", elastic_run["error"]
    members = [m["member"] for m in api.get(f"/runs/{elastic_run['id']}/elastic").json()["members"]]
    assert members == ["d3-e8-k2", "d2-e4-k1"]
    refused = api.post(f"/runs/{elastic_run['id']}/elastic/deploy", json={"member": "d1-e4-k1"})
    assert refused.status_code == 422 and refused.json()["message"].startswith("member: 'd1-e4-k1' is not in")
    chain = api.post(f"/runs/{elastic_run['id']}/elastic/deploy", json={"member": "d2-e4-k1"})
    assert chain.status_code == 201, chain.text
    states = [chain.json()["deploy_state"]]

    def deployed():
        e = api.get(f"/exports/{chain.json()['id']}").json()
        if e["deploy_state"] != states[-1]:
            states.append(e["deploy_state"])
        return e["deploy_state"] in ("running", "failed", "export_failed") and e

    chained = wait_for(deployed, 240, "the member's export and deployment", interval=0.1)
    member_dep = api.get(f"/deployments/{chained['deployment_id']}").json()
    assert chained["deploy_state"] == "running", (chained["error"], member_dep["error"])
    assert states == ["exporting", "deploying", "running"]
    assert (member_dep["model_dir"], member_dep["run_id"]) == (chained["export_dir"], elastic_run["id"])
    config = json.loads((Path(member_dep["model_dir"]) / "config.json").read_text())
    assert (config["num_hidden_layers"], config["moe_num_experts"], config["moe_k"]) == (2, 4, 1)

    import openai

    client = openai.OpenAI(base_url=member_dep["url"], api_key="unused")
    reply = client.chat.completions.create(
        model="default", messages=ask["messages"], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens >= 1
    assert api.post(f"/deployments/{member_dep['id']}/stop").json()["status"] in ("stopping", "stopped")

    # A worker that loaded Paddle costs 1.5-2.5 s of CPU at each start and several hundred MB for its life.
    for name in ("train@testnode", "serve@testnode"):
        maps = Path(f"/proc/{studio.procs[name].pid}/maps").read_text()
        assert "libpaddle" not in maps, f"worker {name} loaded Paddle"
