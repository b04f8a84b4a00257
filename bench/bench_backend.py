"""Job backend benchmarks: queued -> running dispatch latency (Redis vs the embedded filesystem broker),
REST read latency under 50 concurrent clients (SQLite and PostgreSQL, against /health as the baseline),
and the first preview page of a 1 GB JSONL (latency and extra memory, against reading 20 lines by hand).

    python bench/bench_backend.py [--samples 20] [--requests 2000] [--gb 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.serve.ports import free_port  # noqa: E402

DEMO = REPO / "examples" / "data" / "sft_demo.jsonl"
CLI = str(Path(sys.executable).parent / "ernie-studio")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def reachable(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


class Stack:
    """`ernie-studio up --no-ui` (API) and, optionally, a training worker, on a fresh home."""

    def __init__(self, root: Path, env: dict[str, str], worker: bool, api_workers: int = 1) -> None:
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ERNIE_STUDIO_")} | env
        self.env["ERNIE_STUDIO_HOME"] = str(root)
        self.procs = []
        log = open(root.parent / f"{root.name}-api.log", "ab")  # noqa: SIM115
        flags = ["--no-ui", "--workers", str(api_workers)] + ([] if worker else ["--no-worker"])
        self.procs.append(
            subprocess.Popen([CLI, "up", *flags, "--port", str(self.port)], env=self.env, stdout=log, stderr=log,
                             start_new_session=True)
        )  # fmt: skip
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{self.port}/api/v1", timeout=60)
        deadline = time.monotonic() + 120
        while True:
            try:
                if self.api.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the API did not start")
            time.sleep(0.2)

    def upload(self) -> int:
        with open(DEMO, "rb") as f:
            return self.api.post("/datasets", files={"file": ("sft_demo.jsonl", f)}).json()["id"]

    def close(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)


def bench_dispatch(name: str, env: dict[str, str], samples: int, root: Path) -> dict:
    """Create a run on an idle worker, time queued_at -> started_at, cancel it, repeat."""
    stack = Stack(root / name, env, worker=True)
    try:
        ds = stack.upload()
        latencies: list[float] = []
        publish: list[float] = []
        # Wait for the local workers to be up before measuring.
        for i in range(samples + 1):
            run = stack.api.post(
                "/runs", json={"dataset_ids": [ds], "hyperparameters": {"max_steps": 1000}}
            ).json()
            while (r := stack.api.get(f"/runs/{run['id']}").json())["status"] == "queued":
                time.sleep(0.01)
            if i > 0:  # the first one includes worker start-up and building the tiny preset
                queued, sent = (
                    datetime.fromisoformat(r["queued_at"]),
                    datetime.fromisoformat(r["dispatched_at"]),
                )
                started = datetime.fromisoformat(r["started_at"])
                latencies.append((started - queued).total_seconds())
                publish.append((sent - queued).total_seconds())
            stack.api.post(f"/runs/{run['id']}/cancel")
            while stack.api.get(f"/runs/{run['id']}").json()["status"] == "running":
                time.sleep(0.05)
        return {
            "p50": pct(latencies, 50),
            "p99": pct(latencies, 99),
            "n": len(latencies),
            "publish_p50": pct(publish, 50),
            "publish_p99": pct(publish, 99),
        }
    finally:
        stack.close()


async def _load(port: int, paths: list[str], clients: int, total: int) -> list[float]:
    """`clients` keep-alive connections, each sending its share of GETs one after another. A minimal
    HTTP/1.1 client on asyncio streams: the load generator shares the 2 cores and must stay cheap."""
    latencies: list[float] = []
    per_client = total // clients

    async def client(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for k in range(per_client):
                path = paths[(i + k) % len(paths)]
                t0 = time.perf_counter()
                writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1])
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t0)
                assert status == 200, (path, status)
        finally:
            writer.close()

    await asyncio.gather(*(client(i) for i in range(clients)))
    return latencies


def bench_api(name: str, env: dict[str, str], requests: int, root: Path, api_workers: int) -> dict[str, dict]:
    stack = Stack(root / name, env, worker=False, api_workers=api_workers)
    try:
        ds = stack.upload()
        spec = {"dataset_ids": [ds], "hyperparameters": {"max_steps": 100}}
        ids = [stack.api.post("/runs", json=spec).json()["id"] for _ in range(20)]
        # 200 metric points on each run, written the way a worker writes them.
        from studio.config import Settings
        from studio.db import session_factory
        from studio.services import run_lifecycle

        settings = Settings(home=root / name, database_url=env.get("ERNIE_STUDIO_DATABASE_URL", ""))
        with session_factory(settings)() as s:
            for rid in ids:
                run_lifecycle.record_metrics(s, rid, [{"step": k, "loss": 1.0 / k} for k in range(1, 201)])
        reads = [f"/api/v1/runs/{i}" for i in ids] + ["/api/v1/runs", "/api/v1/datasets"]
        reads += [f"/api/v1/runs/{i}/metrics" for i in ids[:5]]
        out = {}
        for label, paths in (
            ("GET /health (baseline)", ["/api/v1/health"]),
            ("reads (runs, metrics, datasets)", reads),
        ):
            asyncio.run(_load(stack.port, paths, 50, 200))  # warm-up
            lat = asyncio.run(_load(stack.port, paths, 50, requests))
            out[label] = {"p50": pct(lat, 50), "p99": pct(lat, 99), "n": len(lat)}
        return out
    finally:
        stack.close()


PREVIEW_CHILD = r"""
import json, sys, time
from pathlib import Path
def rss(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
from studio.config import Settings
from studio.db import session_factory
from studio.services import datasets
import engine.data
settings = Settings(home=sys.argv[1])
mode = sys.argv[2]
before = rss('VmRSS:')
t0 = time.perf_counter()
if mode == 'studio':
    with session_factory(settings)() as s:
        page = datasets.preview_dataset(s, settings, int(sys.argv[3]), 0, 20)
    n = len(page['records'])
else:
    with open(sys.argv[3], encoding='utf-8') as f:
        n = len([json.loads(next(f)) for _ in range(20)])
elapsed = time.perf_counter() - t0
print(json.dumps({'seconds': elapsed, 'extra_mb': rss('VmHWM:') - before, 'records': n}))
"""


def bench_preview(gb: float, root: Path) -> dict[str, dict]:
    from studio.config import Settings
    from studio.db import session_factory
    from studio.migrate import upgrade
    from studio.services import datasets

    settings = Settings(home=root / "preview")
    upgrade(settings)
    staged = datasets.incoming_dir(settings) / f"{uuid.uuid4().hex}-big.jsonl"
    lines = DEMO.read_bytes()
    with open(staged, "wb") as f:
        while f.tell() < gb * 1024**3:
            f.write(lines)
    size = staged.stat().st_size
    t0 = time.perf_counter()
    with session_factory(settings)() as s:
        ds = datasets.create_dataset(s, settings, staged, "big.jsonl", validate=False)
        ds_id, path = ds.id, datasets.dataset_path(settings, ds)
    register_s = time.perf_counter() - t0
    out = {}
    for label, mode, arg in (("read 20 lines by hand (baseline)", "hand", str(path)),
                             ("studio preview, first page", "studio", str(ds_id))):  # fmt: skip
        r = subprocess.run([sys.executable, "-c", PREVIEW_CHILD, str(settings.home), mode, arg],
                           capture_output=True, text=True, check=True, cwd=REPO)  # fmt: skip
        out[label] = json.loads(r.stdout.strip().splitlines()[-1])
    out["_meta"] = {"size_gb": size / 1024**3, "register_s": register_s}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--only", choices=["dispatch", "api", "preview"], default=None)
    args = ap.parse_args()
    run = {"dispatch", "api", "preview"} if args.only is None else {args.only}
    root = Path(tempfile.mkdtemp(prefix="ernie-bench-backend-"))
    rows: list[tuple[str, str, str, str]] = []
    pg_database: str | None = None
    try:
        if "dispatch" in run and reachable(6379):
            import redis

            redis.Redis(port=6379, db=12).flushdb()
            env = {
                "ERNIE_STUDIO_BROKER_URL": "redis://127.0.0.1:6379/12",
                "ERNIE_STUDIO_RESULT_BACKEND": "redis://127.0.0.1:6379/12",
            }
            r = bench_dispatch("dispatch-redis", env, args.samples, root)
            rows.append(
                (
                    "dispatch queued->running, Redis",
                    f"{r['p50'] * 1000:.0f} ms",
                    f"{r['p99'] * 1000:.0f} ms",
                    f"{r['n']} runs; publish p50/p99 {r['publish_p50'] * 1000:.0f}/{r['publish_p99'] * 1000:.0f} ms",
                )
            )
        elif "dispatch" in run:
            rows.append(("dispatch queued->running, Redis", "skipped", "Redis on 6379 unreachable", ""))
        if "dispatch" in run:
            r = bench_dispatch("dispatch-fs", {}, args.samples, root)
            rows.append(
                (
                    "dispatch, embedded filesystem broker (baseline)",
                    f"{r['p50'] * 1000:.0f} ms",
                    f"{r['p99'] * 1000:.0f} ms",
                    f"{r['n']} runs; publish p50/p99 {r['publish_p50'] * 1000:.0f}/{r['publish_p99'] * 1000:.0f} ms",
                )
            )

        dbs = [("SQLite", {})] if "api" in run else []
        if "api" in run and reachable(5432):
            import psycopg

            name = pg_database = f"ernie_bench_{uuid.uuid4().hex[:8]}"
            with psycopg.connect("host=127.0.0.1 user=postgres dbname=test", autocommit=True) as c:
                c.execute(f'CREATE DATABASE "{name}"')
            dbs.append(
                (
                    "PostgreSQL",
                    {"ERNIE_STUDIO_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"},
                )
            )
        for (db, env), procs in [(d, 1) for d in dbs] + [(d, 2) for d in dbs]:
            for label, r in bench_api(f"api-{db}-{procs}", env, args.requests, root, procs).items():
                rows.append(
                    (
                        f"API {label}, 50 clients, {db}, {procs} server process{'es' if procs > 1 else ''}",
                        f"{r['p50'] * 1000:.1f} ms",
                        f"{r['p99'] * 1000:.1f} ms",
                        f"{r['n']} requests",
                    )
                )

        pv = bench_preview(args.gb, root) if "preview" in run else {"_meta": {}}
        meta = pv.pop("_meta")
        for label, r in pv.items():
            rows.append(
                (
                    f"{label}, {meta['size_gb']:.2f} GB JSONL",
                    f"{r['seconds'] * 1000:.1f} ms",
                    "",
                    f"+{r['extra_mb']:.0f} MB peak RSS",
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if pg_database:
            import psycopg

            with psycopg.connect("host=127.0.0.1 user=postgres dbname=test", autocommit=True) as c:
                c.execute(f'DROP DATABASE IF EXISTS "{pg_database}" WITH (FORCE)')

    widths = [max(len(r[i]) for r in [("case", "p50 / time", "p99", "notes"), *rows]) for i in range(4)]
    for r in [("case", "p50 / time", "p99", "notes"), tuple("-" * w for w in widths), *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
