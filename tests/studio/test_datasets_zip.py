"""Zip uploads of VL datasets: the data file and its images extracted safely, validated, previewed, served."""

from __future__ import annotations

import io
import json
import stat
import zipfile
from pathlib import Path

import pytest
from studio_helpers import REPO, files_under

from studio.services import datasets as svc

VL_DATA = REPO / "examples" / "data" / "vl_demo.jsonl"
VL_IMAGES = REPO / "examples" / "data" / "images"


def make_zip(members: dict[str, bytes], *, symlinks: dict[str, str] | None = None, prefix: str = "") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(prefix + name, data)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(prefix + name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return buf.getvalue()


def vl_members() -> dict[str, bytes]:
    members = {"data.jsonl": VL_DATA.read_bytes()}
    for img in sorted(VL_IMAGES.iterdir()):
        members[f"images/{img.name}"] = img.read_bytes()
    return members


def post_zip(client, data: bytes, filename: str = "vl.zip", **fields):
    return client.post(
        "/api/v1/datasets", files={"file": (filename, io.BytesIO(data), "application/zip")}, data=fields
    )


def assert_nothing_stored(settings) -> None:
    # A refused upload leaves neither a dataset folder nor staging leftovers, and nothing outside home.
    assert files_under(settings.datasets_dir) == set()
    assert [p.name for p in settings.datasets_dir.iterdir() if p.name != ".incoming"] == []


def test_vl_zip_uploads_validates_previews_serves_images_and_trains(client, settings):
    lines = VL_DATA.read_text().splitlines()
    r = post_zip(client, make_zip(vl_members(), prefix="vl_demo/"), name="vl demo")
    assert r.status_code == 201, r.text
    ds = r.json()
    assert (ds["name"], ds["format"], ds["kind"]) == ("vl demo", "erniekit_vl", "sft")
    assert ds["num_records"] == ds["num_valid"] == len(lines) and ds["problems"] == []
    assert ds["filename"] == "vl.zip"
    expected_size = VL_DATA.stat().st_size + sum(p.stat().st_size for p in VL_IMAGES.iterdir())
    assert ds["size_bytes"] == expected_size

    stored = files_under(settings.datasets_dir)
    folder = {p.relative_to(settings.datasets_dir).parts[0] for p in stored}
    assert len(folder) == 1 and len(stored) == 1 + len(list(VL_IMAGES.iterdir()))
    assert not any((settings.datasets_dir / ".incoming").iterdir())

    page = client.get(f"/api/v1/datasets/{ds['id']}/preview", params={"limit": 3}).json()
    assert page["records"] == [json.loads(x) for x in lines[:3]] and page["total"] == len(lines)
    rendered = client.get(
        f"/api/v1/datasets/{ds['id']}/preview", params={"limit": 1, "render_with": "tiny"}
    ).json()["rendered"][0]
    text = "".join(s["text"] for s in rendered)
    first = json.loads(lines[0])
    img_name = Path(first["image_info"][0]["image_url"]).name
    # With the dataset folder as base the image is opened: its size and token count show in the template.
    assert f"[image {img_name}: " in text and "tokens]" in text
    assert not any(s.get("error") for s in rendered)

    url = first["image_info"][0]["image_url"]
    img = client.get(f"/api/v1/datasets/{ds['id']}/files/{url}")
    assert img.status_code == 200 and img.content == (VL_IMAGES / img_name).read_bytes()
    assert img.headers["content-type"] == "image/png"
    assert client.get(f"/api/v1/datasets/{ds['id']}/files/images/nope.png").status_code == 404
    for bad in ("..%2F..%2F..%2Fapp.db", "%2Fetc%2Fpasswd", "images/..%2F..%2Fx", "0" * 300):
        assert client.get(f"/api/v1/datasets/{ds['id']}/files/{bad}").status_code in (404, 422), bad

    stats = client.get(f"/api/v1/datasets/{ds['id']}/stats", params={"model": "tiny", "max_seq_len": 512})
    assert stats.status_code == 200, stats.text
    assert stats.json()["num_valid"] == len(lines) and sum(stats.json()["histogram"]["counts"]) == len(lines)

    run = client.post(
        "/api/v1/runs",
        json={
            "dataset_ids": [ds["id"]],
            "stage": "VL-SFT",
            "base_model": "tiny-vl",
            "hyperparameters": {"max_steps": 2},
        },
    )
    assert run.status_code == 201, run.text
    cfg = run.json()["config"]
    assert cfg["stage"] == "VL-SFT" and cfg["train_dataset_type"] == "erniekit_vl"
    data_path = Path(cfg["train_dataset_path"])
    assert data_path.name == "data.jsonl" and (data_path.parent / url).is_file()
    assert client.delete(f"/api/v1/runs/{run.json()['id']}").status_code in (204, 409)


def test_delete_removes_the_whole_extracted_folder(client, settings):
    ds = post_zip(client, make_zip(vl_members(), prefix="deep/er/")).json()
    assert client.delete(f"/api/v1/datasets/{ds['id']}").status_code == 204
    assert_nothing_stored(settings)


@pytest.mark.parametrize(
    ("extra", "symlinks", "needle"),
    [
        ({"../x.png": b"x"}, None, "'..'"),
        ({"images/../../x.png": b"x"}, None, "'..'"),
        ({"/tmp/evil.png": b"x"}, None, "absolute path"),
        ({"C:/evil.png": b"x"}, None, "absolute path"),
        ({"images\\..\\..\\x.png": b"x"}, None, "'\\'"),
        ({}, {"images/link.png": "/etc/passwd"}, "symbolic link"),
    ],
)
def test_zip_slip_members_are_refused(client, settings, tmp_path, extra, symlinks, needle):
    before = {p for p in files_under(tmp_path) if not p.name.startswith("studio.db")}
    r = post_zip(client, make_zip({**vl_members(), **extra}, symlinks=symlinks))
    assert r.status_code == 422, r.text
    msg = r.json()["message"]
    assert "member" in msg and needle in msg, msg
    bad = next(iter(extra or symlinks))
    assert repr(bad) in msg
    assert_nothing_stored(settings)
    # Nothing new anywhere under the test's folder (home and around it) but the database.
    assert {p for p in files_under(tmp_path) if not p.name.startswith("studio.db")} == before
    assert not (settings.datasets_dir.parent / "x.png").exists() and not (tmp_path / "x.png").exists()
    assert not Path("/tmp/evil.png").exists()


def test_too_large_and_too_many_members(client, settings, monkeypatch):
    # settings cap uploads at 2 MB: 3 MB of zeros compress to a few KB but unpack over the limit.
    bomb = make_zip({"data.jsonl": VL_DATA.read_bytes(), "images/big.bin": b"\0" * (3 * 2**20)})
    assert len(bomb) < 100_000
    r = post_zip(client, bomb)
    assert r.status_code == 413 and "unpacks to 3.0 MB" in r.json()["message"], r.text
    assert_nothing_stored(settings)

    monkeypatch.setattr(settings, "max_archive_members", 5)
    r = post_zip(client, make_zip(vl_members()))
    assert r.status_code == 413, r.text
    assert f"has {len(vl_members())} members, more than the limit of 5" in r.json()["message"]
    assert_nothing_stored(settings)


def test_data_file_count_and_choice(client, settings):
    images = {k: v for k, v in vl_members().items() if k.startswith("images/")}
    r = post_zip(client, make_zip(images))
    assert r.status_code == 422 and "holds no .jsonl or .json data file" in r.json()["message"]

    two = make_zip({**vl_members(), "other/data.json": b"[]"})
    r = post_zip(client, two)
    assert r.status_code == 422, r.text
    assert "2 data files (data.jsonl, other/data.json)" in r.json()["message"]
    assert "data_file" in r.json()["message"]
    assert_nothing_stored(settings)

    r = post_zip(client, two, data_file="missing.jsonl")
    assert r.status_code == 422 and "'missing.jsonl' is not in vl.zip" in r.json()["message"]
    r = post_zip(client, two, data_file="data.jsonl")
    assert r.status_code == 201, r.text
    assert r.json()["num_valid"] == len(VL_DATA.read_text().splitlines())
    # macOS resource forks (__MACOSX/, ._name) are neither data files nor extracted.
    r = post_zip(client, make_zip({**vl_members(), "__MACOSX/._data.jsonl": b"\0\1"}))
    assert r.status_code == 201, r.text


@pytest.mark.parametrize("clash", ["images", "data.jsonl/x.png"])
def test_file_and_folder_of_the_same_name(client, settings, clash):
    members = {clash: b"x", **vl_members()} if clash == "images" else {**vl_members(), clash: b"x"}
    r = post_zip(client, make_zip(members))
    assert r.status_code == 422, r.text
    assert "clashes with a file or folder of the same name" in r.json()["message"]
    assert_nothing_stored(settings)


def test_corrupt_and_encrypted_archives(client, settings):
    r = post_zip(client, b"PK\x03\x04 this is not really a zip")
    assert r.status_code == 422 and "vl.zip is not a readable zip archive" in r.json()["message"], r.text

    good = bytearray(make_zip(vl_members()))
    # Flip bytes inside the first member's compressed data: the CRC check names the member.
    start = 30 + len("data.jsonl")
    for i in range(start + 10, start + 40):
        good[i] ^= 0xFF
    r = post_zip(client, bytes(good))
    assert r.status_code == 422, r.text
    assert "member 'data.jsonl' cannot be extracted" in r.json()["message"]
    assert_nothing_stored(settings)

    enc = bytearray(make_zip(vl_members()))
    # Set the "encrypted" flag bit of every central directory entry (offset 8 of each record).
    pos = enc.find(b"PK\x01\x02")
    while pos != -1:
        enc[pos + 8] |= 0x01
        pos = enc.find(b"PK\x01\x02", pos + 4)
    r = post_zip(client, bytes(enc))
    assert r.status_code == 422 and "encrypted" in r.json()["message"], r.text
    assert "member 'data.jsonl'" in r.json()["message"]
    assert_nothing_stored(settings)


def test_missing_image_is_located_by_line(client, settings):
    members = vl_members()
    lines = VL_DATA.read_text().splitlines()
    missing = json.loads(lines[1])["image_info"][0]["image_url"]
    del members[missing]
    r = post_zip(client, make_zip(members, prefix="set/"))
    assert r.status_code == 422, r.text
    problems = r.json()["details"]["problems"]
    assert problems[0].startswith(
        f"set/data.jsonl:2: image_info[0]: image '{missing}' not found (looked for set/{missing})"
    )
    assert r.json()["details"]["format"] == "erniekit_vl"
    assert str(settings.home) not in r.json()["message"]
    assert_nothing_stored(settings)


def test_unreadable_images_are_refused_in_the_readers_language(client, session, settings, tmp_path):
    """Images the decoder cannot read are keyed problems: English by default, Chinese through REST with
    Accept-Language: zh and in the Datasets tab's rows of the refused upload."""
    from studio.services.errors import ServiceError
    from studio.ui.datasets_tab import rejected_upload

    members = vl_members()
    lines = VL_DATA.read_text().splitlines()
    first, second = (json.loads(line)["image_info"][0]["image_url"] for line in lines[:2])
    members[first] = b"not an image at all"
    members[second] = members[second][: len(members[second]) // 2]
    data = make_zip(members)
    english = post_zip(client, data).json()["details"]["problems"]
    assert english[0] == (
        f"data.jsonl:1: image_info[0]: image '{first}': not an image PIL can read (unknown format or not an image)"
    ), english
    assert english[1].startswith(f"data.jsonl:2: image_info[0]: image '{second}': truncated or corrupt ("), (
        english
    )
    r = client.post(
        "/api/v1/datasets",
        files={"file": ("vl.zip", io.BytesIO(data), "application/zip")},
        headers={"Accept-Language": "zh"},
    )
    chinese = r.json()["details"]["problems"]
    assert chinese[:2] == [
        f"data.jsonl:1：image_info[0]：图片 '{first}'：不是可读取的图片（格式未知或不是图片）",
        f"data.jsonl:2：image_info[0]：图片 '{second}'：文件被截断或已损坏",
    ], chinese
    (tmp_path / "vl.zip").write_bytes(data)
    with pytest.raises(ServiceError) as refused:  # the Datasets tab calls the service itself
        svc.upload_dataset(session, settings, tmp_path / "vl.zip")
    rows = rejected_upload("vl.zip", refused.value, "zh")[1]
    assert rows.iloc[0].tolist() == [
        1,
        f"image_info[0]：图片 '{first}'：不是可读取的图片（格式未知或不是图片）",
    ]
    assert rows.iloc[1].tolist() == [2, f"image_info[0]：图片 '{second}'：文件被截断或已损坏"]
    assert_nothing_stored(settings)


def test_other_suffixes_are_still_refused(client):
    r = post_zip(client, b"hello", filename="data.tar.gz")
    assert r.status_code == 422 and ".zip" in r.json()["message"]


def test_service_upload_from_a_local_zip(session, settings, tmp_path):
    # The UI hands the service its temp file path; a .zip takes the same route.
    z = tmp_path / "vl_demo.zip"
    z.write_bytes(make_zip(vl_members()))
    ds = svc.upload_dataset(session, settings, z)
    assert ds.format == "erniekit_vl" and ds.name == "vl_demo"
    record = svc.preview_dataset(session, settings, ds.id, limit=1)["records"][0]
    images = svc.record_images(settings, ds, record)
    assert [name for _, name in images] == [Path(record["image_info"][0]["image_url"]).name]
    assert svc.dataset_file(session, settings, ds.id, record["image_info"][0]["image_url"]) == images[0][0]
