"""Nodes tab: every worker with its devices, memory, what it holds, its queues, its start-up doctor (each
check passed or failed, and why) and last heartbeat; refreshed when opened and on demand."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd

from studio.services import nodes as nodes_svc
from studio.ui.context import UIContext, fmt_time, ranks_text

NODE_COLUMNS = ["worker", "state", "devices", "memory", "busy", "queues", "doctor", "heartbeat"]
CHECK_COLUMNS = ["worker", "check", "result", "detail", "seconds"]
STATE_ICONS = {"ready": "🟢", "checking": "⏳", "failed": "❌", "offline": "⚪"}


@dataclass
class NodesTab:
    tab: gr.Tab
    table: gr.Dataframe
    checks: gr.Dataframe


def _gib(n: int | None) -> str:
    return f"{n / 2**30:.1f} GiB" if n else ""


def device_text(devices: list[dict[str, Any]]) -> str:
    if not devices:
        return "CPU"
    return ", ".join(
        f"gpu:{d['index']} {d.get('name', '?')} {_gib(d.get('total_memory_bytes'))}" for d in devices
    )


def doctor_text(node: Any) -> str:
    """✅ n/n passed, ❌ and the failed checks, or ⏳ while it runs."""
    if node.doctor is None:
        return "⏳ running" if node.state == "checking" else ""
    checks = node.checks
    if node.doctor.get("passed"):
        return f"✅ {len(checks)}/{len(checks)} passed ({fmt_time(node.doctor_at)})"
    return f"❌ {node.reason or 'failed'}"


def holds_text(node: Any) -> str:
    if not node.busy:
        return "free"
    return ", ".join(
        f"{h['kind']} #{h['id']} {h['name']}"
        + (f" (ranks {ranks_text(h['ranks'])})" if h.get("ranks") else "")
        for h in node.holds
    )


def node_rows(nodes: list[Any]) -> pd.DataFrame:
    rows = [
        [
            n.name,
            f"{STATE_ICONS.get(n.state, '')} {n.state}",
            device_text(n.devices),
            f"{_gib(n.memory_bytes)}{f', {n.cpu_count} cores' if n.cpu_count else ''}",
            holds_text(n),
            ", ".join(q if q in n.accepting else f"{q} (held)" for q in n.queues),
            doctor_text(n),
            fmt_time(n.heartbeat_at),
        ]
        for n in nodes
    ]
    return pd.DataFrame(rows, columns=NODE_COLUMNS)


def check_rows(nodes: list[Any]) -> pd.DataFrame:
    rows = [
        [n.name, c["name"], "✅ pass" if c["passed"] else "❌ fail", c["detail"], c.get("duration_s", 0.0)]
        for n in nodes
        for c in n.checks
    ]
    return pd.DataFrame(rows, columns=CHECK_COLUMNS)


class NodesHandlers:
    """The Nodes tab's event handler: the same `list_nodes` GET /api/v1/nodes answers from."""

    def __init__(self, ctx: UIContext):
        self.ctx = ctx

    def refresh(self) -> tuple[pd.DataFrame, pd.DataFrame]:
        nodes = self.ctx.read(nodes_svc.list_nodes, self.ctx.settings, default=[])
        return node_rows(nodes), check_rows(nodes)


def build_nodes_tab(ctx: UIContext) -> NodesTab:
    """Lay out the Nodes tab and wire its events."""
    t = ctx.texts
    with t.make(gr.Tab, "tab.nodes", id="nodes") as tab:
        t.make(gr.Markdown, "nodes.help", prop="value")
        refresh = t.make(gr.Button, "nodes.refresh", prop="value", size="sm", elem_id="nodes-refresh")
        table = t.make(
            gr.Dataframe,
            "nodes.table",
            headers=NODE_COLUMNS,
            interactive=False,
            wrap=True,
            elem_id="nodes-table",
        )
        checks = t.make(
            gr.Dataframe,
            "nodes.checks",
            headers=CHECK_COLUMNS,
            interactive=False,
            wrap=True,
            # every check of every worker in view (~15 rows a worker): a scrolled table renders only its
            # visible rows, and an operator reads this one whole
            max_height=4000,
            elem_id="nodes-checks",
        )
    h = NodesHandlers(ctx)
    refresh.click(h.refresh, None, [table, checks])
    tab.select(h.refresh, None, [table, checks], show_progress="hidden")
    ctx.demo.load(h.refresh, None, [table, checks], show_progress="hidden")
    return NodesTab(tab=tab, table=table, checks=checks)
