"""Rewrite tests/engine/data/erniekit_keys.json, the snapshot of ERNIEKit's config keys, from a checkout.

    python tools/erniekit_keys.py /path/to/PaddlePaddle/ERNIE [--files FILE ...]

Reads each listed config of ``examples/configs/`` (by default the ones the committed snapshot names) at the
checkout's HEAD, records every top-level key with the files that use it, and names the commit and ERNIEKit's
version (``erniekit/version/env.py``). Run export configs (``run_export.yaml``) go under ``export_keys``:
`ernie-studio export` reads them. The test suite reads only the committed file.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import yaml

SNAPSHOT = Path(__file__).resolve().parents[1] / "tests" / "engine" / "data" / "erniekit_keys.json"


def config_keys(text: str) -> list[str]:
    """The top-level keys of one ERNIEKit YAML config, in file order (commented-out lines are not keys)."""
    data = yaml.safe_load(text) or {}
    return [str(k) for k in data]


def erniekit_version(checkout: Path) -> str:
    text = (checkout / "erniekit" / "version" / "env.py").read_text(encoding="utf-8")
    return re.search(r'VERSION\s*=\s*"([^"]+)"', text).group(1)


def file_commit(checkout: Path, path: str) -> str:
    """The last commit that changed ``path`` (the snapshot names each file's own version)."""
    out = subprocess.run(
        ["git", "-C", str(checkout), "log", "-1", "--format=%H", "--", path],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def snapshot(checkout: Path, files: list[str], head: str) -> dict:
    """The snapshot's JSON: source, version, files with their commits, and key -> files for both kinds."""
    keys: dict[str, dict[str, list[str]]] = {"train_keys": {}, "export_keys": {}}
    commits = {}
    for path in sorted(files):
        commits[path] = file_commit(checkout, path)
        kind = "export_keys" if path.endswith("run_export.yaml") else "train_keys"
        for key in config_keys((checkout / path).read_text(encoding="utf-8")):
            keys[kind].setdefault(key, []).append(path)
    return {
        "source": "https://github.com/PaddlePaddle/ERNIE",
        "head": head,
        "erniekit_version": erniekit_version(checkout),
        "version_file": f"erniekit/version/env.py at {file_commit(checkout, 'erniekit/version/env.py')}",
        "files": commits,
        **{kind: dict(sorted(found.items())) for kind, found in keys.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a git checkout of PaddlePaddle/ERNIE")
    parser.add_argument(
        "--files", nargs="*", help="configs to read (default: those of the committed snapshot)"
    )
    args = parser.parse_args()
    files = args.files or list(json.loads(SNAPSHOT.read_text())["files"])
    head = subprocess.run(
        ["git", "-C", str(args.checkout), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    SNAPSHOT.write_text(json.dumps(snapshot(args.checkout, files, head), indent=1) + "\n")
    print(f"wrote {SNAPSHOT}")


if __name__ == "__main__":
    main()
