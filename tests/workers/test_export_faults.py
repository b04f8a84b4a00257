"""An export whose worker is SIGKILLed mid-write (Redis + PostgreSQL, real workers and exporter): the final
export directory never holds a partial export, the model list never shows one, and the export is retried by
another worker to a complete one with no leftovers of the killed attempt."""

from __future__ import annotations

import json
import os
import signal
import struct
from pathlib import Path

from trainer_hold import hold_when
from worker_helpers import pid_alive, processes_naming, wait_for


def _export_files(models_dir: Path, name: str) -> list[Path]:
    """Every file an export named ``name`` has written anywhere in home/models (its final directory, or any
    directory beside it whose name holds ``name``, where a writer may stage it)."""
    found = []
    for d in os.scandir(models_dir):
        if name in d.name and d.is_dir():
            found += [Path(f.path) for f in os.scandir(d.path)]
    return found


def _whole_safetensors(path: Path) -> set[str]:
    """The tensor names of a safetensors file that is as long as its header says (no tensor cut short)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    assert path.stat().st_size == 8 + n + end, f"{path.name} is cut short"
    return set(header)


def test_a_worker_killed_mid_export_leaves_no_partial_export_and_the_export_is_retried(
    studio_factory, pg_url, shared_redis_url
):
    studio = studio_factory(database_url=pg_url, broker_url=shared_redis_url)
    studio.start_api()
    studio.start_workers()
    api = studio.client()
    ds = studio.upload_demo(api)
    run = studio.create_run(api, ds["id"], max_steps=2, save_steps=100, logging_steps=1)
    run = studio.wait_status(api, run["id"], {"succeeded", "failed"}, 120)
    assert run["status"] == "succeeded", run["error"]

    export = api.post(f"/runs/{run['id']}/export", json={"layout": "paddle", "max_shard_size": "64KB"}).json()
    final = Path(export["export_dir"])
    models_dir = final.parent
    config_file = Path(run["output_dir"]).parent / "exports" / str(export["id"]) / "export.yaml"
    found = wait_for(lambda: list(processes_naming(str(config_file))), 60, "the exporter to start", 0.01)
    exporter = found[0]
    # held as soon as its first shard exists (a tiny model in 64 KB shards writes many more)
    hold_when(
        exporter,
        lambda: any(p.name.endswith(".safetensors") for p in _export_files(models_dir, final.name)),
        f"the first shard of {final.name}",
    )
    # The worker that will retry it boots meanwhile (the export is claimed: it cannot take the first attempt).
    studio.start_worker("serve2@testnode", serve=True, wait=False)

    def no_partial_export_shown(when: str) -> None:
        listed = [m for m in api.get("/models").json() if final.name in (m["path"] or "")]
        assert listed == [], (when, listed)
        written = _export_files(models_dir, final.name)
        assert not (final / "config.json").exists() and not list(final.glob("*.safetensors")), (when, written)

    # held mid-write: shards exist, the export is not complete
    written = _export_files(models_dir, final.name)
    assert not any(p.name == "export_summary.json" for p in written), written  # the hold came too late
    no_partial_export_shown("held mid-write")
    assert api.get(f"/exports/{export['id']}").json()["status"] == "running"

    studio.stop("serve@testnode", signal.SIGKILL)
    os.kill(exporter, signal.SIGKILL)  # dies with its worker anyway (PR_SET_PDEATHSIG); not left to chance
    wait_for(lambda: not pid_alive(exporter), 10, "the exporter to die")
    no_partial_export_shown("after the kill")

    # The other worker's reconciler finds the export's heartbeat stale, requeues it, and takes it.
    studio.wait_ready("serve2@testnode")
    done = wait_for(
        lambda: (e := api.get(f"/exports/{export['id']}").json())["status"] in ("succeeded", "failed") and e,
        120,
        "the retried export",
        interval=0.2,
    )
    assert done["status"] == "succeeded", done["error"]
    assert done["worker"] == "serve2@testnode"
    events = api.get(f"/runs/{run['id']}/events").json()
    kinds = [e["kind"] for e in events if e["kind"].startswith("export.")]
    assert kinds == ["export.queued", "export.requeued", "export.succeeded"], kinds

    # complete: every shard the index names is there and whole; nothing of the killed attempt is left
    index = json.loads((final / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 5 and sorted(p.name for p in final.glob("*.safetensors")) == shards
    for shard in shards:
        assert _whole_safetensors(final / shard) == {k for k, v in index["weight_map"].items() if v == shard}
    summary = json.loads((final / "export_summary.json").read_text())
    assert summary["merged_lora"] and summary["export_dir"] == str(final)
    assert {p.parent for p in _export_files(models_dir, final.name)} == {final}
    assert sorted(p.name for p in final.iterdir()) == sorted([*summary["files"], "export_summary.json"])
    listed = {m["name"]: m for m in api.get("/models").json()}
    assert listed[final.name]["available"] and listed[final.name]["path"] == str(final)
    assert listed[final.name]["num_parameters"] == listed[f"run:{run['id']}"]["num_parameters"]


def test_a_worker_stopping_mid_export_stops_the_exporter_and_fails_the_export_to_be_run_again(
    studio_factory, pg_url, shared_redis_url
):
    """A graceful stop (SIGTERM) of the worker holding an export goes through the shared supervisor: the
    exporter is stopped and the export, a kind its worker's stop fails, ends at once with the reason (before,
    the export loop ignored the stop and the worker waited on its held child)."""
    studio = studio_factory(database_url=pg_url, broker_url=shared_redis_url)
    studio.start_api()
    studio.start_workers()
    api = studio.client()
    ds = studio.upload_demo(api)
    run = studio.create_run(api, ds["id"], max_steps=2, save_steps=100, logging_steps=1)
    run = studio.wait_status(api, run["id"], {"succeeded", "failed"}, 120)
    assert run["status"] == "succeeded", run["error"]

    export = api.post(f"/runs/{run['id']}/export", json={"layout": "paddle", "max_shard_size": "64KB"}).json()
    final = Path(export["export_dir"])
    config_file = Path(run["output_dir"]).parent / "exports" / str(export["id"]) / "export.yaml"
    found = wait_for(lambda: list(processes_naming(str(config_file))), 60, "the exporter to start", 0.01)
    exporter = found[0]
    hold_when(exporter, lambda: True, "the exporter")  # held as soon as it exists: mid-export
    assert api.get(f"/exports/{export['id']}").json()["status"] == "running"

    studio.stop("serve@testnode", signal.SIGTERM, timeout=60)
    ended = api.get(f"/exports/{export['id']}").json()
    assert ended["status"] == "failed" and ended["error"] == "its worker stopped; export again", ended
    wait_for(lambda: not pid_alive(exporter), 10, "the held exporter to be stopped")
    assert not (final / "config.json").exists()
    events = api.get(f"/runs/{run['id']}/events").json()
    assert [e["kind"] for e in events if e["kind"].startswith("export.")] == [
        "export.queued",
        "export.failed",
    ]
