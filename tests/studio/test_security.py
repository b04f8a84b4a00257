"""The hardening probes of issue 15, replayed as they were sent: each is refused, and no file outside the
studio's home is ever read (a sentinel's contents never appear in any answer, no dataset is made of it)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from studio_helpers import DEMO_DPO, DEMO_SFT, TOKEN, upload

from studio.api.auth import COOKIE, parse_cookies
from studio.api.security import host_name, request_problem
from studio.app import create_app
from studio.config import Settings
from studio.migrate import upgrade
from studio.services.paths import PATH_KEYS

SENTINEL = "SENTINEL-7f3a9c-not-for-your-eyes"
UPLOAD_API = "upload_dataset"  # the api_name the Datasets tab gives its upload event


@pytest.fixture
def outside_file(tmp_path):
    """A valid dataset file the server can read but that lies outside the studio's home."""
    path = tmp_path / "outside" / "secret.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps({"src": [SENTINEL], "tgt": [SENTINEL]}) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def studio_with_ui(tmp_path):
    """The default studio: loopback, no token, the Gradio UI mounted at / as `ernie-studio up` serves it."""
    settings = Settings(home=tmp_path / "home")
    upgrade(settings)
    with TestClient(create_app(settings, with_ui=True), base_url="http://127.0.0.1") as client:
        yield client


def _gradio_call(client: TestClient, api_name: str, data: list, headers: dict | None = None) -> str:
    """Gradio's two-step call API: POST the inputs, then read the event stream of the result."""
    posted = client.post(f"/gradio_api/call/{api_name}", json={"data": data}, headers=headers or {})
    if posted.status_code != 200:
        return f"{posted.status_code} {posted.text}"
    event_id = posted.json()["event_id"]
    return client.get(f"/gradio_api/call/{api_name}/{event_id}", headers=headers or {}).text


def test_gradio_will_not_read_a_server_file_named_in_a_request(studio_with_ui, outside_file):
    payload = [{"path": str(outside_file), "meta": {"_type": "gradio.FileData"}}, "x", "auto"]
    answer = _gradio_call(studio_with_ui, UPLOAD_API, payload)
    assert "event: error" in answer and SENTINEL not in answer
    datasets = studio_with_ui.get("/api/v1/datasets")
    assert datasets.json() == [] and SENTINEL not in datasets.text
    # a file under the studio's home but not uploaded through Gradio is refused the same way
    inside = studio_with_ui.app.state.settings.home / "studio-file.jsonl"
    inside.write_text(outside_file.read_text())
    payload[0]["path"] = str(inside)
    assert "event: error" in _gradio_call(studio_with_ui, UPLOAD_API, payload)
    assert studio_with_ui.get("/api/v1/datasets").json() == []


def test_another_local_origin_cannot_drive_the_tokenless_studio(studio_with_ui, outside_file):
    evil = {"Origin": "http://localhost:3000"}
    payload = [{"path": str(outside_file), "meta": {"_type": "gradio.FileData"}}, "x", "auto"]
    r = studio_with_ui.post(f"/gradio_api/call/{UPLOAD_API}", json={"data": payload}, headers=evil)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    assert "ERNIE_STUDIO_ALLOWED_ORIGINS" in r.json()["message"]
    preflight = studio_with_ui.options(
        "/api/v1/datasets", headers={**evil, "Access-Control-Request-Method": "POST"}
    )
    assert preflight.status_code == 403 and "access-control-allow-credentials" not in preflight.headers
    with open(DEMO_SFT, "rb") as f:
        r = studio_with_ui.post(
            "/api/v1/datasets", files={"file": ("d.jsonl", f)}, headers={"Origin": "http://evil.example"}
        )
    assert r.status_code == 403
    assert studio_with_ui.get("/api/v1/datasets").json() == []
    # the studio's own pages keep working
    with open(DEMO_SFT, "rb") as f:
        own = studio_with_ui.post(
            "/api/v1/datasets", files={"file": ("d.jsonl", f)}, headers={"Origin": "http://127.0.0.1"}
        )
    assert own.status_code == 201


def test_a_rebound_host_name_is_refused(studio_with_ui):
    r = studio_with_ui.get("/api/v1/datasets", headers={"Host": "evil.example"})
    assert r.status_code == 403 and "ERNIE_STUDIO_ALLOWED_HOSTS" in r.json()["message"]
    assert studio_with_ui.get("/", headers={"Host": "attacker.test:7860"}).status_code == 403
    for ok in ("127.0.0.1:7860", "localhost", "[::1]:7860"):
        assert studio_with_ui.get("/api/v1/datasets", headers={"Host": ok}).status_code == 200, ok


def test_proxy_names_are_a_setting(tmp_path):
    settings = Settings(
        home=tmp_path / "home",
        allowed_hosts="studio.example.com",
        allowed_origins="https://studio.example.com",
    )
    upgrade(settings)
    with TestClient(create_app(settings, with_ui=False), base_url="https://studio.example.com") as c:
        assert c.get("/api/v1/runs", headers={"Origin": "https://studio.example.com"}).status_code == 200
        assert c.get("/api/v1/runs", headers={"Origin": "https://other.example.com"}).status_code == 403
        assert c.get("/api/v1/runs", headers={"Host": "other.example.com"}).status_code == 403


def test_an_earlier_json_cookie_does_not_hide_the_token_cookie(locked):
    header = f'prefs={{"theme": "dark", "x": [1, 2]}}; {COOKIE}={TOKEN}; other=1'
    assert locked.get("/api/v1/runs", headers={"Cookie": header}).status_code == 200
    assert parse_cookies(header)[COOKIE] == TOKEN


def test_a_token_in_the_url_is_refused_on_api_routes(locked):
    r = locked.get(f"/api/v1/runs?token={TOKEN}")
    assert r.status_code == 401
    assert locked.post(f"/api/v1/runs?token={TOKEN}", json={}).status_code == 401
    # the one-time browser login link still works and becomes a cookie
    login = locked.get(f"/docs?token={TOKEN}")
    assert login.status_code == 303 and COOKIE in login.headers["set-cookie"]
    assert locked.get("/api/v1/runs", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


@pytest.mark.parametrize(
    ("host", "name"), [("a.example:80", "a.example"), ("[::1]:7860", "::1"), ("LOCALHOST", "localhost")]
)
def test_host_names(host, name):
    assert host_name(host) == name


def test_request_rules():
    rules = dict(loopback_only=True, allowed_hosts=set(), allowed_origins=set())
    assert request_problem("127.0.0.1:7860", None, **rules) is None
    assert request_problem("127.0.0.1:7860", "http://127.0.0.1:7860", **rules) is None
    assert request_problem("127.0.0.1:7860", "null", **rules) is not None
    assert request_problem("127.0.0.1:7860", "http://127.0.0.1:9999", **rules) is not None
    # with a token the host is not limited, the origin still is
    open_rules = dict(loopback_only=False, allowed_hosts=set(), allowed_origins=set())
    assert request_problem("10.0.0.5:7860", None, **open_rules) is None
    assert request_problem("10.0.0.5:7860", "http://evil.example", **open_rules) is not None


# ---- item 3: every path from outside is confined to the studio's home ------------------------------------

_OPENED: list[str] | None = None


def _record_open(event: str, args: tuple) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], str | bytes):
        _OPENED.append(os.fsdecode(args[0]))


@pytest.fixture
def opened_files():
    """Every file the process opens while the test runs (Python's audit hook sees each `open`)."""
    global _OPENED
    if not getattr(sys, "_ernie_open_hook", False):
        sys.addaudithook(_record_open)  # hooks cannot be removed: installed once, off unless a test asks
        sys._ernie_open_hook = True
    _OPENED = []
    try:
        yield _OPENED
    finally:
        _OPENED = None


@pytest.fixture
def api(client, outside_file):
    """The API with one SFT dataset uploaded (before any file is watched)."""
    client.dataset_id = upload(client, DEMO_SFT).json()["id"]
    return client


def _never_read(outside_file, opened: list[str], *answers) -> None:
    assert not [p for p in opened if Path(p).resolve().is_relative_to(outside_file.parent)], opened
    for r in answers:
        assert SENTINEL not in r.text


def test_a_path_in_hyperparameters_is_refused_with_what_to_send_instead(api, outside_file, opened_files):
    answers = []
    for key in PATH_KEYS:
        body = {"dataset_ids": [api.dataset_id], "hyperparameters": {key: str(outside_file)}}
        for route in ("/api/v1/runs", "/api/v1/runs/estimate"):
            r = api.post(route, json=body)
            assert r.status_code == 422, (key, r.text)
            assert f"hyperparameters.{key}: paths are not accepted" in r.json()["message"]
            answers.append(r)
    probe = {"dataset_ids": [api.dataset_id], "hyperparameters": {"eval_dataset_path": str(outside_file)}}
    r = api.post("/api/v1/runs", json=probe)
    assert r.status_code == 422 and "eval_dataset_ids" in r.json()["message"], r.text
    assert api.get("/api/v1/runs").json() == []
    _never_read(outside_file, opened_files, r, *answers)


def test_a_clone_cannot_bring_a_path_in(api, outside_file, opened_files):
    run = api.post("/api/v1/runs", json={"dataset_ids": [api.dataset_id]}).json()
    for overrides in (
        {"eval_dataset_path": str(outside_file)},
        {"train_dataset_path": str(outside_file)},
        {"hyperparameters": {"model_name_or_path": str(outside_file.parent)}},
        {"base_model": str(outside_file.parent)},
    ):
        r = api.post(f"/api/v1/runs/{run['id']}/clone", json={"overrides": overrides})
        assert r.status_code == 422, (overrides, r.text)
        _never_read(outside_file, opened_files, r)
    assert len(api.get("/api/v1/runs").json()) == 1


def test_evaluation_sets_go_by_id_and_resolve_under_home(api, settings):
    sft, dpo = api.dataset_id, upload(api, DEMO_DPO).json()["id"]
    run = api.post("/api/v1/runs", json={"dataset_ids": [sft], "eval_dataset_ids": [sft]})
    assert run.status_code == 201, run.text
    cfg = run.json()["config"]
    assert cfg["eval_dataset_path"] == cfg["train_dataset_path"]
    assert Path(cfg["eval_dataset_path"]).is_relative_to(settings.datasets_dir)
    assert cfg["eval_dataset_type"] == cfg["train_dataset_type"]
    clone = api.post(f"/api/v1/runs/{run.json()['id']}/clone", json={"overrides": {"max_steps": 3}})
    assert (
        clone.status_code == 201 and clone.json()["config"]["eval_dataset_path"] == cfg["eval_dataset_path"]
    )
    r = api.post("/api/v1/runs", json={"dataset_ids": [sft], "eval_dataset_ids": [dpo]})
    assert r.status_code == 422 and r.json()["message"].startswith("eval_dataset_ids: dataset")
    r = api.post("/api/v1/runs", json={"dataset_ids": [sft], "eval_dataset_ids": [999]})
    assert r.status_code == 404 and "dataset 999" in r.json()["message"]


def test_a_stored_config_naming_a_path_outside_is_not_exported(api, settings, session, outside_file):
    from studio.models import Run, RunStatus

    run = api.post("/api/v1/runs", json={"dataset_ids": [api.dataset_id]}).json()
    row = session.get(Run, run["id"])  # a run stored before paths were refused in hyperparameters
    row.config = {**row.config, "eval_dataset_path": str(outside_file)}
    row.status, row.model_dir = RunStatus.SUCCEEDED, row.output_dir
    session.commit()
    r = api.post(f"/api/v1/runs/{run['id']}/export", json={"layout": "paddle", "ptq": "wint8"})
    assert r.status_code == 422 and "eval_dataset_path" in r.json()["message"], r.text
    assert "outside the studio's storage" in r.json()["message"]
    assert api.get("/api/v1/exports").json() == []


def test_a_stored_config_naming_a_path_outside_is_not_resumed(api, settings, session, outside_file):
    from studio.models import Run, RunStatus

    run = api.post("/api/v1/runs", json={"dataset_ids": [api.dataset_id]}).json()
    row = session.get(Run, run["id"])  # stored before paths were refused, then failed
    row.config = {**row.config, "eval_dataset_path": str(outside_file)}
    row.status = RunStatus.FAILED
    session.commit()
    r = api.post(f"/api/v1/runs/{run['id']}/resume")
    assert r.status_code == 422 and "eval_dataset_path" in r.json()["message"], r.text
    session.expire_all()
    assert session.get(Run, run["id"]).status == RunStatus.FAILED


def test_dataset_files_stay_inside_their_dataset(api, settings, outside_file):
    escape = settings.datasets_dir / "escape"
    os.symlink(outside_file.parent, escape)  # a link under home/datasets pointing out of it
    for path in ("../escape/secret.jsonl", "%2e%2e/%2e%2e/escape/secret.jsonl", "..%2f..%2fescape"):
        r = api.get(f"/api/v1/datasets/{api.dataset_id}/files/{path}")
        assert r.status_code in (404, 422) and SENTINEL not in r.text, (path, r.text)


# ---- item 4: bad input is a 4xx naming the field, never a 5xx ------------------------------------------------


def test_clone_refuses_bad_overrides_by_field(api):
    run = api.post("/api/v1/runs", json={"dataset_ids": [api.dataset_id], "name": "n" * 200}).json()
    clone = api.post(f"/api/v1/runs/{run['id']}/clone", json={})
    # the name the clone gets is made to fit; a name the person gives is checked like any field
    assert clone.status_code == 201 and clone.json()["name"] == "n" * 194 + "-clone"
    for overrides, field in [
        ({"stage": 5}, "overrides.stage"),
        ({"dataset_ids": "abc"}, "overrides.dataset_ids"),
        ({"gpu": -1}, "overrides.gpu"),
        ({"name": "x" * 201}, "overrides.name"),
        ({"eval_dataset_ids": [0]}, "overrides.eval_dataset_ids.0"),
        ({"hyperparameters": "lr"}, "overrides.hyperparameters"),
    ]:
        r = api.post(f"/api/v1/runs/{run['id']}/clone", json={"overrides": overrides})
        assert r.status_code == 422 and r.json()["message"].startswith(field), (overrides, r.text)


def _json_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every operation that takes a JSON body, from the OpenAPI schema, ids set to 1."""
    routes = []
    for path, ops in app.openapi()["paths"].items():
        for method, op in ops.items():
            if "application/json" in op.get("requestBody", {}).get("content", {}):
                routes.append((method.upper(), re.sub(r"\{[^}]+\}", "1", path)))
    return routes


def test_a_deeply_nested_body_is_a_4xx_on_every_json_route(api):
    routes = _json_routes(api.app)
    assert ("POST", "/api/v1/runs") in routes and ("POST", "/api/v1/deployments/1/chat") in routes
    bodies = [b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000]
    for method, path in routes:
        for body in bodies:
            r = api.request(method, path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 422, (path, r.status_code, r.text[:200])
            assert r.json()["message"].startswith("body: arrays and objects nest more than")
    # the same without a content type, which FastAPI parses as JSON too
    assert api.post("/api/v1/runs", content=bodies[0]).status_code == 422
    ok = {"dataset_ids": [api.dataset_id], "hyperparameters": {"max_steps": 1}, "name": "[{" * 90}
    assert api.post("/api/v1/runs", json=ok).status_code == 201  # brackets inside strings do not nest


def test_a_deeply_nested_body_is_refused_by_the_mounted_ui_too(studio_with_ui):
    body = b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = studio_with_ui.post(
        f"/gradio_api/call/{UPLOAD_API}", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["message"].startswith("body: arrays and objects nest")


def test_a_lone_surrogate_is_refused_naming_the_field(api):
    run = api.post("/api/v1/runs", json={"dataset_ids": [api.dataset_id]}).json()
    probes = [
        ("/api/v1/runs", '{"dataset_ids": [1], "name": "\\ud800"}', "name"),
        (
            "/api/v1/runs",
            '{"dataset_ids": [1], "hyperparameters": {"seed": "\\udfff"}}',
            "hyperparameters.seed",
        ),
        (
            "/api/v1/runs",
            '{"dataset_ids": [1], "hyperparameters": {"\\ud800x": 1}}',
            "hyperparameters.\\ud800x",
        ),
        (f"/api/v1/runs/{run['id']}/clone", '{"overrides": {"name": "a\\ud800"}}', "overrides.name"),
        ("/api/v1/deployments", '{"model": "tiny", "name": "\\udc00"}', "name"),
        (
            "/api/v1/deployments/1/chat",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
        ),
    ]
    for path, text, field in probes:
        r = api.post(path, content=text.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["message"].startswith(f"{field}: "), (text, r.text)
    raw = '{"dataset_ids": [1], "name": "\ud800"}'.encode("utf-8", "surrogatepass")  # the bytes themselves
    r = api.post("/api/v1/runs", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "not valid UTF-8" in r.json()["message"]
    # a surrogate pair is a character (U+1F600), and an escaped backslash before "ud800" is plain text
    fine = '{"dataset_ids": [ID], "name": "\\ud83d\\ude00 \\\\ud800"}'.replace("ID", str(api.dataset_id))
    r = api.post("/api/v1/runs", content=fine.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 201 and r.json()["name"] == "\U0001f600 \\ud800"
    assert len(api.get("/api/v1/runs").json()) == 2


def test_a_json_body_over_the_limit_is_a_413(api):
    from studio.api.body_limits import MAX_JSON_BYTES

    body = b'{"name": "' + b"x" * MAX_JSON_BYTES + b'"}'
    r = api.post("/api/v1/runs", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["message"].startswith("body: larger than")


# ---- item 5: upper bounds, GPUs this node has, unknown keys --------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_steps", 2**63),
        ("per_device_train_batch_size", 10**9),
        ("max_seq_len", 10**9),
        ("learning_rate", 1e308),
    ],
)
def test_absurd_hyperparameters_are_refused_naming_the_key(api, key, value):
    r = api.post("/api/v1/runs", json={"dataset_ids": [api.dataset_id], "hyperparameters": {key: value}})
    assert r.status_code == 422 and f"{key} must be <=" in r.json()["message"], r.text


def test_a_gpu_this_node_does_not_have_is_refused(api, tmp_path):
    r = api.post("/api/v1/runs", json={"dataset_ids": [api.dataset_id], "gpu": 5})
    assert r.status_code == 422 and "ERNIE_STUDIO_GPUS is empty" in r.json()["message"]
    settings = Settings(home=tmp_path / "gpu-home", gpus="0,1", node_name="n1")
    upgrade(settings)
    with TestClient(create_app(settings, with_ui=False), base_url="http://127.0.0.1") as gpu_node:
        ds = upload(gpu_node, DEMO_SFT).json()["id"]
        r = gpu_node.post("/api/v1/runs", json={"dataset_ids": [ds], "gpu": 5})
        assert r.status_code == 422 and r.json()["message"].startswith(
            "gpu: node n1 has no GPU 5; its GPUs are 0, 1"
        )
        r = gpu_node.post("/api/v1/runs", json={"dataset_ids": [ds], "gpu": 1})
        assert r.status_code == 201 and r.json()["queue"] == "gpu.n1.1"
        r = gpu_node.post(f"/api/v1/runs/{r.json()['id']}/clone", json={"overrides": {"gpu": 7}})
        assert r.status_code == 422 and "no GPU 7" in r.json()["message"]
        assert len(gpu_node.get("/api/v1/runs").json()) == 1


def test_unknown_keys_are_refused_with_the_closest_valid_one(api):
    run = api.post("/api/v1/runs", json={"dataset_ids": [api.dataset_id]}).json()
    for path, body, wanted in [
        ("/api/v1/runs", {"dataset_ids": [1], "hyperparamters": {"max_steps": 2}}, "'hyperparameters'"),
        ("/api/v1/runs/estimate", {"dataset_ids": [1], "gpus": 0}, "'gpu'"),
        (f"/api/v1/runs/{run['id']}/clone", {"override": {"max_steps": 2}}, "'overrides'"),
        (f"/api/v1/runs/{run['id']}/export", {"layot": "hf"}, "'layout'"),
        ("/api/v1/deployments", {"modle": "tiny"}, "'model'"),
    ]:
        r = api.post(path, json=body)
        assert r.status_code == 422, (path, r.text)
        message = r.json()["message"]
        assert f"unknown key '{next(iter(set(body) - {'dataset_ids'}))}'" in message and wanted in message, (
            message
        )
    assert len(api.get("/api/v1/runs").json()) == 1
