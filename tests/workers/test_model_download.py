"""The model picker's Download action through the studio: `POST /models/downloads` queues it, a real serving
worker runs `ernie-studio download` against a local stand-in for the hub, and the official model is then
listed as available; a repo the hub does not have fails with the hub's answer, and nothing is half there."""

from __future__ import annotations

import signal

import pytest
from hub_standin import FakeHub
from trainer_hold import hold_when
from worker_helpers import pid_alive, processes_naming, wait_for

from engine.models.presets import HUB_IDS

PRESET = "ernie-4.5-0.3b"


@pytest.fixture
def hub(tiny_model_dir):
    files = {p.name: p.read_bytes() for p in sorted(tiny_model_dir.iterdir()) if p.is_file()}
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    fake = FakeHub(HUB_IDS[PRESET], files)
    yield fake
    fake.close()


def test_download_from_the_picker_fetches_verifies_and_lists_the_model(studio_factory, hub, tmp_path):
    studio = studio_factory()
    studio.start_api()
    hub_env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}
    studio.start_worker("serve@testnode", serve=True, env=hub_env)
    api = studio.client()

    assert api.post("/models/downloads", json={"name": "tiny"}).status_code == 422  # built here, not fetched
    r = api.post("/models/downloads", json={"name": PRESET})
    assert r.status_code == 202, r.text
    first = r.json()
    assert first["repo_id"] == HUB_IDS[PRESET] and first["status"] == "queued"
    again = api.post("/models/downloads", json={"name": PRESET})
    assert again.status_code == 409 and "already being downloaded" in again.json()["message"]

    done = wait_for(
        lambda: (
            (d := api.get(f"/models/downloads/{first['id']}").json())["status"] in ("succeeded", "failed")
            and d
        ),
        180,
        "the download to finish",
    )
    assert done["status"] == "succeeded", done["error"]
    on_disk = sum(len(b) for b in hub.files.values())
    assert done["bytes_total"] == done["bytes_done"] >= on_disk - len(hub.files[".gitattributes"])
    assert done["commit"] == hub.commit
    listed = {m["name"]: m for m in api.get("/models").json()}[PRESET]
    assert listed["available"] and listed["download"] is None
    assert (studio.home / "models" / PRESET / "config.json").exists()
    refused = api.post("/models/downloads", json={"name": PRESET})
    assert refused.status_code == 409 and "already holds a model" in refused.json()["message"]

    missing = api.post("/models/downloads", json={"name": "someone/not-on-the-hub"}).json()
    failed = wait_for(
        lambda: (
            (d := api.get(f"/models/downloads/{missing['id']}").json())["status"] in ("succeeded", "failed")
            and d
        ),
        120,
        "the second download to end",
    )
    assert failed["status"] == "failed" and "someone/not-on-the-hub" in failed["error"]
    assert not (studio.home / "models" / "not-on-the-hub").exists()


def test_a_worker_stopping_mid_download_requeues_it_and_another_worker_finishes_it(
    studio_factory, hub, tmp_path
):
    """A graceful stop (SIGTERM) of the worker holding a download goes through the shared supervisor as a
    training run's does: the downloader is stopped and the download goes back to the queue at once (before,
    the download loop ignored the stop and the worker waited on its child)."""
    studio = studio_factory()
    studio.start_api()
    hub_env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home")}
    studio.start_worker("serve@testnode", serve=True, env=hub_env)
    api = studio.client()
    first = api.post("/models/downloads", json={"name": PRESET}).json()
    model_dir = str(studio.home / "models" / PRESET)
    found = wait_for(lambda: list(processes_naming(model_dir)), 60, "the downloader to start", 0.001)
    downloader = found[0]
    hold_when(downloader, lambda: True, "the downloader")  # held as soon as it exists: mid-download
    assert api.get(f"/models/downloads/{first['id']}").json()["status"] == "running"

    studio.stop("serve@testnode", signal.SIGTERM, timeout=60)
    requeued = api.get(f"/models/downloads/{first['id']}").json()
    assert requeued["status"] == "queued" and requeued["worker"] is None, requeued
    wait_for(lambda: not pid_alive(downloader), 10, "the held downloader to be stopped")

    studio.start_worker("serve2@testnode", serve=True, env=hub_env)
    done = wait_for(
        lambda: (
            (d := api.get(f"/models/downloads/{first['id']}").json())["status"] in ("succeeded", "failed")
            and d
        ),
        180,
        "the requeued download to finish",
    )
    assert done["status"] == "succeeded" and done["worker"] == "serve2@testnode", done
    assert (studio.home / "models" / PRESET / "config.json").exists()
    assert not processes_naming(model_dir)
