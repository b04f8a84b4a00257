"""Deployments: a model server started by a worker from a run's model or a model dir, and a chat proxy."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jinja2
from pydantic import Field
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from engine.data.paddleocr_vl_processor import TASK_PROMPTS
from engine.models.paddleocr_vl_config import is_paddleocr_vl_dir
from engine.models.paths import architecture_dir
from engine.serve import fastdeploy
from engine.serve.llamacpp import SERVE_GGUF_TYPE
from studio import queue
from studio.config import Settings
from studio.models import Deployment, DeploymentStatus, Export, Run, RunStatus, utcnow
from studio.schemas import RequestModel
from studio.services import jobs
from studio.services.errors import Conflict, InvalidInput, ServiceError, Unavailable
from studio.services.events import add_event
from studio.services.messages import SERVICES, not_succeeded
from studio.services.models import model_dir_for
from studio.services.paths import confine
from studio.services.store import RowId, get_or_404

log = logging.getLogger(__name__)

BACKENDS = ("auto", "paddle", "fastdeploy", "llamacpp")
ACTIVE = (DeploymentStatus.STARTING, DeploymentStatus.RUNNING, DeploymentStatus.STOPPING)


class DeploymentSpec(RequestModel):
    name: str | None = Field(default=None, max_length=200)
    run_id: RowId | None = None
    model: str | None = Field(
        default=None, max_length=1024, description="a name /api/v1/models lists, or a model directory"
    )
    export_id: RowId | None = Field(
        default=None,
        description="a finished export: a checkpoint export's model directory, or a GGUF export's file "
        "(served by llama.cpp)",
    )
    gguf_type: str | None = Field(
        default=None, max_length=16, description="with export_id: which of its GGUF files (default q8_0)"
    )
    backend: str = "auto"


def create_deployment(session: Session, settings: Settings, spec: DeploymentSpec) -> Deployment:
    """Record a deployment and ask a serving worker to start it (LoRA runs are merged by the worker)."""
    dep = new_deployment(session, settings, spec)
    session.commit()
    send_deployment(settings, dep.id)
    return dep


def new_deployment(session: Session, settings: Settings, spec: DeploymentSpec) -> Deployment:
    """The deployment row of ``spec``, checked and added to the session (committed and sent by the caller)."""
    if sum(x is not None for x in (spec.run_id, spec.model, spec.export_id)) != 1:
        raise InvalidInput(
            "give exactly one of run_id (a finished run), model (preset, model dir or run:<id>) or "
            "export_id (a finished export)"
        )
    if spec.backend not in BACKENDS:
        raise InvalidInput(f"backend: {spec.backend!r} is not one of {', '.join(BACKENDS)}")
    if spec.gguf_type is not None and spec.export_id is None:
        raise InvalidInput("gguf_type: picks a file of a GGUF export; give export_id with it")
    run_id = spec.run_id
    if spec.export_id is not None:
        export = get_or_404(session, Export, spec.export_id, "export")
        run_id = export.run_id
        if export.export_format == "gguf":
            model_dir, default_name = gguf_export_file(session, settings, export.id, spec.gguf_type)
            if spec.backend not in ("auto", "llamacpp"):
                raise InvalidInput(
                    f"backend: a GGUF export is served by llama.cpp; give backend llamacpp (or auto), not {spec.backend}"
                )
        else:
            model_dir, default_name = checkpoint_export_dir(settings, export, spec.gguf_type)
    elif spec.run_id is not None:
        run = get_or_404(session, Run, spec.run_id, "run")
        if run.status != RunStatus.SUCCEEDED:
            raise Conflict(not_succeeded("run", run.id, run.status, "deploy"))
        model_dir = str(confine(settings, run.model_dir or run.output_dir, field="run_id"))
        default_name = run.name
    else:
        model_dir = str(model_dir_for(session, settings, spec.model or "", field="model"))
        default_name = Path(model_dir).name
    dep = Deployment(
        name=spec.name or default_name,
        run_id=run_id,
        model_dir=model_dir,
        backend=spec.backend,
        status=DeploymentStatus.STARTING,
    )
    session.add(dep)
    session.flush()
    add_event(session, "deployment.starting", f"deploying {model_dir}", deployment_id=dep.id)
    return dep


def failed_deployment(
    session: Session, name: str, run_id: int | None, model_dir: str, error: str
) -> Deployment:
    """A deployment that could not be made, recorded as failed with the reason (for one made on someone's
    behalf, such as an export's deploy-on-success, where no request is left to refuse)."""
    dep = Deployment(
        name=name, run_id=run_id, model_dir=model_dir, status=DeploymentStatus.FAILED, error=error,
        stopped_at=utcnow(),
    )  # fmt: skip
    session.add(dep)
    session.flush()
    add_event(session, "deployment.failed", error, deployment_id=dep.id)
    return dep


def send_deployment(settings: Settings, deployment_id: int) -> None:
    """Ask a serving worker to start it; on a broker outage the reconciler sends it later."""
    queue.send(settings, queue.DEPLOYMENT_TASK, [deployment_id], queue.SERVE_QUEUE)


def checkpoint_export_dir(settings: Settings, export: Export, gguf_type: str | None) -> tuple[str, str]:
    """(model directory, name) of a succeeded checkpoint export (an elastic member's included)."""
    if gguf_type is not None:
        raise InvalidInput(
            f"gguf_type: export {export.id} is a {export.layout} checkpoint, not a GGUF export; leave it out"
        )
    if export.status != RunStatus.SUCCEEDED:
        raise Conflict(not_succeeded("export", export.id, export.status, "deploy", "export_id"))
    path = confine(settings, export.export_dir, field="export_id")
    if not (path / "config.json").is_file():
        raise Conflict(f"export_id: export {export.id}'s model directory {path} is gone; export again")
    return str(path), path.name


def gguf_export_file(
    session: Session, settings: Settings, export_id: int, gguf_type: str | None
) -> tuple[str, str]:
    """(path, name) of the GGUF file of type ``gguf_type`` (default: the serving type, else the export's
    first) of a succeeded GGUF export."""
    export = get_or_404(session, Export, export_id, "export")
    if export.status != RunStatus.SUCCEEDED or not export.gguf_files:
        raise Conflict(not_succeeded("export", export_id, export.status, "deploy"))
    files = {f["type"]: f["path"] for f in export.gguf_files}
    wanted = gguf_type or (SERVE_GGUF_TYPE if SERVE_GGUF_TYPE in files else next(iter(files)))
    if wanted not in files:
        raise InvalidInput(f"gguf_type: export {export_id} holds {', '.join(files)}, not {wanted!r}")
    path = confine(settings, files[wanted], field="export_id")
    if not path.is_file():
        raise Conflict(f"export {export_id}'s {wanted} file {path} is gone; export again")
    return str(path), f"{Path(export.export_dir).name}-{wanted}"


def record_backend_choice(session: Session, deployment_id: int, backend: str, why: str) -> None:
    """The serving engine a worker chose for a deployment, and why, as one of its events."""
    add_event(
        session,
        "deployment.backend",
        f"backend {backend}: {why}",
        deployment_id=deployment_id,
        data={"backend": backend, "reason": why},
    )
    session.commit()


def list_deployments(session: Session, *, active_only: bool = False) -> list[Deployment]:
    q = select(Deployment).order_by(Deployment.id.desc())
    if active_only:
        q = q.where(Deployment.status.in_([s.value for s in ACTIVE]))
    return list(session.scalars(q).all())


def get_deployment(session: Session, deployment_id: int) -> Deployment:
    return get_or_404(session, Deployment, deployment_id, "deployment")


def stop_deployment(session: Session, deployment_id: int) -> Deployment:
    """Ask the worker holding the server to stop it; a deployment that never started is stopped at once."""
    dep = get_deployment(session, deployment_id)
    if dep.status in (DeploymentStatus.STOPPED, DeploymentStatus.FAILED):
        return dep
    now = utcnow()
    if dep.pid is None and dep.status == DeploymentStatus.STARTING and dep.worker is None:
        n = session.execute(
            update(Deployment)
            .where(Deployment.id == dep.id, Deployment.worker.is_(None))
            .values(status=DeploymentStatus.STOPPED, stop_requested=True, stopped_at=now)
        ).rowcount
        if n:
            add_event(session, "deployment.stopped", "stopped before it started", deployment_id=dep.id)
            session.commit()
            session.refresh(dep)
            return dep
    session.execute(
        update(Deployment)
        .where(Deployment.id == dep.id)
        .values(stop_requested=True, status=DeploymentStatus.STOPPING)
    )
    add_event(session, "deployment.stopping", "stop requested", deployment_id=dep.id)
    session.commit()
    session.refresh(dep)
    return dep


def delete_deployment(session: Session, deployment_id: int) -> None:
    """Remove a stopped or failed deployment from the list."""
    dep = get_deployment(session, deployment_id)
    if dep.status in ACTIVE:
        raise Conflict(SERVICES("deployment_active", id=deployment_id, status=str(dep.status)))
    session.delete(dep)
    session.commit()


def model_reads_images(model_dir: str | Path) -> bool:
    """Whether the model in ``model_dir`` takes images: its config.json (a LoRA run's base's) has a
    ``vision_config``, which is what makes the model server accept ``image_url`` parts."""
    try:
        config = _read_json(architecture_dir(model_dir) / "config.json")
    except FileNotFoundError:
        return False
    return config is not None and config.get("vision_config") is not None


def deployment_reads_images(session: Session, deployment_id: int) -> bool:
    """Whether a chat with this deployment may carry images (its model is an ERNIE 4.5 VL model)."""
    return model_reads_images(get_deployment(session, deployment_id).model_dir)


def model_task_prompts(model_dir: str | Path) -> list[str]:
    """The task prompts the model was trained with, when it is a PaddleOCR-VL model ("OCR:", "Table
    Recognition:", ...: the engine's ``TASK_PROMPTS``); empty for any other model."""
    try:
        ocr = is_paddleocr_vl_dir(architecture_dir(model_dir))
    except FileNotFoundError:
        return []
    return list(TASK_PROMPTS.values()) if ocr else []


def deployment_task_prompts(session: Session, deployment_id: int) -> list[str]:
    """The task prompts Deploy & Chat offers for this deployment (a PaddleOCR-VL model's), else none."""
    return model_task_prompts(get_deployment(session, deployment_id).model_dir)


def answered_message(deployment_id: int, status: int, content: bytes) -> str:
    """A model server's refusal as a person reads it: the message of an OpenAI-shaped error body
    (``{"error": {"message": ...}}``), else the body's first 500 characters."""
    shown = content[:500].decode(errors="replace")
    try:
        error = json.loads(content).get("error")
        shown = error["message"] if isinstance(error, dict) and isinstance(error["message"], str) else shown
    except (ValueError, AttributeError, KeyError, TypeError):
        pass
    return f"deployment {deployment_id} answered {status}: {shown}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def chat_url(session: Session, deployment_id: int) -> str:
    dep = get_deployment(session, deployment_id)
    if dep.status != DeploymentStatus.RUNNING or not dep.url:
        raise Conflict(SERVICES("deployment_not_running", id=deployment_id, status=str(dep.status)))
    return dep.url.rstrip("/") + "/chat/completions"


def prepare_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """Check an OpenAI chat request enough to give a clear error before proxying it."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("messages: give a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise InvalidInput(f"messages[{i}].role: must be one of system, user, assistant, tool")
    return {"model": "default", **body}


def fit_to_backend(
    body: dict[str, Any], backend: str | None, model_dir: str | Path | None = None
) -> dict[str, Any]:
    """The request fields the deployment's server reads (``model_dir``: the deployment's model, which a
    FastDeploy request needs: its prompt length caps ``min_tokens``, a VL model gets thinking off unless
    asked; see engine.serve.fastdeploy.fit_chat_request)."""
    if backend != "fastdeploy":
        return body
    if model_dir is None:
        raise ValueError("a FastDeploy chat request is fitted to its model: give model_dir")
    try:
        prompt = fastdeploy.prompt_tokens(model_tokenizer_dir(model_dir), body.get("messages") or [])
    except (ValueError, jinja2.TemplateError) as e:  # what the model's chat template refuses
        raise InvalidInput(f"messages: the model's chat template cannot render them: {e}") from None
    return fastdeploy.fit_chat_request(body, prompt_tokens=prompt, is_vl=model_reads_images(model_dir))


def model_tokenizer_dir(model_dir: str | Path) -> Path:
    """Where the deployment's tokenizer is: the model directory, or a LoRA run's base."""
    d = Path(model_dir)
    return d if (d / "tokenizer.model").exists() else architecture_dir(d)


def model_thinks(model_dir: str | Path) -> bool:
    """Whether the model can think (its vocabulary holds ``</think>``): Deploy & Chat then offers the choice."""
    try:
        return fastdeploy.thinks(model_tokenizer_dir(model_dir))
    except FileNotFoundError:
        return False


def deployment_thinks(session: Session, deployment_id: int) -> bool:
    """Whether a chat with this deployment may ask for thinking (a thinking model)."""
    return model_thinks(get_deployment(session, deployment_id).model_dir)


def chat(
    session: Session, deployment_id: int, body: dict[str, Any], timeout: float = 300.0
) -> dict[str, Any]:
    """One non-streaming chat completion through the deployment (for the UI and scripts)."""
    url = chat_url(session, deployment_id)
    dep = get_deployment(session, deployment_id)
    payload = fit_to_backend(prepare_chat_body({**body, "stream": False}), dep.backend, dep.model_dir)
    try:
        r = httpx.post(url, json=payload, timeout=timeout)
    except httpx.HTTPError as e:
        raise Unavailable(SERVICES("deployment_no_answer", id=deployment_id, url=url, error=str(e))) from None
    if r.status_code >= 400:
        raise ServiceError(answered_message(deployment_id, r.status_code, r.content))
    return r.json()


def chat_stream(
    session: Session, deployment_id: int, body: dict[str, Any], timeout: float = 300.0
) -> ChatStream:
    """The text deltas of a streamed chat completion (for the UI).

    The deployment is looked up now; the returned stream no longer needs ``session``, so a long reply
    does not hold a database connection.
    """
    url = chat_url(session, deployment_id)
    dep = get_deployment(session, deployment_id)
    payload = fit_to_backend(prepare_chat_body({**body, "stream": True}), dep.backend, dep.model_dir)
    return ChatStream(deployment_id, url, payload, timeout)


class ChatStream:
    """The text deltas of one streamed chat completion, iterated once.

    :meth:`close` may be called from any thread, also while the stream is suspended between deltas (a
    Gradio handler whose event was cancelled is never resumed) or another thread is reading it: the
    connection closes there and then, so the model server stops generating, and a reader ends quietly.
    """

    def __init__(self, deployment_id: int, url: str, payload: dict[str, Any], timeout: float):
        self.deployment_id = deployment_id
        self._url, self._payload, self._timeout = url, payload, timeout
        self._lock = threading.Lock()
        self._response: httpx.Response | None = None
        self.closed = False

    def __iter__(self) -> Iterator[str]:
        with httpx.stream("POST", self._url, json=self._payload, timeout=self._timeout) as r:
            with self._lock:
                if self.closed:
                    return
                self._response = r
            if r.status_code >= 400:
                raise ServiceError(answered_message(self.deployment_id, r.status_code, r.read()))
            try:
                yield from _deltas(r.iter_lines())
            except Exception:
                if self.closed:  # closed from another thread mid-read: the end the closer asked for
                    return
                raise

    def close(self) -> None:
        with self._lock:
            self.closed = True
            response = self._response
        if response is not None:
            response.close()


def _deltas(lines: Iterator[str]) -> Iterator[str]:
    """The content deltas of an OpenAI server-sent event stream, up to its ``[DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        for choice in chunk.get("choices", []):
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                yield delta


# ---- state transitions made by the serving worker ------------------------------------------------------


def claim_deployment(session: Session, deployment_id: int, worker: str, node: str) -> Deployment | None:
    # A deployment stays "starting" until its server answers; claiming it only names its worker and node.
    n = jobs.take(
        session, Deployment, deployment_id, worker, held_in=DeploymentStatus.STARTING,
        only_if=(Deployment.worker.is_(None), Deployment.stop_requested.is_(False)),
        status=DeploymentStatus.STARTING, node=node,
    )  # fmt: skip
    session.commit()
    return session.get(Deployment, deployment_id) if n else None


def mark_deployment(session: Session, deployment_id: int, **values: Any) -> None:
    session.execute(update(Deployment).where(Deployment.id == deployment_id).values(**values))
    status = values.get("status")
    if status:
        add_event(
            session, f"deployment.{status}", values.get("error") or str(status), deployment_id=deployment_id
        )
    session.commit()


def deployment_heartbeat(session: Session, deployment_id: int) -> bool:
    """Record liveness; True when a stop was requested."""
    session.execute(update(Deployment).where(Deployment.id == deployment_id).values(heartbeat_at=utcnow()))
    session.commit()
    return bool(session.scalar(select(Deployment.stop_requested).where(Deployment.id == deployment_id)))
