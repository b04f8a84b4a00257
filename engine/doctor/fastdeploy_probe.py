"""The `fastdeploy` check: does the installed FastDeploy take every flag the launcher passes (its --help), and,
with `--full` on a GPU node, does it serve a tiny model's serving export over the OpenAI API."""

from __future__ import annotations

import json
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from engine.doctor.report import Check
from engine.serve.fastdeploy import FASTDEPLOY_RELEASE, FastDeployServer, check_installed, plan_launch
from engine.serve.fastdeploy_env import fastdeploy_python, pip_check
from engine.serve.ports import free_port


def fastdeploy_checks(facts: dict[str, Any], model_dir: Path | None) -> list[Check]:
    """`fastdeploy` (the --help check; passes with a note where FastDeploy is not installed) and, when
    ``model_dir`` is given (the full doctor on a node with a GPU), `fastdeploy_serve`."""
    fd = facts.get("fastdeploy", {})
    if fd.get("error"):
        return [Check("fastdeploy", False, fd["error"])]
    if not fd.get("available"):
        return [Check("fastdeploy", True, "not installed: deployments use the Paddle server")]
    flags = check_installed()
    values = {"version": flags.version, "pinned": FASTDEPLOY_RELEASE, "missing": flags.missing}
    if not flags.ok:
        return [
            Check("fastdeploy", False, f"{flags.message}; FastDeploy deployments are refused", values=values),
            environment_check(),
        ]
    checks = [Check("fastdeploy", True, f"{flags.message} the launcher passes", values=values)]
    checks.append(environment_check())
    if model_dir is not None:
        checks.append(serve_probe(model_dir))
    return checks


def environment_check(python: str | None = None) -> Check:
    """`fastdeploy_env`: `pip check` of the Python FastDeploy is installed in holds (FastDeploy's pins, such
    as uvicorn==0.29.0 and setuptools<80, untouched by anything installed beside it)."""
    python = python or fastdeploy_python()
    ok, said = pip_check(python)
    values = {"python": python}
    if ok:
        return Check("fastdeploy_env", True, f"`pip check` of {python}: {said or 'no broken requirements'}",
                     values=values)  # fmt: skip
    return Check(
        "fastdeploy_env",
        False,
        f"`pip check` of FastDeploy's Python {python} failed: {said}; keep the studio's packages out of "
        f"FastDeploy's environment (docker/Dockerfile.serve installs them in their own)",
        values=values,
    )


def serve_probe(model_dir: Path, timeout: float = 900.0) -> Check:
    """Serve ``model_dir`` (written in the form FastDeploy loads) and ask it for a short chat completion."""
    from engine.train.serving_export import export_for_serving

    with tempfile.TemporaryDirectory(prefix="ernie-doctor-fd-") as tmp:
        served = export_for_serving(model_dir, Path(tmp) / "model")
        plan = plan_launch(
            served, port=free_port(), max_model_len=2048, max_num_seqs=4, log_dir=Path(tmp) / "logs"
        )
        server = FastDeployServer(plan)
        try:
            server.start(timeout=timeout)
            body = json.dumps(
                {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            ).encode()
            request = urllib.request.Request(
                f"{plan.base_url}/chat/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=120) as r:
                reply = json.loads(r.read())
            tokens = reply["usage"]["completion_tokens"]
        except Exception as e:
            return Check("fastdeploy_serve", False, f"FastDeploy did not serve the tiny model: {e}")
        finally:
            server.stop()
    return Check("fastdeploy_serve", tokens >= 1, f"served the tiny model: {tokens} completion token(s)")
