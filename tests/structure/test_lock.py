"""uv.lock is the only source of versions: what `make` installed is exactly what the lock holds."""

from __future__ import annotations

import importlib.metadata
import re
import site
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _locked() -> dict[str, set[str]]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text(encoding="utf-8"))
    versions: dict[str, set[str]] = {}
    for package in lock["package"]:
        # the bench extra is resolved apart, so a few packages hold one version per fork
        versions.setdefault(_norm(package["name"]), set()).add(package.get("version", ""))
    return versions


def test_every_installed_distribution_is_a_locked_version():
    locked = _locked()
    wrong, unlocked = [], []
    # the environment's own site-packages: setuptools adds its vendored copies to sys.path once imported
    for dist in importlib.metadata.distributions(path=site.getsitepackages()):
        name = _norm(dist.metadata["Name"])
        if name in ("ernie-studio", "pip"):  # the project itself; pip only where the venv was made by hand
            continue
        if name not in locked:
            unlocked.append(f"{name} {dist.version}")
        elif dist.version not in locked[name]:
            wrong.append(f"{name} {dist.version} (uv.lock: {', '.join(sorted(locked[name]))})")
    assert not wrong, "installed versions that differ from uv.lock:\n" + "\n".join(wrong)
    assert not unlocked, "installed but not in uv.lock:\n" + "\n".join(unlocked)


def test_make_installs_from_the_lock_and_checks_it():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "sync --locked" in makefile  # refuses a lock that disagrees with pyproject.toml
    assert "lock --check" in makefile
    assert "pip install -q -e" not in makefile  # no second, unlocked way in


def test_images_install_the_locked_versions_with_the_same_uv():
    uv = re.search(r"^UV_VERSION\s*:=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    for dockerfile in sorted((ROOT / "docker").glob("Dockerfile*")):
        text = dockerfile.read_text(encoding="utf-8")
        # pip's pinned uv, or uv's own image at that tag (the serving image keeps FastDeploy's Python clean)
        assert f"uv=={uv}" in text or f"astral-sh/uv:{uv} " in text, dockerfile.name
        assert "uv export --frozen" in text or "uv sync --frozen" in text, dockerfile.name
        assert "COPY pyproject.toml uv.lock" in text, dockerfile.name
