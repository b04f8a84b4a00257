"""The pre-flight estimate through REST and the Train form: checked against the node serving the run's
queue (a warning when it will not fit), recorded on the run; and the ETA / progress in GET /runs/{id}."""

from __future__ import annotations

import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
from sqlalchemy import event, text
from studio_helpers import DEMO_DPO, DEMO_SFT, upload

from engine.models.config import ErnieConfig
from engine.models.presets import preset_fields
from studio.config import Settings
from studio.db import session_factory
from studio.migrate import upgrade
from studio.models import Dataset, Run, RunMetric, RunStatus, utcnow
from studio.services import nodes as nodes_svc
from studio.services import run_lifecycle
from studio.services import runs as runs_svc
from studio.services.progress import run_progress
from studio.ui import i18n
from studio.ui.context import UIContext
from studio.ui.estimate_text import format_plan, launch_warning
from studio.ui.i18n import Texts
from studio.ui.run_views import predicted_vs_measured
from studio.ui.train_tab import CONFIG_KEYS, TrainHandlers, form_defaults

GIB = 2**30


def cpu_node(session, name: str, ram_gib: float, queues=("train", "cpu"), probe: float = 4300.0) -> None:
    nodes_svc.register_node(session, name=name, node=name.split("@")[-1], hostname="h", queues=list(queues))
    nodes_svc.record_doctor(
        session,
        name,
        {
            "passed": True,
            "facts": {"devices": [], "memory": {"total_bytes": int(ram_gib * GIB)}, "cpu_count": 2},
            "checks": [{"name": "throughput", "passed": True, "values": {"tokens_per_second": probe}}],
        },
    )


@pytest.fixture
def big_model(settings) -> str:
    """The official 21B-A3B config.json in a model dir under home (no weights: estimates read the config)."""
    d = settings.models_dir / "ernie-21b-config-only"
    d.mkdir(parents=True)
    ErnieConfig(**preset_fields("ernie-4.5-21b-a3b")).save(d)
    return str(d)


def test_estimate_warns_when_the_run_will_not_fit_the_node_of_its_queue(client, session, big_model):
    cpu_node(session, "train@small", ram_gib=16)
    ds = upload(client, DEMO_SFT).json()
    spec = {
        "base_model": big_model,
        "dataset_ids": [ds["id"]],
        "fine_tuning": "Full",
        "hyperparameters": {"max_steps": 10, "max_seq_len": 512, "compute_type": "bf16"},
    }
    est = client.post("/api/v1/runs/estimate", json=spec).json()
    assert est["fits"] is False
    assert est["warning"].startswith("will not fit") and "train@small" in est["warning"]
    assert est["node"]["name"] == "train@small" and est["node"]["probe_tokens_per_second"] == 4300.0
    assert est["memory_gib"]["peak"] > 16 and est["precision"] == "bf16-emulated"
    assert est["parameters"]["active"] < 0.2 * est["num_parameters"]
    # a node with the RAM for it takes it (the checkpoint's serialised copy of 21.8B fp32 weights and
    # moments included)
    cpu_node(session, "train@small", ram_gib=2048)
    assert client.post("/api/v1/runs/estimate", json=spec).json()["fits"] is True
    # the warning is recorded on the run it was made for, and the launch message repeats it
    cpu_node(session, "train@small", ram_gib=16)
    run = client.post("/api/v1/runs", json=spec).json()
    assert run["estimate"]["warning"].startswith("will not fit")
    assert launch_warning(run["estimate"]).startswith("⚠️ **will not fit")


def test_estimate_without_a_reporting_node_says_it_was_not_checked(client):
    ds = upload(client, DEMO_SFT).json()
    est = client.post("/api/v1/runs/estimate", json={"dataset_ids": [ds["id"]]}).json()
    assert est["fits"] is None and est["warning"] is None and est["node"] is None
    assert any("not checked against a node" in a for a in est["assumptions"])


def test_the_train_form_shows_the_warning(settings, session, big_model):
    cpu_node(session, "train@small", ram_gib=8)
    ctx = UIContext(settings=settings, texts=Texts(), demo=None)
    from studio.services import datasets as datasets_svc

    ds = ctx.call(datasets_svc.upload_dataset, settings, str(DEMO_SFT)).id
    keys = ["base_model", "dataset_ids", *CONFIG_KEYS]
    form = {"base_model": big_model, "dataset_ids": [ds], **form_defaults("SFT", "Full")}
    form["max_steps"] = 5
    shown = TrainHandlers(ctx, keys).show_estimate(*form.values())
    assert shown.startswith("⚠️ **will not fit") and "train@small" in shown
    assert "trainable parameters" in shown and "assumptions" in shown
    assert "**Proposed settings** for" in shown and "**Nothing fits** on 1 device(s)" in shown


@pytest.fixture
def chinese(monkeypatch):
    """The UI in Chinese, with the old sentence patterns out of the way: what is Chinese is so by key."""
    token = i18n.LocalContext.request.set(SimpleNamespace(session_hash="zh-estimate"))
    i18n.remember_language("zh")
    yield
    i18n.LocalContext.request.reset(token)


def test_the_estimate_its_record_and_its_launch_are_chinese_in_chinese(
    settings, session, client, big_model, chinese
):
    ctx = UIContext(settings=settings, texts=Texts(), demo=None)
    handlers = TrainHandlers(ctx, ["base_model", "dataset_ids", *CONFIG_KEYS])
    with_stats, without = upload(client, DEMO_SFT).json()["id"], upload(client, DEMO_SFT).json()["id"]
    form = {"base_model": big_model, "dataset_ids": [with_stats, without], **form_defaults("SFT", "Full")}
    form["max_steps"] = 5
    # the second dataset has no token statistics (the model dir holds no tokenizer), the first has some
    ds = session.get(Dataset, with_stats)
    ds.stats = {f"{big_model}@{form['max_seq_len']}": {"num_valid": 400, "mean_length": 180.0,
                                                        "p95_length": 400.0, "max_length": 900}}  # fmt: skip
    session.commit()
    shown = handlers.show_estimate(*form.values())
    assert "1 个数据集尚无 Token 统计" in shown and "服务此队列的工作进程尚未上报：未对照节点检查" in shown
    assert "个权重参与训练（Full）" in shown and "数据：400 个样本，平均 180 / p95 400" in shown
    cpu_node(session, "train@small", ram_gib=8)
    shown = handlers.show_estimate(*form.values())
    assert shown.startswith("⚠️ **放不下：任务峰值约需 ") and "而 train@small 的内存（8.0 GiB）不足" in shown
    # the run keeps its estimate: the launch message and the Runs tab show its warning in Chinese
    launched, run_id = handlers.launch(*form.values())
    assert launched.startswith("⚠️ **放不下：任务峰值约需 "), launched
    session.expire_all()
    stored = session.get(Run, run_id).estimate  # read back through the column (studio.models.KeyedJSON)
    assert stored["warning"].startswith("will not fit") and "message_keys" not in stored
    raw = session.execute(text("SELECT estimate FROM runs WHERE id = :id"), {"id": run_id}).scalar_one()
    assert "message_keys" in (json.loads(raw) if isinstance(raw, str) else raw)  # what the row keeps
    line = predicted_vs_measured(stored, {"peak_rss_gib": 1.5, "step_s": 0.4}, "zh")
    assert "⚠️ 放不下：任务峰值约需 " in line and "而 train@small 的内存（8.0 GiB）不足" in line
    assert "⚠️ will not fit: the run needs about" in predicted_vs_measured(stored, {}, "en")
    # REST shows the estimate as it always did: English, without the keys kept for the UI
    out = client.get(f"/api/v1/runs/{run_id}").json()["estimate"]
    assert "message_keys" not in out and out["warning"] == stored["warning"]
    assert out["assumptions"] == stored["assumptions"]


# ---- ETA and progress in GET /runs/{id} -------------------------------------------------------------------


def _running_run(client, session, **hyper) -> int:
    ds = upload(client, DEMO_SFT).json()
    spec = {"dataset_ids": [ds["id"]], "hyperparameters": hyper}
    run_id = client.post("/api/v1/runs", json=spec).json()["id"]
    run_lifecycle.claim_run(session, run_id, "test-worker", "node")
    return run_id


def _rows(steps, total, step_s, **extra):
    return [
        {"step": s, "loss": 2.0, "step_s": step_s(s), "total_steps": total, "elapsed_s": 10.0 * s, **extra}
        for s in steps
    ]


def test_eta_in_get_run_uses_recent_steps_and_counts_the_final_save(client, session):
    run_id = _running_run(client, session, max_steps=10, save_steps=4)
    run = session.get(Run, run_id)
    run.estimate = {
        **(run.estimate or {}),
        "time": {"step_s": 99.0, "checkpoint_s": 3.0, "final_save_s": 20.0},
    }
    session.commit()
    # a slow first step (30 s) does not skew the ETA: the median of the last rows is 10 s
    run_lifecycle.record_metrics(session, run_id, _rows(range(1, 6), 10, lambda s: 30.0 if s == 1 else 10.0))
    out = client.get(f"/api/v1/runs/{run_id}").json()
    assert out["progress"]["step"] == 5 and out["progress"]["total_steps"] == 10
    assert out["progress"]["step_s"] == 10.0 and out["progress"]["fraction"] == 0.5
    # 5 steps, one checkpoint at step 8, the final save; minus the time since the last point (~0)
    assert out["eta_seconds"] == pytest.approx(5 * 10 + 3 + 20, abs=1.0)
    # after the last step the run still saves: the ETA counts the final save down, never 0
    run_lifecycle.record_metrics(session, run_id, _rows(range(6, 11), 10, lambda s: 10.0))
    out = client.get(f"/api/v1/runs/{run_id}").json()
    assert out["progress"]["step"] == 10 and 15 <= out["eta_seconds"] <= 20
    point = session.query(RunMetric).filter_by(run_id=run_id, step=10).one()
    point.recorded_at = utcnow() - timedelta(seconds=60)
    session.commit()
    assert client.get(f"/api/v1/runs/{run_id}").json()["eta_seconds"] == 1.0
    listed = {r["id"]: r for r in client.get("/api/v1/runs").json()}
    assert listed[run_id]["progress"]["total_steps"] == 10 and listed[run_id]["eta_seconds"] == 1.0


def test_an_epoch_run_shows_progress_and_eta_from_the_trainers_total(client, session):
    run_id = _running_run(client, session, max_steps=-1, num_train_epochs=2)
    before = client.get(f"/api/v1/runs/{run_id}").json()
    # before the first point, the estimate's step count (the demo set has 400 samples, batch 1)
    assert before["progress"]["total_steps"] == 800 and before["progress"]["step"] is None
    run_lifecycle.record_metrics(session, run_id, _rows(range(1, 4), 800, lambda s: 2.0))
    out = client.get(f"/api/v1/runs/{run_id}").json()
    assert out["progress"]["total_steps"] == 800 and out["progress"]["fraction"] == pytest.approx(3 / 800)
    assert out["eta_seconds"] == pytest.approx(797 * 2.0, rel=0.05)
    # the Runs table shows the same progress and ETA
    from studio.services.progress import runs_progress
    from studio.ui.run_views import run_rows

    row = run_rows([session.get(Run, run_id)], runs_progress(session, [run_id])).values.tolist()[0]
    assert row[5] == "3/800 (0%)" and row[7].startswith("26m")


def test_a_finished_run_shows_its_measured_peak_beside_the_prediction(session, client):
    run_id = _running_run(client, session, max_steps=2)
    run_lifecycle.record_metrics(session, run_id, _rows([1, 2], 2, lambda s: 1.0, peak_rss_mib=900.0))
    run = session.get(Run, run_id)
    run.status, run.final_metrics = RunStatus.SUCCEEDED, {"peak_rss_mib": 1024.0}
    session.commit()
    p = run_progress(run, session.query(RunMetric).filter_by(run_id=run_id).order_by(RunMetric.step).all())
    assert p["peak_rss_gib"] == 1.0 and p["eta_s"] == 0.0
    line = predicted_vs_measured(run.estimate, p)
    assert "peak memory predicted" in line and "measured 1.00 GiB" in line
    assert runs_svc.get_run(session, run_id).estimate["steps"] == 2


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_progress_reads_only_each_runs_latest_points(backend, request, tmp_path):
    """runs_progress takes each run's last ETA_WINDOW + 1 points, oldest first, whatever the series'
    length or the order the runs are asked in (an index lookup per run, not a scan of every step)."""
    from engine.estimate import ETA_WINDOW
    from studio.services.progress import _recent_points, runs_progress

    url = request.getfixturevalue("pg_url") if backend == "postgresql" else ""
    s = Settings(home=tmp_path / "home", database_url=url)
    upgrade(s)
    with session_factory(s)() as session:
        ids = []
        for n in (3, 2000, 40):
            run = Run(name=f"r{n}", status=RunStatus.RUNNING, queue="train", output_dir="/x",
                      stage="sft", fine_tuning="lora", base_model="tiny", dataset_ids=[], config={})  # fmt: skip
            session.add(run)
            session.commit()
            ids.append(run.id)
            run_lifecycle.record_metrics(session, run.id, _rows(range(1, n + 1), n, lambda s: 1.0))
        sql: list[tuple[str, tuple]] = []
        listen = (session.get_bind(), "before_cursor_execute", lambda *a: sql.append((a[2], a[3])))
        event.listen(*listen)
        recent = _recent_points(session, ids[::-1])
        event.remove(*listen)
        assert [[p.step for p in recent[i]] for i in ids] == [
            [1, 2, 3],
            list(range(2000 - ETA_WINDOW, 2001)),
            list(range(40 - ETA_WINDOW, 41)),
        ]
        assert runs_progress(session, [ids[1]])[ids[1]]["step"] == 2000
        if backend == "sqlite":  # each run's points are found through the (run_id, step) index, never scanned
            ((statement, params),) = sql
            plan = [
                row[3]
                for row in session.connection().exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params)
            ]
            assert not [p for p in plan if p.startswith("SCAN run_metrics")], plan
            assert sum("USING COVERING INDEX" in p for p in plan) == len(ids), plan


# ---- the planner through REST -----------------------------------------------------------------------------


def gpu_node(session, name: str, gpus: int, gib: float = 80, ram_gib: float = 2048) -> None:
    nodes_svc.register_node(session, name=name, node=name.split("@")[-1], hostname="h", queues=["train"])
    devices = [{"name": "NVIDIA H800", "total_memory_bytes": int(gib * GIB)} for _ in range(gpus)]
    nodes_svc.record_doctor(
        session,
        name,
        {
            "passed": True,
            "facts": {"devices": devices, "memory": {"total_bytes": int(ram_gib * GIB)}},
            "checks": [],
        },
    )


def test_the_estimate_proposes_settings_that_fit_the_studios_nodes(client, session, big_model):
    gpu_node(session, "train@gpu1", gpus=8)
    ds = upload(client, DEMO_DPO).json()
    spec = {
        "base_model": big_model,
        "dataset_ids": [ds["id"]],
        "stage": "DPO",
        "fine_tuning": "Full",
        "hyperparameters": {"max_steps": 10, "max_seq_len": 4096},
    }
    plan = client.post("/api/v1/runs/estimate", json=spec).json()["plan"]
    assert plan["verdict"] == "fits" and plan["devices_known"] == 8 and plan["device"] == "gpu"
    best = plan["proposal"]["settings"]
    # the fewest devices that fit: all 8, as ERNIEKit lists it (its frozen reference quantized)
    assert best["num_devices"] == 8 and best["expert_parallel_degree"] > 1
    assert best["dpo_reference_dtype"] in ("wint8", "wint4")
    assert best["tensorwise_offload_optimizer"] is True and best["compute_type"] == "bf16"
    assert plan["proposal"]["memory_gib"]["peak"] <= 0.92 * 80
    # why the others do not: fewer devices, and the cheaper choices at 8 (no offload)
    reasons = [r["reason"] for r in plan["rejected"]]
    assert all("GiB per device against" in r for r in reasons)
    assert any(r["settings"]["num_devices"] == 4 for r in plan["rejected"])
    # the Train form shows the proposal with the keys to set, and (folded) why the others do not fit
    shown = format_plan(plan)
    assert shown.startswith("**Proposed settings** for") and "tensorwise_offload_optimizer: True" in shown
    assert (
        f"expert_parallel_degree: {best['expert_parallel_degree']}" in shown
        and "GiB** per device of 73.6" in shown
    )
    # half the GPUs it needs: nothing fits, and the planner says why
    gpu_node(session, "train@gpu1", gpus=4)
    plan = client.post("/api/v1/runs/estimate", json=spec).json()["plan"]
    assert plan["verdict"] == "does not fit" and plan["proposal"] is None
    assert plan["reason"].startswith("does not fit on 4 device(s)")
    shown = format_plan(plan)
    assert "**Nothing fits** on 4 device(s): at best" in shown and "GiB per device against 73.6 GiB" in shown
    assert "没有可行配置" in format_plan(plan, "zh") and "Nothing fits" not in format_plan(plan, "zh")
    # rows four times as long on the 8 GPUs: tensor parallelism would make it fit, and the planner says so
    gpu_node(session, "train@gpu1", gpus=8)
    spec["hyperparameters"]["max_seq_len"] = 16384
    plan = client.post("/api/v1/runs/estimate", json=spec).json()["plan"]
    assert plan["verdict"] == "does not fit" and plan["needs_tensor_parallel"] in (2, 4, 8)
    assert f"tensor_parallel_degree {plan['needs_tensor_parallel']}" in plan["reason"]


def test_more_devices_than_the_studios_nodes_hold_is_refused_and_nothing_is_queued(client, session, settings):
    settings.worker_devices = 4  # the studio's own node could run 4 processes: its workers report 1
    cpu_node(session, "train@small", ram_gib=16)
    ds = upload(client, DEMO_SFT).json()
    spec = {"dataset_ids": [ds["id"]], "num_devices": 2, "hyperparameters": {"max_steps": 2}}
    for url in ("/api/v1/runs/estimate", "/api/v1/runs"):
        r = client.post(url, json=spec)
        assert r.status_code in (400, 422), r.text
        assert "num_devices: 2 devices are more than the studio's nodes hold (1 in all" in r.text
    assert client.get("/api/v1/runs").json() == []
    assert session.query(Run).count() == 0
    # a node whose worker runs 2 processes holds them
    cpu_node(session, "train@small", ram_gib=16, queues=("train", "cpu", "train.devices.2"))
    assert client.post("/api/v1/runs/estimate", json=spec).status_code == 200


def test_the_step_time_follows_the_nodes_own_record(client, session):
    """A probe taken once at the worker's start misjudged the node (REST said 8.6 s a step for a 0.3B LoRA
    run that took 4.2 s): the node's finished runs correct the modelled step time by their median ratio."""
    cpu_node(session, "train@small", ram_gib=64, probe=1000.0)
    ds = upload(client, DEMO_SFT).json()
    spec = {"dataset_ids": [ds["id"]], "hyperparameters": {"max_steps": 6}}
    first = client.post("/api/v1/runs/estimate", json=spec).json()["time"]
    assert first["step_s"] == first["step_s_model"]
    run_id = client.post("/api/v1/runs", json=spec).json()["id"]
    run_lifecycle.claim_run(session, run_id, "train@small", "small")
    modelled = session.get(Run, run_id).estimate["time"]["step_s_model"]
    run_lifecycle.record_metrics(session, run_id, _rows(range(1, 7), 6, lambda s: 0.49 * modelled))
    run = session.get(Run, run_id)
    run.status, run.ended_at = RunStatus.SUCCEEDED, utcnow()
    session.commit()
    est = client.post("/api/v1/runs/estimate", json=spec).json()
    assert est["time"]["step_s"] == pytest.approx(0.49 * est["time"]["step_s_model"], rel=1e-6)
    assert any(
        "this node's recent runs took 0.49x the modelled step time (1 run(s))" in a
        for a in est["assumptions"]
    )


def test_the_train_form_names_both_degrees_when_tensor_parallelism_alone_is_not_enough():
    """ERNIE-4.5-300B-A47B Full DPO on ERNIEKit's 112 GPUs: the plan (as REST returns it) needs tensor and
    pipeline parallelism, and the Train form says both degrees, in English and Chinese."""
    from engine.estimate import GIB, NodeFacts, plan_run

    model = ErnieConfig(**preset_fields("ernie-4.5-300b-a47b"))
    nodes = [NodeFacts("gpu", f"node{i}", 80 * GIB, 2048 * GIB, "NVIDIA H800", devices=8) for i in range(14)]
    plan = plan_run(model, "DPO", "Full", 4096, nodes).to_dict()
    tp, pp = plan["needs_tensor_parallel"], plan["needs_pipeline_parallel"]
    assert (
        tp in (2, 4, 8)
        and pp
        and plan["tensor_parallel_option"]["settings"]["pipeline_parallel_degree"] == pp
    )
    assert f"tensor_parallel_degree {tp} and pipeline_parallel_degree {pp}" in format_plan(plan)
    assert f"pipeline_parallel_degree {pp}" in format_plan(plan, "zh") and "流水线并行" in format_plan(
        plan, "zh"
    )
