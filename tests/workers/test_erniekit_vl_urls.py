"""ERNIEKit's own VL demo data runs unchanged: a JSON array in a .jsonl file whose records name their images by
URL (examples/data/sft_vl-train_demo1.jsonl in PaddlePaddle/ERNIE), with a loopback server standing in for the
image host. It uploads through POST /datasets and the Datasets tab, a worker's media fetch job (never the
upload request) fetches the images once into the dataset's folder under home, the preview shows them, and a tiny VL-SFT run trains from them under the worker's
``execute_run`` without fetching anything again."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient
from image_standin import ImageHost, picture

from engine.data import remote
from studio.app import create_app
from studio.config import Settings
from studio.migrate import upgrade
from studio.services import datasets as datasets_svc
from studio.services import runs as runs_svc
from studio.ui.context import UIContext
from studio.ui.datasets_tab import DatasetsHandlers, summary_markdown
from studio.ui.i18n import Texts
from workers.media import execute_media_fetch
from workers.training import execute_run

COLOURS = {"red": (200, 30, 30), "green": (30, 180, 40), "blue": (30, 50, 210)}


def demo_records(host: str) -> list[dict]:
    """ERNIEKit's demo shape: one image by https URL (here the stand-in's), then mask / no_mask turns."""
    return [
        {
            "image_info": [
                {"matched_text_index": 0, "image_url": f"{host}/data/ernie4.5/demo_images/{name}.jpg"}
            ],
            "text_info": [
                {"text": "What colour is the picture?", "tag": "mask"},
                {"text": f"It is {name}.", "tag": "no_mask"},
                {"text": "Is it one colour?", "tag": "mask"},
                {"text": "Yes.", "tag": "no_mask"},
            ],
        }
        for name in COLOURS
    ]


def test_erniekit_vl_demo_with_image_urls_uploads_previews_and_trains(
    tmp_path, tiny_vl_model_dir, monkeypatch
):
    pictures = {name: picture(rgb, format="JPEG") for name, rgb in COLOURS.items()}
    host = ImageHost({f"/data/ernie4.5/demo_images/{n}.jpg": (b, "image/jpeg") for n, b in pictures.items()})
    data = tmp_path / "sft_vl-train_demo1.jsonl"
    data.write_text(json.dumps(demo_records(host.url), indent=4))
    settings = Settings(home=tmp_path / "home", model_roots=str(tiny_vl_model_dir.parent))
    upgrade(settings)
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")  # the stand-in host is on loopback
    try:
        with TestClient(create_app(settings, with_ui=False), base_url="http://127.0.0.1") as client:
            with data.open("rb") as f:
                r = client.post("/api/v1/datasets", files={"file": (data.name, f)}, data={"name": "vl demo"})
            assert r.status_code == 201, r.text
            ds = r.json()
            assert (ds["format"], ds["kind"], ds["num_records"], ds["num_valid"]) == (
                "erniekit_vl",
                "sft",
                3,
                3,
            )
            assert host.hits == [] and ds["media_fetch"]["status"] == "queued"  # the request fetches nothing
            page = client.get(f"/api/v1/datasets/{ds['id']}/preview", params={"limit": 1}).json()
            assert host.hits == []  # nor does a preview
            model = str(tiny_vl_model_dir)
            r = client.get(f"/api/v1/datasets/{ds['id']}/stats", params={"model": model})
            assert r.status_code == 409 and "still being fetched (0/3)" in r.json()["message"]
            assert execute_media_fetch(settings, ds["media_fetch"]["id"], "me@n") == "succeeded"
            assert len(host.hits) == 3  # each image fetched once, by the worker's job
            fetch = client.get(f"/api/v1/datasets/{ds['id']}").json()["media_fetch"]
            assert (fetch["status"], fetch["urls_done"], fetch["urls_total"], fetch["failed"]) == (
                "succeeded",
                3,
                3,
                None,
            )
            assert fetch["bytes_done"] == sum(len(b) for b in pictures.values())
            stats = client.get(f"/api/v1/datasets/{ds['id']}/stats", params={"model": model}).json()
            assert stats["num_invalid"] == 0, stats
            # ... into the dataset's own folder under home, beside the data file
            (stored,) = settings.datasets_dir.glob(f"*/{data.name}")
            folder = stored.parent
            fetched = sorted(p.read_bytes() for p in (folder / ".remote").iterdir())
            assert fetched == sorted(pictures.values())
            assert (
                folder.parent == settings.datasets_dir
                and not (settings.datasets_dir / ".incoming/.remote").exists()
            )

            page = client.get(f"/api/v1/datasets/{ds['id']}/preview", params={"limit": 3}).json()
            assert page["records"] == json.loads(data.read_text()) and page["total"] == 3
            rendered = client.get(
                f"/api/v1/datasets/{ds['id']}/preview",
                params={"limit": 1, "render_with": str(tiny_vl_model_dir)},
            ).json()["rendered"][0]
            assert not any(s.get("error") for s in rendered), rendered
            assert "It is red." in "".join(s["text"] for s in rendered if s["trained"])

        # the Datasets tab: the same file uploads there, and a record shows its fetched picture
        tab = DatasetsHandlers(UIContext(settings, Texts(), None))
        result, problems, summary = tab.upload(str(data), "vl demo (tab)", "auto")[:3]
        assert result.startswith("✅ added **vl demo (tab)**") and problems.empty and "3 valid" in summary
        assert (
            len(host.hits) == 3 and "Images named by URL: 0/3 fetched so far; a worker is fetching" in summary
        )
        tab_ds = max(d.id for d in tab.ctx.read(datasets_svc.list_datasets, default=[]))
        pending = tab.show_record(tab_ds, 1, None)[3]["value"]  # not fetched yet: said so, not fetched
        assert [name for _, name in pending] == [
            f"not fetched yet: {demo_records(host.url)[1]['image_info'][0]['image_url']}"
        ]
        fetch_id = tab.ctx.read(datasets_svc.get_dataset, tab_ds, default=None).media_fetch.id
        assert execute_media_fetch(settings, fetch_id, "me@n") == "succeeded"
        assert len(host.hits) == 6  # a dataset of its own, with copies of its own
        fetched = tab.ctx.read(datasets_svc.get_dataset, tab_ds, default=None)
        assert "Images named by URL: 3 of 3 fetched by a worker." in summary_markdown(fetched)
        gallery = tab.show_record(ds["id"], 1, None)[3]
        ((image, name),) = gallery["value"]
        assert gallery["visible"] and name.endswith(".jpg")
        assert np.abs(np.asarray(image, np.int16).mean((0, 1)) - COLOURS["green"]).max() < 8

        # training reads the copies: with fetching now turned off, the run still trains and nothing is asked
        monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "off")
        spec = runs_svc.RunSpec(
            base_model=str(tiny_vl_model_dir),
            dataset_ids=[ds["id"]],
            stage="VL-SFT",
            fine_tuning="LoRA",
            hyperparameters={"max_steps": 2, "logging_steps": 1, "save_steps": 10, "max_seq_len": 256},
        )
        run = UIContext(settings, Texts(), None).call(runs_svc.create_run, settings, spec)
        assert execute_run(settings, run.id, "me@n") == "succeeded", runs_svc.log_path(
            settings, run.id
        ).read_text()
        rows = (Path(run.output_dir) / "metrics.jsonl").read_text().splitlines()
        metrics = [json.loads(x) for x in rows]
        assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
        assert all(np.isfinite(m["loss"]) for m in metrics if "loss" in m)
        assert len(host.hits) == 6
    finally:
        host.close()


def test_url_images_that_fail_become_located_problems_and_only_images_are_kept(
    tmp_path, tiny_vl_model_dir, monkeypatch
):
    good, big = picture((200, 20, 20), format="JPEG"), picture((20, 20, 200), (400, 400), "BMP")
    host = ImageHost(
        {
            "/demo_images/1.jpg": (good, "image/jpeg"),
            "/demo_images/page.jpg": (b"<html>a login page</html>", "text/html"),
            "/demo_images/big.bmp": (big, "image/bmp"),
        }
    )
    urls = [f"{host.url}/demo_images/{n}" for n in ("1.jpg", "gone.jpg", "page.jpg", "big.bmp")]
    records = demo_records(host.url)[:1] * 4
    records = [
        {**r, "image_info": [{"matched_text_index": 0, "image_url": u}]}
        for r, u in zip(records, urls, strict=True)
    ]
    data = tmp_path / "sft_vl-train_demo1.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    settings = Settings(home=tmp_path / "home", model_roots=str(tiny_vl_model_dir.parent))
    upgrade(settings)
    try:
        with TestClient(create_app(settings, with_ui=False), base_url="http://127.0.0.1") as client:

            def fetched(policy: str) -> dict:
                monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", policy)
                with data.open("rb") as f:
                    r = client.post("/api/v1/datasets", files={"file": (data.name, f)})
                assert r.status_code == 201, r.text  # the request only queues the fetch
                ds = r.json()
                assert execute_media_fetch(settings, ds["media_fetch"]["id"], "me@n") == "succeeded"
                return client.get(f"/api/v1/datasets/{ds['id']}").json()

            # the default fetches from public hosts only: a record cannot make the worker reach loopback
            ds = fetched("public")
            assert host.hits == [] and ds["num_valid"] == 0 and len(ds["problems"]) == 4
            where = f"{data.name}:1: image_info[0]: image {urls[0]!r} could not be fetched"
            assert ds["problems"][0].startswith(where) and "loopback address (127.0.0.1)" in ds["problems"][0]

            monkeypatch.setattr(remote, "MAX_BYTES", 100_000)  # the good picture is smaller, the big one not
            ds = fetched("any")
            assert ds["num_valid"] == 1 and ds["media_fetch"]["urls_done"] == 4
            expected = [
                (2, urls[1], "the server answered 404 Not Found"),
                (3, urls[2], "the answer is not an image the VL processor accepts"),
                (4, urls[3], "larger than 100,000 bytes"),
            ]
            for problem, (line, url, why) in zip(ds["problems"], expected, strict=True):
                assert problem.startswith(f"{data.name}:{line}: image_info[0]: image {url!r}"), problem
                assert why in problem, problem
            assert set(ds["media_fetch"]["failed"]) == set(urls[1:])
            # token statistics count the records whose image could not be fetched as invalid
            r = client.get(f"/api/v1/datasets/{ds['id']}/stats", params={"model": str(tiny_vl_model_dir)})
            assert r.status_code == 200 and r.json()["num_invalid"] == 3, r.text
            kept = [p.read_bytes() for p in settings.datasets_dir.glob("*/.remote/*")]
            assert kept == [good]  # the page and the oversized picture were never kept
    finally:
        host.close()


def test_a_text_record_naming_an_image_url_is_never_fetched(tmp_path, monkeypatch):
    """The read-back of issue 27: a text dataset whose one record carries image_info. Neither the upload nor
    opening the record in the Datasets tab fetches it, so nothing can be read back from .remote/."""
    host = ImageHost({"/secret": (b"internal answer", "text/plain")})
    data = tmp_path / "notes.jsonl"
    url = f"{host.url}/secret"
    record = {"src": ["hi"], "tgt": ["hello"], "image_info": [{"matched_text_index": 0, "image_url": url}]}
    data.write_text(json.dumps(record) + "\n")
    settings = Settings(home=tmp_path / "home")
    upgrade(settings)
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")  # even where loopback may be fetched
    try:
        with TestClient(create_app(settings, with_ui=False), base_url="http://127.0.0.1") as client:
            with data.open("rb") as f:
                r = client.post(
                    "/api/v1/datasets", files={"file": (data.name, f)}, data={"format": "erniekit"}
                )
            assert r.status_code == 201, r.text
            ds = r.json()
            assert ds["media_fetch"] is None  # a text dataset's stray image_info is no image to fetch
            tab = DatasetsHandlers(UIContext(settings, Texts(), None))
            tab.show_record(ds["id"], 0, None)
            client.get(f"/api/v1/datasets/{ds['id']}/preview", params={"limit": 1})
            hashed = remote.cached_path(url, Path("x")).name
            r = client.get(f"/api/v1/datasets/{ds['id']}/files/.remote/{hashed}")
            assert r.status_code in (403, 404) and b"internal answer" not in r.content
        assert host.hits == [] and not list(settings.datasets_dir.glob("*/.remote"))
    finally:
        host.close()
