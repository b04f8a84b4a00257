"""What the Runs tab shows of runs, as rows and text: the run table, its exports and family, the status
card, placement, the forgetting check, the estimate against what the run measured, and a whole run view's
values (`view_of`, in the tab's `VIEW_PARTS` order)."""

from __future__ import annotations

import json
from typing import Any

import gradio as gr
import pandas as pd

from studio.ui import charts
from studio.ui.context import fmt_time, ranks_text
from studio.ui.i18n import DEFAULT_LANGUAGE, localize_message, status_text, text

RUN_COLUMNS = ["id", "name", "stage", "tuning", "status", "progress", "loss", "ETA", "created"]
CHECKPOINT_COLUMNS = ["step", "path", "saved"]
EXPORT_COLUMNS = ["id", "member", "layout", "ptq", "dtype", "status", "perplexity", "model dir"]
FAMILY_PLOT_COLUMNS = ["member", "active weights (M)", "eval loss"]
FAMILY_COLUMNS = [
    "member", "depth", "experts", "top-k", "weights", "active weights", "steps", "eval loss", "decode tok/s",
    "deployment",
]  # fmt: skip
STATUS_ICONS = {"queued": "⏳", "running": "🏃", "succeeded": "✅", "failed": "❌", "cancelled": "⏹️"}
# An export deployed on success: the chain's own steps, then its deployment's status (Export.deploy_state).
DEPLOY_STATE_ICONS = {
    "exporting": "⏳", "export_failed": "❌", "deploying": "🚀", "running": "🏃", "failed": "❌",
    "stopping": "⏹️", "stopped": "⏹️", "removed": "🗑️",
}  # fmt: skip


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = round(seconds)
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def shown_status(status: str, lang: str = DEFAULT_LANGUAGE) -> str:
    """A status with its icon, in ``lang``."""
    return f"{STATUS_ICONS.get(status, '')} {status_text(status, lang)}"


def run_rows(
    runs: list[Any], progress: dict[int, dict[str, Any]], lang: str = DEFAULT_LANGUAGE
) -> pd.DataFrame:
    rows = []
    for r in runs:
        p = progress.get(r.id, {})
        step, total = p.get("step"), p.get("max_steps")
        frac = (
            f"{step}/{total} ({100 * step / total:.0f}%)" if step is not None and total else (str(step or ""))
        )
        loss = p.get("loss")
        rows.append(
            [
                r.id,
                r.name,
                r.stage,
                r.fine_tuning,
                shown_status(r.status, lang),
                frac,
                f"{loss:.4f}" if loss is not None else "",
                _eta(p.get("eta_s")) if r.status == "running" else "",
                fmt_time(r.created_at),
            ]
        )
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


def gguf_quality(files: list[dict[str, Any]] | None) -> str:
    """Each GGUF file's size and llama.cpp's perplexity of it (change against f16)."""
    parts = []
    for f in files or []:
        part = f"{f['type']} {f['size_bytes'] / 2**20:.1f} MiB"
        if f.get("perplexity") is not None:
            part += f" ppl {f['perplexity']:.3f}"
            if f.get("relative_to_f16") is not None and f["type"] != "f16":
                part += f" ({f['relative_to_f16']:+.2%})"
        parts.append(part)
    return ", ".join(parts)


def export_rows(items: list[Any], lang: str = DEFAULT_LANGUAGE) -> pd.DataFrame:
    """Exports of a run; PTQ ones carry perplexity before and after quantization, GGUF ones each file's size
    and perplexity."""
    rows = []
    for e in items:
        ppl = e.perplexity or {}
        shown = ", ".join(
            f"{k} {v:+.2%}" if k == "relative_change" else f"{k} {v:.3f}" for k, v in ppl.items()
        )
        if e.export_format == "gguf":
            shown = gguf_quality(e.gguf_files) or e.gguf_types
        status = shown_status(e.status, lang) + (f": {e.error.splitlines()[-1][:120]}" if e.error else "")
        dtype = (
            text("runs.msg.shards", lang, dtype=e.dtype, size=e.max_shard_size) if not e.quantization else "—"
        )
        if e.export_format == "gguf":
            dtype = e.gguf_types.replace(",", " · ")
        if e.deploy_state:
            status += " → " + deploy_state_text(e, lang)
        member = e.elastic_member or "—"
        rows.append([e.id, member, e.layout, e.quantization or "—", dtype, status, shown, e.export_dir])
    return pd.DataFrame(rows, columns=EXPORT_COLUMNS)


def deploy_state_text(export: Any, lang: str = DEFAULT_LANGUAGE) -> str:
    """Where an export deployed on success stands, with its icon and the export or deployment it is at:
    exporting (export #N), deploying, running, ... (deployment #M)."""
    state = export.deploy_state
    own = ("exporting", "export_failed", "deploying", "removed")
    shown = text(f"runs.deploy.{state}", lang) if state in own else status_text(state, lang)
    if export.deployment_id is not None:
        ref = text("runs.deploy.deployment_ref", lang, id=export.deployment_id)
    else:
        ref = text("runs.deploy.export_ref", lang, id=export.id)
    return f"{DEPLOY_STATE_ICONS.get(state, '')} {shown}{ref}"


def family_rows(
    family: dict[str, Any] | None, exports: list[Any] | None = None, lang: str = DEFAULT_LANGUAGE
) -> pd.DataFrame:
    """An elastic run's members, the full model first: size, active weights per token, eval loss, and
    where the newest one-click deployment of each stands (``exports``, newest first)."""
    deployed: dict[str, Any] = {}
    for e in exports or []:
        if e.deploy_state and e.elastic_member:
            deployed.setdefault(e.elastic_member, e)
    rows = []
    for m in (family or {}).get("members", []):
        loss = m.get("eval_loss")
        state = deploy_state_text(deployed[m["member"]], lang) if m["member"] in deployed else "—"
        rows.append(
            [m["member"], m["depth"], m["experts"], m["topk"], f"{m['parameters']:,}",
             f"{m['active_parameters']:,}", m["steps_trained"], "—" if loss is None else round(loss, 4),
             m.get("decode_tokens_per_second") or "—", state]
        )  # fmt: skip
    return pd.DataFrame(rows, columns=FAMILY_COLUMNS)


def gguf_choices(items: list[Any]) -> list[tuple[str, str]]:
    """The deployable GGUF files of a run's succeeded exports, newest export first, each as
    ("#<export> <type> · <size>", "<export id>:<type>")."""
    out = []
    for e in items:
        if getattr(e, "export_format", "") != "gguf" or e.status != "succeeded":
            continue
        for f in e.gguf_files or []:
            out.append((f"#{e.id} {f['type']} · {f['size_bytes'] / 2**20:.1f} MiB", f"{e.id}:{f['type']}"))
    return out


def family_points(family: dict[str, Any] | None) -> pd.DataFrame:
    """The size-vs-quality plot: one point per member with an eval loss (active weights in millions)."""
    rows = [
        [m["member"], m["active_parameters"] / 1e6, float(m["eval_loss"])]
        for m in (family or {}).get("members", [])
        if m.get("eval_loss") is not None
    ]
    frame = pd.DataFrame(rows, columns=FAMILY_PLOT_COLUMNS)
    return frame.astype({"member": "object", "active weights (M)": "float64", "eval loss": "float64"})


def member_of_row(family: pd.DataFrame, row: int) -> str:
    """The member named in row ``row`` of the family table (whatever language its headers are in)."""
    return str(family.iloc[row, 0]) if 0 <= row < len(family) else ""


def run_choices(runs: list[Any], lang: str = DEFAULT_LANGUAGE) -> list[tuple[str, int]]:
    return [(f"#{r.id} {r.name} · {status_text(r.status, lang)}", r.id) for r in runs]


def placement_text(placement: list[dict[str, Any]], lang: str = DEFAULT_LANGUAGE) -> str:
    """Which node holds which ranks of a run over several nodes ("" for a one-node run)."""
    if not placement:
        return ""
    cells = [
        text(
            "runs.msg.placement_part", lang, node=p["node"], ranks=ranks_text(p["ranks"]), status=p["status"]
        )
        if p.get("node")
        else text("runs.msg.placement_open", lang, rank=p["node_rank"])
        for p in placement
    ]
    return text("runs.msg.placement", lang, parts="; ".join(cells))


def status_markdown(
    run: Any,
    p: dict[str, Any],
    position: int | None,
    lang: str = DEFAULT_LANGUAGE,
    placement: list[dict[str, Any]] | None = None,
) -> str:
    icon = STATUS_ICONS.get(run.status, "")
    parts = [f"### {icon} #{run.id} {run.name} — {status_text(run.status, lang)}"]
    line = [
        text("runs.msg.stage", lang, stage=run.stage, tuning=run.fine_tuning),
        text("runs.msg.base", lang, base=run.base_model),
    ]
    if p.get("step") is not None:
        total = p.get("max_steps")
        line.append(text("runs.msg.step", lang, step=p["step"]) + (f" / {total}" if total else ""))
    if run.status == "running" and p.get("eta_s") is not None:
        line.append(text("runs.msg.eta", lang, eta=_eta(p["eta_s"])))
    if p.get("step_s"):
        line.append(text("runs.msg.step_s", lang, s=p["step_s"]))
    if run.status == "queued" and position:
        line.append(text("runs.msg.queue_position", lang, n=position))
    if run.attempt and run.attempt > 1:
        line.append(text("runs.msg.attempt", lang, n=run.attempt))
    parts.append(" · ".join(line))
    where = placement_text(placement or [], lang)
    if where:
        parts.append("\n" + where)
    predicted = predicted_vs_measured(run.estimate, p, lang)
    if predicted:
        parts.append("\n" + predicted)
    if run.error:
        parts.append(f"\n❌ `{run.error.strip().splitlines()[-1][:400]}`")
    parts += ["\n" + line for line in _result_lines(run, lang)]
    return "\n".join(parts)


def _result_lines(run: Any, lang: str) -> list[str]:
    """What a run made: its model directory and its forgetting check."""
    lines = [text("runs.msg.model", lang, path=run.model_dir)] if run.model_dir else []
    check = forgetting_text(getattr(run, "forgetting", None), lang)
    return [*lines, check] if check else lines


def forgetting_text(check: dict[str, Any] | None, lang: str = DEFAULT_LANGUAGE) -> str:
    """The forgetting check's line: task and general scores of base and result, each change with its
    interval, and the warning when the general score fell by more than the margin."""
    if not check:
        return ""
    cells, level = [], 95
    for side in ("task", "general"):
        s = check.get(side)
        if not s or s.get("change") is None:
            continue
        level = round(100 * s.get("confidence", 0.95))
        ci = s.get("change_ci")
        interval = f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else ""
        score = f"{s['base']:.3f} → {s['result']:.3f} ({s['change']:+.3f}{interval}, n={s['n']})"
        cells.append(text(f"runs.msg.forgetting_{side}", lang, score=score))
    if not cells:
        return ""
    line = text("runs.msg.forgetting", lang, level=level, parts=" · ".join(cells))
    if check.get("warning"):
        line += "  \n" + text("runs.msg.forgetting_warning", lang, margin=check["margin"])
    return line


def predicted_vs_measured(
    estimate: dict[str, Any] | None, p: dict[str, Any], lang: str = DEFAULT_LANGUAGE
) -> str:
    """The estimate recorded at launch beside what the run measured: peak memory and seconds per step."""
    if not estimate:
        return ""
    mem = estimate.get("memory_gib") or {}
    t = estimate.get("time") or {}
    cells = []
    if mem.get("peak"):
        lo, hi = mem.get("range") or (mem["peak"], mem["peak"])
        peak = p.get("peak_device_gib") if estimate.get("device") == "gpu" else p.get("peak_rss_gib")
        measured = f"{peak:.2f} GiB" if peak else "—"
        cells.append(text("runs.msg.memory", lang, peak=mem["peak"], lo=lo, hi=hi, measured=measured))
    if t.get("step_s"):
        measured = f"{p['step_s']:.2f} s" if p.get("step_s") else "—"
        cells.append(text("runs.msg.per_step", lang, predicted=t["step_s"], measured=measured))
    warning = f"  \n⚠️ {localize_message(estimate['warning'], lang)}" if estimate.get("warning") else ""
    return " · ".join(cells) + warning


def blank_view(message: str = "") -> tuple[Any, ...]:
    """The run view with no run: empty plots and tables, actions off."""
    empty = charts.empty_frame()
    off = gr.update(interactive=False)
    return (
        message,
        empty,
        empty,
        empty,
        gr.update(value=empty, visible=False),
        "",
        pd.DataFrame(columns=CHECKPOINT_COLUMNS),
        "",
        off,
        off,
        off,
        pd.DataFrame(columns=EXPORT_COLUMNS),
        gr.update(value=pd.DataFrame(columns=FAMILY_COLUMNS), visible=False),
        gr.update(value=family_points(None), visible=False),
        gr.update(choices=[], value=None),
    )


def view_of(
    run: Any,
    rows: list[dict[str, Any]],
    p: dict[str, Any],
    position: int | None,
    tail: str,
    checkpoints: list[Any],
    exports: list[Any],
    family: dict[str, Any] | None = None,
    lang: str = DEFAULT_LANGUAGE,
    placement: list[dict[str, Any]] | None = None,
) -> tuple[Any, ...]:
    """One run's view from what the store holds, in ``VIEW_PARTS`` order."""
    extras = charts.extra_metric_names(rows)
    # The step axis spans the whole run, so a live curve shows how far along it is.
    x_lim = [0, p["max_steps"]] if p.get("max_steps") else None
    ckpts = pd.DataFrame(
        [[c.step, c.path, fmt_time(c.created_at)] for c in checkpoints], columns=CHECKPOINT_COLUMNS
    )
    return (
        status_markdown(run, p, position, lang, placement),
        gr.update(value=charts.metric_frame(rows, ["loss"]), x_lim=x_lim),
        gr.update(value=charts.metric_frame(rows, ["learning_rate"]), x_lim=x_lim),
        gr.update(value=charts.metric_frame(rows, ["tokens_per_second"]), x_lim=x_lim),
        gr.update(value=charts.metric_frame(rows, extras), visible=bool(extras), x_lim=x_lim),
        tail,
        ckpts,
        json.dumps(run.config, indent=2, ensure_ascii=False),
        gr.update(interactive=run.status in ("queued", "running")),
        gr.update(interactive=run.status in ("failed", "cancelled")),
        gr.update(interactive=run.status == "succeeded"),
        export_rows(exports, lang),
        gr.update(value=family_rows(family, exports, lang), visible=family is not None),
        family_plot_update(family),
        gr.update(choices=gguf_choices(exports)),
    )


def family_plot_update(family: dict[str, Any] | None) -> Any:
    """The plot's points with some room around them (Gradio's own limits put the extremes on the frame)."""
    points = family_points(family)
    if points.empty:
        return gr.update(value=points, visible=family is not None)
    limits = {}
    for key, col in (("x_lim", "active weights (M)"), ("y_lim", "eval loss")):
        lo, hi = float(points[col].min()), float(points[col].max())
        pad = max(hi - lo, abs(hi) * 0.02, 1e-3) * 0.15
        limits[key] = [lo - pad, hi + pad]
    return gr.update(value=points, visible=True, **limits)
