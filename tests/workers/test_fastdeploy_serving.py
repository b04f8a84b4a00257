"""The serving worker's FastDeploy rules: backend choice behind the --help check, GPU memory shared by a
stated rule, and chat fields fitted to FastDeploy's request schema."""

from __future__ import annotations

import importlib.util

import pytest

from engine.serve.fastdeploy import FlagCheck
from studio.config import Settings
from studio.services.deployments import fit_to_backend
from workers import serving


def test_auto_falls_back_and_explicit_fastdeploy_is_refused(monkeypatch):
    monkeypatch.delenv("ERNIE_STUDIO_FASTDEPLOY_PYTHON", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    refused = FlagCheck(
        False, "2.0.0", ["--served-model-name"], "FastDeploy 2.0.0 does not accept --served-model-name"
    )
    monkeypatch.setattr(serving, "installed_check", lambda: refused)
    assert serving.resolve_backend("auto") == "paddle"
    with pytest.raises(RuntimeError, match=r"FastDeploy 2\.0\.0 does not accept --served-model-name"):
        serving.resolve_backend("fastdeploy")
    monkeypatch.setattr(serving, "installed_check", lambda: FlagCheck(True, "2.3.0"))
    assert serving.resolve_backend("auto") == "fastdeploy"
    assert serving.resolve_backend("paddle") == "paddle"


def test_gpu_slots_share_memory_by_the_stated_rule(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    settings = Settings(home=tmp_path, fastdeploy_per_gpu=2)
    slots = serving.FastDeploySlots()
    taken = [slots.take(settings, i) for i in range(4)]
    assert sorted(g for g, _ in taken) == ["0", "0", "1", "1"] and {s for _, s in taken} == {0.45}
    with pytest.raises(RuntimeError, match="2 per GPU on GPU\\(s\\) 0,1"):
        slots.take(settings, 4)
    slots.release(0)
    assert slots.take(settings, 5) == (taken[0][0], 0.45)


def test_chat_fields_fit_fastdeploy(tiny_model_dir):
    body = {"messages": [], "max_tokens": 32, "ignore_eos": True, "seed": 1}
    assert fit_to_backend(body, "fastdeploy", tiny_model_dir)["min_tokens"] == 32
    assert fit_to_backend(body, "paddle") == body


def test_auto_says_why_it_serves_with_paddle_and_llamacpp_refuses_what_llamacpp_cannot_hold(
    monkeypatch, tiny_model_dir, tmp_path
):
    """Without FastDeploy and without llama-server on the node (neither ERNIE_STUDIO_LLAMACPP_BIN, nor the
    build cache, nor PATH), auto is the Paddle server and says why; an explicit llamacpp is refused with the
    reason (a VL model, or llama.cpp missing)."""
    monkeypatch.delenv("ERNIE_STUDIO_LLAMACPP_BIN", raising=False)
    monkeypatch.delenv("ERNIE_STUDIO_CPU_SERVING", raising=False)
    monkeypatch.setenv("ERNIE_STUDIO_LLAMACPP_HOME", str(tmp_path / "no-build"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("ERNIE_STUDIO_FASTDEPLOY_PYTHON", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    backend, why = serving.choose_backend("auto", tiny_model_dir)
    assert backend == "paddle"
    assert why.startswith("FastDeploy is not installed; llama.cpp is not installed on this node")
    assert why.endswith("the built-in Paddle server serves it")
    with pytest.raises(RuntimeError, match=r"llama\.cpp refused: .*llama-server is not installed; build it"):
        serving.choose_backend("llamacpp", tiny_model_dir)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "llama-server").write_text("#!/bin/sh\necho 'usage: llama-server --model FNAME'\n")
    (fake / "llama-server").chmod(0o755)
    monkeypatch.setenv("ERNIE_STUDIO_LLAMACPP_BIN", str(fake))
    with pytest.raises(RuntimeError, match="does not accept --host, --port, --alias"):
        serving.choose_backend("llamacpp", tiny_model_dir)
    import json

    from engine.models.presets import preset_config
    from engine.serve import llamacpp

    vl = tmp_path / "vl"
    vl.mkdir()
    (vl / "config.json").write_text(json.dumps(preset_config("tiny-vl").to_dict()))
    assert "no ERNIE 4.5 VL architecture" in llamacpp.model_problem(vl)
    assert llamacpp.model_problem(tiny_model_dir) == ""


def test_auto_serves_a_text_model_on_a_cpu_node_with_llamacpp_unless_the_node_says_paddle(
    monkeypatch, tiny_model_dir, tiny_vl_model_dir, tmp_path
):
    """llama-server in the build cache of `make llamacpp` (no PATH, no ERNIE_STUDIO_LLAMACPP_BIN) is enough
    for auto on a CPU node: a text model goes to llama.cpp with the reason, a VL model to the built-in server
    with llama.cpp's reason; the node's cpu_serving=paddle (or ERNIE_STUDIO_CPU_SERVING) keeps the built-in
    server and says so; a GPU node never takes llama.cpp under auto; a bad setting is refused by name."""
    from engine.serve import llamacpp

    home = tmp_path / "cache"
    tools = home / "llama-cpp-python-0.3.36" / "bin"
    tools.mkdir(parents=True)
    flags = " ".join(llamacpp.launcher_flags())
    (tools / "llama-server").write_text(
        f"#!/bin/sh\ncase \"$1\" in --version) echo 'version: 1 (fake)';; *) echo 'usage: --model {flags}';; esac\n"
    )
    (tools / "llama-server").chmod(0o755)
    monkeypatch.setenv("ERNIE_STUDIO_LLAMACPP_HOME", str(home))
    monkeypatch.delenv("ERNIE_STUDIO_LLAMACPP_BIN", raising=False)
    monkeypatch.delenv("ERNIE_STUDIO_CPU_SERVING", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no FastDeploy
    monkeypatch.setattr("engine.serve.fastdeploy_env.gpu_present", lambda: False)
    llamacpp.installed_check.cache_clear()
    try:
        backend, why = serving.choose_backend("auto", tiny_model_dir)
        assert backend == "llamacpp", why
        assert why == (
            "FastDeploy is not installed; llama.cpp (version: 1 (fake)) is installed on this CPU node and "
            "serves this model (q8_0 GGUF)"
        )
        backend, why = serving.choose_backend("auto", tiny_vl_model_dir)
        assert backend == "paddle" and "llama.cpp has no ERNIE 4.5 VL architecture" in why, why
        backend, why = serving.choose_backend("auto", tiny_model_dir, "paddle")
        assert backend == "paddle" and "ERNIE_STUDIO_CPU_SERVING is paddle" in why, why
        monkeypatch.setenv("ERNIE_STUDIO_CPU_SERVING", "paddle")  # the CLI's `serve --backend auto` reads it
        assert llamacpp.choose("auto", tiny_model_dir)[0] is None
        monkeypatch.setenv("ERNIE_STUDIO_CPU_SERVING", "llama")
        with pytest.raises(
            ValueError, match="ERNIE_STUDIO_CPU_SERVING must be one of llamacpp, paddle, not 'llama'"
        ):
            llamacpp.choose("auto", tiny_model_dir)
        assert llamacpp.choose("auto", tiny_model_dir, gpu=True, prefer="llamacpp") == (
            None,
            "a GPU node: llama.cpp serves CPU nodes",
        )
    finally:
        llamacpp.installed_check.cache_clear()


def test_a_gguf_is_served_by_llamacpp_only(monkeypatch, tmp_path):
    """A GGUF file or export has one engine: auto means llama.cpp (refused clearly when it is missing), and
    the Paddle and FastDeploy backends are refused naming the one that serves it."""
    export = tmp_path / "run-1-gguf"
    export.mkdir()
    (export / "model-q8_0.gguf").write_bytes(b"GGUF")
    monkeypatch.delenv("ERNIE_STUDIO_LLAMACPP_BIN", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("ERNIE_STUDIO_LLAMACPP_HOME", str(tmp_path / "no-build"))
    for model in (export, export / "model-q8_0.gguf"):
        for backend in ("paddle", "fastdeploy"):
            with pytest.raises(RuntimeError, match=r"is a GGUF, which only llama\.cpp serves"):
                serving.choose_backend(backend, model)
        with pytest.raises(RuntimeError, match=r"llama\.cpp refused: .*llama-server is not installed"):
            serving.choose_backend("auto", model)


def test_a_paddleocr_vl_goes_to_the_built_in_server(monkeypatch, tmp_path):
    """PaddleOCR-VL: FastDeploy (the studio's launch plan is checked for ERNIE 4.5 only) and llama.cpp (no
    GGUF architecture) are refused by name; auto serves it with the built-in Paddle server even where
    FastDeploy is installed, and a LoRA run of it is judged by its base."""
    import json

    from engine.models.initialize import init_model
    from engine.serve import llamacpp

    model = init_model("tiny-ocr-vl", tmp_path / "ocr")
    run = tmp_path / "run"
    run.mkdir()
    (run / "adapter_config.json").write_text(json.dumps({"base_model": str(model), "r": 8, "lora_alpha": 16}))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # FastDeploy "installed"
    monkeypatch.setattr(serving, "installed_check", lambda: FlagCheck(True, "2.3.0"))
    for target in (model, run):
        with pytest.raises(RuntimeError, match=r"FastDeploy refused: .* is a PaddleOCR-VL model"):
            serving.choose_backend("fastdeploy", target)
        backend, why = serving.choose_backend("auto", target)
        assert backend == "paddle" and why.startswith("not FastDeploy: a PaddleOCR-VL model"), why
        assert "no PaddleOCR-VL architecture" in llamacpp.model_problem(target)


def test_a_models_serving_gguf_has_a_folder_of_its_own(tmp_path):
    """Each model gets its own GGUF folder, so a deployment never serves another model's file: inside a run
    the run's model and one of its checkpoints keep apart (deleted with the run), outside runs each path
    gets a cache folder of its own."""
    from studio.config import Settings

    settings = Settings(home=tmp_path)
    run = settings.runs_dir / "7"
    final = serving.serving_gguf_dir(settings, run / "output")
    checkpoint = serving.serving_gguf_dir(settings, run / "output" / "checkpoint-20")
    assert final == (run / "serving-gguf" / "output").resolve()
    assert checkpoint == (run / "serving-gguf" / "output" / "checkpoint-20").resolve()
    elsewhere = {serving.serving_gguf_dir(settings, tmp_path / "models" / n) for n in ("a", "b")}
    assert len(elsewhere) == 2 and all(d.parent == settings.home / "cache" / "gguf" for d in elsewhere)
