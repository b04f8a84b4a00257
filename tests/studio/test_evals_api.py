"""Evaluations through the REST API without a worker: bad requests get located 4xx errors, the held-out
split of "evaluate after training" is kept out of the trainer's files, sample rows import once however
often they are read, the sample browser puts the samples two evals differ on first, and the evals after
training are queued once."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from studio_helpers import DEMO_DPO, DEMO_SFT, upload

from studio.db import session_factory
from studio.models import Evaluation, Run, RunStatus
from studio.services import eval_after
from studio.services import evals as evals_svc


def _lines(path: str | Path) -> list[str]:
    return [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def _canonical(lines: list[str]) -> Counter:
    return Counter(json.dumps(json.loads(x), sort_keys=True, ensure_ascii=False) for x in lines)


def test_bad_eval_requests_get_located_errors(client, settings):
    sft = upload(client, DEMO_SFT).json()
    dpo = upload(client, DEMO_DPO).json()

    def post(**body):
        return client.post("/api/v1/evals", json={"dataset_ids": [sft["id"]], **body})

    ok = post(model="tiny", options={"max_new_tokens": 8, "metrics": ["exact_match", "rouge_l"]})
    assert ok.status_code == 201, ok.text
    ev = ok.json()
    assert ev["status"] == "queued" and ev["samples_total"] == 400 and ev["samples_done"] == 0
    assert ev["config"]["max_new_tokens"] == 8 and ev["config"]["eval_dataset_type"] == "erniekit"
    assert ev["output_dir"] == str(settings.home / "evals" / str(ev["id"]) / "output")

    cases = [
        (post(model="tiny", run_id=1), 422, "exactly one of model"),
        (post(), 422, "exactly one of model"),
        (post(model="tiny", dataset_ids=[dpo["id"]]), 422, f"dataset_ids: dataset {dpo['id']}"),
        (post(model="tiny", options={"max_new_token": 8}), 422, "options.max_new_token: not an ernie-studio eval key; did you mean 'max_new_tokens'"),
        (post(model="tiny", options={"output_dir": "/tmp/x"}), 422, "options.output_dir: set by the studio"),
        (post(model="tiny", options={"judge_api_key": "k"}), 422, "ERNIE_STUDIO_JUDGE_API_KEY"),
        (post(model="tiny", options={"max_new_tokens": 0}), 422, "max_new_tokens"),
        (post(model="tiny", options={"metrics": ["judge"]}), 422, "judge_url"),
        (post(model="/etc"), 422, "model:"),
        (post(model="tiny", dataset_ids=[999]), 404, "dataset 999"),
        (post(model="tiny", judge_deployment_id=5, options={"metrics": ["judge"]}), 404, "deployment 5"),
        (client.get("/api/v1/evals/999"), 404, "eval 999 does not exist"),
        (client.get("/api/v1/evals/999/samples"), 404, "eval 999"),
        (client.get(f"/api/v1/evals/{ev['id']}/samples", params={"only_differ": True}), 422, "only_differ"),
        (client.get(f"/api/v1/evals/{ev['id']}/samples", params={"compare_to": ev["id"]}), 422, "compare_to"),
    ]  # fmt: skip
    for response, status, text in cases:
        assert response.status_code == status, (text, response.text)
        assert text in response.json()["message"], (text, response.json())

    run = client.post(
        "/api/v1/runs", json={"dataset_ids": [sft["id"]], "hyperparameters": {"max_steps": 2}}
    ).json()
    r = post(run_id=run["id"])
    assert r.status_code == 409 and f"run_id: run {run['id']} is queued" in r.json()["message"]

    def run_with(evaluate: dict, **spec):
        return client.post("/api/v1/runs", json={"dataset_ids": [sft["id"]], "evaluate": evaluate, **spec})

    r = run_with({"holdout": 400})
    assert r.status_code == 422 and "evaluate.holdout: hold out between 1 and 399" in r.json()["message"]
    r = run_with({})
    assert r.status_code == 422 and "evaluate: give holdout" in r.json()["message"]
    r = run_with({"holdout": 5, "options": {"metricz": "bleu"}})
    assert r.status_code == 422 and "evaluate.options.metricz" in r.json()["message"]
    r = client.post(
        "/api/v1/runs", json={"dataset_ids": [dpo["id"]], "stage": "DPO", "evaluate": {"holdout": 5}}
    )
    assert r.status_code == 422 and "evaluate: runs of stage SFT" in r.json()["message"]
    # nothing of the refused runs is left behind: no split files, no rows
    assert len(client.get("/api/v1/runs").json()) == 1
    assert not list((settings.home / "runs").glob("*/data"))


def test_holdout_is_kept_out_of_the_trainers_files(client, settings):
    sft = upload(client, DEMO_SFT).json()
    body = {
        "dataset_ids": [sft["id"]],
        "hyperparameters": {"max_steps": 2, "seed": 7},
        "evaluate": {"holdout": 40, "options": {"max_new_tokens": 8}},
    }
    run = client.post("/api/v1/runs", json=body).json()
    plan = run_plan(settings, run["id"])
    train_path = run["config"]["train_dataset_path"]
    assert Path(train_path).parent == settings.home / "runs" / str(run["id"]) / "data"
    held = plan["holdout_files"]
    assert [h["records"] for h in held] == [40] and plan["seed"] == 7
    train, out = _lines(train_path), _lines(held[0]["path"])
    assert len(train) == 360 and len(out) == 40
    original = _canonical(_lines(DEMO_SFT))
    assert _canonical(train) + _canonical(out) == original  # a split: nothing lost, nothing trained twice
    # The ERNIEKit YAML the trainer gets names the training split only.
    yaml_text = client.get(f"/api/v1/runs/{run['id']}/config").text
    assert train_path in yaml_text and "holdout.jsonl" not in yaml_text
    # Seeded: a clone holds out the same records.
    clone = client.post(f"/api/v1/runs/{run['id']}/clone", json={}).json()
    assert _lines(run_plan(settings, clone["id"])["holdout_files"][0]["path"]) == out


def run_plan(settings, run_id: int) -> dict:
    with session_factory(settings)() as s:
        return s.get(Run, run_id).evaluate


def _rows(preds: list[str], judge: list[float] | None = None) -> list[dict]:
    return [
        {
            "id": f"held.jsonl:{i + 1}", "dataset": "held.jsonl", "line": i + 1, "prompt": f"q{i}",
            "reference": "meow", "prediction": p,
            "scores": {"exact_match": float(p == "meow"), **({"judge": judge[i]} if judge else {})},
        }
        for i, p in enumerate(preds)
    ]  # fmt: skip


def test_samples_import_once_and_differences_come_first(client, settings):
    sft = upload(client, DEMO_SFT).json()
    a = client.post("/api/v1/evals", json={"model": "tiny", "dataset_ids": [sft["id"]]}).json()
    b = client.post("/api/v1/evals", json={"model": "tiny", "dataset_ids": [sft["id"]]}).json()
    with session_factory(settings)() as s:
        rows = _rows(["x", "y", "meow", "meow", "z"])
        assert evals_svc.record_samples(s, a["id"], rows[:3]) == 3
        # A restarted worker reads the whole file again: only the new lines are stored.
        assert evals_svc.record_samples(s, a["id"], rows) == 2
        assert evals_svc.record_samples(s, a["id"], rows) == 0
        evals_svc.record_samples(
            s, b["id"], _rows(["meow", "y", "meow", "meow", "meow"], [1, 0.5, 0.5, 0.75, 0])
        )
        s.get(Evaluation, b["id"]).config = {
            "metrics": ["judge"],
            "judge_mode": "pairwise",
            "judge_baseline": "x",
        }
        s.commit()
    assert client.get(f"/api/v1/evals/{a['id']}").json()["samples_done"] == 5
    page = client.get(f"/api/v1/evals/{a['id']}/samples", params={"compare_to": b["id"], "limit": 10}).json()
    assert page["total"] == 5
    assert [i["line"] for i in page["items"]] == [1, 5, 2, 3, 4]  # the two that differ first, then in order
    assert [i["differ"] for i in page["items"]] == [True, True, False, False, False]
    assert page["items"][0]["prediction"] == "x" and page["items"][0]["other"]["prediction"] == "meow"
    only = client.get(
        f"/api/v1/evals/{a['id']}/samples", params={"compare_to": b["id"], "only_differ": True, "limit": 1}
    ).json()
    assert only["total"] == 2 and len(only["items"]) == 1
    cmp = client.get("/api/v1/evals/compare", params={"eval_ids": [a["id"], b["id"]]}).json()
    assert cmp["differ"] == {"evals": [a["id"], b["id"]], "samples": 2, "of": 5}
    pw = cmp["pairwise"][str(b["id"])]
    assert (pw["wins"], pw["ties"], pw["losses"]) == (2, 2, 1) and abs(pw["win_rate"] - 0.55) < 1e-9


def test_evals_after_training_are_queued_once(client, settings):
    sft = upload(client, DEMO_SFT).json()
    body = {"dataset_ids": [sft["id"]], "hyperparameters": {"max_steps": 2}, "evaluate": {"holdout": 8}}
    run = client.post("/api/v1/runs", json=body).json()
    with session_factory(settings)() as s:
        row = s.get(Run, run["id"])
        assert eval_after.evaluate_after(s, settings, row) == []  # not succeeded yet
        row.status, row.model_dir = RunStatus.SUCCEEDED, row.output_dir
        s.commit()
        made = eval_after.evaluate_finished_runs(s, settings)  # as the reconciler finds it
        assert made == 1
        assert eval_after.evaluate_after(s, settings, row) == []
        assert eval_after.evaluate_finished_runs(s, settings) == 0
    evals = client.get("/api/v1/evals", params={"run_id": run["id"]}).json()
    assert sorted((e["role"], e["model"]) for e in evals) == [
        ("base", "tiny"),
        ("result", f"run:{run['id']}"),
    ]
    assert {e["samples_total"] for e in evals} == {8}
    assert all(e["config"]["eval_dataset_path"].endswith("sft_demo.holdout.jsonl") for e in evals)


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "eval"


def test_benchmark_files_are_eval_datasets_and_never_training_data(client, tmp_path):
    # The example files docs/evaluation.md describes (MMLU, ARC, C-Eval as CSV, GSM8K), detected by the
    # engine's one detection (engine.eval.items.detect_benchmark).
    shapes = {
        "mmlu_style.jsonl": ("multiple_choice", 4), "arc_style.jsonl": ("multiple_choice", 3),
        "ceval_style.csv": ("multiple_choice", 3), "gsm8k_style.jsonl": ("gsm8k", 3),
    }  # fmt: skip
    ids = {}
    for name, (fmt, n) in shapes.items():
        r = upload(client, EXAMPLES / name)
        assert r.status_code == 201, r.text
        ds = r.json()
        assert (ds["format"], ds["kind"], ds["num_records"], ds["num_valid"]) == (fmt, "benchmark", n, n)
        ids[name] = ds["id"]

    # The CSV pages like JSONL, one record per row with the header's names.
    page = client.get(f"/api/v1/datasets/{ids['ceval_style.csv']}/preview", params={"offset": 1, "limit": 5})
    assert page.json()["total"] == 3 and [r["answer"] for r in page.json()["records"]] == ["C", "A"]
    assert page.json()["records"][0]["question"] == "一年有几个月？"
    r = client.get(f"/api/v1/datasets/{ids['mmlu_style.jsonl']}/preview", params={"render_with": "tiny"})
    assert r.status_code == 422 and "is a multiple_choice benchmark" in r.json()["message"]
    r = client.get(f"/api/v1/datasets/{ids['gsm8k_style.jsonl']}/stats", params={"model": "tiny"})
    assert r.status_code == 422 and "benchmarks are not trained on" in r.json()["message"]

    # Bad benchmark files: every problem with its file and line, nothing kept.
    rows = [json.loads(x) for x in _lines(EXAMPLES / "mmlu_style.jsonl")]
    rows[1]["answer"], rows[3]["answer"] = 7, "E"
    bad = tmp_path / "bad_mc.jsonl"
    bad.write_text("".join(json.dumps(x) + "\n" for x in rows), encoding="utf-8")
    r = upload(client, bad)
    body = r.json()
    assert (
        r.status_code == 422
        and "not a valid multiple_choice benchmark file (2 problem(s))" in body["message"]
    )
    assert [p.split(": ")[0] for p in body["details"]["problems"]] == ["bad_mc.jsonl:2", "bad_mc.jsonl:4"]
    assert "answer 7 is not among the choices (A, B, C, D" in body["details"]["problems"][0]
    assert body["details"]["kind"] == "benchmark"
    table = tmp_path / "scores.csv"
    table.write_text("name,score\nann,3\n", encoding="utf-8")
    r = upload(client, table)
    assert r.status_code == 422 and "scores.csv: a table is read as a benchmark file" in r.json()["message"]
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "2 + 2?", "answer": "four"}) + "\n", encoding="utf-8")
    r = upload(client, gsm)
    assert r.status_code == 422 and "gsm.jsonl:1: answer 'four' has no final number" in r.json()["message"]
    assert len(client.get("/api/v1/datasets").json()) == len(shapes)

    # Evaluations take them (with chat records alongside); runs refuse them as training data.
    chat = upload(client, EXAMPLES / "qa_eval.jsonl").json()
    r = client.post(
        "/api/v1/evals",
        json={"model": "tiny", "dataset_ids": [*ids.values(), chat["id"]], "options": {"max_new_tokens": 8}},
    )
    assert r.status_code == 201, r.text
    ev = r.json()
    assert (
        ev["config"]["eval_dataset_type"] == "multiple_choice,multiple_choice,multiple_choice,gsm8k,erniekit"
    )
    assert ev["samples_total"] == 4 + 3 + 3 + 3 + 6
    for field in ("dataset_ids", "eval_dataset_ids"):
        body = {"dataset_ids": [chat["id"]], field: [ids["arc_style.jsonl"]]}
        r = client.post("/api/v1/runs", json=body)
        assert r.status_code == 422, r.text
        assert (
            f"{field}: dataset {ids['arc_style.jsonl']} (arc_style) is a multiple_choice benchmark file"
            in (r.json()["message"])
        )


def test_judge_by_deployment_or_external_url_and_key_and_pairwise_baseline(client, settings):
    import stat

    from studio.models import Deployment
    from studio.ui.context import UIContext
    from studio.ui.evaluate_tab import EvaluateHandlers, JudgeFields, judge_spec
    from studio.ui.i18n import Texts

    qa = upload(client, EXAMPLES / "qa_eval.jsonl").json()["id"]
    mc = upload(client, EXAMPLES / "mmlu_style.jsonl").json()["id"]
    with session_factory(settings)() as s:
        deps = [
            Deployment(name="judge", model_dir="m", status="running", url="http://127.0.0.1:8188"),
            Deployment(name="gone", model_dir="m", status="stopped", url=None),
        ]
        s.add_all(deps)
        s.commit()
        running, stopped = (d.id for d in deps)
    judged = {"max_new_tokens": 8, "metrics": ["exact_match", "judge"]}

    def post(dataset_ids=(qa,), **body):
        return client.post("/api/v1/evals", json={"model": "tiny", "dataset_ids": list(dataset_ids), **body})

    r = post(judge_deployment_id=running, options=judged)
    assert r.status_code == 201, r.text
    by_deployment = r.json()
    assert by_deployment["config"]["judge_url"] == "http://127.0.0.1:8188/v1"
    assert evals_svc.judge_environment(settings, by_deployment["id"]) == {}

    # An external judge: its key is kept beside the eval (mode 600), handed to the scorer's environment,
    # and never returned or written to the config.
    key = "sk-test-0123456789"
    external = {**judged, "judge_url": "https://judge.example/v1", "judge_model": "big"}
    r = post(options=external, judge_api_key=key)
    assert r.status_code == 201, r.text
    ev = r.json()
    assert key not in r.text and key not in client.get(f"/api/v1/evals/{ev['id']}").text
    assert ev["config"]["judge_url"] == "https://judge.example/v1" and "judge_api_key" not in ev["config"]
    path = evals_svc.judge_key_path(settings, ev["id"])
    assert path.read_text() == key and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert evals_svc.judge_environment(settings, ev["id"]) == {"ERNIE_STUDIO_EVAL_JUDGE_API_KEY": key}
    assert client.delete(f"/api/v1/evals/{ev['id']}").status_code == 204 and not path.exists()

    # The baseline of pairwise judging: a finished eval of the same datasets.
    with session_factory(settings)() as s:
        s.get(Evaluation, by_deployment["id"]).status = RunStatus.SUCCEEDED
        s.commit()
    r = post(judge_deployment_id=running, judge_baseline_eval_id=by_deployment["id"], options=judged)
    assert r.status_code == 201, r.text
    assert r.json()["config"]["judge_mode"] == "pairwise"
    assert r.json()["config"]["judge_baseline"] == f"{by_deployment['output_dir']}/eval_samples.jsonl"

    cases = [
        (post(judge_deployment_id=stopped, options=judged), 409, f"deployment {stopped} is stopped"),
        (post(judge_deployment_id=running, options={"max_new_tokens": 8}), 422, "judge_deployment_id: options.metrics has no judge"),
        (post(judge_deployment_id=running, options=external), 422, "not both"),
        (post(judge_api_key=key, options={**judged, "judge_url": ""}), 422, "judge_api_key: the key of an external judge needs options.judge_url"),
        (post(judge_api_key="a b", options=external), 422, "judge_api_key: must be 1 to"),
        (post(judge_deployment_id=running, judge_baseline_eval_id=by_deployment["id"], options={**judged, "judge_mode": "score"}), 422, "a baseline is for judge_mode pairwise"),
        (post(dataset_ids=(mc,), judge_deployment_id=running, judge_baseline_eval_id=by_deployment["id"], options=judged), 422, f"did not score dataset(s) [{mc}]"),
        (post(judge_deployment_id=running, judge_baseline_eval_id=r.json()["id"], options=judged), 409, "judge against a finished eval"),
    ]  # fmt: skip
    for response, status, text in cases:
        assert response.status_code == status, (text, response.text)
        assert text in response.json()["message"], (text, response.json())

    # The Evaluate tab's judge box makes the same requests through the same service.
    h = EvaluateHandlers(UIContext(settings=settings, texts=Texts(), demo=None))
    refreshed = h.refresh()
    assert refreshed[6]["choices"] == [(f"#{running} judge · http://127.0.0.1:8188", running)]
    assert [c[1] for c in refreshed[7]["choices"]] == [by_deployment["id"]]
    fields = (running, "", "default", "", "pairwise", f"{by_deployment['id']}")
    shown = h.launch(["tiny"], [str(qa)], ["exact_match"], 8, *fields)
    made = client.get("/api/v1/evals").json()[0]
    assert f"#{made['id']}" in shown and made["config"]["metrics"] == ["exact_match", "judge"]
    assert made["config"]["judge_mode"] == "pairwise" and made["config"]["judge_baseline"].endswith(
        f"evals/{by_deployment['id']}/output/eval_samples.jsonl"
    )
    options = {"metrics": ["bleu"]}
    spec = judge_spec(JudgeFields(None, " https://x.example/v1 ", "gpt", " k1 ", "score", None), options)
    assert spec == {"judge_deployment_id": None, "judge_baseline_eval_id": None, "judge_api_key": "k1"}
    assert options == {"metrics": ["bleu", "judge"], "judge_mode": "score", "judge_url": "https://x.example/v1", "judge_model": "gpt"}  # fmt: skip
    for no_judge in (
        JudgeFields(mode="pairwise"), JudgeFields(api_key="k"), JudgeFields(baseline="3"), JudgeFields(model="gpt"),
    ):  # fmt: skip
        with pytest.raises(Exception, match="Pick a judge"):
            judge_spec(no_judge, {"metrics": []})
    assert (
        judge_spec(JudgeFields(), {"metrics": []})
        == judge_spec(JudgeFields(model=" "), {"metrics": []})
        == {}
    )
