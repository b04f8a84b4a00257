"""Dataset uploads through the REST API: format detection, validation, paging, stats, and bad input."""

from __future__ import annotations

import json

from studio_helpers import DEMO_DPO, DEMO_PT, DEMO_SFT, files_under, upload


def test_upload_detects_validates_and_pages(client, settings):
    r = upload(client, DEMO_SFT, name="demo")
    assert r.status_code == 201, r.text
    ds = r.json()
    assert (ds["name"], ds["format"], ds["kind"]) == ("demo", "erniekit", "sft")
    lines = DEMO_SFT.read_text().splitlines()
    assert ds["num_records"] == ds["num_valid"] == len(lines)
    assert ds["size_bytes"] == DEMO_SFT.stat().st_size
    stored = files_under(settings.datasets_dir)
    assert len(stored) == 1 and next(iter(stored)).read_bytes() == DEMO_SFT.read_bytes()

    page = client.get(f"/api/v1/datasets/{ds['id']}/preview", params={"offset": 0, "limit": 5}).json()
    assert page["records"] == [json.loads(x) for x in lines[:5]]
    nxt = client.get(
        f"/api/v1/datasets/{ds['id']}/preview", params={"offset": page["next_offset"], "limit": 3}
    )
    assert nxt.json()["records"] == [json.loads(x) for x in lines[5:8]]

    rendered = client.get(
        f"/api/v1/datasets/{ds['id']}/preview", params={"limit": 1, "render_with": "tiny"}
    ).json()
    spans = rendered["rendered"][0]
    assert any(s["trained"] for s in spans) and any(not s["trained"] for s in spans)
    assert json.loads(lines[0])["tgt"][-1] in "".join(s["text"] for s in spans if s["trained"])

    stats = client.get(
        f"/api/v1/datasets/{ds['id']}/stats", params={"model": "tiny", "max_seq_len": 64}
    ).json()
    assert stats["num_records"] == stats["num_valid"] == len(lines)
    assert sum(stats["histogram"]["counts"]) == len(lines)
    assert 0 < stats["p50_length"] <= stats["max_length"]
    assert stats["max_length"] > 64 and 0 < stats["truncated_share"] < 1  # some demo records exceed 64 tokens
    # Cached on the dataset: a second call answers the same without recomputing.
    again = client.get(
        f"/api/v1/datasets/{ds['id']}/stats", params={"model": "tiny", "max_seq_len": 64}
    ).json()
    assert again == stats

    assert [d["id"] for d in client.get("/api/v1/datasets").json()] == [ds["id"]]
    assert client.delete(f"/api/v1/datasets/{ds['id']}").status_code == 204
    assert client.get(f"/api/v1/datasets/{ds['id']}").status_code == 404
    assert files_under(settings.datasets_dir) == set()


def test_dpo_and_explicit_format(client):
    r = upload(client, DEMO_DPO)
    assert r.status_code == 201, r.text
    assert (r.json()["format"], r.json()["kind"]) == ("erniekit", "dpo")


def test_pretraining_text_is_a_format_like_the_others(client):
    # The formats the studio takes are the engine's (engine.data.formats.FORMATS), `text` included.
    r = upload(client, DEMO_PT, format="text")
    assert r.status_code == 201, r.text
    assert (r.json()["format"], r.json()["kind"]) == ("text", "pt")
    pt = client.post("/api/v1/runs", json={"dataset_ids": [r.json()["id"]], "stage": "PT"})
    assert pt.status_code == 201, pt.text
    sft = client.post("/api/v1/runs", json={"dataset_ids": [r.json()["id"]], "stage": "SFT"})
    assert sft.status_code == 422 and "needs sft data" in sft.json()["message"]


def test_path_traversal_names_are_refused(client, settings, tmp_path):
    before = files_under(tmp_path)
    for name in ["../evil.jsonl", "..\\evil.jsonl", "/etc/evil.jsonl", "a/../../evil.jsonl", ".hidden.jsonl"]:
        r = upload(client, DEMO_SFT, filename=name)
        assert r.status_code == 422, (name, r.text)
        assert "file name" in r.json()["message"], r.json()
    assert files_under(tmp_path) == before
    assert not (tmp_path / "evil.jsonl").exists() and not (settings.home.parent / "evil.jsonl").exists()


def test_non_utf8_is_refused_with_the_line(client, tmp_path):
    bad = tmp_path / "latin1.jsonl"
    good = DEMO_SFT.read_text().splitlines()[:3]
    bad.write_bytes(
        ("\n".join(good) + "\n").encode() + '{"src": ["caf\xe9"], "tgt": ["x"]}\n'.encode("latin-1")
    )
    r = upload(client, bad)
    assert r.status_code == 422
    assert "line 4" in r.json()["message"] and "UTF-8" in r.json()["message"]


def test_wrong_format_and_invalid_records(client, tmp_path):
    csv = tmp_path / "table.jsonl"
    csv.write_text("question,answer\nhi,hello\n")
    r = upload(client, csv)
    assert r.status_code == 422 and "table.jsonl" in r.json()["message"]

    bad = tmp_path / "bad.jsonl"
    lines = DEMO_SFT.read_text().splitlines()[:4]
    lines[2] = json.dumps({"src": ["a", "b"], "tgt": ["only one"]})
    bad.write_text("\n".join(lines) + "\n")
    r = upload(client, bad)
    assert r.status_code == 422
    body = r.json()
    assert "bad.jsonl:3" in body["message"], body
    assert any(p.startswith("bad.jsonl:3") for p in body["details"]["problems"])

    r = upload(client, DEMO_SFT, filename="data.txt")
    assert r.status_code == 422 and ".jsonl or .json" in r.json()["message"]
    r = upload(client, DEMO_SFT, filename="data.csv")  # tables are benchmark files (C-Eval, CMMLU)
    assert r.status_code == 422 and "data.csv: a table is read as a benchmark file" in r.json()["message"]
    r = upload(client, DEMO_SFT, format="yaml")
    assert r.status_code == 422 and "format" in r.json()["message"]
    r = client.post("/api/v1/datasets", data={"name": "no file"})
    assert r.status_code == 422 and "file" in r.json()["message"]


def test_over_the_size_limit_is_413(client, settings, tmp_path):
    big = tmp_path / "big.jsonl"
    line = DEMO_SFT.read_text().splitlines()[0] + "\n"
    with open(big, "w") as f:
        for _ in range(settings.max_upload_bytes // len(line) + 10):
            f.write(line)
    r = upload(client, big)
    assert r.status_code == 413
    assert "2 MB" in r.json()["message"]
    assert files_under(settings.datasets_dir) == set()


def test_preview_bounds(client):
    ds = upload(client, DEMO_SFT).json()
    assert client.get(f"/api/v1/datasets/{ds['id']}/preview", params={"limit": 0}).status_code == 422
    assert client.get(f"/api/v1/datasets/{ds['id']}/preview", params={"offset": -1}).status_code == 422
    far = client.get(f"/api/v1/datasets/{ds['id']}/preview", params={"offset": 10_000}).json()
    assert far["records"] == []
    r = client.get(f"/api/v1/datasets/{ds['id']}/stats", params={"model": "../../etc"})
    assert r.status_code == 422 and "outside" in r.json()["message"]


def test_erniekit_function_call_and_pretraining_data_upload_and_preview(client, tmp_path):
    # ERNIEKit's own demo shapes (examples/data/function-call-*.jsonl and pt-*.jsonl in PaddlePaddle/ERNIE).
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    fc = {
        "messages": [
            {"role": "user", "content": "1+2?"},
            {"role": "assistant", "content": "<think>Use add.</think>", "tool_calls": [call]},
            {"role": "tool", "content": [{"sum": 3}]},
            {"role": "assistant", "content": "3"},
        ],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
    }
    path = tmp_path / "function-call.jsonl"
    path.write_text(json.dumps(fc) + "\n")
    r = upload(client, path)
    assert r.status_code == 201, r.text
    assert (r.json()["format"], r.json()["kind"]) == ("chatml", "sft")
    rendered = client.get(
        f"/api/v1/datasets/{r.json()['id']}/preview", params={"limit": 1, "render_with": "tiny"}
    ).json()["rendered"][0]
    trained = "".join(s["text"] for s in rendered if s["trained"])
    assert (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}' in trained
        and "tool_response" not in trained
    )

    pt = tmp_path / "pt.jsonl"
    pt.write_text('{"tgt": ["真。"]}\n{"tgt": ["26.7摄氏度。"]}\n')
    r = upload(client, pt)
    assert r.status_code == 201, r.text
    assert (r.json()["format"], r.json()["kind"]) == ("erniekit", "pt")
    sft = client.post("/api/v1/runs", json={"dataset_ids": [r.json()["id"]], "stage": "SFT"})
    assert sft.status_code == 422 and "needs sft data" in sft.json()["message"]


def test_a_file_naming_more_image_urls_than_a_dataset_may_fetch_is_refused(
    client, settings, tmp_path, monkeypatch
):
    from engine.data import remote

    monkeypatch.setattr(remote, "MAX_URLS", 2)
    data = tmp_path / "vl.jsonl"
    text_info = [{"text": "Colour?", "tag": "mask"}, {"text": "Red.", "tag": "no_mask"}]
    data.write_text(
        "".join(
            json.dumps({"image_info": [{"matched_text_index": 0, "image_url": f"https://img.example/{i}.png"}],
                        "text_info": text_info}) + "\n"
            for i in range(3)
        )
    )  # fmt: skip
    r = upload(client, data)
    assert r.status_code == 422, r.text
    assert "file: vl.jsonl names 3 image URLs; at most 2 are fetched per dataset" in r.json()["message"]
    assert files_under(settings.datasets_dir) == set()
