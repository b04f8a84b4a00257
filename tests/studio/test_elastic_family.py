"""An elastic run's family in the studio: REST lists it, the Runs tab shows it, and one member is exported
(by the export worker's own function, `ernie-studio export` as a child process) into a smaller model."""

from __future__ import annotations

import json
from pathlib import Path

import gradio as gr
import pytest
from studio_helpers import DEMO_PT, upload

from engine.train import run_training
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict
from studio import queue
from studio.models import Export, Run, RunStatus
from studio.services.exports import export_config
from studio.ui.context import UIContext
from studio.ui.i18n import Texts
from studio.ui.run_views import member_of_row
from studio.ui.runs_tab import VIEW_PARTS, RunsHandlers
from workers.exporting import execute_export


@pytest.fixture
def elastic_run(client, session, tiny_moe_model_dir) -> int:
    """A succeeded studio run whose output_dir holds a 4-step elastic PT run of tiny-moe."""
    ds = upload(client, DEMO_PT).json()["id"]
    body = {"dataset_ids": [ds], "stage": "PT", "fine_tuning": "Full"}
    run = client.post("/api/v1/runs", json=body)
    assert run.status_code == 201, run.text
    row = session.get(Run, run.json()["id"])
    values = dict(
        model_name_or_path=str(tiny_moe_model_dir),
        stage="PT",
        fine_tuning="Full",
        output_dir=row.output_dir,
        train_dataset_path=str(DEMO_PT),
        eval_dataset_path=str(DEMO_PT),
        max_evaluate_steps=2,
        max_seq_len=64,
        batch_size=2,
        max_steps=4,
        disable_tqdm=True,
        report_to="none",
        elastic=True,
        elastic_depth_choices="2",
        elastic_experts_choices="4",
        elastic_topk_choices="1",
    )
    assert run_training(config_from_dict(TrainConfig, values)).status == "succeeded"
    row.status, row.model_dir = RunStatus.SUCCEEDED, row.output_dir
    session.commit()
    return row.id


def test_the_family_is_listed_shown_and_one_member_exported(client, settings, session, elastic_run):
    family = client.get(f"/api/v1/runs/{elastic_run}/elastic")
    assert family.status_code == 200, family.text
    members = family.json()["members"]
    assert [m["member"] for m in members] == ["d3-e8-k2", "d2-e4-k1"]
    assert members[1]["active_parameters"] < members[0]["active_parameters"]
    assert all(m["eval_loss"] is not None for m in members)

    h = RunsHandlers(UIContext(settings=settings, texts=Texts(), demo=None))
    view = dict(zip(VIEW_PARTS, h.run_view(elastic_run), strict=True))
    table = view["family"]["value"]
    assert view["family"]["visible"] and table["member"].tolist() == ["d3-e8-k2", "d2-e4-k1"]
    points = view["family_plot"]["value"]
    assert view["family_plot"]["visible"] and points["member"].tolist() == ["d3-e8-k2", "d2-e4-k1"]
    assert points["eval loss"].tolist() == [m["eval_loss"] for m in members]
    member = member_of_row(table, 1)  # what a click on the second row puts into the member box
    message = h.export(elastic_run, "merge LoRA (paddle layout)", None, None, member)
    assert "member d2-e4-k1" in message and "queued" in message

    export = session.query(Export).filter_by(run_id=elastic_run).one()
    assert export.elastic_member == "d2-e4-k1" and export.export_dir.endswith(
        f"run-{elastic_run}-d2-e4-k1-paddle"
    )
    assert not export.deploy_on_success and export.deploy_state == ""
    cfg = export_config(session.get(Run, elastic_run), export)
    assert (cfg["elastic_depth"], cfg["elastic_experts"], cfg["elastic_topk"]) == (2, 4, 1)

    # One click exports the member and deploys it once written: the export worker makes the deployment.
    message = h.deploy_member(elastic_run, member)
    chain = session.query(Export).filter_by(run_id=elastic_run).order_by(Export.id.desc()).first()
    assert message.startswith(f"Export #{chain.id} of member d2-e4-k1 queued; it is deployed")
    assert (
        chain.deploy_on_success
        and chain.deploy_state == "exporting"
        and chain.export_dir == export.export_dir
    )
    view = dict(zip(VIEW_PARTS, h.run_view(elastic_run), strict=True))
    assert view["family"]["value"]["deployment"].tolist() == ["—", f"⏳ exporting (export #{chain.id})"]
    assert view["exports"]["status"].tolist()[0] == f"⏳ queued → ⏳ exporting (export #{chain.id})"
    with pytest.raises(
        gr.Error,
        match=rf"member: d2-e4-k1 of run {elastic_run} is already exporting \(export {chain.id}\); wait for it",
    ):
        h.deploy_member(elastic_run, member)
    with pytest.raises(gr.Error, match="Click a row of the elastic family table"):
        h.deploy_member(elastic_run, " ")

    assert execute_export(settings, chain.id, "test-worker") == "succeeded"
    written = json.loads((Path(chain.export_dir) / "config.json").read_text())
    assert (written["num_hidden_layers"], written["moe_num_experts"], written["moe_k"]) == (2, 4, 1)
    summary = json.loads((Path(chain.export_dir) / "export_summary.json").read_text())
    assert summary["elastic_member"] == "d2-e4-k1"
    session.expire_all()
    dep = session.get(Export, chain.id).deployment
    assert (dep.status, dep.model_dir, dep.run_id) == ("starting", chain.export_dir, elastic_run)
    assert dep.name == f"run-{elastic_run}-d2-e4-k1-paddle"
    assert (queue.DEPLOYMENT_TASK, dep.id) in queue.held_jobs(settings, [queue.SERVE_QUEUE], 60)
    view = dict(zip(VIEW_PARTS, h.run_view(elastic_run), strict=True))
    assert view["family"]["value"]["deployment"].tolist() == ["—", f"🚀 deploying (deployment #{dep.id})"]
    listed = client.get(f"/api/v1/exports?run_id={elastic_run}").json()
    assert listed[0]["elastic_member"] == "d2-e4-k1" and listed[0]["status"] == "succeeded"
    assert (listed[0]["deploy_state"], listed[0]["deployment_id"]) == ("deploying", dep.id)
    assert (listed[1]["deploy_on_success"], listed[1]["deploy_state"]) == (False, "")


def test_members_outside_the_family_and_runs_without_one_are_refused(client, session, elastic_run):
    r = client.post(f"/api/v1/runs/{elastic_run}/export", json={"elastic_member": "d2-e8-k2"})
    assert r.status_code == 422
    assert r.json()["message"] == (
        f"elastic_member: 'd2-e8-k2' is not in run {elastic_run}'s family (d3-e8-k2, d2-e4-k1)"
    )
    # one request exports and deploys a member; the member must be one of the family
    r = client.post(f"/api/v1/runs/{elastic_run}/elastic/deploy", json={"member": "d2-e8-k2"})
    assert r.status_code == 422
    assert (
        r.json()["message"] == f"member: 'd2-e8-k2' is not in run {elastic_run}'s family (d3-e8-k2, d2-e4-k1)"
    )
    r = client.post(f"/api/v1/runs/{elastic_run}/elastic/deploy", json={"member": ""})
    assert r.status_code == 422 and r.json()["message"].startswith(
        f"member: name one of run {elastic_run}'s family"
    )
    r = client.post(f"/api/v1/runs/{elastic_run}/elastic/deploy", json={})
    assert (r.status_code, r.json()["message"]) == (422, "invalid request: member: Field required")
    r = client.post(f"/api/v1/runs/{elastic_run}/elastic/deploy", json={"member": "d3-e8-k2"})
    assert r.status_code == 201, r.text
    assert (r.json()["elastic_member"], r.json()["deploy_state"]) == ("d3-e8-k2", "exporting")
    r = client.post(f"/api/v1/runs/{elastic_run}/export", json={"layout": "hf", "deploy_on_success": True})
    assert r.status_code == 201 and r.json()["deploy_on_success"] is True, r.text
    # a GPAS model's gates: the engine's choices (keep | fold) go through to `ernie-studio export`
    r = client.post(f"/api/v1/runs/{elastic_run}/export", json={"layout": "hf", "gpas_gates": "fold"})
    assert r.status_code == 201 and r.json()["gpas_gates"] == "fold", r.text
    cfg = export_config(session.get(Run, elastic_run), session.get(Export, r.json()["id"]))
    assert cfg["gpas_gates"] == "fold" and "elastic_depth" not in cfg
    r = client.post(f"/api/v1/runs/{elastic_run}/export", json={"gpas_gates": "drop"})
    assert r.status_code == 422 and r.json()["message"] == "gpas_gates: 'drop' is not one of keep, fold"
    ds = upload(client, DEMO_PT).json()["id"]
    plain = client.post("/api/v1/runs", json={"dataset_ids": [ds], "stage": "PT"}).json()["id"]
    row = session.get(Run, plain)
    row.status = RunStatus.SUCCEEDED
    session.commit()
    r = client.post(f"/api/v1/runs/{plain}/export", json={"elastic_member": "d2-e4-k1"})
    assert r.status_code == 422 and r.json()["message"].startswith(
        f"elastic_member: run {plain} was not trained with elastic: true"
    )
    r = client.post(f"/api/v1/runs/{plain}/elastic/deploy", json={"member": "d2-e4-k1"})
    assert r.status_code == 422 and r.json()["message"].startswith(
        f"member: run {plain} was not trained with elastic: true"
    )
    r = client.get(f"/api/v1/runs/{plain}/elastic")
    assert r.status_code == 404 and "has no elastic family" in r.json()["message"]
