"""Every UI text has both languages, and table headers follow a session's language switch."""

from __future__ import annotations

import json
import pickle
import re
from datetime import UTC, datetime
from types import SimpleNamespace

import gradio as gr
import pandas as pd

from engine.messages import Word, restored, with_keys
from studio.messages import ZH
from studio.models import DeploymentStatus, KeyedJSON, RunStatus
from studio.services.errors import ServiceError
from studio.services.messages import SERVICES
from studio.ui import i18n
from studio.ui.compare_tab import diff_frame
from studio.ui.datasets_tab import (
    DATASET_COLUMNS,
    PROBLEM_COLUMNS,
    problem_rows,
    record_view,
    rejected_upload,
    stats_markdown,
    summary_markdown,
)
from studio.ui.deploy_tab import DEPLOYMENT_COLUMNS, deployment_choices, deployment_rows, deployment_status
from studio.ui.i18n import (
    LANGUAGES,
    STRINGS,
    Texts,
    header,
    localize_frame,
    status_text,
    text,
)
from studio.ui.nodes_tab import CHECK_COLUMNS, NODE_COLUMNS
from studio.ui.run_views import (
    CHECKPOINT_COLUMNS,
    EXPORT_COLUMNS,
    FAMILY_COLUMNS,
    RUN_COLUMNS,
    export_rows,
    family_rows,
    run_choices,
    run_rows,
    status_markdown,
)
from studio.ui.sweeps_tab import SWEEP_COLUMNS, TRIAL_COLUMNS
from studio.ui.text_check import untranslated_words

ALL_COLUMNS = [
    *RUN_COLUMNS,
    *CHECKPOINT_COLUMNS,
    *EXPORT_COLUMNS,
    *FAMILY_COLUMNS,
    *DATASET_COLUMNS,
    *PROBLEM_COLUMNS,
    *DEPLOYMENT_COLUMNS,
    *NODE_COLUMNS,
    *CHECK_COLUMNS,
    *SWEEP_COLUMNS,
    *TRIAL_COLUMNS,
    "key",
    "metric",
]
NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_every_key_has_english_and_chinese_and_headers_are_translated():
    assert set(LANGUAGES) == {"en", "zh"}
    for key, pair in STRINGS.items():
        assert isinstance(pair, tuple) and len(pair) == 2, key
        en, zh = pair
        assert en.strip() and zh.strip(), key
    for column in ALL_COLUMNS:
        assert f"col.{column}" in STRINGS, column
        zh = header(column, "zh")
        assert zh != column and not zh.isascii(), (column, zh)  # a real translation, not a copy
        assert header(zh, "en") == column  # back again from the shown Chinese header


def test_run_and_deployment_tables_get_chinese_headers():
    run = SimpleNamespace(
        id=3, name="lora", stage="sft", fine_tuning="lora", status="running", created_at=NOW
    )
    frame = localize_frame(run_rows([run], {3: {"step": 5, "max_steps": 10, "loss": 1.25}}), "zh")
    assert list(frame.columns) == [
        "编号",
        "名称",
        "阶段",
        "微调方式",
        "状态",
        "进度",
        "损失",
        "剩余时间",
        "创建时间",
    ]
    assert frame.iloc[0].tolist()[:6] == [3, "lora", "sft", "lora", "🏃 running", "5/10 (50%)"]
    dep = SimpleNamespace(
        id=1, name="d", status="running", backend="paddle", url="http://x", model_dir="/m", started_at=NOW
    )
    assert list(localize_frame(deployment_rows([dep]), "zh").columns) == [
        "编号", "名称", "状态", "后端", "地址", "模型", "启动时间",
    ]  # fmt: skip
    # Run-named columns of the Compare tables are kept; only the fixed first column is translated.
    diff = diff_frame({"runs": [{"id": 1, "name": "a"}], "config_diff": {"lr": {"1": 0.1}}})
    assert list(localize_frame(diff, "zh").columns) == ["配置项", "#1 a"]


def test_language_switch_returns_tables_with_translated_headers():
    texts = Texts()
    with gr.Blocks():
        texts.make(gr.Textbox, "runs.logs")
        table = texts.make(gr.Dataframe, "runs.table", headers=RUN_COLUMNS)
    assert texts.tables == [table]
    shown = pd.DataFrame([[1] * len(RUN_COLUMNS)], columns=RUN_COLUMNS)
    updates = texts.updates("zh", [shown])
    assert updates[0] == {"__type__": "update", "label": "日志末尾"}
    assert updates[1]["label"] == "任务列表" and updates[1]["value"].columns[0] == "编号"
    # Switching back to English maps the Chinese headers home again.
    back = texts.updates("en", [updates[1]["value"]])[1]["value"]
    assert list(back.columns) == RUN_COLUMNS
    # A table already in the language keeps whatever it holds now: the value the event carried may be older
    # than a fill that finished meanwhile (on a fresh page it was the empty table, and the rows were lost).
    empty = pd.DataFrame([], columns=RUN_COLUMNS)
    assert "value" not in texts.updates("en", [empty])[1]
    assert "value" not in texts.updates("zh", [updates[1]["value"]])[1]
    assert texts.updates("zh", [empty])[1]["value"].columns[0] == "编号"


def test_table_callbacks_answer_in_the_language_their_session_switched_to():
    texts = Texts()
    with gr.Blocks() as demo:
        table = texts.make(gr.Dataframe, "runs.checkpoints", headers=CHECKPOINT_COLUMNS)
        other = gr.Textbox()
        button = gr.Button()
        button.click(
            lambda: (pd.DataFrame([[1, "/p", "now"]], columns=CHECKPOINT_COLUMNS), "x"), None, [table, other]
        )
    texts.localize_tables(demo)
    fn = next(f for f in demo.fns.values() if f.outputs == [table, other]).fn

    def in_session(session: str, call):
        token = i18n.LocalContext.request.set(SimpleNamespace(session_hash=session))
        try:
            return call()
        finally:
            i18n.LocalContext.request.reset(token)

    in_session("zh-session", lambda: i18n.remember_language("zh"))
    frame, plain = in_session("zh-session", fn)
    assert list(frame.columns) == ["步数", "路径", "保存时间"] and plain == "x"
    frame, _ = in_session("other-session", fn)  # a session that never switched stays English
    assert list(frame.columns) == CHECKPOINT_COLUMNS


# ---- text made at run time -----------------------------------------------------------------------------------


def test_every_status_has_a_translation():
    for status in [*RunStatus, *DeploymentStatus]:
        assert f"status.{status.value}" in STRINGS, status
        assert status_text(status.value, "zh") != status.value
    assert status_text("unheard-of", "zh") == "unheard-of"  # shown as stored rather than failing


def test_the_checker_finds_english_that_reached_a_chinese_page():
    assert untranslated_words("将文件拖放到此处 · 点击上传") == []
    assert untranslated_words("Drop File Here · 点击上传") == ["Drop", "File", "Here"]
    # Names the person gave and identifiers (formats, stages, paths, keys) are not text to translate.
    assert (
        untranslated_words("**my data** · erniekit · SFT · LoRA · `/tmp/x.jsonl` max_seq_len", ["my data"])
        == []
    )
    assert untranslated_words("record 1 of 3") == ["record", "of"]


def test_run_time_text_of_the_datasets_runs_and_deploy_tabs_is_chinese_in_chinese():
    """Each piece of text a handler makes for the page, made in Chinese, holds no English word outside the
    translation table's kept words and the data's own names."""
    ds = SimpleNamespace(
        name="demo", filename="demo.jsonl", size_bytes=2048, format="chatml", kind="sft", num_records=1,
        num_valid=1, problems=[],
    )  # fmt: skip
    bad = SimpleNamespace(**{**vars(ds), "num_valid": 0, "problems": ["demo.jsonl:1: bad"]})
    page = {"records": [{"messages": []}], "total": 1, "rendered": [[{"text": "hi", "trained": True}]]}
    stats = {
        "num_valid": 1, "mean_length": 12.0, "p50_length": 12, "p95_length": 12, "max_length": 12,
        "truncated_share": 0.0, "trained_share": 0.5, "turns_per_sample": {"1": 1},
    }  # fmt: skip
    run = SimpleNamespace(
        id=2, name="lr", stage="SFT", fine_tuning="LoRA", status="running", base_model="tiny", attempt=2,
        error=None, model_dir="/home/runs/2", created_at=NOW,
        estimate={"memory_gib": {"peak": 1.0, "range": [0.9, 1.1]}, "time": {"step_s": 0.5}, "device": "cpu"},
    )  # fmt: skip
    progress = {"step": 5, "max_steps": 10, "eta_s": 65, "step_s": 0.4, "peak_rss_gib": 1.2, "loss": 1.0}
    export = SimpleNamespace(
        id=1, status="succeeded", error=None, perplexity={}, dtype="bfloat16", max_shard_size="5GB",
        quantization=None, layout="paddle", export_dir="/e", export_format="safetensors", gguf_types="",
        gguf_files=None, elastic_member="d2-e4-k1", deploy_on_success=True, deploy_state="running",
        deployment_id=3,
    )  # fmt: skip
    member = {
        "member": "d2-e4-k1", "depth": 2, "experts": 4, "topk": 1, "parameters": 10, "active_parameters": 5,
        "steps_trained": 4, "eval_loss": 1.0, "decode_tokens_per_second": 9.0,
    }  # fmt: skip
    family = {"members": [member]}
    dep = SimpleNamespace(
        id=1, name="lr", status="running", url="http://127.0.0.1:8188/v1", error=None, backend="paddle",
        model_dir="/m", started_at=NOW,
    )  # fmt: skip
    # starting: not yet taken by a serve worker, then taken by one
    waiting = SimpleNamespace(
        **{**vars(dep), "status": "starting", "url": None, "backend": "auto", "worker": None}
    )
    taken = SimpleNamespace(**{**vars(waiting), "worker": "serve@n1"})
    assert "waiting for a serve worker" in deployment_status(waiting, "en")
    assert "serve@n1 is starting its server" in deployment_status(taken, "en")
    assert "serve worker" not in deployment_status(dep, "en")  # a running one says nothing of it
    err = ServiceError(
        "demo.jsonl:1: bad", details={"problems": ["demo.jsonl:1: bad"], "format": "chatml", "kind": "sft"}
    )
    shown = [
        summary_markdown(ds, "zh"),
        summary_markdown(bad, "zh"),
        *record_view(page, 0, "zh")[:1],
        *(label for _, label in record_view(page, 0, "zh")[1] if label),
        record_view({"records": [], "total": 1}, 3, "zh")[0],
        stats_markdown(stats, 512, "zh"),
        rejected_upload("demo.jsonl", err, "zh")[0],
        status_markdown(run, progress, None, "zh"),
        status_markdown(SimpleNamespace(**{**vars(run), "status": "queued"}), {}, 3, "zh"),
        localize_frame(run_rows([run], {2: progress}, "zh"), "zh").to_csv(),
        *(label for label, _ in run_choices([run], "zh")),
        localize_frame(export_rows([export], "zh"), "zh").to_csv(),
        *(
            localize_frame(
                family_rows(family, [SimpleNamespace(**{**vars(export), "deploy_state": st})], "zh"), "zh"
            ).to_csv()
            for st in ("exporting", "export_failed", "deploying", "running", "failed", "stopped", "removed")
        ),
        deployment_status(dep, "zh"),
        deployment_status(waiting, "zh"),
        deployment_status(taken, "zh"),
        localize_frame(deployment_rows([dep], "zh"), "zh").to_csv(),
        *(label for label, _ in deployment_choices([dep], "zh")),
        *(text(key, "zh") for key in ("ds.msg.all_valid", "dep.msg.stopped_stream", "ds.span.trained")),
    ]
    data = ["demo", "demo.jsonl", "lr", "tiny", "paddle", "bfloat16", "d2-e4-k1", "serve@n1"]
    for piece in shown:
        assert untranslated_words(piece, data) == [], piece
    # The same pieces in English do carry English words: the check above is not vacuous.
    assert untranslated_words(summary_markdown(ds, "en"), data)
    assert untranslated_words(status_markdown(run, progress, None, "en"), data)


# ---- messages the services and the engine build from parts ---------------------------------------------------


def test_every_message_has_chinese_words_and_plain_text_is_never_parsed():
    for key, zh in ZH.items():
        # a translation, not a copy (or only fields, such as a located message's "{field}：{msg}")
        assert re.search(r"[\u4e00-\u9fff]", zh) or not re.sub(r"\{[^{}]*\}|\W", "", zh), (key, zh)
    refusal = SERVICES("not_found", what=Word("run"), id=3)
    assert refusal == "run 3 does not exist" and i18n.localize_message(refusal, "en") == refusal
    assert i18n.localize_message(refusal, "zh") == "任务 3 不存在"
    # the same sentence as plain text (no key) is shown as it is: nothing matches sentences any more
    assert i18n.localize_message("run 3 does not exist", "zh") == "run 3 does not exist"
    # nested messages, our words and statuses in the fields are shown in the reader's language too
    ended = SERVICES("nothing_to_cancel", what=Word("run"), id=3, status="succeeded")
    assert i18n.localize_message(ended, "zh") == "任务 3 已结束（已完成）；无需取消"
    # a message keeps its key through pickling (Celery) and through JSON storage (with_keys / restored)
    assert pickle.loads(pickle.dumps(ended)).key == ended.key
    stored = json.loads(json.dumps(with_keys({"problems": [ended]})))
    assert i18n.localize_message(restored(stored)["problems"][0], "zh") == i18n.localize_message(ended, "zh")


def _estimate_texts(lang: str) -> list[str]:
    """The Train tab's estimate (and the Runs tab's predicted-vs-measured line) of real engine estimates that
    carry every kind of note and warning: CPU nodes with and without a probe, a GPU node, packing, epochs
    over data without statistics, two devices, evaluation, LoRA and Full."""
    from engine.estimate import DatasetTokens, NodeFacts, estimate_run
    from engine.estimate.messages import ESTIMATE
    from engine.models.config import ErnieConfig
    from engine.models.presets import preset_fields
    from engine.train.config import TrainConfig
    from engine.train.config_load import config_from_dict
    from studio.services.estimates import with_fit
    from studio.ui.estimate_text import format_estimate, launch_warning
    from studio.ui.run_views import predicted_vs_measured

    model = ErnieConfig(**preset_fields("tiny"))
    data = [DatasetTokens(num_samples=1000, mean_length=250, p95_length=600, max_length=900)]
    base = {"model_name_or_path": "m", "train_dataset_path": "d.jsonl", "output_dir": "o", "max_steps": 10}

    def cfg(**values) -> TrainConfig:
        return config_from_dict(TrainConfig, base | values)

    small_cpu = NodeFacts(name="laptop", memory_bytes=2**20, probe_tokens_per_second=900.0)
    tight_cpu = NodeFacts(name="laptop", memory_bytes=2**30)
    gpu = NodeFacts(device="gpu", name="gpunode", memory_bytes=2**20, ram_bytes=2**20, gpu_name="A100")
    roomy_gpu = NodeFacts(device="gpu", name="gpunode", memory_bytes=2**40, ram_bytes=2**20, gpu_name="A100")
    runs = [
        (cfg(fine_tuning="LoRA"), data, [], small_cpu, 1),
        (cfg(fine_tuning="Full", packing=True, compute_type="fp16"), data, data, None, 2),
        (
            cfg(max_steps=-1, do_eval=True, eval_dataset_path="e.jsonl", eval_steps=5, compute_type="bf16"),
            [],
            [],
            gpu,
            2,
        ),
        (cfg(fine_tuning="Full"), data, [], roomy_gpu, 1),
        (
            cfg(fine_tuning="LoRA", do_eval=True, eval_dataset_path="e.jsonl", eval_steps=5),
            data,
            data,
            tight_cpu,
            1,
        ),
    ]
    shown = []
    for train, stats, evals, node, devices in runs:
        est = estimate_run(model, train, stats, evals, node=node, num_devices=devices)
        out = with_fit(est, node)
        out["assumptions"].append(ESTIMATE("datasets_without_stats", n=1))  # as estimate_spec adds it
        shown += [format_estimate(out, lang), launch_warning(out, lang)]
        column = KeyedJSON()  # the run's estimate column: stored as JSON, read back with its keys
        stored = column.process_result_value(
            json.loads(json.dumps(column.process_bind_param(out, None))), None
        )
        shown.append(predicted_vs_measured(stored, {"peak_rss_gib": 1.5, "step_s": 0.4}, lang))
    return shown


def test_the_estimate_is_chinese_in_chinese(monkeypatch):
    data = ["laptop", "gpunode", "A100"]
    zh, en = _estimate_texts("zh"), _estimate_texts("en")
    assert any("will not fit" in t for t in en) and any("may not fit" in t for t in en)
    assert any("may not fit: loading takes" in t for t in en)  # every warning kind is among them
    for piece in zh:
        assert untranslated_words(piece, data) == [], piece
    assert all(untranslated_words(piece, data) for piece in en if piece)  # the check is not vacuous


def test_service_refusals_the_tabs_show_are_chinese_in_chinese(settings, tmp_path, monkeypatch):
    """Messages that real service calls raise, as the tabs show them (toasts of ctx.call, problem rows of a
    refused upload): Chinese in Chinese, English in English and through REST."""
    from image_standin import ImageHost, picture

    from studio.services import datasets as datasets_svc
    from studio.services import deployments as deployments_svc
    from studio.services import runs as runs_svc
    from studio.ui.context import UIContext
    from workers.media import execute_media_fetch

    ctx = UIContext(settings=settings, texts=Texts(), demo=None)
    token = i18n.LocalContext.request.set(SimpleNamespace(session_hash="zh-refusals"))
    try:
        i18n.remember_language("zh")
        toasts = []
        for fn, *args in [
            (datasets_svc.get_dataset, 41),
            (runs_svc.cancel_run, settings, 7),
            (deployments_svc.get_deployment, 9),
        ]:
            try:
                ctx.call(fn, *args)
            except gr.Error as e:
                toasts.append(e.message)
        assert len(toasts) == 3 and toasts[0] == "数据集 41 不存在", toasts
        host = ImageHost({})
        data = tmp_path / "vl.jsonl"
        record = {"image_info": [{"matched_text_index": 0, "image_url": f"{host.url}/a.jpg"}],
                  "text_info": [{"text": "Q", "tag": "mask"}, {"text": "A", "tag": "no_mask"}]}  # fmt: skip
        data.write_text(json.dumps(record) + "\n")
        # images named by URL are fetched by the worker's job; what it could not fetch is a dataset problem
        rows, english = [], []
        page = picture((9, 9, 9), format="PNG")[:40]  # a PNG's start: no image the processor accepts
        host.files["/page.png"] = (page, "image/png")
        whole = picture((9, 9, 9), format="PNG")
        host.files["/half.png"] = (whole[: len(whole) // 2], "image/png")  # a good header, half the pixels
        cases = [
            ("public", "a.jpg"),
            ("off", "a.jpg"),
            ("any", "a.jpg"),
            ("any", "page.png"),
            ("any", "half.png"),
        ]
        for policy, path in cases:
            monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", policy)
            data.write_text(json.dumps(record).replace("a.jpg", path) + "\n")
            ds = ctx.call(datasets_svc.upload_dataset, settings, str(data), "vl.jsonl")
            assert execute_media_fetch(settings, ds.media_fetch.id, "me@n") == "succeeded"
            problems = ctx.call(datasets_svc.get_dataset, ds.id).problems
            english += problems
            rows += problem_rows(problems, "zh")["problem"].tolist()
        host.close()
    finally:
        i18n.LocalContext.request.reset(token)
    assert len(rows) == 5 and "ERNIE_STUDIO_MEDIA_URLS=off" in rows[1] and "404" in rows[2], rows
    # the problems are keyed messages, kept through the dataset's row: their Chinese is looked up, not parsed
    assert [p.key for p in english] == ["media.at_line"] * 5, english
    assert rows[0].endswith(
        "127.0.0.1 是回环地址（127.0.0.1）；记录中的 URL 只从公网主机获取"
        "（ERNIE_STUDIO_MEDIA_URLS=any 允许内部图床）；也可把图片保存在数据文件旁边"
    ), rows
    assert rows[2].endswith("无法获取：服务器返回 HTTP 404；也可把图片保存在数据文件旁边"), rows
    assert rows[3].endswith(
        "返回内容不是 VL 处理器接受的图片（不是可读取的图片（格式未知或不是图片））；"
        "也可把图片保存在数据文件旁边"
    ), rows
    assert rows[4].startswith("image_info[0]：图片 'http://127.0.0.1:") and rows[4].endswith(
        "返回内容不是 VL 处理器接受的图片（文件被截断或已损坏）；也可把图片保存在数据文件旁边"
    ), rows
    for piece in [*toasts, *rows]:
        assert untranslated_words(piece, ["vl.jsonl"]) == [], piece
    assert all("could not be fetched" in p and i18n.localize_message(p, "en") == p for p in english)
