"""Rewrite tests/engine/data/erniekit_keys.json, the snapshot of ERNIEKit's config keys.

    python tools/erniekit_keys.py checkout /path/to/PaddlePaddle/ERNIE [--files FILE ...]
    python tools/erniekit_keys.py tree DIR --commits COMMITS --version V --version-file TEXT --head TEXT

``checkout`` reads each listed config of ``examples/configs/`` (by default the ones the committed snapshot
names) at a git checkout's HEAD and names each file's last commit and ERNIEKit's version
(``erniekit/version/env.py``). ``tree`` reads every ``examples/configs/**/*.yaml`` under DIR, files saved
one by one from a source that stores each at its own commit (COMMITS: one ``path commit`` line per file).
Both record every top-level key with the files that use it, by the command that reads the file:
``run_export.yaml`` (`ernie-studio export`), ``run_chat.yaml``, ``run_eval.yaml`` (`ernie-studio eval`),
and the rest (`ernie-studio train`). The test suite reads only the committed file.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

import yaml

SNAPSHOT = Path(__file__).resolve().parents[1] / "tests" / "engine" / "data" / "erniekit_keys.json"
SOURCE = "https://github.com/PaddlePaddle/ERNIE"
KINDS = {"run_export.yaml": "export_keys", "run_chat.yaml": "chat_keys", "run_eval.yaml": "eval_keys"}


def config_keys(text: str) -> list[str]:
    """The top-level keys of one ERNIEKit YAML config, in file order (commented-out lines are not keys)."""
    data = yaml.safe_load(text) or {}
    return [str(k) for k in data]


def kind(path: str) -> str:
    """Which snapshot section a config's keys go to: the command that reads that file."""
    return KINDS.get(Path(path).name, "train_keys")


def snapshot(texts: dict[str, str], commits: dict[str, str], header: dict[str, str]) -> dict:
    """The snapshot's JSON: the header, files with their commits, and key -> files for each kind."""
    keys: dict[str, dict[str, list[str]]] = {k: {} for k in ("train_keys", *KINDS.values())}
    for path in sorted(texts):
        for key in config_keys(texts[path]):
            keys[kind(path)].setdefault(key, []).append(path)
    return {
        **header,
        "files": {path: commits[path] for path in sorted(texts)},
        **{section: dict(sorted(found.items())) for section, found in keys.items()},
    }


def _git(checkout: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def from_checkout(checkout: Path, files: list[str]) -> dict:
    text = (checkout / "erniekit" / "version" / "env.py").read_text(encoding="utf-8")
    header = {
        "source": SOURCE,
        "head": _git(checkout, "rev-parse", "HEAD"),
        "erniekit_version": re.search(r'VERSION\s*=\s*"([^"]+)"', text).group(1),
        "version_file": "erniekit/version/env.py at "
        + _git(checkout, "log", "-1", "--format=%H", "--", "erniekit/version/env.py"),
    }
    texts = {path: (checkout / path).read_text(encoding="utf-8") for path in files}
    commits = {path: _git(checkout, "log", "-1", "--format=%H", "--", path) for path in files}
    return snapshot(texts, commits, header)


def from_tree(root: Path, commits_file: Path, header: dict[str, str]) -> dict:
    commits = dict(line.split()[:2] for line in commits_file.read_text().splitlines() if line.strip())
    texts = {
        str(p.relative_to(root)): p.read_text(encoding="utf-8")
        for p in sorted((root / "examples" / "configs").rglob("*.yaml"))
    }
    missing = sorted(set(texts) ^ set(commits))
    if missing:
        raise SystemExit(f"files and commits differ: {missing}")
    return snapshot(texts, commits, {"source": SOURCE, **header})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("checkout", help="a git checkout of PaddlePaddle/ERNIE")
    c.add_argument("checkout", type=Path)
    c.add_argument("--files", nargs="*", help="configs to read (default: those of the committed snapshot)")
    t = sub.add_parser("tree", help="configs saved file by file, each with its own commit")
    t.add_argument("root", type=Path, help="holds examples/configs/**/*.yaml")
    t.add_argument("--commits", type=Path, required=True, help="'path commit' lines, one per file")
    t.add_argument("--version", required=True, help="ERNIEKit's VERSION (erniekit/version/env.py)")
    t.add_argument("--version-file", required=True, help="where the version was read, with its commit")
    t.add_argument("--head", required=True, help="how the files were read (no single checkout)")
    args = parser.parse_args()
    if args.mode == "checkout":
        files = args.files or list(json.loads(SNAPSHOT.read_text())["files"])
        data = from_checkout(args.checkout, files)
    else:
        header = {"head": args.head, "erniekit_version": args.version, "version_file": args.version_file}
        data = from_tree(args.root, args.commits, header)
    SNAPSHOT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {SNAPSHOT}")


if __name__ == "__main__":
    main()
