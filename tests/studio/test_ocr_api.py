"""PaddleOCR-VL in the studio's requests (no worker): tiny-ocr-vl is listed and named like the other presets;
a run's stage and its base model's family are checked before it is queued; evaluate-after on OCR pairs holds
out records with their images linked beside the split files; OCR sets go to PaddleOCR-VL models only, text
sets and text-metric options never to them, each refusal naming the dataset or key and the model."""

from __future__ import annotations

import json
from pathlib import Path

from ocr_demo import ocr_demo_zip
from studio_helpers import DEMO_SFT, upload

from studio.db import session_factory
from studio.services.datasets import dataset_path, get_dataset

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "data" / "ocr_demo"


def upload_lines(client) -> dict:
    """The demo's document lines (train and eval renderings) as one zip of lines.jsonl and its images."""
    r = client.post("/api/v1/datasets", files={"file": ("lines.zip", ocr_demo_zip())})
    assert r.status_code == 201, r.text
    return r.json()


def ocr_run(**changes) -> dict:
    return {
        "base_model": "tiny-ocr-vl",
        "stage": "OCR-VL-SFT",
        "fine_tuning": "LoRA",
        "hyperparameters": {"max_steps": 2, "max_seq_len": 96},
        **changes,
    }


def test_the_ocr_preset_is_listed_with_its_architecture(client):
    models = {m["name"]: m for m in client.get("/api/v1/models").json()}
    ocr = models["tiny-ocr-vl"]
    assert (ocr["kind"], ocr["model_type"], ocr["available"]) == ("preset", "paddleocr_vl", False)
    # the vision encoder counts too: more than the decoder of the same width alone
    assert ocr["num_parameters"] > models["tiny"]["num_parameters"]


def test_stage_and_model_family_are_checked_before_queueing(client):
    ds = upload_lines(client)
    assert (ds["format"], ds["kind"], ds["num_valid"]) == ("ocr", "sft", 48)
    r = client.post("/api/v1/runs", json=ocr_run(dataset_ids=[ds["id"]], stage="SFT"))
    assert r.status_code == 422 and r.json()["message"] == (
        "stage: base_model 'tiny-ocr-vl' is a PaddleOCR-VL model, which trains with stage OCR-VL-SFT (its "
        "prompt form and image processor), not SFT"
    )
    r = client.post("/api/v1/runs", json=ocr_run(dataset_ids=[ds["id"]], base_model="tiny"))
    assert r.status_code == 422 and r.json()["message"].startswith(
        "stage: OCR-VL-SFT fine-tunes PaddleOCR-VL models, and base_model 'tiny' is not one"
    )
    assert client.get("/api/v1/runs").json() == []
    r = client.post("/api/v1/runs", json=ocr_run(dataset_ids=[ds["id"]]))
    assert r.status_code == 201, r.text
    assert r.json()["config"]["train_dataset_type"] == "ocr"


def test_ocr_holdout_keeps_the_images_and_evals_pair_ocr_sets_with_ocr_models(client, settings):
    ds = upload_lines(client)
    qa = upload(client, DEMO_SFT).json()
    r = client.post(
        "/api/v1/runs",
        json=ocr_run(dataset_ids=[ds["id"]], evaluate={"holdout": 12, "dataset_ids": [qa["id"]]}),
    )
    assert r.status_code == 422 and r.json()["message"].startswith(
        f"evaluate.dataset_ids: dataset {qa['id']} (sft_demo) holds erniekit records, and tiny-ocr-vl is a "
        "PaddleOCR-VL model, which reads images"
    )
    r = client.post(
        "/api/v1/runs",
        json=ocr_run(dataset_ids=[ds["id"]], evaluate={"holdout": 12, "options": {"metrics": ["rouge_l"]}}),
    )
    assert r.status_code == 422 and r.json()["message"] == (
        "evaluate.options.metrics: rouge_l is a text metric; a PaddleOCR-VL model's readings are scored by "
        "cer and exact_match: name only those, or leave metrics out"
    )
    r = client.post(
        "/api/v1/runs",
        json={"dataset_ids": [ds["id"]], "base_model": "tiny", "stage": "SFT", "evaluate": {"holdout": 12}},
    )
    assert r.status_code == 422 and r.json()["message"].startswith(
        f"evaluate.holdout: dataset {ds['id']} (lines) is an OCR set (images with the text they show), which a "
        "PaddleOCR-VL model reads, and tiny is not one"
    )
    assert not list((settings.home / "runs").glob("*/data"))  # nothing of the refused runs is left

    r = client.post("/api/v1/runs", json=ocr_run(dataset_ids=[ds["id"]], evaluate={"holdout": 12}))
    assert r.status_code == 201, r.text
    run = r.json()
    train = Path(run["config"]["train_dataset_path"])
    assert train == settings.home / "runs" / str(run["id"]) / "data" / "lines" / "lines.train.jsonl"
    held = train.with_name("lines.holdout.jsonl")
    trained = [json.loads(x) for x in train.read_text().splitlines()]
    kept = [json.loads(x) for x in held.read_text().splitlines()]
    assert len(trained) == 36 and len(kept) == 12
    assert not {r["image"] for r in trained} & {r["image"] for r in kept}
    with session_factory(settings)() as session:
        upload_dir = dataset_path(settings, get_dataset(session, ds["id"])).parent
    for record in trained + kept:  # each image beside the split files is the upload's, linked
        linked, original = train.parent / record["image"], upload_dir / record["image"]
        assert linked.stat().st_ino == original.stat().st_ino

    r = client.post("/api/v1/evals", json={"model": "tiny", "dataset_ids": [ds["id"]]})
    assert r.status_code == 422 and r.json()["message"].startswith(
        f"dataset_ids: dataset {ds['id']} (lines) is an OCR set (images with the text they show), which a "
        "PaddleOCR-VL model reads, and tiny is not one"
    )
    r = client.post(
        "/api/v1/evals", json={"model": "tiny", "dataset_ids": [qa["id"]], "options": {"metrics": "cer"}}
    )
    assert r.status_code == 422 and r.json()["message"].startswith(
        "options.metrics: cer scores OCR sets read by a PaddleOCR-VL model"
    )
    r = client.post("/api/v1/evals", json={"model": "tiny-ocr-vl", "dataset_ids": [qa["id"]]})
    assert r.status_code == 422 and "tiny-ocr-vl is a PaddleOCR-VL model" in r.json()["message"]
    r = client.post(
        "/api/v1/evals",
        json={"model": "tiny-ocr-vl", "dataset_ids": [ds["id"]], "options": {"normalize": "lower"}},
    )
    assert r.status_code == 422 and r.json()["message"].startswith(
        "options.normalize: it shapes text metrics"
    )
    r = client.post("/api/v1/evals", json={"model": "tiny-ocr-vl", "dataset_ids": [ds["id"]]})
    assert r.status_code == 201, r.text
    assert r.json()["config"]["eval_dataset_type"] == "ocr" and r.json()["samples_total"] == 48
