"""Deploy & Chat tab: deploy a finished run in one click, watch its status, and chat with streaming."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd

from studio.models import RunStatus
from studio.services import deployments as deployments_svc
from studio.services import runs as runs_svc
from studio.services.errors import ServiceError
from studio.ui.chat_messages import (
    chat_messages,
    clear_choice,
    empty_chat,
    thinking_fields,
    user_turn,
    with_task_prompt,
)
from studio.ui.context import SentValues, UIContext, echo, fmt_time, parse_id, refusal
from studio.ui.i18n import DEFAULT_LANGUAGE, Texts, current_language, localize_message, status_text, text
from studio.ui.sampling import sampling_controls, sampling_params

DEPLOYMENT_COLUMNS = ["id", "name", "status", "backend", "url", "model", "started"]
STATUS_ICONS = {"starting": "⏳", "running": "🟢", "failed": "❌", "stopping": "⏹️", "stopped": "⚪"}
POLL_SECONDS = 2.0
# A streamed reply reaches the page a few times a second, not once per token: the browser renders the whole
# message (markdown) again on every update, and one update per token kept a 1,000-token reply's page busy for
# 10-20 s. The pause grows with the reply, as each render costs more (on a loaded 2-core node a 2,000-
# character reply took up to 0.8 s to render).
STREAM_UPDATE_S = 0.2
STREAM_UPDATE_MAX_S = 1.0
STREAM_CHARS_PER_EXTRA_S = 8000


def update_pause(shown_chars: int) -> float:
    """Seconds between two updates of a streaming reply that already shows ``shown_chars`` characters."""
    return min(STREAM_UPDATE_S + shown_chars / STREAM_CHARS_PER_EXTRA_S, STREAM_UPDATE_MAX_S)


# Keeps ?deployment=N in the address bar in step with the picked deployment, so a reload shows it again.
URL_JS = """(depId) => {
  const url = new URL(window.location.href);
  if (depId === null || depId === undefined || depId === "") { url.searchParams.delete("deployment"); }
  else { url.searchParams.set("deployment", String(depId)); }
  window.history.replaceState(null, "", url.toString());
  return depId;
}"""


@dataclass
class DeployTab:
    tab: gr.Tab
    run: gr.Dropdown
    selected: gr.Dropdown
    timer: gr.Timer
    refresh_fn: Any  # (run, deployment) -> updates of refresh_outputs
    refresh_outputs: list[Any]


def deployment_choices(deps: list[Any], lang: str = DEFAULT_LANGUAGE) -> list[tuple[str, int]]:
    return [(f"#{d.id} {d.name} · {status_text(d.status, lang)}", d.id) for d in deps]


def deployment_rows(deps: list[Any], lang: str = DEFAULT_LANGUAGE) -> pd.DataFrame:
    rows = [
        [
            d.id,
            d.name,
            f"{STATUS_ICONS.get(d.status, '')} {status_text(d.status, lang)}",
            d.backend,
            d.url or "",
            d.model_dir,
            fmt_time(d.started_at),
        ]
        for d in deps
    ]
    return pd.DataFrame(rows, columns=DEPLOYMENT_COLUMNS)


def deployment_status(dep: Any, lang: str = DEFAULT_LANGUAGE) -> str:
    icon = STATUS_ICONS.get(dep.status, "")
    shown = f"**{icon} #{dep.id} {dep.name} — {status_text(dep.status, lang)}**"
    if dep.status == "starting":  # not yet answering: say whether a serve worker has it
        shown += (
            text("dep.msg.taken", lang, worker=dep.worker) if dep.worker else text("dep.msg.no_worker", lang)
        )
    if dep.backend and dep.backend != "auto":  # the engine the worker chose (its reason is an event)
        shown += f" · {dep.backend}"
    if dep.url:
        shown += text("dep.msg.endpoint", lang, url=dep.url)
    if dep.error:
        shown += f"\n\n❌ `{dep.error.strip().splitlines()[-1][:400]}`"
    return shown


def wanted_deployment(deps: list[Any], *candidates: Any, run_id: Any = None) -> int | None:
    """The deployment to show: the first candidate (dropdown, ?deployment=N, browser storage) that still
    exists, else a running deployment of ``run_id`` (?run=N), else the newest running one."""
    known = {d.id for d in deps}
    for candidate in candidates:
        did = parse_id(candidate)
        if did in known:
            return did
    running = [d for d in deps if d.status == RunStatus.RUNNING.value]
    rid = parse_id(run_id)
    of_run = [d for d in running if rid is not None and getattr(d, "run_id", None) == rid]
    pick = max(of_run or running, key=lambda d: d.id, default=None)
    return pick.id if pick is not None else None


# How many page loads' address deployments DeployHandlers keeps for their first tab select.
LINKED_SESSIONS = 1000


def _url_params(request: gr.Request | None) -> tuple[Any, Any]:
    """(?deployment=N, ?run=N) of the page's address."""
    if request is None:
        return None, None
    return request.query_params.get("deployment"), request.query_params.get("run")


class DeployHandlers:
    """The Deploy & Chat tab's event handlers: component values in, plain values out."""

    def __init__(self, ctx: UIContext):
        self.ctx = ctx
        # The reply each browser session is streaming, by Gradio session hash: Stop closes it from its own
        # request, so the model server stops whether or not the streaming handler is ever resumed (Stop
        # also cancels that handler, and Gradio does not resume a cancelled one).
        self._replies: dict[str, deployments_svc.ChatStream] = {}
        self._lock = threading.Lock()
        self._sent = SentValues()
        # The deployment a page was opened on by its address (?tab=deploy&deployment=N), by session, until
        # that page's first tab select: opening the tab programmatically on load selects it, and that select
        # (which prefers browser storage, see on_select) raced the load's restore of the address's deployment
        # and could show the one stored by an earlier visit instead.
        self._linked: OrderedDict[str, Any] = OrderedDict()

    def refresh(self, run_value: Any, current: Any, *candidates: Any, run_id: Any = None) -> tuple[Any, ...]:
        """(finished-run dropdown, deployments table, deployment dropdown, status) keeping valid picks;
        with nothing picked, the first of ``candidates`` that exists, else a running deployment."""
        lang = current_language()
        finished = self.ctx.read(runs_svc.list_runs, status=RunStatus.SUCCEEDED.value, default=[])
        deps = self.ctx.read(deployments_svc.list_deployments, default=[])
        if parse_id(current) is None and not candidates and run_id is None:
            value = None
        else:
            value = wanted_deployment(deps, current, *candidates, run_id=run_id)
        dep = next((d for d in deps if d.id == value), None)
        run_keep = parse_id(run_value)
        return (
            gr.update(
                choices=[(f"#{r.id} {r.name}", r.id) for r in finished],
                value=run_keep if run_keep in {r.id for r in finished} else None,
            ),
            deployment_rows(deps, lang),
            gr.update(choices=deployment_choices(deps, lang), value=value),
            deployment_status(dep, lang) if dep else "",
        )

    def restore(self, run_value: Any, saved: Any, request: gr.Request) -> tuple[Any, ...]:
        """On page load: the deployment in ?deployment=N, else the one in browser storage, else a running
        deployment of ?run=N, else the newest running one."""
        self._sent.forget(request)
        url_dep, url_run = _url_params(request)
        session = getattr(request, "session_hash", None)
        if session and url_dep is not None and request.query_params.get("tab") == "deploy":
            with self._lock:
                self._linked[session] = url_dep
                while len(self._linked) > LINKED_SESSIONS:
                    self._linked.popitem(last=False)
        return self.refresh(run_value, None, url_dep, saved, run_id=url_run)

    def pick(self, run_value: Any, current: Any, request: gr.Request | None = None) -> tuple[Any, ...]:
        """:meth:`refresh` for an event other than the tick (a pick, a deployment opened from elsewhere)."""
        self._sent.forget(request)
        self._drop_link(request)
        return self.refresh(run_value, current)

    def _drop_link(self, request: gr.Request | None) -> None:
        """The page's address deployment no longer decides its next tab select (it was shown and then the
        person or a tick moved on: the select that raced the load had come first)."""
        session = getattr(request, "session_hash", None)
        if session:
            with self._lock:
                self._linked.pop(session, None)

    def on_select(
        self, run_value: Any, current: Any, saved: Any, request: gr.Request | None
    ) -> tuple[Any, ...]:
        """Opening the tab shows the remembered deployment (a deployment just started elsewhere, as the
        Runs tab's deploy buttons open it), else the shown one, else as :meth:`restore`. The dropdown's own
        picks are remembered as they happen, so the two differ only while such a switch is on its way: the
        dropdown still shows the deployment picked before it."""
        self._sent.forget(request)
        url_dep, url_run = _url_params(request)
        session = getattr(request, "session_hash", None)
        with self._lock:
            linked = self._linked.pop(session, None) if session else None
        if linked is not None:  # the page's load-time select: the address wins, as in restore
            return self.refresh(run_value, linked, saved, current, run_id=url_run)
        return self.refresh(run_value, saved, current, url_dep, run_id=url_run)

    def relabel(self, current: Any, run_value: Any) -> tuple[Any, ...]:
        """After a language switch: the table, choices and status line in the new language (values kept)."""
        run_u, rows, dep_u, md = self.refresh(run_value, current)
        run_u.pop("value", None)
        dep_u.pop("value", None)
        return run_u, rows, dep_u, md

    def tick(
        self, run_value: Any, current: Any, saved: Any, shown: list | None, request: gr.Request
    ) -> tuple[Any, ...]:
        """The timer's refresh: as :meth:`refresh`, plus the choices now shown."""
        # As in the Runs tab: a tick never overrides a value the dropdowns already have (it may be stale by
        # the time it lands), fills an empty deployment as a page load does, and skips unchanged choices.
        self._drop_link(request)
        url_dep, url_run = _url_params(request)
        run_u, rows, dep_u, md = self.refresh(run_value, current, url_dep, saved, run_id=url_run)
        sig = [[list(c) for c in run_u["choices"]], [list(c) for c in dep_u["choices"]]]
        same = shown is not None and sig == shown
        if parse_id(run_value) is not None or same:
            run_u.pop("value", None)
        if parse_id(current) is not None:
            dep_u.pop("value", None)
        run_out = gr.skip() if same else run_u
        dep_out = gr.skip() if same and parse_id(current) is not None else dep_u
        # and of the rest only what changed since this session's last tick (every value re-renders the page)
        return self._sent.changed(request, (run_out, rows, dep_out, md, sig))

    def deploy(
        self, run_id: Any, backend: str | None = "auto", request: gr.Request | None = None
    ) -> tuple[Any, ...]:
        """(table, deployment dropdown, status, browser state) after starting a deployment of ``run_id``
        with ``backend`` (auto: the worker picks, and the deployment shows what it took)."""
        lang = current_language()
        rid = parse_id(run_id)
        if rid is None:
            raise refusal(text("dep.err.no_run", lang))
        spec = deployments_svc.DeploymentSpec(run_id=rid, backend=backend or "auto")
        dep = self.ctx.call(deployments_svc.create_deployment, self.ctx.settings, spec)
        gr.Info(text("dep.msg.starting", lang, id=dep.id))
        self._sent.forget(request)
        return (*self.refresh(rid, dep.id)[1:], dep.id)

    def stop(self, current: Any, request: gr.Request | None = None) -> str:
        self._sent.forget(request)
        lang = current_language()
        did = parse_id(current)
        if did is None:
            raise refusal(text("dep.err.no_stop", lang))
        return deployment_status(self.ctx.call(deployments_svc.stop_deployment, did), lang)

    def take_turn(
        self, message: dict[str, Any] | None, history: list[dict[str, Any]], dep_id: Any
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """:func:`user_turn` for the picked deployment, which decides whether images may come along."""
        lang = current_language()
        did = parse_id(dep_id)
        if did is None:
            raise refusal(text("dep.err.no_deployment", lang))
        # Checked before the message leaves the box: a deployment that is not running keeps it there.
        self.ctx.call(deployments_svc.chat_url, did)
        reads_images = self.ctx.call(deployments_svc.deployment_reads_images, did)
        return user_turn(message, history or [], reads_images, lang)

    def check_turn(self, message: dict[str, Any] | None, history: list[dict[str, Any]], dep_id: Any) -> None:
        """Refuse, with a notice saying why, a turn :meth:`take_turn` would refuse (wired with no outputs, so
        a refusal leaves the chat and the message box in view instead of covering them with an error)."""
        self.take_turn(message, history, dep_id)

    def image_input(self, dep_id: Any) -> tuple[Any, Any, Any]:
        """(message box, "reads images" note, "text only" note) for the picked deployment: the box offers 📎
        only when the deployment's model reads images."""
        did = parse_id(dep_id)
        reads = did is not None and self.ctx.read(deployments_svc.deployment_reads_images, did, default=False)
        return (
            gr.update(sources=["upload"] if reads else []),
            gr.update(visible=reads),
            gr.update(visible=did is not None and not reads),
        )

    def task_prompt_input(self, dep_id: Any) -> Any:
        """The task prompts (PaddleOCR-VL's "OCR:", "Table Recognition:", ...), offered only when the picked
        deployment's model was trained with them; none chosen."""
        did = parse_id(dep_id)
        prompts = (
            [] if did is None else self.ctx.read(deployments_svc.deployment_task_prompts, did, default=[])
        )
        return gr.update(choices=prompts, value=None, visible=bool(prompts))

    def thinking_input(self, dep_id: Any) -> Any:
        """The thinking choice, offered (unticked) only when the picked deployment's model can think."""
        did = parse_id(dep_id)
        thinks = did is not None and self.ctx.read(deployments_svc.deployment_thinks, did, default=False)
        return gr.update(visible=thinks, value=False)

    def bot_turn(
        self,
        history: list[dict[str, Any]],
        dep_id: Any,
        sys_prompt: str,
        temperature: float,
        top_p: float,
        max_tokens: float,
        seed: float | None,
        ignore_eos: bool,
        thinking: bool = False,
        request: gr.Request | None = None,
    ) -> Iterator[list[dict[str, Any]]]:
        """Stream the deployment's reply into the history's last message, a few updates a second
        (:func:`update_pause`).

        Stop ends it at the next token and closes the request, so the model server stops generating. A
        failure is written into the reply and shown as a notice; the asked message stays in the chat.
        """
        lang = current_language()
        session = getattr(request, "session_hash", None) or ""
        did = parse_id(dep_id)
        if did is None:
            raise refusal(text("dep.err.no_deployment", lang))
        sampling = {
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "seed": seed,
            "ignore_eos": ignore_eos,
        }
        body = {
            "messages": chat_messages(sys_prompt, history, lang),
            **sampling_params(sampling),
            **thinking_fields(thinking),
        }
        history = [*history, {"role": "assistant", "content": ""}]
        shown_at = 0.0
        reply: deployments_svc.ChatStream | None = None
        try:
            reply = self.ctx.call(deployments_svc.chat_stream, did, body)
            with self._lock:
                self._replies[session] = reply
            for delta in reply:
                history[-1]["content"] += delta
                now = time.monotonic()
                if now - shown_at >= update_pause(len(history[-1]["content"])):
                    shown_at = now
                    yield history
            if not history[-1]["content"] and not reply.closed:  # ended at once (EOS first), not stopped
                history[-1]["content"] = text("dep.msg.empty_reply", lang)
        except (gr.Error, ServiceError, OSError) as e:
            message = getattr(e, "message", None) or str(e)
            notice = text("dep.err.reply_failed", lang, message=localize_message(message, lang))
            gr.Warning(notice, duration=None)
            history[-1]["content"] += f"\n\n⚠️ {notice}"
        finally:
            if reply is not None:
                reply.close()  # ends the HTTP request, so the model server stops generating
                with self._lock:
                    if self._replies.get(session) is reply:
                        del self._replies[session]
        yield history

    def stop_reply(self, request: gr.Request) -> None:
        """Stop: the reply streaming in this browser session ends now, and its request to the model server
        with it."""
        session = getattr(request, "session_hash", None) or ""
        with self._lock:
            reply = self._replies.pop(session, None)
        if reply is not None:
            reply.close()


# ---- layout ----------------------------------------------------------------------------------------------


def _deployments_panel(t: Texts) -> dict[str, Any]:
    """Run to deploy, the deployments table, the deployment picker and its status."""
    with gr.Row(equal_height=True):
        run = t.make(gr.Dropdown, "dep.run", choices=[], elem_id="dep-run", scale=4)
        backend = t.make(
            gr.Dropdown,
            "dep.backend",
            choices=list(deployments_svc.BACKENDS),
            value="auto",
            elem_id="dep-backend",
            scale=2,
        )
        deploy = t.make(gr.Button, "dep.btn", prop="value", variant="primary", elem_id="dep-btn", scale=1)
    table = t.make(
        gr.Dataframe,
        "dep.table",
        headers=DEPLOYMENT_COLUMNS,
        interactive=False,
        elem_id="dep-table",
        wrap=True,
        max_height=200,
    )
    with gr.Row(equal_height=True):
        selected = t.make(gr.Dropdown, "dep.select", choices=[], elem_id="dep-select", scale=4)
        stop_dep = t.make(
            gr.Button, "dep.stop", prop="value", variant="stop", size="sm", elem_id="dep-stop", scale=1
        )
    status = gr.Markdown("", elem_id="dep-status")
    return {
        "run": run,
        "backend": backend,
        "deploy": deploy,
        "table": table,
        "selected": selected,
        "stop_dep": stop_dep,
        "status": status,
    }


def _chat_panel(t: Texts) -> dict[str, Any]:
    """System prompt and sampling controls beside the chat."""
    with gr.Row():
        with gr.Column(scale=1):
            system = t.make(gr.Textbox, "dep.system", lines=3, elem_id="dep-system")
            sampling = sampling_controls(t, "dep", advanced=("seed", "ignore_eos"))
            # Shown when the picked deployment's model can think (DeployHandlers.thinking_input).
            thinking = t.make(gr.Checkbox, "dep.thinking", value=False, visible=False, elem_id="dep-thinking")
        with gr.Column(scale=3):
            chatbot = t.make(gr.Chatbot, "dep.chat", height=380, elem_id="dep-chat")
            # Which of the two shows follows the picked deployment (DeployHandlers.image_input).
            images_on = t.make(
                gr.Markdown, "dep.images_on", prop="value", visible=False, elem_id="dep-images-on"
            )
            images_off = t.make(
                gr.Markdown, "dep.images_off", prop="value", visible=False, elem_id="dep-images-off"
            )
            with gr.Row(equal_height=True):
                # 📎 (sources) appears once a deployment whose model reads images is picked; the browser's file
                # picker offers images only, and each file is checked again when the turn is sent.
                message = t.make(
                    gr.MultimodalTextbox,
                    "dep.message",
                    sources=[],
                    file_types=["image"],
                    file_count="multiple",
                    submit_btn=False,
                    elem_id="dep-message",
                    scale=5,
                )
                send = t.make(
                    gr.Button, "dep.send", prop="value", variant="primary", elem_id="dep-send", scale=1
                )
                stop_gen = t.make(gr.Button, "dep.stop_gen", prop="value", elem_id="dep-stop-gen", scale=1)
                clear = t.make(gr.Button, "dep.clear", prop="value", elem_id="dep-clear", scale=1)
            # Shown for a PaddleOCR-VL deployment (DeployHandlers.task_prompt_input): one click puts the prompt
            # the model was trained with in the message box.
            task_prompt = t.make(
                gr.Radio, "dep.task_prompt", choices=[], visible=False, elem_id="dep-task-prompt"
            )
    return {
        "task_prompt": task_prompt,
        "system": system,
        "sampling": sampling,
        "thinking": thinking,
        "chatbot": chatbot,
        "images_on": images_on,
        "images_off": images_off,
        "message": message,
        "send": send,
        "stop_gen": stop_gen,
        "clear": clear,
    }


def build_deploy_tab(ctx: UIContext, selected_state: gr.BrowserState) -> DeployTab:
    """Lay out the Deploy & Chat tab and wire its events."""
    t = ctx.texts
    with t.make(gr.Tab, "tab.deploy", id="deploy") as tab:
        timer = gr.Timer(POLL_SECONDS, active=True)
        shown = gr.State(None)
        d = _deployments_panel(t)
        c = _chat_panel(t)
    h = DeployHandlers(ctx)
    run, selected = d["run"], d["selected"]
    refresh_outputs = [run, d["table"], selected, d["status"]]
    _wire_chat(h, c, selected)
    d["deploy"].click(h.deploy, [run, d["backend"]], [d["table"], selected, d["status"], selected_state])
    selected.input(h.pick, [run, selected], refresh_outputs, show_progress="hidden")
    # However the deployment got selected (a click, a deploy, a restore), browser storage and the URL follow.
    selected.change(echo, selected, selected_state, show_progress="hidden").then(
        None, selected, None, js=URL_JS
    )
    d["stop_dep"].click(h.stop, selected, d["status"])
    timer.tick(  # its status on the table alone, as the Runs tab's tick
        h.tick,
        [run, selected, selected_state, shown],
        [*refresh_outputs, shown],
        show_progress="hidden",
        show_progress_on=d["table"],
    )
    tab.select(h.on_select, [run, selected, selected_state], refresh_outputs, show_progress="hidden")
    ctx.demo.load(h.restore, [run, selected_state], refresh_outputs, show_progress="hidden")
    ctx.on_language(h.relabel, [selected, run], refresh_outputs)
    return DeployTab(
        tab=tab,
        run=run,
        selected=selected,
        timer=timer,
        refresh_fn=h.pick,
        refresh_outputs=refresh_outputs,
    )


def _wire_chat(h: DeployHandlers, c: dict[str, Any], selected: gr.Dropdown) -> None:
    chatbot, message = c["chatbot"], c["message"]
    chat_inputs = [chatbot, selected, c["system"], *c["sampling"].values(), c["thinking"]]
    turn = [message, chatbot, selected]
    # `.success`: a refused turn (nothing typed, images for a text model) goes no further, so the model is
    # not asked to answer the previous history again.
    sent = (
        c["send"]
        .click(h.check_turn, turn, None)
        .success(h.take_turn, turn, [message, chatbot])
        .success(h.bot_turn, chat_inputs, chatbot)
    )
    submitted = (
        message.submit(h.check_turn, turn, None)
        .success(h.take_turn, turn, [message, chatbot])
        .success(h.bot_turn, chat_inputs, chatbot)
    )
    # Stop is answered at once (no queue): the streaming reply sees it at its next token and ends, closing
    # its request; the cancel also ends a reply that waits on a silent server.
    c["stop_gen"].click(h.stop_reply, None, None, queue=False).then(
        None, None, None, cancels=[sent, submitted]
    )
    c["clear"].click(empty_chat, None, chatbot, cancels=[sent, submitted])
    # However the deployment got picked (a click, a deploy, a restore), the box offers 📎 only for VL models.
    selected.change(
        h.image_input, selected, [message, c["images_on"], c["images_off"]], show_progress="hidden"
    )
    selected.change(h.thinking_input, selected, c["thinking"], show_progress="hidden")
    selected.change(h.task_prompt_input, selected, c["task_prompt"], show_progress="hidden")
    # The choice acts as a row of buttons: it is cleared once its prompt is in the box, so the same task can be
    # picked again for the next image.
    c["task_prompt"].input(
        with_task_prompt, [c["task_prompt"], message], message, show_progress="hidden"
    ).then(clear_choice, None, c["task_prompt"], show_progress="hidden")
