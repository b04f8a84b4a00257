"""Rewrite tests/engine/data/erniekit_keys.json, the snapshot of ERNIEKit's config keys.

    python tools/erniekit_keys.py checkout /path/to/PaddlePaddle/ERNIE [--files FILE ...]
    python tools/erniekit_keys.py tree DIR --commits COMMITS --version V --version-file TEXT --head TEXT

``checkout`` reads each listed config of ``examples/configs/`` (by default the ones the committed snapshot
names) at a git checkout's HEAD and names each file's last commit and ERNIEKit's version
(``erniekit/version/env.py``). ``tree`` reads every ``examples/configs/**/*.yaml`` under DIR, files saved
one by one from a source that stores each at its own commit (COMMITS: one ``path commit`` line per file).
Both record each file's commit, its top-level keys and the command that reads it: ``run_export.yaml``
(`ernie-studio export`), ``run_eval.yaml`` (`ernie-studio eval`), ``run_chat.yaml`` (`serve` / `chat` flags)
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
COMMANDS = {"run_export.yaml": "export", "run_chat.yaml": "chat", "run_eval.yaml": "eval"}


def config_keys(text: str) -> list[str]:
    """The top-level keys of one ERNIEKit YAML config, in file order (commented-out lines are not keys)."""
    data = yaml.safe_load(text) or {}
    return [str(k) for k in data]


def command(path: str) -> str:
    """The ernie-studio command that reads a config like this one (run_chat.yaml: serve / chat flags)."""
    return COMMANDS.get(Path(path).name, "train")


def snapshot(texts: dict[str, str], commits: dict[str, str], header: dict[str, str]) -> dict:
    """The snapshot's JSON: the header, then each file with its commit, its command and its keys."""
    files = {
        path: {"commit": commits[path], "command": command(path), "keys": config_keys(texts[path])}
        for path in sorted(texts)
    }
    return {**header, "files": files}


def dumps(data: dict) -> str:
    """The snapshot as JSON with one line per file, so a changed config is a one-line diff."""
    header = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in data.items() if k != "files"]
    files = [f"  {json.dumps(path)}: {json.dumps(entry)}" for path, entry in data["files"].items()]
    return "{\n" + "\n".join(header) + '\n "files": {\n' + ",\n".join(files) + "\n }\n}\n"


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
    SNAPSHOT.write_text(dumps(data))
    print(f"wrote {SNAPSHOT}")


if __name__ == "__main__":
    main()
