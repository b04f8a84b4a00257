"""The forgetting check in the studio's services: what a run's `evaluate.general` accepts and refuses (named
by key), and a sweep's max_general_drop: the trial with the better objective whose general score fell too far
is not eligible as best, and the leaderboard and promote say why.

The trials go through the real life cycle (create_run by the sweep's driver, claim, finish, evaluate_after,
record_samples, finish_eval); the scorer's sample lines are written here as `ernie-studio eval` writes them
(the process-level test, tests/workers/test_forgetting.py, scores real models)."""

from __future__ import annotations

import pytest
from studio_helpers import DEMO_SFT, upload

from engine.eval.general import GENERAL_SETS, general_set_path, paired_change
from engine.eval.items import read_eval_file
from studio.models import Evaluation, Run, RunStatus
from studio.services import eval_after, jobs
from studio.services import evals as evals_svc
from studio.services import sweeps as sweeps_svc
from studio.services.run_lifecycle import claim_run, record_metrics

LR = {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}
MMLU = GENERAL_SETS["mmlu"]


def test_built_in_general_sets_are_benchmarks_the_engine_reads():
    kinds = {name: read_eval_file(str(general_set_path(name)), "auto") for name in GENERAL_SETS}
    assert {n: (f.type, len(f.items)) for n, f in kinds.items()} == {
        "mmlu": ("multiple_choice", 24),
        "ceval": ("multiple_choice", 20),
        "gsm8k": ("gsm8k", 20),
    }
    with pytest.raises(ValueError, match="no built-in general set is called 'mmlu-pro'"):
        general_set_path("mmlu-pro")


def test_paired_change_interval():
    out = paired_change([1.0] * 8 + [0.0] * 8, [0.0] * 8 + [0.0] * 8, resamples=200, seed=1)
    assert out["base"] == 0.5 and out["result"] == 0.0 and out["change"] == -0.5 and out["n"] == 16
    low, high = out["change_ci"]
    assert -0.8 < low < -0.5 < high < -0.2
    same = paired_change([1.0, 0.0, 1.0], [1.0, 0.0, 1.0], resamples=200)
    assert same["change"] == 0 and same["change_ci"] == [0.0, 0.0]


def _refused(client, body: dict) -> str:
    r = client.post("/api/v1/runs", json=body)
    assert r.status_code == 422, r.text
    return r.json()["message"]


def test_general_check_input_is_checked(client):
    ds = upload(client, DEMO_SFT).json()["id"]
    body = {"dataset_ids": [ds], "hyperparameters": {"max_steps": 2}}
    assert "evaluate.general.sets: no built-in general set is called 'mmlu-pro'" in _refused(
        client, {**body, "evaluate": {"general": {"sets": ["mmlu-pro"]}}}
    )
    assert "evaluate.general: give sets (mmlu, ceval, gsm8k) or dataset_ids" in _refused(
        client, {**body, "evaluate": {"general": {}}}
    )
    r = client.post("/api/v1/runs", json={**body, "evaluate": {"general": {"sets": ["mmlu"], "margin": 2}}})
    assert r.status_code == 422 and "margin" in r.text, r.text
    r = client.post("/api/v1/runs", json={**body, "evaluate": {"general": {"sets": ["mmlu", "gsm8k"]}}})
    assert r.status_code == 201, r.text
    run = r.json()
    assert run["forgetting"] is None
    files = client.get(f"/api/v1/runs/{run['id']}").json()
    assert files["forgetting"] is None


def _finish_trial(session, settings, run: Run, eval_loss: float, general_after: list[float]) -> None:
    """The trial's run trains and succeeds; its base and result evals score the built-in MMLU-style set
    (the base answers every item right, the result as given)."""
    attempt = claim_run(session, run.id, "train@n1", "n1")
    record_metrics(session, run.id, [{"step": 2, "eval_loss": eval_loss}])
    attempt.finish(session, RunStatus.SUCCEEDED, model_dir=run.output_dir)
    session.refresh(run)
    made = {ev.role: ev for ev in eval_after.evaluate_after(session, settings, run)}
    assert set(made) == {"base", "result"}
    for role, scores in (("base", [1.0] * len(general_after)), ("result", general_after)):
        ev = made[role]
        assert jobs.claim(session, jobs.EVALS, ev.id, "train@n1") is not None
        rows = [
            {"id": f"{MMLU}:{i + 1}", "dataset": MMLU, "line": i + 1, "scores": {"acc": s, "acc_norm": s}}
            for i, s in enumerate(scores)
        ]
        evals_svc.record_samples(session, ev.id, rows)
        evals_svc.finish_eval(session, ev.id, RunStatus.SUCCEEDED, results={"metrics": {}, "datasets": {}})


def test_sweep_best_trial_must_not_lose_more_than_max_general_drop(client, session, settings):
    ds = upload(client, DEMO_SFT).json()["id"]
    run = {"dataset_ids": [ds], "eval_dataset_ids": [ds], "hyperparameters": {"max_steps": 2}}
    body = {
        "run": run, "parameters": {"learning_rate": LR}, "n_trials": 3, "parallelism": 2,
        "enqueue": [{"learning_rate": 1e-2}, {"learning_rate": 1e-4}], "max_general_drop": 0.1,
    }  # fmt: skip
    r = client.post("/api/v1/sweeps", json=body)
    assert (
        r.status_code == 422
        and "max_general_drop: the constraint reads each trial's forgetting check" in (r.json()["message"])
    )
    body["run"] = {**run, "evaluate": {"general": {"sets": ["mmlu"], "margin": 0.05}}}
    r = client.post("/api/v1/sweeps", json=body)
    assert r.status_code == 201, r.text
    sweep_id = r.json()["id"]
    assert jobs.claim(session, jobs.SWEEPS, sweep_id, "train@n1") is not None  # a worker drives it
    # the driver makes the two enqueued trials' runs (parallelism 2; trial 2 waits for one to end)
    sweeps_svc.advance(session, settings, sweep_id)
    runs = {r.sweep_trial: r for r in session.query(Run).filter(Run.sweep_id == sweep_id)}
    assert set(runs) == {0, 1}
    # trial 0 (lr 1e-2): the better objective, but its general score falls from 1.0 to 0.5
    _finish_trial(session, settings, runs[0], 0.5, [1.0, 0.0] * 12)
    # trial 1 (lr 1e-4): a worse objective, its general score holds
    _finish_trial(session, settings, runs[1], 0.9, [1.0] * 24)
    sweeps_svc.advance(session, settings, sweep_id)  # tells Optuna both ended (and starts trial 2)

    board = client.get(f"/api/v1/sweeps/{sweep_id}").json()["leaderboard"]
    assert [(t["number"], t["value"], t["general_change"]) for t in board] == [(1, 0.9, 0.0), (0, 0.5, -0.5)]
    assert board[0]["ineligible"] is None
    assert board[1]["ineligible"] == "its general score fell by 0.5, more than max_general_drop 0.1"
    best = client.post(f"/api/v1/sweeps/{sweep_id}/promote").json()
    assert best["number"] == 1 and best["run_id"] == runs[1].id

    # the run's forgetting check, as the run page and GET /runs/{id} show it
    got = client.get(f"/api/v1/runs/{runs[0].id}").json()["forgetting"]
    g = got["general"]
    assert (g["base"], g["result"], g["change"], g["n"]) == (1.0, 0.5, -0.5, 24)
    assert g["change_ci"][1] < -0.2 and got["warning"] is True and got["task"] is None
    assert got["eval_ids"] == {
        role: session.query(Evaluation).filter_by(after_run_id=runs[0].id, role=role).one().id
        for role in ("base", "result")
    }
    kinds = [e["kind"] for e in client.get(f"/api/v1/runs/{runs[0].id}/events").json()]
    assert kinds.count("run.forgetting_warning") == 1, kinds
    assert client.get(f"/api/v1/runs/{runs[1].id}").json()["forgetting"]["warning"] is False


def test_run_page_line_shows_both_changes_and_the_warning():
    from studio.ui.run_views import forgetting_text

    g = paired_change([1.0] * 8, [1.0, 0.0] * 4, resamples=100)
    t = paired_change([0.0] * 4, [1.0] * 4, resamples=100)
    check = {"task": t, "general": g, "margin": 0.05, "warning": True}
    en = forgetting_text(check)
    assert en.startswith("**Forgetting check** (base → result, change with its 95% interval)")
    assert "task 0.000 → 1.000 (+1.000 [+1.000, +1.000], n=4)" in en
    assert "general 1.000 → 0.500 (-0.500 [" in en and "fell by more than the margin 0.05" in en
    zh = forgetting_text(check, "zh")
    assert "遗忘检查" in zh and "通用能力 1.000 → 0.500" in zh and "超过阈值 0.05" in zh
    assert "⚠️" not in forgetting_text({**check, "warning": False}) and forgetting_text(None) == ""


def test_max_general_drop_is_a_fraction_and_studio_only():
    from engine.sweep import SweepError, SweepSettings, check_settings, parse_space, settings_from_dict

    space = {"parameters": {"learning_rate": LR}, "max_general_drop": 0.1}
    with pytest.raises(SweepError, match="max_general_drop: the forgetting check scores general sets"):
        settings_from_dict(space, "space.yaml")
    params = parse_space({"learning_rate": LR})
    with pytest.raises(
        SweepError, match="max_general_drop: must be a fraction of accuracy from 0 to 1, got 5"
    ):
        check_settings(SweepSettings(max_general_drop=5), "SFT", params)
    check_settings(SweepSettings(max_general_drop=0.0), "SFT", params)
