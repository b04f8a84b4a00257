"""docker-compose.yml (no Docker engine here): the services, their healthchecks, volumes and GPU
reservations are there, and every command the compose file runs is one our CLI accepts."""

from __future__ import annotations

import json
import re

import yaml
from studio_helpers import REPO

from engine.cli import build_parser
from engine.serve.fastdeploy import FASTDEPLOY_IMAGE, FASTDEPLOY_RELEASE
from engine.serve.fastdeploy_env import FASTDEPLOY_PYTHON_ENV

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_services_and_healthchecks():
    assert set(SERVICES) == {"postgres", "redis", "studio", "worker-gpu", "worker-serve", "flower"}
    for name, svc in SERVICES.items():
        check = svc.get("healthcheck", {}).get("test")
        assert check and check[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"
    for name in ("studio", "worker-gpu", "worker-serve"):
        deps = SERVICES[name]["depends_on"]
        assert all(d["condition"] == "service_healthy" for d in deps.values()), name


def test_volumes_are_declared_and_shared():
    declared = set(COMPOSE["volumes"])
    assert declared == {"pgdata", "redisdata", "studio-data"}
    used = {m.split(":")[0] for svc in SERVICES.values() for m in svc.get("volumes", [])}
    assert used == declared
    # Runs, datasets and logs live under ERNIE_STUDIO_HOME: the API and the workers must share it.
    for name in ("studio", "worker-gpu", "worker-serve"):
        assert "studio-data:/data" in SERVICES[name]["volumes"]
        assert SERVICES[name]["environment"]["ERNIE_STUDIO_HOME"] == "/data"


def test_production_settings_point_at_postgres_and_redis():
    for name in ("studio", "worker-gpu", "worker-serve"):
        env = SERVICES[name]["environment"]
        assert (
            env["ERNIE_STUDIO_DATABASE_URL"].startswith("postgresql+psycopg://")
            and "@postgres:5432/" in env["ERNIE_STUDIO_DATABASE_URL"]
        )
        assert env["ERNIE_STUDIO_BROKER_URL"] == "redis://redis:6379/0"
    assert SERVICES["studio"]["environment"]["ERNIE_STUDIO_TOKEN"].startswith("${ERNIE_STUDIO_TOKEN:?")
    assert "--appendonly" in SERVICES["redis"]["command"]


def test_gpu_reservations_and_dockerfiles():
    for name in ("worker-gpu", "worker-serve"):
        devices = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    for svc in SERVICES.values():
        if "build" in svc:
            assert (REPO / svc["build"]["dockerfile"]).is_file()
    assert "fastdeploy" in (REPO / "docker/Dockerfile.serve").read_text()


def test_commands_are_valid_cli_invocations():
    parser = build_parser()
    for name in ("studio", "worker-gpu", "worker-serve"):
        cmd = SERVICES[name]["command"]
        assert cmd[0] == "ernie-studio"
        args = parser.parse_args(cmd[1:])
        assert callable(args.func)
    gpu = parser.parse_args(SERVICES["worker-gpu"]["command"][1:])
    assert gpu.gpu == 0 and not gpu.serve
    assert parser.parse_args(SERVICES["worker-serve"]["command"][1:]).serve
    studio = parser.parse_args(SERVICES["studio"]["command"][1:])
    assert studio.host == "0.0.0.0" and studio.no_worker


def dockerfile_steps(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile's last stage, continuation lines joined, comments dropped."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    steps: list[tuple[str, str]] = []
    for joined in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines():
        if joined.strip():
            word, _, rest = joined.strip().partition(" ")
            steps.append((word.upper(), " ".join(rest.split())))
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def shell_commands(steps: list[tuple[str, str]]) -> list[str]:
    """Every command of the RUN steps, split at &&, || and ;."""
    return [
        c.strip() for word, args in steps if word == "RUN" for c in re.split(r"&&|\|\||;", args) if c.strip()
    ]


def test_serving_image_keeps_fastdeploy_and_the_studio_in_separate_environments():
    """docker/Dockerfile.serve: FastDeploy stays in the image's own Python with its pins (the only package
    installed there is fastdeploy-gpu of the pinned release, and `pip check` holds); the studio's locked
    packages go into their own Python 3.11 environment, which the worker's commands run from."""
    steps = dockerfile_steps(REPO / "docker/Dockerfile.serve")
    build = SERVICES["worker-serve"]["build"]
    assert build["dockerfile"] == "docker/Dockerfile.serve"
    assert build["args"]["FASTDEPLOY_IMAGE"].endswith(f":{FASTDEPLOY_RELEASE}")
    assert build["args"]["FASTDEPLOY_VERSION"] == FASTDEPLOY_RELEASE
    assert steps[0] == ("FROM", "${FASTDEPLOY_IMAGE}")
    text = (REPO / "docker/Dockerfile.serve").read_text()
    assert f"ARG FASTDEPLOY_IMAGE={FASTDEPLOY_IMAGE}\n" in text
    assert f"ARG FASTDEPLOY_VERSION={FASTDEPLOY_RELEASE}\n" in text

    env = dict(re.findall(r"(\w+)=(\S+)", " ".join(args for word, args in steps if word == "ENV")))
    studio_env, fd_python = env["UV_PROJECT_ENVIRONMENT"], env[FASTDEPLOY_PYTHON_ENV]
    assert not fd_python.startswith(studio_env + "/")
    assert env["PATH"].split(":")[0] == f"{studio_env}/bin"

    commands = shell_commands(steps)
    fastdeploy_side = [c for c in commands if re.match(r"(python|pip)\b", c)]
    installs = [c for c in fastdeploy_side if " install " in f"{c} "]
    assert installs and all(
        re.match(r'python -m pip install "fastdeploy-gpu==\$\{FASTDEPLOY_VERSION\}" -i ', c) for c in installs
    ), installs
    assert "python -m pip check" in fastdeploy_side and "python -V" in fastdeploy_side
    for c in fastdeploy_side:  # nothing else reaches FastDeploy's environment
        assert not re.search(r"uvicorn|setuptools|uv\.lock|requirements|-r |--upgrade|-U\b|uninstall", c), c
    uv = [c for c in commands if c.startswith("uv ")]
    assert all("--system" not in c for c in uv)
    low = re.search(r'requires-python = ">=(\d+\.\d+)', (REPO / "pyproject.toml").read_text()).group(1)
    assert f"uv python install {low}" in uv
    assert any(c.startswith("uv sync --frozen") and f"--python {low}" in c for c in uv), uv
    assert f"{studio_env}/bin/python -V" in commands
    cmd = json.loads(next(args for word, args in steps if word == "CMD"))
    assert cmd == SERVICES["worker-serve"]["command"]
