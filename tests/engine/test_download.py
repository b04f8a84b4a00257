"""``ernie-studio download`` against a local stand-in for the Hugging Face hub.

The download code is the real one (huggingface_hub's client and all). ``FakeHub`` answers the requests that
client makes, as huggingface.co answers them (read from huggingface_hub's source): model info with file
metadata, the recursive tree listing, HEAD/GET on ``/resolve`` with ``X-Repo-Commit`` and ``ETag``, and for
LFS files a redirect to a second origin (the CDN) with ``X-Linked-Etag`` / ``X-Linked-Size``, which serves
byte ranges. It serves a tiny model built by ``init-model``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest
from hub_standin import FakeHub

import engine
from engine.models.download import (
    STAGING_DIR,
    DownloadError,
    check_model_dir,
    default_out_dir,
    download_model,
    resolve_name,
)
from engine.models.presets import HUB_IDS

PRESET = "ernie-4.5-0.3b"
REPO_ID = HUB_IDS[PRESET]


@pytest.fixture(scope="module")
def repo_files(tiny_model_dir) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in sorted(tiny_model_dir.iterdir()) if p.is_file()}
    files["README.md"] = b"# A tiny ERNIE 4.5 model\n"
    files[".gitattributes"] = (
        b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.model filter=lfs diff=lfs merge=lfs -text\n"
    )
    return files


@pytest.fixture
def hub(repo_files):
    fake = FakeHub(REPO_ID, repo_files)
    yield fake
    fake.close()


def _cli(*args: str, endpoint: str, tmp: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "ERNIE_STUDIO_"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp / "hf-home"), ERNIE_STUDIO_HOME=str(tmp / "studio"))
    return subprocess.run(
        [sys.executable, "-m", "engine", "download", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp,
        env=env,
    )


def _models_looking_complete(root: Path) -> list[Path]:
    """What the studio would list as a model: a directory of ``root`` with a config.json."""
    return [d for d in root.iterdir() if (d / "config.json").is_file()] if root.is_dir() else []


def _assert_same_files(out: Path, files: dict[str, bytes]) -> None:
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == sorted(files)
    for name, data in files.items():
        assert (out / name).read_bytes() == data, name


def test_download_a_preset_into_the_studio_home_and_load_it(hub, tmp_path):
    r = _cli(PRESET, endpoint=hub.url, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "studio" / "models" / PRESET
    assert f"downloaded {REPO_ID} at {hub.commit} to {out}" in r.stdout
    assert "Verifying checksums" in r.stderr  # the progress bars are huggingface_hub's (on stderr)
    _assert_same_files(out, hub.files)  # no .cache bookkeeping, nothing missing
    assert not (out.parent / STAGING_DIR).exists()
    # LFS files came from the CDN the hub redirected to, the others from /resolve at the listed commit
    assert hub.get_requests("model.safetensors") and hub.get_requests("config.json")
    model = engine.load_model(str(out))
    tok = engine.load_tokenizer(str(out))
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    logits = model(paddle.to_tensor([ids])).logits.numpy()
    assert logits.shape == (1, len(ids), model.config.vocab_size) and np.isfinite(logits).all()

    again = _cli(PRESET, endpoint=hub.url, tmp=tmp_path)
    assert again.returncode == 2 and f"{out}: already exists and is not empty" in again.stderr


def test_a_cut_off_download_resumes_where_it_stopped(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub writes whole chunks of DOWNLOAD_CHUNK_SIZE (10 MiB); smaller chunks let a 2 MB file
    # be cut after some have landed, as a multi-GB shard is cut in the middle
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    size = len(hub.files["model.safetensors"])
    hub.cut_after["model.safetensors"] = size // 2

    done = download_model(PRESET, tmp_path / "m", endpoint=hub.url)

    assert done.path == tmp_path / "m" and done.commit == hub.commit
    _assert_same_files(done.path, hub.files)
    first, second = hub.get_requests("model.safetensors")
    assert first[2] is None  # the cut one
    resumed_at = int(re.fullmatch(r"bytes=(\d+)-", second[2])[1])
    assert 0 < resumed_at <= size // 2  # took up the file from the last bytes written, not from zero
    engine.load_model(str(done.path))


@pytest.mark.parametrize(
    ("name", "algorithm"), [("model.safetensors", "sha256"), ("tokenizer_config.json", "git blob sha1")]
)
def test_a_corrupt_file_is_deleted_and_named_and_a_rerun_fetches_only_it(hub, tmp_path, name, algorithm):
    hub.corrupt.add(name)
    r = _cli(PRESET, endpoint=hub.url, tmp=tmp_path)
    assert r.returncode == 1
    assert f"{name} is corrupt: {algorithm}" in r.stderr
    expected = hub.sha256(name) if algorithm == "sha256" else hub.blob_id(name)
    assert f"the hub lists {expected}" in r.stderr and "Run the command again" in r.stderr
    models = tmp_path / "studio" / "models"
    assert not (models / PRESET).exists() and _models_looking_complete(models) == []
    staging = models / STAGING_DIR / PRESET
    assert not (staging / name).exists() and (staging / "config.json").exists() == (name != "config.json")

    hub.corrupt.clear()
    fetched_before = {n: len(hub.get_requests(n)) for n in hub.files}
    r = _cli(PRESET, endpoint=hub.url, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    _assert_same_files(models / PRESET, hub.files)
    fetched_again = {n for n in hub.files if len(hub.get_requests(n)) > fetched_before[n]}
    assert fetched_again == {name}


def test_unreachable_hub_says_how_to_get_the_model_and_writes_nothing(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    r = _cli(PRESET, endpoint=endpoint, tmp=tmp_path)
    assert r.returncode == 1
    out = tmp_path / "studio" / "models" / PRESET
    assert f"error: cannot reach {endpoint}: " in r.stderr and "Connection refused" in r.stderr
    assert f"set HF_ENDPOINT for a mirror or copy the model into {out} by hand" in r.stderr
    assert not (tmp_path / "studio").exists()


def test_a_host_lost_mid_download_leaves_no_model_and_a_rerun_finishes(hub, tmp_path):
    hub.unreachable.add("model.safetensors")  # the CDN hangs up on the weights; small files arrive
    r = _cli(PRESET, endpoint=hub.url, tmp=tmp_path)
    assert r.returncode == 1
    models = tmp_path / "studio" / "models"
    assert f"error: cannot reach {hub.cdn_url}: " in r.stderr
    assert f"the files fetched so far stay in {models / STAGING_DIR / PRESET}" in r.stderr
    assert not (models / PRESET).exists() and _models_looking_complete(models) == []
    assert (models / STAGING_DIR / PRESET / "config.json").is_file()

    hub.unreachable.clear()
    fetched_before = {n: len(hub.get_requests(n)) for n in hub.files}
    r = _cli(PRESET, endpoint=hub.url, tmp=tmp_path)
    assert r.returncode == 0, r.stderr
    _assert_same_files(models / PRESET, hub.files)
    assert {n for n in hub.files if len(hub.get_requests(n)) > fetched_before[n]} == {"model.safetensors"}
    assert _models_looking_complete(models) == [models / PRESET]


def test_a_repo_that_is_not_an_ernie_model_is_not_presented_as_one(repo_files, tmp_path):
    files = {n: d for n, d in repo_files.items() if n != "model.safetensors"}
    fake = FakeHub("someone/no-weights", files)
    try:
        r = _cli("someone/no-weights", endpoint=fake.url, tmp=tmp_path)
        missing = _cli("someone/missing", endpoint=fake.url, tmp=tmp_path)
        wrong_rev = _cli("someone/no-weights", "--revision", "v9", endpoint=fake.url, tmp=tmp_path)
    finally:
        fake.close()
    assert r.returncode == 1 and "someone/no-weights has no usable weights" in r.stderr
    assert "no model weights" in r.stderr and "the verified files stay in" in r.stderr
    assert _models_looking_complete(tmp_path / "studio" / "models") == []
    assert missing.returncode == 1 and f"{fake.url} has no model repo someone/missing" in missing.stderr
    assert wrong_rev.returncode == 1 and "someone/no-weights has no revision 'v9'" in wrong_rev.stderr


def test_aistudio_and_unknown_names_are_refused_before_any_download(tmp_path):
    r = _cli(PRESET, "--source", "aistudio", endpoint="http://127.0.0.1:9", tmp=tmp_path)
    assert r.returncode == 2 and "--source aistudio is not supported yet" in r.stderr
    with pytest.raises(ValueError, match="built on this machine, not downloaded: ernie-studio init-model"):
        resolve_name("tiny")
    with pytest.raises(ValueError, match="unknown model 'ernie-5'"):
        resolve_name("ernie-5")
    # the repo part names the directory under models/: nothing that leaves it, nothing the hub would not name
    for bad in ("x/..", "x/.", "../x", "x/a\\b", "x/a b", "x/-a", "x/a..b", "x/" + "a" * 97):
        with pytest.raises(ValueError, match="is not a hub repo id"):
            resolve_name(bad)
    assert not (tmp_path / "studio").exists()


def test_names_and_default_directories(monkeypatch):
    assert resolve_name("ERNIE-4.5-VL-28B-A3B") == (HUB_IDS["ernie-4.5-vl-28b-a3b"], "ernie-4.5-vl-28b-a3b")
    assert resolve_name(REPO_ID.lower()) == (REPO_ID, PRESET)  # an official repo id lands under its preset
    assert resolve_name("baidu/ERNIE-4.5-0.3B-PT") == ("baidu/ERNIE-4.5-0.3B-PT", "ERNIE-4.5-0.3B-PT")
    monkeypatch.delenv("ERNIE_STUDIO_HOME", raising=False)
    assert default_out_dir(PRESET) == Path("models") / PRESET
    monkeypatch.setenv("ERNIE_STUDIO_HOME", "~/studio")
    assert default_out_dir(PRESET) == Path("~/studio").expanduser() / "models" / PRESET


def test_a_config_of_another_model_family_is_refused(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    with pytest.raises(
        DownloadError, match=r"someone/qwen is not an ERNIE 4\.5 model: .* model_type 'qwen2'"
    ):
        check_model_dir(tmp_path / "m", "someone/qwen")
    check_model_dir(tiny_model_dir, REPO_ID)
