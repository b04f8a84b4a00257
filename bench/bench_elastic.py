"""Elastic MoE training against plain training: the eval loss of every family member, cut out of each run.

Run with ``.venv/bin/python bench/bench_elastic.py [--steps 300] [--seeds 0 1 2]``. For each seed, two PT
runs from the same random tiny-moe model on the same data with the same steps: one plain, one elastic
(depth 2 of 3, 4 of 8 experts, top-1 of 2; full model half of the steps). Every member is then extracted
(``ernie-studio export elastic_*=...``, the real smaller model directory) and evaluated on held-out text.
Prints a table of eval losses per member and run, and the full model's difference.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "pt_demo.jsonl"
ELASTIC = dict(
    elastic=True,
    elastic_depth_choices="2",
    elastic_experts_choices="4",
    elastic_topk_choices="1",
    elastic_full_share=0.5,
)


def split_data(tmp: Path, held_out: int = 20) -> tuple[Path, Path]:
    """pt_demo.jsonl's last ``held_out`` documents for evaluation, the others for training."""
    lines = DATA.read_text().splitlines()
    train, evals = tmp / "train.jsonl", tmp / "eval.jsonl"
    train.write_text("\n".join(lines[:-held_out]) + "\n")
    evals.write_text("\n".join(lines[-held_out:]) + "\n")
    return train, evals


def pretrain(base: Path, out: Path, train: Path, steps: int, seed: int, **extra) -> float:
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
        max_seq_len=64,
        packing=True,
        batch_size=4,
        learning_rate=3e-3,
        warmup_steps=10,
        max_steps=steps,
        save_steps=steps,
        logging_steps=10,
        disable_tqdm=True,
        report_to="none",
        seed=seed,
        moe_correction_bias_rate=0.01,
    )
    t0 = time.time()
    run_training(config_from_dict(TrainConfig, values | extra))
    return time.time() - t0


def member_losses(run: Path, evals: Path, members: list[tuple[int, int, int]]) -> dict[str, float]:
    """Export each member of ``run`` as a model directory, load it and evaluate it on ``evals``."""
    import engine
    from engine.data import build_train_data
    from engine.train import run_export
    from engine.train.config_load import config_from_dict
    from engine.train.export_config import ExportConfig
    from engine.train.sft import evaluate_lm
    from engine.train.stages import PT

    tok = engine.load_tokenizer(run)
    batches = list(
        build_train_data(
            {"train_dataset_path": str(evals)}, tok, stage=PT.name, max_seq_len=64, packing=True, batch_size=8
        ).one_pass()
    )
    out = {}
    for d, e, k in members:
        name = f"d{d}-e{e}-k{k}"
        export = run / f"member-{name}"
        values = dict(output_dir=str(run), export_dir=str(export))
        values |= dict(elastic_depth=d, elastic_experts=e, elastic_topk=k)
        run_export(config_from_dict(ExportConfig, values))
        out[name] = evaluate_lm(engine.load_model(export), batches)["eval_loss"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--plot", type=Path, help="draw eval loss against active weights into this PNG")
    parser.add_argument("--replot", type=Path, help="only report and draw what a --json run wrote")
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        args.steps, args.seeds = saved["steps"], saved["seeds"]
        report({k: saved[k] for k in ("plain", "elastic")}, args)
        return
    logging.disable(logging.INFO)
    from engine.models.initialize import init_model

    members = [(3, 8, 2), (3, 8, 1), (3, 4, 2), (3, 4, 1), (2, 8, 2), (2, 8, 1), (2, 4, 2), (2, 4, 1)]
    results: dict[str, dict[str, list[float]]] = {"plain": {}, "elastic": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, evals = split_data(tmp)
        for seed in args.seeds:
            base = tmp / f"tiny-moe-{seed}"
            init_model("tiny-moe", base, seed=seed)
            for kind, extra in (("plain", {}), ("elastic", ELASTIC)):
                run = tmp / f"{kind}-{seed}"
                secs = pretrain(base, run, train, args.steps, seed, **extra)
                losses = member_losses(run, evals, members)
                for name, loss in losses.items():
                    results[kind].setdefault(name, []).append(loss)
                print(f"seed {seed} {kind}: {args.steps} steps in {secs:.0f} s", flush=True)
    report(results, args)


def report(results: dict[str, dict[str, list[float]]], args) -> None:
    members = [tuple(int(x[1:]) for x in name.split("-")) for name in results["plain"]]
    print(
        f"\ntiny-moe PT, {args.steps} steps, seeds {args.seeds}: held-out eval loss of each extracted member"
    )
    print("| member (depth-experts-topk) | plain run | elastic run | elastic - plain |")
    print("|---|---|---|---|")
    for d, e, k in members:
        name = f"d{d}-e{e}-k{k}"
        p, el = results["plain"][name], results["elastic"][name]
        mp, me = statistics.mean(p), statistics.mean(el)
        spread = lambda v: f" ± {statistics.stdev(v):.3f}" if len(v) > 1 else ""  # noqa: E731
        print(f"| {name}{' (full)' if (d, e, k) == (3, 8, 2) else ''} | {mp:.3f}{spread(p)} | "
              f"{me:.3f}{spread(el)} | {me - mp:+.3f} |")  # fmt: skip
    wins = {
        name: sum(e < p for p, e in zip(results["plain"][name], results["elastic"][name], strict=True))
        for name in results["plain"]
    }
    print("seeds where the elastic run's member is lower: " + ", ".join(f"{k} {v}" for k, v in wins.items()))
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "seeds": args.seeds, **results}, indent=2))
    if args.plot:
        plot(results, members, args)


def plot(results: dict, members: list[tuple[int, int, int]], args) -> None:
    """Eval loss against active weights per token, one point per member and run (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from engine.models.elastic import SubModel, active_parameters
    from engine.models.presets import preset_config

    config = preset_config("tiny-moe", vocab_size=1024)  # init-model's tokenizer (train_tokenizer's default)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, color in (("plain", "tab:blue"), ("elastic", "tab:orange")):
        xs, ys = [], []
        for d, e, k in members:
            xs.append(active_parameters(config, SubModel(d, e, k))[1] / 1e3)
            ys.append(statistics.mean(results[kind][f"d{d}-e{e}-k{k}"]))
            ax.annotate(f"d{d}-e{e}-k{k}", (xs[-1], ys[-1]), fontsize=7, color=color)
        ax.scatter(xs, ys, color=color, label=f"cut from the {kind} run")
    ax.set_xlabel("active weights per token (thousands)")
    ax.set_ylabel(f"held-out eval loss (mean of {len(args.seeds)} seeds)")
    ax.set_title(f"tiny-moe family after {args.steps} PT steps: size vs quality")
    ax.legend()
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
