"""Training-step cost of each stage and compute type against full fp32 SFT, measured in the same run.

One step = the trainer's own ``accumulate_gradients`` (forward, loss, backward) + gradient clipping +
AdamW, on the same demo batch for every variant. Variants are interleaved round by round so load from
other processes on the machine hits them alike; the median step is reported.

    .venv/bin/python bench/bench_train.py [--rounds 5] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import paddle

import engine
from engine.data import build_train_data
from engine.models import ErnieConfig, ErnieForCausalLM, save_model
from engine.models.initialize import init_model, init_weights
from engine.models.presets import scaled_config
from engine.tokenizer import copy_tokenizer_files
from engine.train import quant
from engine.train.build import build_model, build_optimizer
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict
from engine.train.objectives import build_objective
from engine.train.parallel import DataParallel
from engine.train.stages import DPO, SFT
from engine.train.step import accumulate_gradients

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"

VARIANTS = {
    "SFT Full fp32 (baseline)": dict(),
    "SFT LoRA r8": dict(fine_tuning="LoRA"),
    "SFT Full, recompute": dict(recompute=True),
    "SFT Full, FP8 QAT + Hadamard": dict(compute_type="fp8"),
    "SFT Full, FP8 QAT, no Hadamard": dict(compute_type="fp8", fp8_hadamard=False),
    "SFT LoRA on wint8 base": dict(fine_tuning="LoRA", compute_type="wint8"),
    "DPO Full (frozen reference copy)": dict(stage=DPO.name),
    "DPO LoRA (adapters-off reference)": dict(stage=DPO.name, fine_tuning="LoRA"),
}


def make_model_dir(out: Path, hidden: int, layers: int) -> Path:
    """A dense model wider than the tiny preset (so matmuls, not Python, dominate), with its tokenizer."""
    tiny = init_model("tiny", out / "tiny")
    cfg = scaled_config("tiny", hidden, layers, vocab_size=ErnieConfig.from_file(tiny).vocab_size)
    model = ErnieForCausalLM(cfg)
    init_weights(model, seed=0)
    d = out / "model"
    save_model(model, d)
    copy_tokenizer_files(tiny, d)
    return d


class Variant:
    def __init__(self, name: str, cfg: TrainConfig, batch: dict):
        self.name, self.cfg, self.batch = name, cfg, batch
        self.model, trainable = build_model(cfg)
        self.params = list(trainable.values())
        self.optimizer = build_optimizer(cfg, self.model, trainable)
        self.objective = build_objective(cfg)
        self.dp = DataParallel()
        self.times: list[float] = []
        self.trainable = sum(int(p.numel()) for p in self.params)

    def step(self) -> None:
        t0 = time.perf_counter()
        accumulate_gradients(self.model, self.objective, [self.batch], self.dp, [])
        for p in self.params:
            if p.grad is None:
                p._copy_gradient_from(paddle.zeros_like(p))
        paddle.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.clear_grad(set_to_zero=False)
        if self.cfg.compute_type == "fp8":
            quant.next_step(self.model)
        self.times.append(time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp), args.hidden, args.layers)
        tok = engine.load_tokenizer(model_dir)

        def first_batch(stage: str, path: Path) -> dict:
            data = build_train_data(
                {"train_dataset_path": str(path)},
                tok,
                stage=stage,
                max_seq_len=256,
                packing=False,
                batch_size=args.batch,
                shuffle=False,
            )
            return next(iter(data.one_pass()))

        batches = {
            SFT.name: first_batch(SFT.name, DATA / "sft_demo.jsonl"),
            DPO.name: first_batch(DPO.name, DATA / "dpo_demo.jsonl"),
        }
        variants = []
        for name, extra in VARIANTS.items():
            values = dict(
                model_name_or_path=str(model_dir), train_dataset_path="demo.jsonl", learning_rate=1e-4
            )
            cfg = config_from_dict(TrainConfig, values | extra)
            variants.append(Variant(name, cfg, batches[cfg.stage]))
        for v in variants:  # warm-up: first-call allocations and kernel selection
            v.step()
            v.times.clear()
        for _ in range(args.rounds):
            for v in variants:
                v.step()

    base = statistics.median(variants[0].times)
    tokens = int(batches[SFT.name]["attention_mask"].sum())
    print(
        f"\nTraining step, hidden {args.hidden}, {args.layers} layers, batch {args.batch} "
        f"(SFT {tokens} real tokens), median of {args.rounds} interleaved rounds\n"
    )
    print("| variant | trainable weights | step ms | vs Full fp32 |")
    print("|---|---:|---:|---:|")
    for v in variants:
        ms = statistics.median(v.times) * 1000
        print(f"| {v.name} | {v.trainable:,} | {ms:.0f} | {ms / (base * 1000):.2f}x |")


if __name__ == "__main__":
    main()
