"""REST and UI exports offer the engine's dtype choices and shard size (ExportConfig: one source), checked by
the engine, and go to the `export` queue."""

from __future__ import annotations

import pytest
from studio_helpers import DEMO_SFT, upload

from engine.train.export_config import EXPORT_CHOICES, ExportConfig
from engine.train.options import EXPORT_DTYPES, config_default, field_info
from studio import queue
from studio.models import Export, Run, RunStatus
from studio.services.exports import export_config, export_default
from studio.ui.context import UIContext
from studio.ui.i18n import Texts
from studio.ui.run_views import export_rows
from studio.ui.runs_tab import EXPORT_DTYPES as UI_DTYPES
from studio.ui.runs_tab import RunsHandlers


@pytest.fixture
def run_id(client, session) -> int:
    ds = upload(client, DEMO_SFT).json()["id"]
    run = client.post("/api/v1/runs", json={"dataset_ids": [ds]}).json()
    row = session.get(Run, run["id"])
    row.status, row.model_dir = RunStatus.SUCCEEDED, row.output_dir
    session.commit()
    return run["id"]


def test_the_export_body_takes_dtype_and_shard_size_with_the_engines_defaults(
    client, settings, session, run_id
):
    schema = client.get("/openapi.json").json()["components"]["schemas"]["ExportIn"]["properties"]
    assert schema["dtype"]["default"] == ExportConfig.dtype == "float32"
    assert all(d in schema["dtype"]["description"] for d in EXPORT_DTYPES)
    assert schema["max_shard_size"]["default"] == ExportConfig.max_shard_size == "5GB"
    assert list(field_info(ExportConfig, "dtype")["choices"]) == UI_DTYPES

    plain = client.post(f"/api/v1/runs/{run_id}/export", json={"layout": "hf"}).json()
    assert (plain["dtype"], plain["max_shard_size"]) == (
        export_default("dtype"),
        export_default("max_shard_size"),
    )
    half = client.post(
        f"/api/v1/runs/{run_id}/export", json={"layout": "paddle", "dtype": "bfloat16", "max_shard_size": "2"}
    )
    assert half.status_code == 201, half.text
    half = half.json()
    assert half["export_dir"].endswith(f"models/run-{run_id}-paddle-bf16") and half["max_shard_size"] == "2"
    cfg = export_config(session.get(Run, run_id), session.get(Export, half["id"]))
    assert (cfg["dtype"], cfg["max_shard_size"], cfg["layout"]) == ("bfloat16", "2", "paddle")
    held = queue.held_jobs(settings, [queue.EXPORT_QUEUE], 60)
    assert held == {(queue.EXPORT_TASK, plain["id"]), (queue.EXPORT_TASK, half["id"])}


@pytest.mark.parametrize(
    ("body", "start"),
    [
        ({"dtype": "int8"}, "dtype: 'int8' is not one of float32, bfloat16, float16"),
        ({"max_shard_size": "huge"}, "max_shard_size must be a size like 5GB or 500MB"),
        ({"max_shard_size": "0MB"}, "max_shard_size must be a size like 5GB or 500MB"),
        ({"ptq": "wint8", "dtype": "float16"}, "dtype: a wint8 export stores quantized weights"),
    ],
)
def test_export_choices_outside_the_engines_are_refused_naming_the_field(client, run_id, body, start):
    r = client.post(f"/api/v1/runs/{run_id}/export", json={"layout": "paddle", **body})
    assert r.status_code == 422 and r.json()["message"].startswith(start), r.text
    assert client.get("/api/v1/exports").json() == []


def test_the_runs_tab_exports_with_the_chosen_dtype_and_shard_size(settings, run_id):
    h = RunsHandlers(UIContext(settings=settings, texts=Texts(), demo=None))
    assert "queued" in h.export(run_id, "merge LoRA (hf layout)", "float16", " 1GB ")
    assert "queued" in h.export(run_id, "PTQ wint8", "float16", "1GB")  # PTQ writes its own weights
    rows = export_rows(h.ctx.read(lambda s: s.query(Export).order_by(Export.id).all(), default=[]))
    assert rows["dtype"].tolist() == ["float16 · 1GB shards", "—"]
    assert rows["layout"].tolist() == ["hf", "paddle"]


def test_a_gguf_export_takes_the_engines_types_and_measures_on_the_runs_data(
    client, settings, session, run_id
):
    r = client.post(f"/api/v1/runs/{run_id}/export", json={"export_format": "gguf"})
    assert r.status_code == 201, r.text
    out = r.json()
    assert (out["export_format"], out["gguf_types"]) == ("gguf", ",".join(export_default("gguf_types")))
    assert out["export_dir"].endswith(f"models/run-{run_id}-gguf") and out["gguf_files"] is None
    cfg = export_config(session.get(Run, run_id), session.get(Export, out["id"]))
    assert cfg["export_format"] == "gguf" and cfg["gguf_types"] == ["f16", "q8_0"]
    assert cfg["eval_dataset_path"] == session.get(Run, run_id).config["train_dataset_path"]
    bad = client.post(f"/api/v1/runs/{run_id}/export", json={"export_format": "gguf", "gguf_types": ["q5_1"]})
    assert (
        bad.status_code == 422 and "gguf_types must be one of f32, f16, q8_0, q4_K_M" in bad.json()["message"]
    )
    ptq = client.post(f"/api/v1/runs/{run_id}/export", json={"export_format": "gguf", "ptq": "wint8"})
    assert ptq.status_code == 422 and "gguf_types (q8_0, q4_K_M)" in ptq.json()["message"]


def test_the_runs_tab_shows_each_gguf_files_size_and_perplexity(settings, session, run_id):
    h = RunsHandlers(UIContext(settings=settings, texts=Texts(), demo=None))
    assert "size and perplexity" in h.export(run_id, "GGUF f16 + q8_0 + q4_K_M (llama.cpp / Ollama)")
    row = session.query(Export).one()
    assert row.gguf_types == "f16,q8_0,q4_K_M"
    row.gguf_files = [
        {"type": "f16", "size_bytes": 2 * 2**20, "perplexity": 10.0, "relative_to_f16": 0.0},
        {"type": "q8_0", "size_bytes": 2**20, "perplexity": 10.05, "relative_to_f16": 0.005},
    ]
    session.commit()
    rows = export_rows([row])
    assert rows["perplexity"].tolist() == ["f16 2.0 MiB ppl 10.000, q8_0 1.0 MiB ppl 10.050 (+0.50%)"]
    assert rows["dtype"].tolist() == ["f16 · q8_0 · q4_K_M"] and rows["layout"].tolist() == ["gguf"]


def _finished_gguf_export(session, settings, run_id: int) -> Export:
    out = settings.models_dir / f"run-{run_id}-gguf"
    out.mkdir(parents=True)
    files = []
    for t in ("f16", "q8_0"):
        (out / f"model-{t}.gguf").write_bytes(b"GGUF")
        files.append({"type": t, "path": str(out / f"model-{t}.gguf"), "size_bytes": 4, "perplexity": None})
    row = Export(
        run_id=run_id, layout="gguf", quantization="", export_format="gguf", gguf_types="f16,q8_0",
        status=RunStatus.SUCCEEDED, export_dir=str(out), gguf_files=files,
    )  # fmt: skip
    session.add(row)
    session.commit()
    return row


def test_a_gguf_export_deploys_with_llamacpp_from_rest_and_the_runs_tab(client, settings, session, run_id):
    """export_id deploys one file of a finished GGUF export (q8_0 unless gguf_type says otherwise) with
    llama.cpp; anything else is refused naming the field."""
    export = _finished_gguf_export(session, settings, run_id)
    h = RunsHandlers(UIContext(settings=settings, texts=Texts(), demo=None))
    message, dep_id = h.deploy_gguf(run_id, None)
    assert "GGUF q8_0 starting with llama.cpp" in message
    dep = client.get(f"/api/v1/deployments/{dep_id}").json()
    assert dep["model_dir"] == str(settings.models_dir / f"run-{run_id}-gguf" / "model-q8_0.gguf")
    assert (dep["backend"], dep["name"]) == ("llamacpp", f"run-{run_id}-gguf-q8_0")
    _, dep_id = h.deploy_gguf(run_id, f"{export.id}:f16")
    assert client.get(f"/api/v1/deployments/{dep_id}").json()["model_dir"].endswith("model-f16.gguf")
    assert (queue.DEPLOYMENT_TASK, dep_id) in queue.held_jobs(settings, [queue.SERVE_QUEUE], 60)

    def refused(body: dict) -> str:
        r = client.post("/api/v1/deployments", json=body)
        assert r.status_code in (409, 422), r.text
        return r.json()["message"]

    assert refused({"export_id": export.id, "gguf_type": "q4_K_M"}).startswith(
        f"gguf_type: export {export.id} holds f16, q8_0, not 'q4_K_M'"
    )
    assert "give backend llamacpp" in refused({"export_id": export.id, "backend": "paddle"})
    assert refused({"run_id": run_id, "gguf_type": "f16"}).startswith(
        "gguf_type: picks a file of a GGUF export"
    )
    assert refused({"run_id": run_id, "export_id": export.id}).startswith("give exactly one of run_id")
    plain = client.post(f"/api/v1/runs/{run_id}/export", json={"layout": "hf"}).json()
    assert refused({"export_id": plain["id"]}) == (
        f"export_id: export {plain['id']} is queued; deploy it once it has succeeded"
    )
    assert refused({"export_id": plain["id"], "gguf_type": "f16"}).startswith(
        f"gguf_type: export {plain['id']} is a hf checkpoint, not a GGUF export"
    )
    (settings.models_dir / f"run-{run_id}-gguf" / "model-q8_0.gguf").unlink()
    assert "q8_0 file" in refused({"export_id": export.id}) and "is gone" in refused({"export_id": export.id})


def test_a_gguf_export_is_not_a_model_to_train_or_evaluate(client, settings, session, run_id):
    """/models lists what may be trained from, evaluated and deployed alike; a GGUF export only deploys
    (export_id, GET /exports lists its files), so it is not listed there, and evaluating it, or a deployment
    serving it, is refused at once naming the field (evaluation runs the model in Paddle)."""
    export = _finished_gguf_export(session, settings, run_id)
    names = {m["name"] for m in client.get("/api/v1/models").json()}
    assert f"run:{run_id}" in names and not {n for n in names if "gguf" in n}
    listed = client.get("/api/v1/exports", params={"run_id": run_id}).json()
    assert [f["type"] for f in listed[0]["gguf_files"]] == ["f16", "q8_0"]
    ds = upload(client, DEMO_SFT).json()["id"]
    dep = client.post("/api/v1/deployments", json={"export_id": export.id}).json()
    for body, message in (
        (
            {"export_id": export.id},
            f"export_id: export {export.id} is a GGUF export, which only llama.cpp runs",
        ),
        (
            {"deployment_id": dep["id"]},
            f"deployment_id: deployment {dep['id']} serves a GGUF file with llama.cpp",
        ),
    ):
        r = client.post("/api/v1/evals", json={**body, "dataset_ids": [ds]})
        assert r.status_code == 422 and r.json()["message"].startswith(message), r.text
    assert client.get("/api/v1/evals").json() == []
    r = client.post("/api/v1/runs", json={"dataset_ids": [ds], "base_model": export.export_dir})
    assert r.status_code == 422 and "has no config.json" in r.json()["message"]


def test_the_export_body_and_row_are_made_from_the_engines_export_choices(client, session, run_id):
    """ExportConfig's EXPORT_CHOICES are the REST body's fields (help, choices, defaults) and the row's
    columns (defaults): a new export option is a field of ExportConfig, its name there and its column."""
    schema = client.get("/openapi.json").json()["components"]["schemas"]["ExportIn"]["properties"]
    columns = Export.__table__.columns
    for key in EXPORT_CHOICES:
        info, default = field_info(ExportConfig, key), config_default(ExportConfig, key)
        assert schema[key]["description"].startswith(info["help"]), key
        assert all(c in schema[key]["description"] for c in info["choices"] or ()), key
        empty = default == "" or isinstance(default, list)  # None: the engine's default at the service
        assert schema[key].get("default") == (None if empty else default), key
        if key != "gguf_types":  # comma-joined in its row; "" for a checkpoint export
            assert columns[key].default.arg == default, key
    r = client.post(f"/api/v1/runs/{run_id}/export", json={})
    assert r.status_code == 201, r.text
    row = session.get(Export, r.json()["id"])
    assert {k: getattr(row, k) for k in EXPORT_CHOICES} == {
        **{k: config_default(ExportConfig, k) for k in EXPORT_CHOICES},
        "gguf_types": "",
    }


def test_quantization_is_the_bodys_name_and_ptq_is_still_read(client, session, run_id):
    new = client.post(f"/api/v1/runs/{run_id}/export", json={"quantization": "wint8"})
    old = client.post(f"/api/v1/runs/{run_id}/export", json={"ptq": "wint4"})
    assert (new.status_code, old.status_code) == (201, 201), (new.text, old.text)
    assert (new.json()["quantization"], old.json()["quantization"]) == ("wint8", "wint4")
    assert old.json()["export_dir"].endswith(f"models/run-{run_id}-paddle-wint4")
    both = client.post(f"/api/v1/runs/{run_id}/export", json={"quantization": "wint8", "ptq": "wint8"})
    assert both.status_code == 422 and both.json()["message"].startswith(
        "ptq: the former name of quantization"
    )
    for body, field in (({"ptq": "wint9"}, "ptq"), ({"quantization": "wint9"}, "quantization")):
        bad = client.post(f"/api/v1/runs/{run_id}/export", json=body)
        assert (
            bad.status_code == 422
            and bad.json()["message"] == f"{field}: 'wint9' is not one of wint8, wint4, fp8"
        )
    hf = client.post(f"/api/v1/runs/{run_id}/export", json={"quantization": "fp8", "layout": "hf"})
    assert hf.status_code == 422 and hf.json()["message"].startswith(
        "quantization: quantized exports are written"
    )
    assert len(client.get("/api/v1/exports").json()) == 2
