"""Importing an ERNIEKit training YAML into the Train form (studio.services.config_import, studio.ui.train_import).

Every example config this repository keeps (examples/*.yaml and ERNIEKit's configs of
tests/engine/test_erniekit_configs.py) is imported; the form values it gives become a run whose engine config
is, key for key, what `ernie-studio train` makes of the same YAML. YAML is user data: each attack is refused
by name and line, and no path in a file is opened.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest
import yaml
from studio_helpers import REPO

from engine.train.config_load import load_config
from engine.train.options import comma_list
from engine.train.run_checks import defaults_for
from studio.services import datasets as datasets_svc
from studio.services import runs as runs_svc
from studio.services.config_import import MAX_IMPORT_BYTES, import_train_yaml, path_name
from studio.services.errors import InvalidInput, PayloadTooLarge
from studio.ui import i18n
from studio.ui.context import UIContext
from studio.ui.i18n import Texts, localize_message
from studio.ui.text_check import untranslated_words
from studio.ui.train_import import ImportHandlers, import_summary, imported_form_values
from studio.ui.train_tab import build_train_tab, run_spec

DATA = REPO / "examples" / "data"
UPLOADS = ["sft_demo.jsonl", "dpo_demo.jsonl", "pt_demo.jsonl", "chatml_demo.jsonl", "vl_demo.jsonl"]
OCR = ["ocr_demo/lines_train.jsonl", "ocr_demo/lines_eval.jsonl"]
# Keys whose values are places, compared by the names the import matched them by (below).
PLACES = {
    "model_name_or_path",
    "output_dir",
    "logging_dir",
    "train_dataset_type",
    "train_dataset_path",
    "train_dataset_prob",
    "eval_dataset_type",
    "eval_dataset_path",
    "eval_dataset_prob",
}


def _erniekit_configs() -> dict[str, str]:
    """ERNIEKit's configs as test_erniekit_configs.py runs them, models and data named as a person's files."""
    path = REPO / "tests" / "engine" / "test_erniekit_configs.py"
    spec = importlib.util.spec_from_file_location("erniekit_configs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {
        f"erniekit:{name}": text.replace("@MODEL@", f"/home/someone/models/{preset}")
        .replace("@OUT@", "./output")
        .replace("@DATA@", "/data/erniekit")
        for name, (preset, text) in module.RUNS.items()
    }


CONFIGS = {
    **{f"examples/{p.name}": p.read_text() for p in sorted((REPO / "examples").glob("*.yaml"))},
    **_erniekit_configs(),
}
EXPORT_CONFIGS = {name for name in CONFIGS if Path(name).name.startswith("export")}
# ERNIEKit runs the studio's form cannot hold whole: no training datasets (eval only; VL text-only data).
NO_TRAINING_DATA = {"erniekit:eval_only", "erniekit:vl_function_call_lora"}


@pytest.fixture(scope="module")
def tab():
    with gr.Blocks() as demo:
        return build_train_tab(UIContext(settings=None, texts=Texts(), demo=demo))


@pytest.fixture
def uploaded(settings, session):
    """The demo files as datasets of their own names (the image sets unvalidated: their images are not
    uploaded, and a run config only names the files)."""
    for name in UPLOADS + OCR:
        with open(DATA / name, "rb") as f:
            staged, safe = datasets_svc.stage_upload(settings, iter([f.read()]), Path(name).name)
        datasets_svc.create_dataset(session, settings, staged, safe, validate=False)
    session.commit()
    return datasets_svc.list_datasets(session)


def _form(tab, imported, datasets) -> dict:
    """The form after the import: its starting values with the import's on top."""
    keys = tab.handlers.keys
    values = {k: tab.fields[k].value for k in keys}
    for key, value in zip(keys, imported_form_values(imported, keys, datasets), strict=True):
        if isinstance(value, dict) and value.get("__type__") == "update":
            if "value" in value:
                values[key] = value["value"]
            continue
        values[key] = value
    return values


@pytest.mark.parametrize("name", sorted(set(CONFIGS) - EXPORT_CONFIGS))
def test_every_example_config_imports_to_the_run_ernie_studio_train_makes_of_it(
    tab, uploaded, settings, session, tmp_path, name
):
    text = CONFIGS[name]
    path = tmp_path / "run.yaml"
    path.write_text(text)
    cli = load_config(path)
    imported = import_train_yaml(session, settings, text, source="run.yaml")
    form = _form(tab, imported, uploaded)
    assert (form["stage"], form["fine_tuning"], form["compute_type"]) == (
        cli.stage,
        cli.fine_tuning,
        cli.compute_type,
    )
    assert {k for k, _ in imported.notices} == {n.key for n in cli.notices}
    # every path the file names is matched by its name, or listed as missing: none is dropped unnoticed
    named = [
        (key, p) for key in ("train_dataset_path", "eval_dataset_path", "text_dataset_path") for p in
        comma_list(getattr(cli, key))
    ]  # fmt: skip
    assert [(m.key, m.path) for m in imported.datasets] == named
    if name in NO_TRAINING_DATA:
        assert not imported.dataset_ids and not cli.train_dataset_path
        with pytest.raises(gr.Error, match="dataset_ids"):
            run_spec(form)
        return
    assert not imported.missing, imported.missing
    if imported.base_model is None:  # a model the studio does not list (PaddleOCR-VL, a run's output dir)
        assert f"`{imported.model_path}`: the studio has no model" in import_summary(imported)
        form["base_model"] = "tiny-vl" if "VL" in cli.stage else "tiny"  # the person picks one
    else:
        assert imported.base_model == path_name(cli.model_name_or_path)
    cfg = runs_svc.build_config(session, settings, run_spec(form), tmp_path / "out")
    studio = runs_svc.effective_config(cfg)
    engine, ours = dataclasses.asdict(cli), dataclasses.asdict(studio)
    defaults = defaults_for(cli.stage, cli.fine_tuning)
    not_applied = {k for k, _ in imported.not_applied}
    for key in engine:
        if key in PLACES:
            continue
        if key in not_applied:  # no effect on this run: the form leaves it out, and lists it
            assert ours[key] == defaults[key], key
            continue
        assert ours[key] == engine[key], key
    for split in ("train", "eval"):
        a, b = cli.dataset_spec(split), studio.dataset_spec(split)
        assert [path_name(p) for p in comma_list(a["train_dataset_path"])] == [
            path_name(p) for p in comma_list(b["train_dataset_path"])
        ], split
        if a["train_dataset_type"]:  # a file without types leaves each to detection; the studio's detected it
            assert comma_list(a["train_dataset_type"]) == comma_list(b["train_dataset_type"]), split
        assert [float(p) for p in comma_list(a["train_dataset_prob"])] == [
            float(p) for p in comma_list(b["train_dataset_prob"])
        ], split
    import_summary(imported, "zh")  # shows in either language


@pytest.mark.parametrize("name", sorted(EXPORT_CONFIGS))
def test_an_export_config_is_refused_naming_its_export_keys(settings, session, name):
    with pytest.raises(InvalidInput, match=r"unknown key 'layout'"):
        import_train_yaml(session, settings, CONFIGS[name])


LORA = """\
model_name_or_path: ./models/tiny
stage: SFT
fine_tuning: LoRA
lora_rank: 32
train_dataset_type: erniekit
train_dataset_path: /data/erniekit/sft_demo.jsonl,/data/other/not_uploaded.jsonl
train_dataset_prob: 0.7,0.3
eval_dataset_path: C:\\data\\sft_demo.jsonl
fuse_rope: True
freeze_config: freeze_vision
learning_rate: 5.0
output_dir: /etc/cron.d
"""


def test_missing_datasets_are_listed_and_values_the_engine_refuses_are_imported(
    tab, uploaded, settings, session
):
    imported = import_train_yaml(session, settings, LORA, source="lora.yaml")
    sft = next(d for d in uploaded if d.filename == "sft_demo.jsonl")
    assert [(m.path, m.dataset_id, m.line) for m in imported.datasets] == [
        ("/data/erniekit/sft_demo.jsonl", sft.id, 6),
        ("/data/other/not_uploaded.jsonl", None, 6),
        ("C:\\data\\sft_demo.jsonl", sft.id, 8),
    ]
    assert "not_uploaded.jsonl" in imported.missing[0].note
    assert imported.dataset_ids == [sft.id] and imported.eval_dataset_ids == [sft.id]
    assert imported.dataset_probs == [0.7]
    assert imported.base_model == "tiny"
    assert ("fuse_rope", imported.notices[0][1]) in imported.notices
    assert [k for k, _ in imported.not_applied] == ["freeze_config"]
    assert [k for k, _, _ in imported.studio_set] == ["output_dir", "train_dataset_type"]
    # learning_rate 5.0 is above the engine's bound: imported, and the form's check names it by its field
    form = _form(tab, imported, uploaded)
    assert form["learning_rate"] == 5.0 and form["lora_rank"] == 32
    problems = runs_svc.spec_problems(session, settings, run_spec(form))
    assert any(p.startswith("learning_rate must be <= 1") for p in problems), problems
    summary = import_summary(imported, "en")
    assert "not_uploaded.jsonl" in summary and "line 6" in summary


def test_unknown_keys_are_one_error_naming_each_with_its_line(settings, session):
    text = "stage: SFT\nlearning_rat: 1e-4\nmax_stepz: 3\n"
    with pytest.raises(InvalidInput) as e:
        import_train_yaml(session, settings, text, source="run.yaml")
    assert "run.yaml:2: unknown key 'learning_rat'; did you mean 'learning_rate'?" in e.value.message
    assert "run.yaml:3: unknown key 'max_stepz'" in e.value.message


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("lr_scheduler_type: cosin\n", "run.yaml:1", "lr_scheduler_type must be one of"),
        ("stage: SFT\nlearning_rate: .nan\n", "run.yaml:2", "learning_rate must be a finite number"),
        ("max_steps: [1, 2]\n", "run.yaml:1", "max_steps must be int"),
        ("tensor_parallel_degree: 4\n", "run.yaml:1", "asks for tensor parallelism"),
        (
            "train_dataset_path: a.jsonl\ntrain_dataset_prob: lots\n",
            "run.yaml:2",
            "train_dataset_prob: 'lots' is not",
        ),
    ],
)
def test_values_no_field_can_hold_are_refused_with_the_engines_message(
    settings, session, text, where, problem
):
    with pytest.raises(InvalidInput) as e:
        import_train_yaml(session, settings, text, source="run.yaml")
    assert where in e.value.message and problem in e.value.message


# ---- attacks --------------------------------------------------------------------------------------------


def test_python_tags_are_refused_not_executed(settings, session, tmp_path):
    marker = tmp_path / "pwned"
    text = f"stage: SFT\nseed: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(InvalidInput, match=r"run.yaml:2: YAML tag '!!python/object/apply:os.system'"):
        import_train_yaml(session, settings, text, source="run.yaml")
    assert not marker.exists()
    # a tag the safe loader would build harmlessly is refused too: an imported config has plain values
    with pytest.raises(InvalidInput, match="YAML tag '!!str'"):
        import_train_yaml(session, settings, "seed: !!str 3\n", source="run.yaml")


BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
lora_target_modules: [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_an_alias_bomb_is_refused_before_anything_is_built(settings, session):
    with pytest.raises(InvalidInput, match=r"run.yaml:1: YAML anchors and aliases"):
        import_train_yaml(session, settings, BILLION_LAUGHS, source="run.yaml")
    with pytest.raises(InvalidInput, match=r"run.yaml:2: YAML anchors and aliases"):
        import_train_yaml(session, settings, "seed: 1\nmax_steps: *x\n", source="run.yaml")


def test_oversize_input_is_refused_by_its_size(settings, session):
    text = "seed: 1\n" + "# padding\n" * (MAX_IMPORT_BYTES // 10)
    with pytest.raises(PayloadTooLarge, match=f"at most {MAX_IMPORT_BYTES:,} bytes"):
        import_train_yaml(session, settings, text.encode())
    assert len(("seed: 1\n" + "#" * (MAX_IMPORT_BYTES - 20)).encode()) < MAX_IMPORT_BYTES
    import_train_yaml(
        session, settings, "seed: 1\n" + "#" * (MAX_IMPORT_BYTES - 20)
    )  # the limit itself is fine


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- stage: SFT\n- seed: 1\n", "a config is a mapping of key: value lines, not list"),
        ("just words\n", "a config is a mapping of key: value lines, not str"),
        ("stage: SFT\n---\nseed: 1\n", "run.yaml:2: a second YAML document"),
        ("seed: 1\n" + "x: " + "[" * 50 + "]" * 50 + "\n", "run.yaml:2: nested 5 levels deep"),
        ("stage: SFT\nseed: [1\n", "run.yaml:3: not valid YAML"),
        ("   \n", "run.yaml: empty"),
    ],
)
def test_documents_that_are_not_one_mapping_are_refused_saying_where(settings, session, text, message):
    with pytest.raises(InvalidInput) as e:
        import_train_yaml(session, settings, text, source="run.yaml")
    assert message in e.value.message


def test_bytes_that_are_not_utf8_are_refused_with_their_line(settings, session):
    with pytest.raises(InvalidInput, match=r"run.yaml:2: not UTF-8 text"):
        import_train_yaml(session, settings, b"seed: 1\nstage: \xff\n", source="run.yaml")


def test_no_path_in_the_file_reaches_the_filesystem(settings, session, tmp_path, monkeypatch):
    """Paths are matched by their last part against the studio's datasets and models: none is opened,
    listed or checked for existence, wherever it points."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "sft_demo.jsonl").write_text('{"src": "x", "tgt": "y"}\n')
    (secret / "config.json").write_text("{}")
    text = (
        f"model_name_or_path: {secret}\ntrain_dataset_path: {secret / 'sft_demo.jsonl'}\n"
        f"eval_dataset_path: ../../../../etc/passwd\noutput_dir: {secret}/out\nlogging_dir: /etc\n"
    )
    touched: list[str] = []
    real_open, real_stat = open, os.stat

    def watch_open(file, *args, **kwargs):
        touched.append(str(file))
        return real_open(file, *args, **kwargs)

    def watch_stat(path, *args, **kwargs):
        touched.append(str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watch_open)
    monkeypatch.setattr(os, "stat", watch_stat)
    imported = import_train_yaml(session, settings, text)
    monkeypatch.undo()
    assert not [p for p in touched if str(secret) in p or "passwd" in p or p.startswith("/etc")], touched
    assert imported.base_model is None and imported.dataset_ids == [] and imported.eval_dataset_ids == []
    assert [m.path for m in imported.missing] == [str(secret / "sft_demo.jsonl"), "../../../../etc/passwd"]
    assert not (secret / "out").exists()


def test_the_rest_api_imports_a_yaml_and_refuses_each_attack_with_its_status(client):
    with open(DATA / "sft_demo.jsonl", "rb") as f:
        sft = client.post("/api/v1/datasets", files={"file": ("sft_demo.jsonl", f)}).json()
    headers = {"content-type": "application/yaml"}
    r = client.post("/api/v1/runs/import", content=LORA, headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["stage"], body["fine_tuning"], body["base_model"]) == ("SFT", "LoRA", "tiny")
    assert body["dataset_ids"] == [sft["id"]] and body["hyperparameters"]["lora_rank"] == 32
    missing = [d for d in body["datasets"] if d["dataset_id"] is None]
    assert [(d["path"], d["line"]) for d in missing] == [("/data/other/not_uploaded.jsonl", 6)]
    assert body["not_applied"] == {"freeze_config": ["applies to Full runs only"]}
    assert "fuse_rope" in body["notices"] and "output_dir" in body["studio_set"]
    r = client.post(
        "/api/v1/runs/import", content="seed: !!python/object/apply:os.getpid []\n", headers=headers
    )
    assert r.status_code == 422 and "request body:1: YAML tag" in r.text
    r = client.post("/api/v1/runs/import", content=BILLION_LAUGHS, headers=headers)
    assert r.status_code == 422 and "anchors and aliases" in r.text
    r = client.post(
        "/api/v1/runs/import", content=b"seed: 1\n" + b"#" * MAX_IMPORT_BYTES * 4, headers=headers
    )
    assert r.status_code == 413 and f"at most {MAX_IMPORT_BYTES:,} bytes" in r.text
    assert "/api/v1/runs/import" in client.get("/openapi.json").json()["paths"]
    # the answer is a run spec once the missing datasets are uploaded: POST /runs takes it as it is
    text = "stage: SFT\nlora_target_modules: [qkv_proj, o_proj]\nmax_steps: 2\nfreeze_config: freeze_vision\n"
    text += "train_dataset_path: /elsewhere/sft_demo.jsonl\nmodel_name_or_path: tiny\n"
    body = client.post("/api/v1/runs/import", content=text, headers=headers).json()
    assert body["hyperparameters"] == {"lora_target_modules": "qkv_proj,o_proj", "max_steps": 2}
    spec = {k: body[k] for k in ("stage", "fine_tuning", "base_model", "dataset_ids", "hyperparameters")}
    run = client.post("/api/v1/runs", json=spec)
    assert run.status_code == 201, run.text
    assert run.json()["config"]["lora_target_modules"] == "qkv_proj,o_proj"


def test_the_import_box_and_its_refusals_are_chinese_in_chinese(uploaded, settings, session):
    imported = import_train_yaml(session, settings, LORA, source="lora.yaml")
    shown = import_summary(imported, "zh")
    # names the file and the person gave, and the engine's announcements (the same English a run prints)
    data = [
        imported.model_path,
        imported.base_model,
        *imported.hyperparameters,
        *(m.path for m in imported.datasets),
    ]
    data += [k for k, _, _ in imported.studio_set] + [f"{k} {m}" for k, m in imported.notices]
    data += ["SFT", "LoRA", "fp32", "sft_demo", "freeze_config"]
    assert untranslated_words(shown, data) == [], shown
    attacks = [
        "seed: !!python/object/apply:os.system ['x']\n",
        BILLION_LAUGHS,
        "a: 1\n---\nb: 2\n",
        "x: " + "[" * 9 + "]" * 9 + "\n",
        "stage: SFT\nseed: [1\n",
        " \n",
        "seed: 1\n" + "#" * MAX_IMPORT_BYTES,
        b"seed: 1\n\xff\xfe\n",
        "train_dataset_path: /data/sft_demo.jsonl\ntrain_dataset_prob: half,half\n",
    ]
    for text in attacks:
        with pytest.raises((InvalidInput, PayloadTooLarge)) as e:
            import_train_yaml(session, settings, text, source="lora.yaml")
        zh = localize_message(e.value.message, "zh")
        assert zh != e.value.message, e.value.message
        parser = "expected ',' or ']', but got '<stream end>'"  # PyYAML's own words, quoted
        data = ["lora.yaml", "!!python/object/apply:os.system", parser, "'half,half'"]
        assert untranslated_words(zh, data) == [], zh


def test_the_import_box_says_why_in_chinese(tab, settings):
    """The box's own refusal text (each line of the service's refusal) in a session switched to Chinese."""
    handlers = ImportHandlers(UIContext(settings=settings, texts=Texts(), demo=None), tab.handlers.keys)
    token = i18n.LocalContext.request.set(SimpleNamespace(session_hash="zh-import"))
    i18n.remember_language("zh")
    try:
        empty, not_utf8 = handlers.import_text(" \n")[-1], handlers._import(b"seed: 1\n\xff\n", "x.yaml")[-1]
    finally:
        i18n.LocalContext.request.reset(token)
    assert empty.endswith("\n\n- pasted YAML：内容为空；请粘贴 ERNIEKit 训练配置（key: value 形式的行）"), (
        empty
    )
    assert not_utf8.endswith("\n\n- x.yaml:2：不是 UTF-8 文本（第 8 字节）；请以 UTF-8 保存文件"), not_utf8


def test_a_refused_import_leaves_every_field_as_it_was_and_says_why(tab, settings, tmp_path):
    handlers = ImportHandlers(UIContext(settings=settings, texts=Texts(), demo=None), tab.handlers.keys)
    out = handlers.import_text("stage: SFT\nlearning_rat: 1e-4\n")
    assert all(v == gr.skip() for v in out[:-1]) and len(out) == len(tab.handlers.keys) + 1
    assert "Not imported" in out[-1] and "pasted YAML:2: unknown key 'learning_rat'" in out[-1]
    big = tmp_path / "big.yaml"
    big.write_bytes(b"seed: 1\n" + b"#" * (3 * MAX_IMPORT_BYTES))
    out = handlers.import_file(str(big))
    assert all(v == gr.skip() for v in out[:-1]) and f"at most {MAX_IMPORT_BYTES:,} bytes" in out[-1]
    ok = tmp_path / "run.yaml"
    ok.write_text("stage: DPO\nfine_tuning: Full\nbeta: 0.2\n")
    form = dict(zip(tab.handlers.keys, handlers.import_file(str(ok)), strict=False))
    assert (form["stage"], form["fine_tuning"], form["beta"]) == ("DPO", "Full", 0.2)
    assert form["learning_rate"] == defaults_for("DPO", "Full")["learning_rate"]  # the stage's own default
    assert form["name"] == gr.skip()  # what the file does not say stays as the person left it


@pytest.mark.parametrize(
    "name", ["examples/dpo.yaml", "erniekit:sft_wint8mix_lora_thinking", "examples/vl_sft.yaml"]
)
def test_the_yaml_view_imports_back_to_the_same_form(tab, uploaded, settings, session, name):
    """The YAML the Train tab shows for a form, imported, fills the form it came from."""
    first = _form(tab, import_train_yaml(session, settings, CONFIGS[name]), uploaded)
    first["base_model"] = first["base_model"] or ("tiny-vl" if "vl" in name else "tiny")
    shown = yaml.safe_dump(runs_svc.preview_config(session, settings, run_spec(first)), sort_keys=False)
    again = _form(tab, import_train_yaml(session, settings, shown, source="train.yaml"), uploaded)
    assert again == first
