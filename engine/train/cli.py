"""``ernie-studio train CONFIG.yaml [key=value ...]``, ``ernie-studio estimate CONFIG.yaml [key=value ...]`` and
``ernie-studio export CONFIG.yaml [key=value ...]``."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def cmd_train(args: argparse.Namespace) -> int:
    from engine.train.parallel import die_with_launcher

    die_with_launcher()  # first: a rank must not outlive a launcher killed while this one loads

    from engine.train import run_training
    from engine.train.config_load import load_config

    cfg = load_config(args.config, args.overrides)
    summary = run_training(cfg)
    if summary.status == "succeeded" and not cfg.do_train:
        print(f"evaluation finished: {summary.final_metrics}", flush=True)
    elif summary.status == "succeeded":
        print(f"training finished: {summary.steps} steps, model in {summary.model_dir}", flush=True)
    elif summary.status == "cancelled":
        print(f"training cancelled at step {summary.steps}; run the same command to resume", flush=True)
    return summary.exit_code


def cmd_sweep(args: argparse.Namespace) -> int:
    """A local hyperparameter sweep: the config's trials trained one after another in this process."""
    import yaml

    from engine.sweep import check_base, check_settings, run_local_sweep, settings_from_dict
    from engine.train.config_load import load_config

    cfg = load_config(args.config, args.overrides)
    space = yaml.safe_load(Path(args.space).read_text())
    if not isinstance(space, dict):
        raise ValueError(f"{args.space}: a mapping with `parameters` (docs/training.md, Sweeps)")
    settings, params = settings_from_dict(space, args.space)
    check_settings(settings, cfg.stage, params, args.space)
    check_base(cfg, settings.objective, args.config)
    study = run_local_sweep(cfg, settings, params, storage=args.storage)
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    if not done:
        print("no trial completed", flush=True)
        return 1
    best = study.best_trial
    print(
        f"best trial {best.number}: {settings.objective}={best.value} {best.params} "
        f"model in {Path(cfg.output_dir) / f'trial-{best.number}'}",
        flush=True,
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from engine.train import run_export
    from engine.train.config_load import load_export_config

    cfg = load_export_config(args.config, args.overrides)
    summary = run_export(cfg)
    print(f"exported to {summary.export_dir} ({summary.layout} layout)")
    if summary.perplexity:
        print("perplexity: " + json.dumps(summary.perplexity))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    """The pre-flight estimate of a training config on this machine (or a node of --memory-gib)."""
    import os

    from engine.estimate import NodeFacts, PlanError, estimate_run, fit_warning, plan_config, plan_run
    from engine.models.config import ErnieConfig
    from engine.train.config_load import load_config

    cfg = load_config(args.config, args.overrides)
    model = ErnieConfig.from_file(cfg.model_name_or_path)
    datasets = _token_stats(cfg, "train")
    evals = _token_stats(cfg, "eval") if cfg.eval_dataset_path else []
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    memory = int(args.memory_gib * 2**30) if args.memory_gib else ram
    node = NodeFacts(
        device="gpu" if args.gpu else "cpu",
        name="this machine" if not args.memory_gib else "the node",
        memory_bytes=memory,
        ram_bytes=ram,
        gpu_name=args.gpu or "",
        probe_tokens_per_second=_probe() if args.probe else None,
    )
    node_devices = args.node_devices or args.devices
    nodes = [
        dataclasses.replace(node, name=f"node {i + 1}" if args.nodes > 1 else node.name, devices=node_devices)
        for i in range(args.nodes)
    ]
    try:
        plan = plan_config(model, cfg, nodes)
        if args.devices > plan.devices_known:
            plan_run(model, cfg.stage, cfg.fine_tuning, cfg.max_seq_len, nodes, num_devices=args.devices)
    except PlanError as e:
        raise SystemExit(f"ernie-studio estimate: {e} (--devices, --nodes, --node-devices)") from None
    est = estimate_run(model, cfg, datasets, evals, node=node, num_devices=args.devices)
    out = est.to_dict()
    if args.json:
        print(json.dumps({**out, "warning": fit_warning(est, node), "plan": plan.to_dict()}, indent=2))
        return 0
    mem, t = out["memory_gib"], out["time"]
    print(f"peak memory {mem['peak']:.2f} GiB ({mem['range'][0]:.2f} - {mem['range'][1]:.2f}), per part:")
    for part in (
        "weights",
        "adapters",
        "master_weights",
        "gradients",
        "optimizer",
        "activations",
        "load_peak",
    ):
        if mem.get(part):
            print(f"  {part:<15} {mem[part]:8.2f} GiB")
    print(f"  {'save_peak':<15} {mem['save_peak']:8.2f} GiB")
    lo, hi = t["step_s_range"]
    print(
        f"{out['steps']:,} steps x {t['step_s']:.2f} s ({lo:.2f} - {hi:.2f}) = {t['total_s'] / 60:.1f} min with "
        f"saves and evaluation; disk {out['disk']['total_bytes'] / 1e9:.2f} GB"
    )
    for line in out["assumptions"]:
        print(f"assumed: {line}")
    warning = fit_warning(est, node)
    if warning:
        print(f"warning: {warning}")
    _print_plan(plan.to_dict())
    return 0


def _print_plan(plan: dict) -> None:
    """The planner's proposal: the settings that fit (best first) and why the others do not."""
    print(
        f"\nplan for {plan['stage']} {plan['fine_tuning']} at {plan['seq_len']:,} tokens a row on "
        f"{plan['devices_known']} {plan['device'].upper()} device(s) of {plan['device_memory_gib']:.0f} GiB: "
        f"{plan['verdict']}"
    )
    for option in plan["fits"]:
        keys = " ".join(f"{k}={v}" for k, v in option["settings"].items())
        print(
            f"  fits: {option['description']}: {option['memory_gib']['peak']:.1f} GiB per device\n    {keys}"
        )
    if plan["reason"]:
        print(f"  {plan['reason']}")
    for option in plan["rejected"]:
        print(f"  does not fit: {option['description']}: {option['reason']}")


def _token_stats(cfg, split: str) -> list:
    """Token statistics of a split's files with the model's tokenizer (as the studio computes them)."""
    from engine import load_tokenizer
    from engine.data import dataset_stats, detect_format
    from engine.estimate import DatasetTokens

    tokenizer = load_tokenizer(cfg.model_name_or_path)
    spec = cfg.dataset_spec(split)
    paths = [p for p in spec["train_dataset_path"].split(",") if p]
    out = []
    for path in paths:
        fmt, kind = detect_format(path)
        out.append(DatasetTokens.from_stats(dataset_stats(path, fmt, kind, tokenizer, cfg.max_seq_len)))
    return out


def _probe() -> float:
    """This machine's doctor throughput probe (tokens/s of the tiny model), the estimate's calibration."""
    import tempfile

    from engine.doctor.probes import throughput_probe
    from engine.doctor.report import DoctorFloors
    from engine.models.initialize import init_model

    with tempfile.TemporaryDirectory() as tmp:
        tiny = init_model("tiny", Path(tmp) / "tiny")
        return float(throughput_probe(tiny, DoctorFloors(), timed_steps=4).values["tokens_per_second"])


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train a stage (SFT, DPO, PT, VL-SFT) from an ERNIEKit YAML config"
    )
    p.add_argument("config", help="YAML config (ERNIEKit keys)")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied after the file")
    p.set_defaults(func=cmd_train)
    p = subparsers.add_parser(
        "sweep", help="search hyperparameters with Optuna: train a config's trials here, one after another"
    )
    p.add_argument("config", help="YAML config (ERNIEKit keys), as for train; it needs eval_dataset_path")
    p.add_argument("--space", required=True, help="YAML search space and sweep settings (docs/training.md)")
    p.add_argument(
        "--storage",
        default=None,
        help="Optuna storage URL (e.g. sqlite:///sweep.db) to keep and resume the study; default: in memory",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides applied after the file")
    p.set_defaults(func=cmd_sweep)
    p = subparsers.add_parser(
        "estimate",
        help="memory, time and disk a training config would take, with a range and what it assumed",
    )
    p.add_argument("config", help="YAML config (ERNIEKit keys)")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied after the file")
    p.add_argument("--devices", type=int, default=1, help="data-parallel devices (num_devices)")
    p.add_argument(
        "--gpu", metavar="NAME", help="estimate for a GPU of this name (e.g. A100) instead of the CPU"
    )
    p.add_argument("--memory-gib", type=float, help="memory of the node (one device for --gpu); default RAM")
    p.add_argument("--nodes", type=int, default=1, help="nodes like this one the planner may use")
    p.add_argument(
        "--node-devices", type=int, help="devices of each node for the planner (default: --devices)"
    )
    p.add_argument(
        "--probe", action="store_true", help="calibrate CPU time with the doctor's throughput probe"
    )
    p.add_argument("--json", action="store_true", help="the estimate as JSON")
    p.set_defaults(func=cmd_estimate)
    p = subparsers.add_parser("export", help="merge LoRA, convert layout, quantize and shard a model")
    p.add_argument("config", help="YAML config (export keys; a training config works too)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. lora=True layout=hf")
    p.set_defaults(func=cmd_export)
