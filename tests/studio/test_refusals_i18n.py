"""The services' refusals are keyed messages: the REST API answers in the language of ``Accept-Language``
(with the key and fields), the tabs in the session's, and the English is what it always was."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr
import pytest
from studio_helpers import DEMO_SFT, upload

from studio.db import session_factory
from studio.messages import accepted_language
from studio.models import Deployment, DeploymentStatus, Evaluation, Run, RunStatus, Sweep
from studio.services import datasets as datasets_svc
from studio.services import deployments as deployments_svc
from studio.services import evals as evals_svc
from studio.services import sweeps as sweeps_svc
from studio.ui import i18n
from studio.ui.context import UIContext
from studio.ui.i18n import Texts

ZH = {"Accept-Language": "zh-CN,zh;q=0.9,en;q=0.8"}


def test_a_refusal_is_in_the_language_the_client_asks_for(client):
    r = client.get("/api/v1/runs/4242", headers=ZH)
    assert r.status_code == 404 and r.headers["content-language"] == "zh"
    body = r.json()
    assert body["message"] == "任务 4242 不存在"
    assert body["key"] == "services.not_found" and body["fields"] == {"what": {"word": "run"}, "id": 4242}
    r = client.get("/api/v1/runs/4242")
    assert r.status_code == 404 and r.headers["content-language"] == "en"
    assert r.json()["message"] == "run 4242 does not exist"
    # the header a client sends never reaches the response's: Content-Language is one of ours
    r = client.get("/api/v1/runs/4242", headers={"Accept-Language": "zh-x-<script>;q=1, evil\tvalue"})
    assert r.headers["content-language"] == "zh" and r.json()["message"] == "任务 4242 不存在"
    r = client.get("/api/v1/runs/4242", headers={"Accept-Language": "x" * 4000})
    assert r.headers["content-language"] == "en"


def _set(settings, model, row_id: int, **values) -> None:
    with session_factory(settings)() as s:
        row = s.get(model, row_id)
        for k, v in values.items():
            setattr(row, k, v)
        s.commit()


def _refused(r, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["message"]


def test_a_runs_refusals_through_rest_in_chinese(client, settings, tmp_path):
    ds = upload(client, DEMO_SFT).json()["id"]
    r = client.post("/api/v1/runs", json={"dataset_ids": [ds], "hyperparameters": {"max_steps": 5}})
    run = r.json()["id"]
    english = _refused(client.post(f"/api/v1/runs/{run}/resume"), 409)
    assert english == f"run {run} is queued; only failed or cancelled runs can be resumed"
    refusals = {
        f"任务 {run} 的状态为 排队中；只有失败或已取消的任务可以恢复": client.post(
            f"/api/v1/runs/{run}/resume", headers=ZH
        ),
        f"任务 {run} 的状态为 排队中；请在其成功完成后再导出": client.post(
            f"/api/v1/runs/{run}/export", json={}, headers=ZH
        ),
        f"任务 {run} 的状态为 排队中；请在其成功完成后再部署": client.post(
            "/api/v1/deployments", json={"run_id": run}, headers=ZH
        ),
        f"run_id：任务 {run} 的状态为 排队中；请在其成功完成后再评估": client.post(
            "/api/v1/evals", json={"run_id": run, "dataset_ids": [ds]}, headers=ZH
        ),
        f"数据集 {ds} 正被排队或运行中的任务 [{run}] 使用；请先取消它们": client.delete(
            f"/api/v1/datasets/{ds}", headers=ZH
        ),
        f"dataset_ids：数据集 {ds}（sft_demo）为 sft 数据；阶段 DPO 需要 dpo 数据": client.post(
            "/api/v1/runs", json={"dataset_ids": [ds], "stage": "DPO"}, headers=ZH
        ),
    }
    for zh, r in refusals.items():
        assert r.status_code in (404, 409, 422) and r.json()["message"] == zh, r.text
    _set(settings, Run, run, status=RunStatus.RUNNING)
    assert _refused(client.delete(f"/api/v1/runs/{run}", headers=ZH), 409) == f"任务 {run} 正在运行；请先取消"
    _set(settings, Run, run, status=RunStatus.CANCELLED)
    shown = _refused(client.post(f"/api/v1/runs/{run}/cancel", headers=ZH), 409)
    assert shown == f"任务 {run} 已结束（已取消）；无需取消"


def test_uploads_refused_through_rest_in_chinese(client, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert _refused(upload(client, empty), 422) == "file: empty.jsonl is empty"
    with open(empty, "rb") as f:
        r = client.post("/api/v1/datasets", files={"file": ("empty.jsonl", f)}, headers=ZH)
    assert _refused(r, 422) == "文件 empty.jsonl 是空文件"
    big = tmp_path / "big.jsonl"
    # over the fixture's studio's 2 MB, within what the declared length may hold besides the file: the
    # refusal of the file as it streams in
    big.write_bytes(b"x" * (2 * 1024 * 1024 + 100_000))
    with open(big, "rb") as f:
        r = client.post("/api/v1/datasets", files={"file": ("big.jsonl", f)}, headers=ZH)
    assert _refused(r, 413) == "文件 big.jsonl 超过上传上限 2 MB；请拆分文件或调大 ERNIE_STUDIO_MAX_UPLOAD_MB"
    assert r.json()["fields"] == {"name": "big.jsonl", "mb": 2}


def test_the_datasets_tab_refuses_a_file_over_the_upload_limit_in_chinese(zh_ctx, settings, tmp_path):
    big = tmp_path / "big.jsonl"
    big.write_bytes(b"x" * (2 * 1024 * 1024 + 1))
    shown = _toast(zh_ctx, datasets_svc.upload_dataset, settings, str(big), "big.jsonl")
    assert shown == "文件 big.jsonl 超过上传上限 2 MB；请拆分文件或调大 ERNIE_STUDIO_MAX_UPLOAD_MB"


def test_templates_and_recipes_refused_through_rest_in_chinese(client):
    assert _refused(client.get("/api/v1/templates/77", headers=ZH), 404) == (
        "模板 77 不存在；GET /api/v1/templates 列出全部模板"
    )
    shown = _refused(client.get("/api/v1/recipes/no-such-recipe", headers=ZH), 404)
    assert shown.startswith("recipe：没有名为 'no-such-recipe' 的配方；现有配方：")


@pytest.fixture
def zh_ctx(settings):
    """A UI context whose session switched to Chinese."""
    token = i18n.LocalContext.request.set(SimpleNamespace(session_hash="zh-service-refusals"))
    i18n.remember_language("zh")
    yield UIContext(settings=settings, texts=Texts(), demo=None)
    i18n.LocalContext.request.reset(token)


def _toast(ctx: UIContext, fn, *args, **kwargs) -> str:
    with pytest.raises(gr.Error) as e:
        ctx.call(fn, *args, **kwargs)
    return e.value.message


def test_the_tabs_show_the_refusals_of_evals_sweeps_deployments_and_datasets_in_chinese(zh_ctx, settings):
    with session_factory(settings)() as s:
        ev = Evaluation(name="e", model="tiny", model_dir="/m", output_dir="/o", status=RunStatus.RUNNING)
        sweep = Sweep(name="s", spec={}, parameters={}, settings={}, study_name="s1", status=RunStatus.FAILED)
        starting = Deployment(name="d", model_dir="/m", status=DeploymentStatus.STARTING)
        # a running deployment whose server is gone (nothing listens on port 9)
        gone = Deployment(
            name="g", model_dir="/m", status=DeploymentStatus.RUNNING, url="http://127.0.0.1:9/v1"
        )
        s.add_all([ev, sweep, starting, gone])
        s.commit()
        ids = ev.id, sweep.id, starting.id, gone.id
    eid, sid, did, gid = ids
    assert _toast(zh_ctx, evals_svc.delete_eval, settings, eid) == f"评估 {eid} 正在运行；请先取消"
    assert _toast(zh_ctx, evals_svc.resume_eval, settings, eid) == (
        f"评估 {eid} 的状态为 运行中；只有失败或已取消的评估可以恢复"
    )
    _set(settings, Evaluation, eid, status=RunStatus.SUCCEEDED)
    assert _toast(zh_ctx, evals_svc.cancel_eval, settings, eid) == f"评估 {eid} 已结束（已完成）；无需取消"
    assert (
        _toast(zh_ctx, sweeps_svc.cancel_sweep, settings, sid) == f"超参搜索 {sid} 已结束（失败）；无需取消"
    )
    assert _toast(zh_ctx, deployments_svc.delete_deployment, did) == f"部署 {did} 的状态为 启动中；请先停止"
    assert _toast(zh_ctx, deployments_svc.chat_url, did) == f"部署 {did} 的状态为 启动中；请在其运行后再对话"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    shown = _toast(zh_ctx, deployments_svc.chat, gid, body, timeout=5)
    assert shown.startswith(f"部署 {gid} 在 http://127.0.0.1:9/v1/chat/completions 没有应答：")
    assert _toast(zh_ctx, datasets_svc.get_dataset, 41) == "数据集 41 不存在"


def test_the_datasets_tab_says_in_chinese_that_images_are_still_being_fetched(zh_ctx, settings, tmp_path):
    data = tmp_path / "vl.jsonl"
    record = '{"image_info": [{"matched_text_index": 0, "image_url": "http://example.invalid/a.jpg"}], '
    record += '"text_info": [{"text": "Q", "tag": "mask"}, {"text": "A", "tag": "no_mask"}]}'
    data.write_text(record + "\n")
    ds = zh_ctx.call(datasets_svc.upload_dataset, settings, str(data), "vl.jsonl")
    assert ds.media_fetch is not None and ds.media_fetch.status == "queued"  # no worker fetches it here
    shown = _toast(zh_ctx, datasets_svc.dataset_stats, settings, ds.id, model="tiny", max_seq_len=512)
    assert shown == f"数据集 {ds.id}：按 URL 引用的图片仍在获取中（0/1）；获取完成后再查看统计"


def test_the_language_a_client_accepts_is_read_by_its_weights():
    assert accepted_language(None) == accepted_language("") == "en"
    assert accepted_language("zh-CN,zh;q=0.9,en;q=0.8") == "zh"
    assert accepted_language("en-US,en;q=0.9,zh;q=0.8") == "en"
    assert accepted_language("fr;q=1.0, zh;q=0.5") == "zh"  # the best language we have
    assert accepted_language("zh;q=0.2, en;q=0.7") == "en"
    assert accepted_language("zh;q=oops, en") == "en"  # a weight that is no number counts as 0
    assert accepted_language("de, fr") == "en"
