"""GPAS against the plain Pre-LN model: PT from scratch on the tiny preset, same data, steps and seeds.

Run with ``.venv/bin/python bench/bench_gpas.py [--steps 300] [--seeds 0 1 2] [--plot docs/figures/gpas_tiny.png]``.
Every seed initialises its own tiny model (``init-model --preset tiny``) and trains it twice, with and
without ``gpas: true``; the held-out eval loss is measured every ``--eval-every`` steps. Prints the curves
(mean over seeds, with the spread) and the final losses whatever they show; ``--plot`` also draws them.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "pt_demo.jsonl"


def curves(base: Path, out: Path, train: Path, evals: Path, steps: int, every: int, seed: int, gpas: bool):
    """(train loss per logged step, eval loss per eval step, last row) of one PT run."""
    from engine.train import run_training
    from engine.train.config import TrainConfig
    from engine.train.config_load import config_from_dict
    from engine.train.stages import PT

    values = dict(
        model_name_or_path=str(base),
        stage=PT.name,
        fine_tuning="Full",
        output_dir=str(out),
        train_dataset_path=str(train),
        eval_dataset_path=str(evals),
        eval_steps=every,
        max_seq_len=64,
        packing=True,
        batch_size=4,
        learning_rate=1e-3,  # the reference's 71M-1B learning rate
        warmup_steps=steps // 10,
        max_steps=steps,
        save_steps=steps,
        logging_steps=10,
        disable_tqdm=True,
        report_to="none",
        seed=seed,
        gpas=gpas,
    )
    run_training(config_from_dict(TrainConfig, values))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_curve = {r["step"]: r["loss"] for r in rows if "loss" in r}
    eval_curve = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    return train_curve, eval_curve, rows[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--plot", type=Path, help="draw the curves into this PNG")
    parser.add_argument("--json", type=Path, help="write the curves here")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (the tiny preset has 2)")
    parser.add_argument("--replot", type=Path, help="only report and draw the curves a --json run wrote")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        results = {k: {int(s): {c: _int_keys(v) for c, v in r.items()} for s, r in runs.items()}
                   for k, runs in saved["results"].items()}  # fmt: skip
        args.steps, args.layers = saved["steps"], saved.get("layers", 2)
        report(results, args)
        return
    logging.disable(logging.INFO)
    from engine.models.initialize import init_model

    results: dict[str, dict] = {"plain": {}, "gpas": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        lines = DATA.read_text().splitlines()
        train, evals = tmp / "train.jsonl", tmp / "eval.jsonl"
        train.write_text("\n".join(lines[:-20]) + "\n")
        evals.write_text("\n".join(lines[-20:]) + "\n")
        for seed in args.seeds:
            base = tmp / f"tiny-{seed}"
            init_model("tiny", base, seed=seed)
            if args.layers != 2:
                deepen(base, args.layers, seed)
            for kind in ("plain", "gpas"):
                tr, ev, last = curves(
                    base,
                    tmp / f"{kind}-{seed}",
                    train,
                    evals,
                    args.steps,
                    args.eval_every,
                    seed,
                    kind == "gpas",
                )
                gates = {k: round(v, 4) for k, v in last.items() if k.startswith("gpas/")}
                results[kind][seed] = {"train": tr, "eval": ev, "gates": gates}
                print(
                    f"seed {seed} {kind}: final train {tr[max(tr)]:.4f} eval {ev[max(ev)]:.4f} {gates}",
                    flush=True,
                )
    report(results, args)


def deepen(base: Path, layers: int, seed: int) -> None:
    """The tiny preset with ``layers`` decoder layers, freshly initialised in place (tokenizer kept)."""
    from engine.models import ErnieForCausalLM
    from engine.models.config import ErnieConfig
    from engine.models.initialize import init_weights
    from engine.models.saving import save_model

    model = ErnieForCausalLM(ErnieConfig.from_file(base).replace(num_hidden_layers=layers))
    init_weights(model, seed)
    save_model(model, base)


def _int_keys(curve: dict) -> dict:
    return {int(k) if k.isdigit() else k: v for k, v in curve.items()}


def _stats(values: list[float]) -> str:
    spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.3f}{spread}"


def report(results: dict, args) -> None:
    seeds = args.seeds
    steps = sorted(results["plain"][seeds[0]]["eval"])
    print(
        f"\ntiny PT from scratch, {args.steps} steps, seeds {seeds}: held-out eval loss (mean ± sd over seeds)"
    )
    print("| step | plain | GPAS | GPAS - plain |")
    print("|---|---|---|---|")
    for s in steps:
        p = [results["plain"][seed]["eval"][s] for seed in seeds]
        g = [results["gpas"][seed]["eval"][s] for seed in seeds]
        print(f"| {s} | {_stats(p)} | {_stats(g)} | {statistics.mean(g) - statistics.mean(p):+.3f} |")
    wins = sum(results["gpas"][s]["eval"][steps[-1]] < results["plain"][s]["eval"][steps[-1]] for s in seeds)
    print(f"GPAS ends lower in {wins} of {len(seeds)} seeds")
    if args.json:
        saved = {"steps": args.steps, "layers": args.layers, "results": results}
        args.json.write_text(json.dumps(saved, indent=2, default=str))
    if args.plot:
        plot(results, seeds, args.plot, args)


def plot(results: dict, seeds: list[int], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, curve in zip(axes[:2], ("train", "eval"), strict=True):
        for kind, color in (("plain", "tab:blue"), ("gpas", "tab:orange")):
            steps = sorted(results[kind][seeds[0]][curve])
            ys = np.array([[results[kind][s][curve][t] for t in steps] for s in seeds])
            ax.plot(steps, ys.mean(0), color=color, label=f"{'GPAS' if kind == 'gpas' else 'Pre-LN'}")
            ax.fill_between(steps, ys.min(0), ys.max(0), color=color, alpha=0.2)
        ax.set_title(f"{curve} loss, mean of {len(seeds)} seeds (band: min..max)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    ax = axes[2]
    for s in seeds:  # paired by seed: the same initial weights and data order
        steps = sorted(results["plain"][s]["eval"])
        diff = [results["gpas"][s]["eval"][t] - results["plain"][s]["eval"][t] for t in steps]
        ax.plot(steps, diff, marker=".", label=f"seed {s}")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_title("eval loss, GPAS minus Pre-LN (per seed)")
    ax.set_xlabel("step")
    ax.legend()
    fig.suptitle(f"tiny preset ({getattr(args, 'layers', 2)} layers, hidden 128), PT from scratch")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
