"""Ports on this node: a free one now, and one set per deployment reserved in a registry file so two
deployments starting together never take the same (FastDeploy needs four per deployment, llama.cpp one)."""

import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.serve.process_records import _pid_alive, _read_int


def free_port(host: str = "127.0.0.1", exclude: set[int] | None = None) -> int:
    """A port nothing listens on right now (the OS picks it; ``exclude`` avoids ones already handed out)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if not exclude or port not in exclude:
            return port
    raise RuntimeError("could not find a free port")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# ---- ports: one set per deployment, reserved on the node -------------------------------------------------


@dataclass(frozen=True)
class Ports:
    """The four ports one FastDeploy server listens on (it fails at start when one is taken)."""

    api: int
    metrics: int
    engine_worker_queue: int
    cache_queue: int

    def all(self) -> list[int]:
        return [self.api, self.metrics, self.engine_worker_queue, self.cache_queue]


def port_registry() -> Path:
    """Where deployments on this node mark the ports they hold (one file per port, holding the owner's pid)."""
    return Path(
        os.environ.get("ERNIE_STUDIO_PORT_REGISTRY") or Path(tempfile.gettempdir()) / "ernie-studio-ports"
    )


class PortReservation:
    """Ports held for one deployment until `release`, so deployments planned at the same moment on one node
    never pick the same free port (a port is free to the OS until FastDeploy binds it, minutes later)."""

    def __init__(self, registry: Path | None = None) -> None:
        self.registry = registry or port_registry()
        self.ports: list[int] = []

    def take(self, port: int) -> bool:
        """Hold ``port`` unless another live process holds it."""
        self.registry.mkdir(parents=True, exist_ok=True)
        marker = self.registry / str(port)
        for _ in range(2):
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if _pid_alive(_read_int(marker)):
                    return False
                marker.unlink(missing_ok=True)  # its holder died without releasing it
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            self.ports.append(port)
            return True
        return False

    def release(self) -> None:
        for port in self.ports:
            (self.registry / str(port)).unlink(missing_ok=True)
        self.ports = []


def _usable(port: int, host: str) -> bool:
    # FastDeploy checks its queue ports and binds its metrics server on 0.0.0.0 whatever --host says
    return port_is_free(port, host) and (host == "0.0.0.0" or port_is_free(port, "0.0.0.0"))


def reserve_ports(host: str, api_port: int, registry: Path | None = None) -> tuple[Ports, PortReservation]:
    """The api port asked for plus three free ones, all reserved on this node."""
    reservation = PortReservation(registry)
    if not _usable(api_port, host) or not reservation.take(api_port):
        raise ValueError(f"port {api_port} on {host} is already in use; choose another --port")
    found: list[int] = []
    for _ in range(200):
        if len(found) == 3:
            break
        port = free_port(host, set(found) | {api_port})
        if _usable(port, host) and reservation.take(port):
            found.append(port)
    if len(found) < 3:
        reservation.release()
        raise RuntimeError("could not reserve free ports for FastDeploy")
    return Ports(api_port, *found), reservation
