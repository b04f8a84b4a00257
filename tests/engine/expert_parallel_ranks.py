"""One rank of tests/engine/test_expert_parallel.py under ``paddle.distributed.launch`` (2 gloo ranks).

For tiny-moe and tiny-vl: one step's logits and gradients with the experts split over both ranks against
one process holding the whole batch, the bytes of the routed experts each rank holds, and a 20-step
expert-parallel training run; then each rank trains one of the two one-process references (rank 0 the text
MoE, rank 1 the VL MoE, at the same time). Also splits the transformers-parity golden text MoE and VL MoE
(both expert groups), runs their golden inputs through the split models, and writes them back un-split.
Results go to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import paddle

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.models.expert_parallel import (  # noqa: E402
    RemoteExpert,
    gather_to_writer,
    moe_layers,
    unsplit_experts,
)
from engine.models.moe import MoELayer  # noqa: E402
from engine.startup import end_rank  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from engine.train import run_training  # noqa: E402
from engine.train.build import build_data, build_model  # noqa: E402
from engine.train.config_load import load_config  # noqa: E402
from engine.train.objectives import LanguageModel  # noqa: E402
from engine.train.parallel import DataParallel  # noqa: E402
from engine.train.sft import to_tensor_batch  # noqa: E402
from engine.train.step import accumulate_gradients  # noqa: E402

# A router loss of each kind, so their global-batch form is part of every gradient compared here.
ROUTER = ["moe_aux_loss_lambda=0.01", "moe_z_loss_lambda=0.001", "moe_orthogonal_loss_lambda=0.01"]


def overrides(kind: str, model: str, out: Path, extra: list[str]) -> tuple[Path, list[str]]:
    yaml = ROOT / ("examples/sft_full.yaml" if kind == "moe" else "examples/vl_sft.yaml")
    data = "examples/data/sft_demo.jsonl" if kind == "moe" else "examples/data/vl_demo.jsonl"
    return yaml, [
        f"model_name_or_path={model}",
        f"train_dataset_path={ROOT / data}",
        "max_seq_len=128" if kind == "moe" else "max_seq_len=256",
        "max_steps=20",
        # At 3e-3 the tiny VL model's step 10 has a gradient norm of 13, after which any float32 rounding
        # (data parallel's as well) grows past 1e-5; at 1e-3 both parallel runs stay within 1e-6.
        "learning_rate=3e-3" if kind == "moe" else "learning_rate=1e-3",
        "warmup_steps=2",
        "save_steps=10",
        "logging_steps=1",
        "disable_tqdm=true",
        "seed=5",
        f"output_dir={out}",
        *ROUTER,
        # the text runs keep a weight average too: each rank averages its own experts, checkpoints gather it
        *(["ema_decay=0.9"] if kind == "moe" else []),
        *extra,
    ]


# Six LoRA steps (rank 8, every linear of the experts included), saved at step 3 and at the end.
LORA = ["fine_tuning=LoRA", "lora_rank=8", "max_steps=6", "save_steps=3"]


class OneProcess(DataParallel):
    """The one-process reference inside a launched rank: no communication."""

    def __init__(self):
        self.world, self.rank = 1, 0


def grads(model) -> dict[str, np.ndarray]:
    return {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}


def step_parity(kind: str, model_dir: str, dp: DataParallel, out: Path, extra: tuple = ()) -> dict:
    """One step's logits and gradients, split over the ranks (with ``extra`` settings) vs. one process
    with the whole batch."""
    yaml, over = overrides(kind, model_dir, out / f"unused-{kind}", ["batch_size=2"])
    cfg = load_config(yaml, [*over, "expert_parallel_degree=2", *extra])
    one_cfg = load_config(yaml, over)
    tok = load_tokenizer(model_dir)
    ref, _ = build_model(one_cfg)
    batch = next(iter(build_data(cfg, tok, "train", 2 * dp.world, ref.config.vision_config)))
    groups = ref.config.expert_counts
    full_sums, _, _ = accumulate_gradients(ref, LanguageModel(), [batch], OneProcess(), groups)
    ref_grads = grads(ref)
    ep, trainable = build_model(cfg, world=dp.world)
    mine = dp.slice(batch, ep.config)
    calls = [0]  # forward calls of the held and shared expert MLPs (twice with recompute: the replay)
    hooks = [
        mlp.register_forward_post_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        for m in ep.sublayers()
        if isinstance(m, MoELayer)
        for mlp in [*m.experts, m.shared_experts]
        if mlp is not None and not isinstance(mlp, RemoteExpert)
    ]
    sums, _, _ = accumulate_gradients(ep, LanguageModel(), [mine], dp, groups)
    for h in hooks:
        h.remove()
    replicated = [p for n, p in trainable.items() if ".mlp.experts." not in n and p.grad is not None]
    dp.sum_grads(replicated)  # what optimizer_step does; held experts' gradients stay as they are
    ep_grads = grads(ep)
    missing = sorted(set(ref_grads) & set(trainable) - set(ep_grads))
    grad_diff = max(float(np.abs(g - ref_grads[n]).max()) for n, g in ep_grads.items())
    ref.eval(), ep.eval()
    with paddle.no_grad():
        rows = mine["input_ids"].shape[0]
        ref_logits = ref(**to_tensor_batch(batch)["inputs"]).logits.numpy()
        ep_logits = ep(**to_tensor_batch(mine)["inputs"]).logits.numpy()
    ref_logits = ref_logits[dp.rank * rows : (dp.rank + 1) * rows]
    loss = float(dp.sum(np.array([sums["loss"]]))[0])

    def expert_bytes(model) -> int:
        return sum(
            p.numel().item() * p.element_size() for n, p in model.named_parameters() if ".mlp.experts." in n
        )

    held = [
        sum(not isinstance(e, RemoteExpert) for e in m.experts)
        for m in ep.sublayers()
        if isinstance(m, MoELayer)
    ]
    return {
        "logits_diff": float(np.abs(ep_logits - ref_logits).max()),
        "grad_diff": grad_diff,
        "grads_compared": len(ep_grads),
        "missing_grads": missing,
        "loss": loss,
        "one_process_loss": full_sums["loss"],
        "expert_bytes": expert_bytes(ep),
        "full_expert_bytes": expert_bytes(ref),
        "held_experts": held,
        "expert_calls": calls[0],
    }


# The transformers-parity goldens each kind splits: the text MoE's one input, the VL MoE's cases (text,
# images, a video) through both expert groups.
GOLDENS = {"moe": "tests/engine/golden/moe", "vl": "tests/engine/golden/vl_moe"}


def golden_inputs(kind: str, expected) -> dict[str, tuple[dict, np.ndarray]]:
    """Each golden case's model inputs and transformers' logits."""
    if kind == "moe":
        return {"text": ({"input_ids": paddle.to_tensor(expected["input_ids"])}, expected["logits"])}
    from tests.engine.test_vl_parity import CASES
    from tests.engine.test_vl_parity import _case as vl_case

    cases = {}
    for case in CASES:
        ids, pix, grids = vl_case(expected, case)
        images = {"pixel_values": paddle.to_tensor(pix), "grid_thw": grids} if pix is not None else {}
        cases[case] = ({"input_ids": paddle.to_tensor(ids), **images}, expected[f"{case}/logits"])
    return cases


def golden_roundtrip(kind: str, dp: DataParallel, out: Path) -> dict:
    """A transformers-parity golden split over the ranks: each case's largest logit difference from
    transformers', the experts this rank held (per MoE layer), and the model written back un-split to
    ``<out>/golden-<kind>-unsplit``."""
    golden = ROOT / GOLDENS[kind]
    yaml, over = overrides(kind, str(golden / "paddle"), out / f"unused-golden-{kind}", [])
    cfg = load_config(yaml, [*over, "expert_parallel_degree=2"])
    model, _ = build_model(cfg, world=dp.world)
    model.eval()
    gaps = {}
    with paddle.no_grad():
        for case, (inputs, logits) in golden_inputs(kind, np.load(golden / "expected.npz")).items():
            gaps[case] = float(np.abs(model(**inputs).logits.numpy() - logits).max())
    held = [
        [i for i, e in enumerate(m.experts) if not isinstance(e, RemoteExpert)] for m in moe_layers(model)
    ]
    if unsplit_experts(model, model.expert_group):
        from engine.models.saving import save_model

        save_model(model, out / f"golden-{kind}-unsplit")
    return {"logits_diff": gaps, "held_experts": held}


def gather_check(dp: DataParallel) -> dict:
    """``gather_to_writer``: rank 0 receives what only rank 1 holds (each dtype kept, numpy as numpy), takes
    a name both hold from itself, and rank 1 ends with nothing."""
    mine = {
        "both": paddle.full([2], float(dp.rank)),
        f"only{dp.rank}.bf16": paddle.full([3], 1.5 + dp.rank, dtype="bfloat16"),
        f"only{dp.rank}.int8": paddle.full([2, 2], 7 + dp.rank, dtype="int8"),
        f"only{dp.rank}.numpy": np.full([4], 2.5 + dp.rank, np.float32),
        "scheduler": {"last_epoch": dp.rank},
    }
    got = gather_to_writer(mine)
    if got is None:
        return {"got": None}
    return {
        "got": {
            k: (
                type(v).__name__,
                str(v.dtype),
                np.asarray(v.astype("float32") if k.endswith("bf16") else v).tolist(),
            )
            if not isinstance(v, dict)
            else v
            for k, v in got.items()
        }
    }


def main() -> None:
    moe_dir, vl_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dp = DataParallel()
    result: dict = {"rank": dp.rank}
    models = {"moe": moe_dir, "vl": vl_dir}
    for kind, model_dir in models.items():
        result[kind] = step_parity(kind, model_dir, dp, out)
        result[f"{kind}_recompute"] = step_parity(kind, model_dir, dp, out, ("recompute=true",))
    result["golden"] = {kind: golden_roundtrip(kind, dp, out) for kind in models}
    result["gather"] = gather_check(dp)
    for kind, model_dir in models.items():
        # the VL run also recomputes (experts replayed, the exchange not): its losses must not move
        extra = ["recompute=true"] if kind == "vl" else []
        yaml, over = overrides(kind, model_dir, out / f"ep-{kind}", ["batch_size=2", *extra])
        result[f"train_{kind}"] = run_training(load_config(yaml, [*over, "expert_parallel_degree=2"])).status
    # LoRA on the experts too: the final adapter gathers every expert's A and B to rank 0
    yaml, over = overrides("moe", moe_dir, out / "ep-moe-lora", ["batch_size=2", *LORA])
    result["train_moe_lora"] = run_training(load_config(yaml, [*over, "expert_parallel_degree=2"])).status
    # The one-process references, one per rank at the same time: PADDLE_TRAINERS_NUM=1 makes the trainer
    # run alone (no collective), with the doubled batch.
    kind = list(models)[dp.rank]
    os.environ["PADDLE_TRAINERS_NUM"] = "1"
    yaml, over = overrides(kind, models[kind], out / f"one-{kind}", ["batch_size=4"])
    result[f"reference_{kind}"] = run_training(load_config(yaml, over)).status
    if kind == "moe":
        yaml, over = overrides(kind, models[kind], out / "one-moe-lora", ["batch_size=4", *LORA])
        result["reference_moe_lora"] = run_training(load_config(yaml, over)).status
    (out / f"rank{dp.rank}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
    end_rank(0)  # no native teardown racing rank 0's TCP store thread
