"""Deploy & Chat tab: deploy a finished run in one click, watch its status, and chat with streaming."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd

from studio.models import RunStatus
from studio.services import deployments as deployments_svc
from studio.services import runs as runs_svc
from studio.ui.context import UIContext, fmt_time, parse_id

DEPLOYMENT_COLUMNS = ["id", "name", "status", "backend", "url", "model", "started"]
STATUS_ICONS = {"starting": "⏳", "running": "🟢", "failed": "❌", "stopping": "⏹️", "stopped": "⚪"}
POLL_SECONDS = 2.0


@dataclass
class DeployTab:
    tab: gr.Tab
    run: gr.Dropdown
    selected: gr.Dropdown
    timer: gr.Timer
    refresh_fn: Any  # (run, deployment) -> updates of refresh_outputs
    refresh_outputs: list[Any]


def deployment_choices(deps: list[Any]) -> list[tuple[str, int]]:
    return [(f"#{d.id} {d.name} · {d.status}", d.id) for d in deps]


def deployment_rows(deps: list[Any]) -> pd.DataFrame:
    rows = [
        [
            d.id,
            d.name,
            f"{STATUS_ICONS.get(d.status, '')} {d.status}",
            d.backend,
            d.url or "",
            d.model_dir,
            fmt_time(d.started_at),
        ]
        for d in deps
    ]
    return pd.DataFrame(rows, columns=DEPLOYMENT_COLUMNS)


def deployment_status(dep: Any) -> str:
    icon = STATUS_ICONS.get(dep.status, "")
    text = f"**{icon} #{dep.id} {dep.name} — {dep.status}**"
    if dep.url:
        text += f" · `{dep.url}` (OpenAI-compatible, model `default`)"
    if dep.error:
        text += f"\n\n❌ `{dep.error.strip().splitlines()[-1][:400]}`"
    return text


def message_text(content: Any) -> str:
    """A Chatbot message's content as plain text (Gradio 6 hands back a list of ``{type, text}`` parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def chat_messages(system: str, history: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Chatbot history -> OpenAI messages (system prompt first when given)."""
    msgs = [{"role": "system", "content": system}] if system and system.strip() else []
    for m in history:
        if m.get("role") in ("user", "assistant"):
            msgs.append({"role": m["role"], "content": message_text(m.get("content"))})
    return msgs


def build_deploy_tab(ctx: UIContext, selected_state: gr.BrowserState) -> DeployTab:
    t = ctx.texts
    with t.make(gr.Tab, "tab.deploy", id="deploy") as tab:
        timer = gr.Timer(POLL_SECONDS, active=True)
        shown = gr.State(None)
        with gr.Row(equal_height=True):
            run = t.make(gr.Dropdown, "dep.run", choices=[], elem_id="dep-run", scale=4)
            deploy = t.make(gr.Button, "dep.btn", prop="value", variant="primary", elem_id="dep-btn", scale=1)
        table = t.make(
            gr.Dataframe,
            "dep.table",
            headers=DEPLOYMENT_COLUMNS,
            interactive=False,
            elem_id="dep-table",
            max_height=200,
        )
        with gr.Row(equal_height=True):
            selected = t.make(gr.Dropdown, "dep.select", choices=[], elem_id="dep-select", scale=4)
            stop_dep = t.make(
                gr.Button, "dep.stop", prop="value", variant="stop", size="sm", elem_id="dep-stop", scale=1
            )
        status = gr.Markdown("", elem_id="dep-status")
        with gr.Row():
            with gr.Column(scale=1):
                system = t.make(gr.Textbox, "dep.system", lines=3, elem_id="dep-system")
                temperature = t.make(
                    gr.Slider,
                    "dep.temperature",
                    minimum=0.0,
                    maximum=2.0,
                    value=0.7,
                    step=0.05,
                    elem_id="dep-temperature",
                )
                top_p = t.make(
                    gr.Slider,
                    "dep.top_p",
                    minimum=0.05,
                    maximum=1.0,
                    value=0.9,
                    step=0.05,
                    elem_id="dep-top-p",
                )
                max_tokens = t.make(
                    gr.Slider,
                    "dep.max_tokens",
                    minimum=1,
                    maximum=2048,
                    value=128,
                    step=1,
                    elem_id="dep-max-tokens",
                )
                with t.make(gr.Accordion, "dep.advanced", open=False):
                    seed = t.make(gr.Number, "dep.seed", value=None, precision=0, elem_id="dep-seed")
                    ignore_eos = t.make(gr.Checkbox, "dep.ignore_eos", value=False, elem_id="dep-ignore-eos")
            with gr.Column(scale=3):
                chatbot = t.make(gr.Chatbot, "dep.chat", height=380, elem_id="dep-chat")
                with gr.Row(equal_height=True):
                    message = t.make(gr.Textbox, "dep.message", elem_id="dep-message", scale=5)
                    send = t.make(
                        gr.Button, "dep.send", prop="value", variant="primary", elem_id="dep-send", scale=1
                    )
                    stop_gen = t.make(
                        gr.Button, "dep.stop_gen", prop="value", elem_id="dep-stop-gen", scale=1
                    )
                    clear = t.make(gr.Button, "dep.clear", prop="value", elem_id="dep-clear", scale=1)

    def refresh(run_value: Any, current: Any) -> tuple[Any, ...]:
        finished = ctx.read(runs_svc.list_runs, status=RunStatus.SUCCEEDED.value, default=[])
        deps = ctx.read(deployments_svc.list_deployments, default=[])
        ids = {d.id for d in deps}
        keep = parse_id(current)
        value = keep if keep in ids else None
        dep = next((d for d in deps if d.id == value), None)
        run_ids = {r.id for r in finished}
        run_keep = parse_id(run_value)
        return (
            gr.update(
                choices=[(f"#{r.id} {r.name}", r.id) for r in finished],
                value=run_keep if run_keep in run_ids else None,
            ),
            deployment_rows(deps),
            gr.update(choices=deployment_choices(deps), value=value),
            deployment_status(dep) if dep else "",
        )

    def tick(run_value: Any, current: Any, saved: Any, shown: list | None) -> tuple[Any, ...]:
        # As in the Runs tab: a tick never overrides a value the dropdowns already have (it may be stale by
        # the time it lands), fills an empty deployment from browser storage, and skips unchanged choices.
        run_u, rows, dep_u, md = refresh(run_value, parse_id(current) or parse_id(saved))
        sig = [[list(c) for c in run_u["choices"]], [list(c) for c in dep_u["choices"]]]
        same = shown is not None and sig == shown
        if parse_id(run_value) is not None or same:
            run_u.pop("value", None)
        if parse_id(current) is not None:
            dep_u.pop("value", None)
        run_out = gr.skip() if same else run_u
        dep_out = gr.skip() if same and parse_id(current) is not None else dep_u
        return run_out, rows, dep_out, md, sig

    def deploy_run(run_id: Any) -> tuple[Any, ...]:
        rid = parse_id(run_id)
        if rid is None:
            raise gr.Error("Pick a finished run to deploy.")
        dep = ctx.call(
            deployments_svc.create_deployment, ctx.settings, deployments_svc.DeploymentSpec(run_id=rid)
        )
        gr.Info(f"Deployment #{dep.id} is starting.")
        return (*refresh(rid, dep.id)[1:], dep.id)

    def stop(current: Any) -> str:
        did = parse_id(current)
        if did is None:
            raise gr.Error("Pick a deployment to stop.")
        return deployment_status(ctx.call(deployments_svc.stop_deployment, did))

    def user_turn(text: str, history: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        if not text or not text.strip():
            raise gr.Error("Type a message first.")
        return "", [*history, {"role": "user", "content": text}]

    def bot_turn(
        history: list[dict[str, Any]],
        dep_id: Any,
        sys_prompt: str,
        temp: float,
        p: float,
        n: float,
        seed_value: float | None,
        no_eos: bool,
    ) -> Iterator[list[dict[str, Any]]]:
        did = parse_id(dep_id)
        if did is None:
            raise gr.Error("Pick a running deployment first.")
        body = {
            "messages": chat_messages(sys_prompt, history),
            "temperature": float(temp),
            "top_p": float(p),
            "max_tokens": int(n),
        }
        if seed_value is not None:
            body["seed"] = int(seed_value)
        if no_eos:
            body["ignore_eos"] = True
        history = [*history, {"role": "assistant", "content": ""}]
        for delta in ctx.stream(deployments_svc.chat_stream, did, body):
            history[-1]["content"] += delta
            yield history

    chat_inputs = [chatbot, selected, system, temperature, top_p, max_tokens, seed, ignore_eos]
    sent = send.click(user_turn, [message, chatbot], [message, chatbot]).then(bot_turn, chat_inputs, chatbot)
    submitted = message.submit(user_turn, [message, chatbot], [message, chatbot]).then(
        bot_turn, chat_inputs, chatbot
    )
    stop_gen.click(None, None, None, cancels=[sent, submitted])
    clear.click(lambda: [], None, chatbot, cancels=[sent, submitted])
    deploy.click(deploy_run, run, [table, selected, status, selected_state])
    selected.input(refresh, [run, selected], [run, table, selected, status], show_progress="hidden")
    # However the deployment got selected (a click, a deploy, a restore), browser storage follows it.
    selected.change(lambda d: d, selected, selected_state, show_progress="hidden")
    stop_dep.click(stop, selected, status)
    timer.tick(
        tick,
        [run, selected, selected_state, shown],
        [run, table, selected, status, shown],
        show_progress="hidden",
    )
    tab.select(
        lambda r, cur, saved: refresh(r, parse_id(cur) or parse_id(saved)),
        [run, selected, selected_state],
        [run, table, selected, status],
        show_progress="hidden",
    )
    ctx.demo.load(refresh, [run, selected_state], [run, table, selected, status], show_progress="hidden")
    return DeployTab(
        tab=tab,
        run=run,
        selected=selected,
        timer=timer,
        refresh_fn=refresh,
        refresh_outputs=[run, table, selected, status],
    )
