"""Studio settings, read from ``ERNIE_STUDIO_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

import ipaddress
import os
import socket
from functools import lru_cache
from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.llamacpp import CPU_SERVING, cpu_serving
from engine.train.options import MAX_DEVICES

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


class Settings(BaseSettings):
    """Everything the API, the UI and the workers need to find the store, the queue and the artifacts."""

    model_config = SettingsConfigDict(env_prefix="ERNIE_STUDIO_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path("~/.ernie-studio"))
    # Defaults are filled in from `home` below so one variable moves everything.
    database_url: str = ""
    broker_url: str = ""
    result_backend: str = ""
    token: str | None = None
    # Without a token the studio answers only loopback Host names and pages of its own origin; a proxy in
    # front of it names its host and origin here (comma-separated), e.g. studio.example.com and
    # https://studio.example.com. With a token, a non-empty host list still limits the names answered.
    allowed_hosts: str = ""
    allowed_origins: str = ""
    max_upload_mb: int = 1024
    # A zip upload (a VL dataset with its images) may hold this many files at most.
    max_archive_members: int = 10_000
    node_name: str = Field(default_factory=lambda: socket.gethostname().split(".")[0] or "local")
    # GPU indices on this node ("0,1"); empty means a CPU-only node.
    gpus: str = ""
    # Devices each training worker owns and a run may ask for (`num_devices`): on a GPU node, `up` splits
    # `gpus` into groups of this many, one worker each; on a CPU-only node, the gloo processes the node's
    # training worker may start for one run.
    worker_devices: int = Field(default=1, ge=1, le=MAX_DEVICES)
    # A run over several nodes (`num_nodes`): the address the other nodes reach this node's launcher
    # rendezvous at (empty: the address the host name resolves to), and how long the parts of an attempt
    # wait for each other once one was claimed before they release their claims and the run is requeued.
    node_address: str = Field(default="", max_length=255)
    gang_timeout_s: float = Field(default=300.0, gt=0)
    # A run over several nodes is requeued when a node loses its ranks (a kill, a dead node); after this many
    # such requeues in a row with no new checkpoint between them (the same rank killed for lack of memory,
    # say), the next loss fails the run instead, with the reason. A person's resume starts a new count.
    lost_rank_retries: int = Field(default=3, ge=0)
    # Runs not heartbeating for this long are considered orphaned by the reconciler.
    stale_after_s: float = 30.0
    # Grace between SIGTERM and SIGKILL when cancelling a child process.
    kill_grace_s: float = 3.0
    # Training and export processes start this much nicer than the worker (0-19): on a machine that also
    # serves the studio they yield the CPU to API reads and chat instead of starving them; alone on a node
    # they still get every idle cycle.
    batch_niceness: int = Field(default=10, ge=0, le=19)
    # Model folders besides home/models (`:`-separated, e.g. /mnt/models:/srv/hf): their model directories
    # are listed by /api/v1/models and the Train tab's picker under their folder name, and may be trained
    # on, deployed and used for dataset stats by that name or by path. Every other path must be under home.
    model_roots: str = Field(
        default="",
        description="extra folders of model directories (':'-separated), listed and accepted by name",
    )
    # Model servers bind here; the API reaches them at serve_advertise_host (defaults to serve_host).
    serve_host: str = "127.0.0.1"
    serve_advertise_host: str = ""
    # Seconds a model server may take to answer /health before the deployment is marked failed.
    serve_start_timeout_s: float = 600.0
    # FastDeploy servers a serving worker holds per GPU it sees; each takes 0.9 / this of the GPU's memory.
    fastdeploy_per_gpu: int = 1
    # What a deployment's `auto` backend serves a text model with on this node when it has no GPU and
    # llama.cpp is installed (`make llamacpp`, ERNIE_STUDIO_LLAMACPP_BIN or PATH): llama.cpp, from a GGUF
    # written at the first deployment and reused (engine.llamacpp.CPU_SERVING_ENV), or the built-in server.
    cpu_serving: str = CPU_SERVING[0]
    # How often a sweep's driver reads its trials' evaluations (pruning) and starts the next trials.
    sweep_poll_s: float = Field(default=5.0, gt=0)
    # How often a worker re-sends runs the broker never got and requeues runs of dead workers.
    reconcile_interval_s: float = 10.0
    # Every worker reports itself in the `nodes` table this often; one silent for node_offline_after_s is
    # shown offline. Its start-up doctor (`ernie-studio doctor --json`) may take doctor_timeout_s.
    node_heartbeat_s: float = Field(default=10.0, gt=0)
    node_offline_after_s: float = Field(default=60.0, gt=0)
    doctor_timeout_s: float = Field(default=300.0, gt=0)
    # A worker starting on a node whose facts, floors and engine are unchanged reuses a passing doctor report
    # at most this old (crash loops, redeploys, several workers per node); 0 runs the checks every start.
    doctor_reuse_s: float = Field(default=600.0, ge=0)

    @field_validator("node_address")
    @classmethod
    def _ipv4_node_address(cls, v: str) -> str:
        # The launcher takes its node's address only as an IPv4 address (`--host` needs a dot).
        if v:
            try:
                ipaddress.IPv4Address(v)
            except ValueError:
                raise ValueError(f"ERNIE_STUDIO_NODE_ADDRESS: {v!r} is not an IPv4 address") from None
        return v

    @field_validator("cpu_serving")
    @classmethod
    def _known_cpu_serving(cls, v: str) -> str:
        return cpu_serving(v)  # the engine's one check: llamacpp or paddle, named when neither

    @field_validator("home", mode="before")
    @classmethod
    def _expand_home(cls, v: object) -> Path:
        return Path(os.path.expanduser(str(v))).resolve()

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{self.home / 'studio.db'}"
        if not self.broker_url:
            self.broker_url = "filesystem://"
        if not self.result_backend:
            self.result_backend = f"db+sqlite:///{self.home / 'celery-results.db'}"
        if self.max_upload_mb <= 0:
            raise ValueError(f"ERNIE_STUDIO_MAX_UPLOAD_MB must be positive, got {self.max_upload_mb}")
        return self

    @property
    def allowed_host_names(self) -> set[str]:
        return {h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip()}

    @property
    def allowed_origin_urls(self) -> set[str]:
        return {o.strip().lower().rstrip("/") for o in self.allowed_origins.split(",") if o.strip()}

    # ---- derived paths -------------------------------------------------------------------------
    @property
    def datasets_dir(self) -> Path:
        return self.home / "datasets"

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def deployments_dir(self) -> Path:
        return self.home / "deployments"

    @property
    def broker_dir(self) -> Path:
        return self.home / "broker"

    @property
    def max_upload_bytes(self) -> int:
        return self.max_upload_mb * 1024 * 1024

    @property
    def gpu_indices(self) -> list[int]:
        return [int(x) for x in self.gpus.replace(" ", "").split(",") if x != ""]

    @property
    def device_groups(self) -> list[list[int]]:
        """The device groups of this node, one training worker each: `gpus` in groups of `worker_devices`
        (a short last group keeps the leftover GPUs), or one group of `worker_devices` CPU processes."""
        gpus, k = self.gpu_indices, self.worker_devices
        if not gpus:
            return [list(range(k))]
        return [gpus[i : i + k] for i in range(0, len(gpus), k)]

    @property
    def extra_model_roots(self) -> list[Path]:
        return [Path(os.path.expanduser(p)).resolve() for p in self.model_roots.split(os.pathsep) if p]

    @property
    def uses_embedded_broker(self) -> bool:
        return self.broker_url.startswith("filesystem://")

    def ensure_dirs(self) -> None:
        for d in (self.home, self.datasets_dir, self.runs_dir, self.models_dir, self.deployments_dir):
            d.mkdir(parents=True, exist_ok=True)
        if self.uses_embedded_broker:
            (self.broker_dir / "processed").mkdir(parents=True, exist_ok=True)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings; tests build their own `Settings(...)` instead of using this."""
    return Settings()
