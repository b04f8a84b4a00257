"""The pre-flight estimate and the planner's options as the Train tab shows them: memory by part, time,
the plans that fit (with the keys each sets), and the warning a launch over the estimate gets."""

from __future__ import annotations

from typing import Any

from studio.ui.i18n import DEFAULT_LANGUAGE, localize_message, text
from studio.ui.train_templates import what_if_text

MEMORY_PARTS = (
    "weights",
    "master_weights",
    "gradients",
    "optimizer",
    "activations",
    "load_peak",
    "save_peak",
)


def format_estimate(est: dict[str, Any], lang: str = DEFAULT_LANGUAGE) -> str:
    """``estimate_resources`` for the form in ``lang``: a warning when the run will not fit its node, peak
    memory with its range and parts, time per step and in all, disk, and what the estimate assumed."""
    lines = [launch_warning(est, lang)] if est.get("warning") else []
    mem = est.get("memory_gib") or {}
    node = est.get("node") or {}
    if "peak" in mem:
        lo, hi = mem.get("range") or (mem["peak"], mem["peak"])
        where = text("tr.est.where.device" if est.get("device") == "gpu" else "tr.est.where.ram", lang)
        checked = text("tr.est.checked", lang, node=node["name"]) if node.get("name") else ""
        lines.append(text("tr.est.peak", lang, where=where, peak=mem["peak"], lo=lo, hi=hi) + checked + "\n")
    lines += [f"| {text('tr.est.memory', lang)} | GiB |", "|---|---:|"]
    lines += [f"| {text(f'tr.est.part.{p}', lang)} | {mem[p]:.2f} |" for p in MEMORY_PARTS if mem.get(p)]
    n, trainable = est.get("num_parameters"), est.get("trainable_parameters")
    if n:
        lines.append(
            "\n" + text("tr.est.trainable", lang, trainable=trainable, total=n, share=100 * trainable / n)
        )
    t = est.get("time") or {}
    if t:
        lo, hi = t.get("step_s_range") or (t["step_s"], t["step_s"])
        shown = text(
            "tr.est.time",
            lang,
            steps=est.get("steps", 0),
            tokens=est.get("tokens_per_step", 0),
            step=_duration(t["step_s"]),
            lo=_duration(lo),
            hi=_duration(hi),
            total=_duration(t["total_s"]),
            checkpoints=t.get("checkpoints", 0),
            save=_duration(t.get("final_save_s", 0)),
        )
        lines.append("  \n" + shown)
    disk = est.get("disk") or {}
    if disk:
        lines.append("  \n" + text("tr.est.disk", lang, gb=disk["total_bytes"] / 1e9))
    if est.get("plan"):
        lines.append("\n" + format_plan(est["plan"], lang))
    if est.get("assumptions"):
        lines.append(f"\n<details><summary>{text('tr.est.assumptions', lang)}</summary>\n")
        lines += [f"- {localize_message(a, lang)}" for a in est["assumptions"]]
        lines.append("\n</details>")
    return "\n".join(lines)


def format_plan(plan: dict[str, Any], lang: str = DEFAULT_LANGUAGE) -> str:
    """The planner's proposal (``plan`` of the estimate) for the form, built from its figures in ``lang``:
    the settings that fit (their keys), or the closest one and what would make it fit; and, folded, the
    settings that do not fit with their figures."""
    lines = [
        text(
            "tr.plan.title",
            lang,
            model=plan.get("model") or "",
            stage=plan["stage"],
            fine_tuning=plan["fine_tuning"],
            seq=plan["seq_len"],
            devices=plan["devices_known"],
            kind=plan["device"].upper(),
        )
    ]
    for option in plan.get("fits") or []:
        shown = text(
            "tr.plan.fits",
            lang,
            peak=option["memory_gib"]["peak"],
            cap=option["capacity_gib"],
            keys=_plan_keys(option),
        )
        lines.append(f"- {shown}")
    rejected = plan.get("rejected") or []
    if not plan.get("fits") and rejected:
        closest = rejected[-1]
        mem = closest["memory_gib"]
        devices = closest["settings"]["num_devices"]
        parts = [text("tr.plan.none", lang, devices=devices, peak=mem["peak"], cap=closest["capacity_gib"])]
        if mem.get("moe_activations", 0) > 0.25 * mem["peak"]:
            parts.append(text("tr.plan.moe", lang, moe=mem["moe_activations"]))
        option = plan.get("tensor_parallel_option")
        if option:
            parts.append(what_if_text(plan, option, lang))
        lines.append("; ".join(parts))
    if rejected:
        lines.append(f"\n<details><summary>{text('tr.plan.rejected', lang)}</summary>\n")
        for option in rejected:
            peak, cap = option["memory_gib"]["peak"], option["capacity_gib"]
            why = [text("tr.plan.over", lang, peak=peak, cap=cap)] if peak > cap else []
            host_cap = option.get("host_capacity_gib")
            if host_cap is not None and option["host_gib_per_node"] > host_cap:
                why.append(text("tr.plan.host", lang, host=option["host_gib_per_node"], cap=host_cap))
            lines.append(f"- `{_plan_keys(option)}`: {'; '.join(why)}")
        lines.append("\n</details>")
    return "\n".join(lines)


def _plan_keys(option: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in option["settings"].items())


def launch_warning(estimate: dict[str, Any] | None, lang: str = DEFAULT_LANGUAGE) -> str:
    """The estimate's warning, when the run just queued will not fit the node it goes to (``estimate`` as
    stored on the run, or as just made)."""
    warning = (estimate or {}).get("warning")
    return f"⚠️ **{localize_message(warning, lang)}**  \n" if warning else ""


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.2g}s"
    seconds = round(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m" if h else (f"{m}m {s:02d}s" if m else f"{s}s")
