"""Who may import whom (ARCHITECTURE.md): the studio (store, services, API, UI) never imports the workers,
and the workers never import the UI; both meet in `studio.queue` and the services."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(folder: str) -> list[tuple[str, str]]:
    """(file, imported module) for every import statement under `folder`, lazy ones inside functions too."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found += [(str(path.relative_to(ROOT)), alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((str(path.relative_to(ROOT)), node.module))
    return found


def test_the_studio_never_imports_the_workers():
    wrong = [f"{f}: {m}" for f, m in _imports("studio") if m == "workers" or m.startswith("workers.")]
    assert not wrong, "\n".join(wrong)


def test_the_workers_never_import_the_ui():
    wrong = [f"{f}: {m}" for f, m in _imports("workers") if m == "studio.ui" or m.startswith("studio.ui.")]
    assert not wrong, "\n".join(wrong)


def test_importing_the_app_does_not_import_paddle():
    """`studio.app` (API + UI) loads without Paddle (~3 s of CPU): services that need the engine's Paddle
    side import it where they use it. (`ernie-studio up` still imports Paddle first, on purpose: a later
    import would replace uvicorn's graceful SIGTERM handling with Paddle's abort.)"""
    import subprocess
    import sys

    code = "import sys, studio.app; print(sorted(m for m in sys.modules if m == 'paddle' or m.startswith('paddle.'))[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_an_api_process_freezes_its_startup_heap(tmp_path):
    """The objects alive when an API process starts serving (imports, the app) are out of the garbage
    collector's reach, so a full collection walks only what requests made: with them in, each one held the
    GIL for 140-225 ms and was the whole p99 of bench/bench_reads.py's paced reads."""
    import os
    import subprocess
    import sys

    code = (
        "import gc; from studio.app import app_from_env; before = gc.get_freeze_count(); app_from_env(); "
        "print(before, gc.get_freeze_count())"
    )
    env = {**os.environ, "ERNIE_STUDIO_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(int, out.stdout.split())
    assert before == 0 and after > 50_000, out.stdout
