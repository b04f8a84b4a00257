"""docker-compose.yml (no Docker engine here): the services, their healthchecks, volumes and GPU
reservations are there, and every command the compose file runs is one our CLI accepts."""

from __future__ import annotations

import yaml
from studio_helpers import REPO

from engine.cli import build_parser

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
