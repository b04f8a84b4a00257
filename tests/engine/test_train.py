"""Training stages end to end on the demo data with the tiny presets.

Trained artefacts (the SFT model, the LoRA run) are session fixtures shared by the tests that need them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

import engine
from engine.data import build_train_data
from engine.models.loading import load_plain_model
from engine.models.lora import LoRALinear, apply_lora, load_adapter_weights, lora_layers
from engine.train import run_export, run_training
from engine.train.build import build_model, build_optimizer
from engine.train.config import TrainConfig
from engine.train.config_load import config_from_dict, load_export_config
from engine.train.dpo import preference_loss
from engine.train.export_config import ExportConfig
from engine.train.moe_balance import expert_counts, present_groups
from engine.train.objectives import LanguageModel, Preference, build_objective
from engine.train.sft import evaluate_lm, language_model_loss, to_tensor_batch
from engine.train.trainer import lr_at

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"


def train(out: Path, **values) -> tuple[object, list[dict]]:
    """Run one stage in-process; returns the summary and the metrics.jsonl rows."""
    base = dict(
        output_dir=str(out),
        fine_tuning="Full",  # the engine's default is ERNIEKit's (LoRA); these runs train every weight
        train_dataset_path=str(DATA / "sft_demo.jsonl"),
        max_seq_len=256,
        batch_size=4,
        logging_steps=1,
        save_steps=1000,
        disable_tqdm=True,
        seed=7,
    )
    cfg = config_from_dict(TrainConfig, base | values)
    summary = run_training(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def mean(rows: list[dict], key: str, sl: slice) -> float:
    return float(np.mean([r[key] for r in rows[sl]]))


def demo_batch(model_dir: Path, n: int = 4) -> dict:
    data = build_train_data(
        {"train_dataset_path": str(DATA / "sft_demo.jsonl")},
        engine.load_tokenizer(model_dir),
        stage="SFT",
        max_seq_len=128,
        packing=False,
        batch_size=n,
        shuffle=False,
    )
    return next(iter(data.one_pass()))


def logits(model, batch: dict) -> np.ndarray:
    with paddle.no_grad():
        return model(paddle.to_tensor(batch["input_ids"])).logits.numpy()


def eval_batches(model_dir: Path, path: Path, n: int = 8) -> list[dict]:
    data = build_train_data(
        {"train_dataset_path": str(path)},
        engine.load_tokenizer(model_dir),
        stage="SFT",
        max_seq_len=256,
        packing=False,
        batch_size=n,
        shuffle=False,
    )
    return list(data.one_pass())


# ---- shared runs -----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def eval_file(tmp_path_factory) -> Path:
    """The first 48 demo records: enough for a stable perplexity, small enough to evaluate often."""
    path = tmp_path_factory.mktemp("eval") / "sft_eval.jsonl"
    lines = (DATA / "sft_demo.jsonl").read_text().splitlines()[:48]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="session")
def sft_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_full")
    summary, rows = train(
        out,
        model_name_or_path=str(tiny_model_dir),
        learning_rate=3e-3,
        warmup_steps=10,
        max_steps=100,
        min_lr=3e-5,
        weight_decay=0.01,
        save_steps=50,
    )
    return out, summary, rows


@pytest.fixture(scope="session")
def lora_run(sft_run, tmp_path_factory):
    base, _, _ = sft_run
    out = tmp_path_factory.mktemp("sft_lora")
    summary, rows = train(
        out,
        model_name_or_path=str(base),
        fine_tuning="LoRA",
        lora_rank=8,
        lora_plus_scale=4.0,
        learning_rate=5e-3,
        max_steps=30,
    )
    return out, summary, rows


# ---- SFT ---------------------------------------------------------------------------------------------------


def test_sft_loss_halves_within_100_steps(sft_run, eval_file):
    out, summary, rows = sft_run
    assert summary.status == "succeeded"
    assert [r["step"] for r in rows] == list(range(1, 101))
    first, last = mean(rows, "loss", slice(0, 5)), mean(rows, "loss", slice(-10, None))
    print(f"SFT loss {first:.3f} -> {last:.3f} ({100 * (1 - last / first):.0f}% lower)")
    assert last <= 0.5 * first
    for key in ("loss", "learning_rate", "tokens_per_second", "elapsed_s", "grad_norm"):
        assert all(math.isfinite(r[key]) for r in rows), key
    assert rows[-1]["learning_rate"] < rows[20]["learning_rate"]  # cosine decay
    # run directory: final model + tokenizer at the root, checkpoints, summary
    assert {"config.json", "model.safetensors", "tokenizer.model", "run_summary.json"} <= {
        p.name for p in out.iterdir()
    }
    assert [Path(c).name for c in summary.checkpoints] == ["checkpoint-50", "checkpoint-100"]
    saved = json.loads((out / "run_summary.json").read_text())
    assert saved["status"] == "succeeded" and saved["final_metrics"]["step"] == 100
    reloaded = engine.load_model(out)
    ppl = evaluate_lm(reloaded, eval_batches(out, eval_file, 16))["eval_ppl"]
    assert ppl < math.exp(0.5 * rows[0]["loss"])


def test_recompute_gives_the_same_losses_and_ema_averages_the_weights(
    sft_run, tiny_model_dir, eval_file, tmp_path
):
    _, _, reference = sft_run
    out = tmp_path / "ema"
    decay = 0.8
    summary, rows = train(
        out,
        model_name_or_path=str(tiny_model_dir),
        learning_rate=3e-3,
        warmup_steps=10,
        max_steps=4,
        min_lr=3e-5,
        weight_decay=0.01,
        save_steps=1,
        recompute=True,
        ema_decay=decay,
        eval_dataset_path=str(eval_file),
        eval_steps=2,
    )
    assert summary.status == "succeeded"
    assert ["eval_loss" in r for r in rows] == [False, True, False, True]  # every eval_steps
    # same seed, data and warmup as the SFT run: recomputation must not change a single loss
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in reference[:4]], atol=1e-6)
    # the final model is the EMA of the weights after each step (the checkpoints hold the raw weights)
    name = "ernie.layers.1.mlp.down_proj.weight"
    ema = load_plain_model(tiny_model_dir).state_dict()[name].numpy()
    for step in range(1, 5):
        raw = paddle.load(str(out / f"checkpoint-{step}" / "model.pdparams"))[name].numpy()
        ema = decay * ema + (1 - decay) * raw
    final = engine.load_model(out).state_dict()[name].numpy()
    np.testing.assert_allclose(final, ema, atol=1e-6)
    assert not np.allclose(final, raw, atol=1e-5)


def test_lora_trains_only_adapter_weights(sft_run):
    base, _, _ = sft_run
    cfg = config_from_dict(
        TrainConfig,
        dict(
            model_name_or_path=str(base), train_dataset_path="x.jsonl", fine_tuning="LoRA", learning_rate=1e-2
        ),
    )
    model, trainable = build_model(cfg)
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    opt = build_optimizer(cfg, model, trainable)
    batch = demo_batch(base)
    tokens = float((batch["labels"] != -100).sum())
    for _ in range(3):
        loss, _, _ = language_model_loss(model, batch, tokens, 1.0)
        loss.backward()
        opt.step()
        opt.clear_grad()
    changed = {n for n, p in model.named_parameters() if not np.array_equal(p.numpy(), before[n])}
    assert changed == {n for n in before if n.endswith("lora_B")} | {
        n for n in before if n.endswith("lora_A")
    }
    # the expert-free tiny model has 4 targets per layer; every one got an adapter
    assert (
        len([m for m in model.sublayers() if isinstance(m, LoRALinear)]) == 4 * model.config.num_hidden_layers
    )


def test_lora_run_dir_and_merged_export_match_adapter_model(lora_run, sft_run):
    out, summary, rows = lora_run
    base, _, _ = sft_run
    assert summary.status == "succeeded"
    assert mean(rows, "loss", slice(-5, None)) < mean(rows, "loss", slice(0, 5))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert Path(cfg["base_model"]) == base.resolve() and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    # the adapter model: base + LoRA layers holding the trained adapter (not merged)
    adapter_model = load_plain_model(base)
    apply_lora(adapter_model, 8, 16.0, False, cfg["target_modules"])
    load_adapter_weights(adapter_model, out)
    adapter_model.eval()
    batch = demo_batch(base)
    want = logits(adapter_model, batch)
    assert not np.allclose(
        want, logits(load_plain_model(base), batch), atol=1e-4
    )  # the adapter does something

    # engine.load_model on the run dir = base + merged adapter
    np.testing.assert_allclose(logits(engine.load_model(out), batch), want, atol=1e-5, rtol=0)
    # ERNIEKit-style export: <output_dir>/export with base config and tokenizer files
    summary = run_export(ExportConfig(output_dir=str(out), lora=True))
    export = out / "export"
    assert summary.merged_lora and Path(summary.export_dir) == export
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"} <= set(
        summary.files
    )
    np.testing.assert_allclose(logits(engine.load_model(export), batch), want, atol=1e-5, rtol=0)


def test_an_export_appears_whole_or_not_at_all(tiny_model_dir, tmp_path):
    """export_dir is renamed into place once complete: a re-export replaces the earlier one whole (no shard
    of it left), one that fails after writing its weights leaves the earlier one as it was, and a directory
    holding other files is refused untouched."""
    import shutil

    out = tmp_path / "models" / "exported"

    def export(source: Path = tiny_model_dir, **values) -> None:
        run_export(ExportConfig(model_name_or_path=str(source), export_dir=str(out), **values))

    export(max_shard_size="200KB")
    assert len(list(out.glob("model-*.safetensors"))) > 2
    export()  # one file now: the earlier shards and their index go with the earlier export
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # a source whose tokenizer cannot be copied: the export fails after its weights are written
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer_config.json").unlink()
    (broken / "tokenizer_config.json").mkdir()
    with pytest.raises(IsADirectoryError):
        export(broken, max_shard_size="200KB")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir()] == ["exported"]  # no hidden work directory left
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an earlier export"):
        run_export(ExportConfig(model_name_or_path=str(tiny_model_dir), export_dir=str(foreign)))
    assert [p.name for p in foreign.iterdir()] == ["todo.txt"]


def test_hf_layout_export_with_shards_reloads_identically(sft_run, tiny_model_dir, tmp_path):
    model_dir, _, _ = sft_run
    out = tmp_path / "hf"
    # the training config's keys, as `ernie-studio export sft.yaml layout=hf` passes them: the trained
    # model in output_dir is exported, not the base in model_name_or_path
    cfg = load_export_config(
        None,
        [
            f"model_name_or_path={tiny_model_dir}",
            f"output_dir={model_dir}",
            "stage=SFT",
            "learning_rate=0.003",
            f"export_dir={out}",
            "layout=hf",
            "max_shard_size=200KB",
        ],
    )
    assert not run_export(cfg).merged_lora
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    keys = set(index["weight_map"])
    assert "model.embed_tokens.weight" in keys and "model.layers.0.self_attn.q_proj.weight" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys and not any("qkv_proj" in k for k in keys)
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["model_type"] == "ernie4_5" and hf_cfg["architectures"] == ["Ernie4_5ForCausalLM"]
    # every key transformers 5.x writes for this model (tests/engine/golden holds one of its config.json files)
    golden = json.loads((Path(__file__).parent / "golden/dense_tied/hf/config.json").read_text())
    assert set(golden) - {"transformers_version", "initializer_range"} <= set(hf_cfg)
    assert hf_cfg["rope_parameters"]["rope_theta"] == hf_cfg["rope_theta"] and hf_cfg["dtype"] == "float32"
    assert (out / "tokenizer.model").exists()
    batch = demo_batch(model_dir)
    np.testing.assert_array_equal(
        logits(engine.load_model(out), batch), logits(engine.load_model(model_dir), batch)
    )


@pytest.mark.parametrize(("method", "limit"), [("wint8", 0.02), ("wint4", 0.10), ("fp8", 0.05)])
def test_ptq_perplexity_close_to_fp32(sft_run, eval_file, tmp_path, method, limit):
    model_dir, _, _ = sft_run
    out = tmp_path / method
    cfg = ExportConfig(
        model_name_or_path=str(model_dir),
        export_dir=str(out),
        quantization=method,
        weight_quant_group_size=32,
        eval_dataset_path=str(eval_file),
        max_seq_len=256,
        batch_size=16,
    )
    ppl = run_export(cfg).perplexity
    print(
        f"PTQ {method}: perplexity {ppl['fp32']:.4f} -> {ppl[method]:.4f} ({100 * ppl['relative_change']:+.2f}%)"
    )
    assert abs(ppl["relative_change"]) <= limit
    # the export reloads quantized and gives the reported perplexity
    reloaded = engine.load_model(out)
    again = evaluate_lm(reloaded, eval_batches(model_dir, eval_file, 16))["eval_ppl"]
    assert again == pytest.approx(ppl[method], rel=1e-5)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    fp32 = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    print(f"PTQ {method}: weights {fp32 / 1e6:.2f} MB -> {size / 1e6:.2f} MB (embeddings stay fp32)")
    assert size < 0.5 * fp32
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["quantization_config"]["quant_method"] in ("weight_only_int8", "weight_only_int4", "fp8")
    # a quantized export is not a source for another export (its linears hold quantized values)
    with pytest.raises(ValueError, match="already a quantized export"):
        run_export(ExportConfig(model_name_or_path=str(out), export_dir=str(tmp_path / "again")))


# ---- DPO ---------------------------------------------------------------------------------------------------


def test_dpo_learns_preferences(sft_run, tmp_path):
    base, _, _ = sft_run
    dpo = str(DATA / "dpo_demo.jsonl")
    summary, rows = train(
        tmp_path / "dpo",
        model_name_or_path=str(base),
        stage="DPO",
        train_dataset_path=dpo,
        eval_dataset_path=dpo,
        learning_rate=2e-3,
        warmup_steps=3,
        max_steps=30,
        beta=0.1,
    )
    assert summary.status == "succeeded"
    # step 1 is computed before any update: policy == frozen reference, so rewards are 0 and loss ln 2
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    early, late = mean(rows, "rewards/margins", slice(0, 5)), mean(rows, "rewards/margins", slice(-5, None))
    acc = summary.final_metrics["eval_rewards/accuracy"]
    print(
        f"DPO margin {early:.3f} -> {late:.3f}; accuracy on the {summary.final_metrics['eval_pairs']} training pairs {acc:.2f}"
    )
    assert late > early + 0.5
    assert acc >= 0.9


def test_dpo_lora_reference_is_the_adapter_free_model(sft_run, tmp_path):
    base, _, _ = sft_run
    summary, rows = train(
        tmp_path / "dpo_lora",
        model_name_or_path=str(base),
        stage="DPO",
        fine_tuning="LoRA",
        loss_type="ipo",
        train_dataset_path=str(DATA / "dpo_demo.jsonl"),
        learning_rate=5e-3,
        max_steps=8,
    )
    assert summary.status == "succeeded"
    # LoRA B starts at zero: the adapter-free reference equals the policy at step 1 (IPO loss = (1/2beta)^2)
    assert rows[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert rows[0]["dpo_loss"] == pytest.approx((1 / (2 * 0.1)) ** 2, rel=1e-4)
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]


def dpo_setup(model_dir: Path, out: Path, **values):
    """(config, policy model, DPO loss with its reference, one batch of pairs) of a Full DPO run."""
    from engine.train.build import build_dpo_loss
    from engine.train.precision import resolve_precision

    dpo = str(DATA / "dpo_demo.jsonl")
    cfg = config_from_dict(
        TrainConfig,
        dict(model_name_or_path=str(model_dir), output_dir=str(out), stage="DPO", fine_tuning="Full")
        | dict(train_dataset_path=dpo, max_seq_len=128)
        | values,
    )
    precision = resolve_precision(cfg.compute_type)
    model, _ = build_model(cfg, precision)
    data = build_train_data(
        {"train_dataset_path": dpo},
        engine.load_tokenizer(model_dir),
        stage="DPO",
        max_seq_len=128,
        packing=False,
        batch_size=4,
        shuffle=False,
    )
    return cfg, model, build_dpo_loss(cfg, precision), next(iter(data.one_pass()))


def reference_logps(loss, model, batch) -> np.ndarray:
    from engine.train.sft import to_tensor_batch

    c, r = loss.reference_logps(model, to_tensor_batch(batch, "chosen_"), to_tensor_batch(batch, "rejected_"))
    return np.concatenate([c.numpy(), r.numpy()])


def test_full_dpo_reference_is_held_as_the_run_holds_its_weights(tiny_model_dir, tmp_path):
    _, model, loss, batch = dpo_setup(tiny_model_dir, tmp_path, compute_type="bf16")
    ref = dict(loss.reference.named_parameters())
    matrices = {n: p.dtype for n, p in ref.items() if len(p.shape) == 2}
    assert set(matrices.values()) == {paddle.bfloat16}  # not a second model in fp32
    assert all(p.stop_gradient for p in ref.values())
    # before its first update the policy is its reference, computed the same way: rewards exactly 0
    _, m, _ = loss(model, batch, pair_norm=4.0, token_norm=100.0, share=1.0)
    assert m["rewards/chosen"] == 0.0 and m["rewards/margins"] == 0.0


def test_full_dpo_reference_can_be_held_weight_only_quantized(tiny_model_dir, tmp_path):
    from engine.models.quantized import WeightOnlyLinear

    _, model, exact, batch = dpo_setup(tiny_model_dir, tmp_path / "fp32")
    _, _, wint8, _ = dpo_setup(tiny_model_dir, tmp_path / "wint8", dpo_reference_dtype="wint8")
    layers = model.config.num_hidden_layers
    assert sum(isinstance(m, WeightOnlyLinear) for m in wint8.reference.sublayers()) == 4 * layers
    assert not any(isinstance(m, WeightOnlyLinear) for m in exact.reference.sublayers())
    a, b = reference_logps(exact, model, batch), reference_logps(wint8, model, batch)
    # int8 per channel moves each summed log-probability by a small share of it, and does move it
    assert 0 < np.abs(a - b).max() < 0.01 * np.abs(a).max()


def test_dpo_reference_dtype_is_refused_where_no_reference_model_is_held(tiny_model_dir, tmp_path):
    base = dict(
        model_name_or_path=str(tiny_model_dir), output_dir=str(tmp_path), train_dataset_path="x.jsonl"
    )
    for values in (
        dict(stage="DPO", fine_tuning="LoRA"),
        dict(stage="DPO", fine_tuning="Full", reference_free=True),
        dict(stage="SFT", fine_tuning="Full"),
    ):
        cfg = TrainConfig(**base, **values, dpo_reference_dtype="wint8")
        assert any(p.startswith("dpo_reference_dtype wint8") for p in cfg.validate()), values
    ok = TrainConfig(**base, stage="DPO", fine_tuning="Full", dpo_reference_dtype="wint8")
    assert not [p for p in ok.validate() if "dpo_reference_dtype" in p]


# ---- pretraining the MoE -------------------------------------------------------------------------------------


def pretrain_moe(model_dir: Path, out: Path, aux_free: bool, steps: int = 200):
    return train(
        out,
        model_name_or_path=str(model_dir),
        stage="PT",
        train_dataset_path=str(DATA / "pt_demo.jsonl"),
        max_seq_len=64,
        packing=True,
        batch_size=2,
        learning_rate=3e-3,
        warmup_steps=10,
        max_steps=steps,
        logging_steps=10,
        save_steps=steps,
        moe_use_aux_free=aux_free,
        moe_correction_bias_rate=0.01,
        moe_orthogonal_loss_lambda=0.1,
    )


def test_pretrain_moe_balances_experts_and_orthogonalises_router(tiny_moe_model_dir, tmp_path):
    out = tmp_path / "pt_moe"
    summary, rows = pretrain_moe(tiny_moe_model_dir, out, aux_free=True)
    assert summary.status == "succeeded"
    # the same run without aux-free balancing starves experts (100 steps show it); with it, every step
    # uses them all
    _, unbalanced = pretrain_moe(tiny_moe_model_dir, tmp_path / "pt_moe_off", aux_free=False, steps=100)
    late = slice(-5, None)
    dead_on, dead_off = (
        mean(rows, "experts_without_tokens", late),
        mean(unbalanced, "experts_without_tokens", late),
    )
    max_on, max_off = mean(rows, "expert_load_max", late), mean(unbalanced, "expert_load_max", late)
    print(
        f"MoE PT, last 5 logged steps: experts without tokens {dead_on:.1f} (aux-free) vs {dead_off:.1f} (off); "
        f"busiest expert {max_on:.2f}x vs {max_off:.2f}x the mean load"
    )
    assert dead_on == 0 and dead_off > 0 and max_on < 0.75 * max_off
    assert rows[-1]["loss"] < rows[0]["loss"]
    for key in ("aux_loss", "z_loss", "orthogonal_loss", "experts_without_tokens"):
        assert key in rows[-1]
    print(
        f"MoE PT: loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}, orthogonal loss "
        f"{rows[0]['orthogonal_loss']:.4f} -> {rows[-1]['orthogonal_loss']:.4f}"
    )
    assert rows[-1]["orthogonal_loss"] < 0.5 * rows[0]["orthogonal_loss"]
    # every expert of every MoE layer receives tokens from the trained model on the demo corpus
    model = engine.load_model(out)
    biases = [
        m.moe_statics.e_score_correction_bias.numpy() for m in model.sublayers() if hasattr(m, "moe_statics")
    ]
    assert any(np.abs(b).max() > 0 for b in biases)  # aux-free balancing moved the biases
    data = build_train_data(
        {"train_dataset_path": str(DATA / "pt_demo.jsonl")},
        engine.load_tokenizer(out),
        stage="PT",
        max_seq_len=64,
        packing=True,
        batch_size=8,
        shuffle=False,
    )
    totals = None
    with paddle.no_grad():
        for batch in data.one_pass():
            t = paddle.to_tensor(batch["input_ids"])
            stats = model(t, segment_ids=paddle.to_tensor(batch["segment_ids"])).router_stats
            counts = expert_counts(stats, model.config.expert_counts, present_groups(batch, model.config))
            flat = np.concatenate([c for layer in counts for c in layer])
            totals = flat if totals is None else totals + flat
    print(f"MoE expert loads (tokens per expert, all layers): {totals.tolist()}")
    assert (totals > 0).all()


# ---- multimodal SFT -----------------------------------------------------------------------------------------


def test_vl_sft_trains_on_images(tiny_vl_model_dir, tmp_path):
    summary, rows = train(
        tmp_path / "vl",
        model_name_or_path=str(tiny_vl_model_dir),
        stage="VL-SFT",
        train_dataset_path=str(DATA / "vl_demo.jsonl"),
        learning_rate=2e-3,
        max_steps=20,
    )
    assert summary.status == "succeeded"
    assert mean(rows, "loss", slice(-5, None)) < 0.8 * mean(rows, "loss", slice(0, 3))
    vision = engine.load_model(tmp_path / "vl").vision_model.state_dict()
    initial = load_plain_model(tiny_vl_model_dir).vision_model.state_dict()
    assert any(not np.array_equal(vision[k].numpy(), initial[k].numpy()) for k in vision)


@pytest.mark.parametrize(
    "targets", [None, ["qkv_proj", "o_proj", "up_gate_proj", "down_proj", "vision", "resampler"]]
)
def test_vl_lora_keeps_the_vision_tower_frozen_unless_asked(tiny_vl_model_dir, tmp_path, targets):
    """ERNIEKit's default: a VL LoRA run adapts the decoder only; naming the vision / resampler groups in
    lora_target_modules puts adapters on the ViT's and the resampler's linears too."""
    from engine.models.safetensors_io import SafetensorsFile

    extra = {"lora_target_modules": targets} if targets else {}
    summary, _ = train(
        tmp_path / "vl-lora",
        model_name_or_path=str(tiny_vl_model_dir),
        stage="VL-SFT",
        fine_tuning="LoRA",
        train_dataset_path=str(DATA / "vl_demo.jsonl"),
        learning_rate=5e-3,
        max_steps=6,
        **extra,
    )
    assert summary.status == "succeeded"
    names = list(SafetensorsFile(tmp_path / "vl-lora" / "adapter_model.safetensors").header)
    on_vision = [n for n in names if n.startswith("vision_model.")]
    on_resampler = [n for n in names if n.startswith("ernie.resampler_model.")]
    trained = engine.load_model(tmp_path / "vl-lora")
    base = load_plain_model(tiny_vl_model_dir)
    qkv = trained.vision_model.blocks[0].attn.qkv.weight.numpy()
    moved = not np.array_equal(qkv, base.vision_model.blocks[0].attn.qkv.weight.numpy())
    if targets:
        # patch embedding + 2 blocks x (qkv, proj, fc1, fc2); the resampler's 2 + 2 + 1 linears; A and B each
        assert (len(on_vision), len(on_resampler)) == ((1 + 2 * 4) * 2, 5 * 2) and moved
    else:
        assert on_vision == on_resampler == [] and not moved
        assert any(n.startswith("ernie.layers.") for n in names)


VL_LORA_TARGETS = ["qkv_proj", "o_proj", "up_gate_proj", "down_proj", "vision", "resampler"]
# The ViT's and the resampler's layers: where the vision / resampler groups put adapters.
VISION_PARTS = ("vision_model.", "ernie.resampler_model.")
# Measured 1.16e-6 (merged export against the adapter model) and 9.2e-7 (transformers' port on the -PT
# export against the adapter model) on logits up to 1.5, AMD EPYC AVX-512, 2026-11-28.
VL_MERGE_ATOL = 5e-6


@pytest.fixture(scope="module")
def vl_lora_run(tiny_vl_model_dir, tmp_path_factory):
    """A VL LoRA run with adapters on the decoder, the ViT and the resampler, trained on the demo images;
    its adapter model (base + unmerged adapters, eval mode) and an image batch with that model's logits."""
    out = tmp_path_factory.mktemp("vl_lora")
    summary, _ = train(
        out,
        model_name_or_path=str(tiny_vl_model_dir),
        stage="VL-SFT",
        fine_tuning="LoRA",
        train_dataset_path=str(DATA / "vl_demo.jsonl"),
        learning_rate=5e-3,
        max_steps=6,
        lora_target_modules=VL_LORA_TARGETS,
    )
    assert summary.status == "succeeded"
    cfg = json.loads((out / "adapter_config.json").read_text())
    adapter_model = load_plain_model(tiny_vl_model_dir)
    apply_lora(adapter_model, cfg["r"], cfg["lora_alpha"], cfg["rslora"], cfg["target_modules"])
    load_adapter_weights(adapter_model, out)
    adapter_model.eval()
    data = build_train_data(
        {"train_dataset_path": str(DATA / "vl_demo.jsonl")},
        engine.load_tokenizer(tiny_vl_model_dir),
        stage="VL-SFT",
        max_seq_len=256,
        packing=False,
        batch_size=2,
        shuffle=False,
    )
    batch = next(iter(data.one_pass()))
    assert len(batch["grid_thw"]) == 2  # an image in each sample
    return out, adapter_model, batch, vl_logits(adapter_model, batch)


def vl_logits(model, batch: dict) -> np.ndarray:
    with paddle.no_grad():
        return model(**to_tensor_batch(batch)["inputs"]).logits.numpy()


def real_token_gap(got: np.ndarray, want: np.ndarray, batch: dict) -> float:
    """The largest logit difference over the samples' tokens (padding's logits mean nothing)."""
    return float(np.abs(got - want)[np.asarray(batch["attention_mask"]).astype(bool)].max())


def test_vl_lora_on_vision_and_resampler_is_merged_into_the_export(vl_lora_run, tiny_vl_model_dir, tmp_path):
    """`ernie-studio export lora=True` of a VL run with adapters on the ViT and the resampler folds those
    adapters into their weights (each merged weight = base + A B scale) and gives the adapter model's logits
    on an image batch, in both layouts."""
    run, adapter_model, batch, want = vl_lora_run
    # the vision / resampler adapters matter: without them the logits move far beyond the bound
    for name, m in lora_layers(adapter_model):
        m.enabled = not name.startswith(VISION_PARTS)
    decoder_only = vl_logits(adapter_model, batch)
    for _, m in lora_layers(adapter_model):
        m.enabled = True
    assert real_token_gap(decoder_only, want, batch) > 1000 * VL_MERGE_ATOL
    base = load_plain_model(tiny_vl_model_dir).state_dict()
    adapters = {n: m for n, m in lora_layers(adapter_model) if n.startswith(VISION_PARTS)}
    assert len(adapters) == 1 + 2 * 4 + 5  # the patch embedding, 2 blocks x 4, the resampler's 5
    for layout in ("paddle", "hf"):
        summary = run_export(
            ExportConfig(output_dir=str(run), lora=True, layout=layout, export_dir=str(tmp_path / layout))
        )
        assert summary.merged_lora
        exported = engine.load_model(tmp_path / layout)
        merged = exported.state_dict()
        for name, m in adapters.items():
            key = f"{name}.weight"
            moved = np.abs(merged[key].numpy() - base[key].numpy()).max()
            assert moved > 1e-4, f"{layout}: {key} is the base's: its adapter was dropped"
            expected = (m.base.weight + m.delta_weight()).numpy()
            np.testing.assert_allclose(merged[key].numpy(), expected, atol=1e-6, rtol=0, err_msg=key)
        gap = real_token_gap(vl_logits(exported, batch), want, batch)
        print(f"VL LoRA export ({layout}): max |logit diff| against the adapter model {gap:.2e}")
        assert gap <= VL_MERGE_ATOL


@pytest.mark.skipif(
    not os.environ.get("ERNIE_STUDIO_REFERENCE_PYTHON"),
    reason="set ERNIE_STUDIO_REFERENCE_PYTHON to a Python with torch + transformers 5 to run it",
)
def test_transformers_reads_the_merged_vl_lora_export(vl_lora_run, tmp_path):
    """transformers' own ernie4_5_vl_moe port (its reference env) on the -PT export of the VL LoRA run gives
    the adapter model's logits on an image batch: the merged ViT and resampler are where it reads them."""
    run, _, batch, want = vl_lora_run
    run_export(ExportConfig(output_dir=str(run), lora=True, layout="hf", export_dir=str(tmp_path / "hf")))
    case = tmp_path / "case.npz"
    np.savez(
        case,
        input_ids=batch["input_ids"],
        pixel_values=batch["pixel_values"],
        image_grid_thw=np.asarray(batch["grid_thw"]),
    )
    done = subprocess.run(
        [
            os.environ["ERNIE_STUDIO_REFERENCE_PYTHON"],
            str(ROOT / "tools" / "check_vl_export.py"),
            str(tmp_path / "hf"),
            str(case),
            str(tmp_path / "logits.npy"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    gap = real_token_gap(np.load(tmp_path / "logits.npy"), want, batch)
    print(f"transformers on the VL LoRA -PT export: max |logit diff| against the adapter model {gap:.2e}")
    assert gap <= VL_MERGE_ATOL


def test_vl_keys_on_a_text_model_are_announced_not_ignored(tiny_model_dir, tiny_vl_model_dir):
    """lora_target_modules' vision / resampler groups and min_pixels / max_pixels do nothing on a text
    model: the run says so (a notice per key); on a VL model they are quiet."""
    from engine.train.notices import runtime_notices

    values = dict(
        model_name_or_path=str(tiny_model_dir),
        output_dir="unused",
        train_dataset_path="x.jsonl",
        fine_tuning="LoRA",
        lora_target_modules=["qkv_proj", "vision"],
        min_pixels=3136,
        max_pixels=90000,
    )
    text = runtime_notices(config_from_dict(TrainConfig, values), load_plain_model(tiny_model_dir))
    assert {n.key: n.message for n in text} == {
        "lora_target_modules": "vision: this model has no vision encoder",
        "min_pixels": "this model reads no images",
        "max_pixels": "this model reads no images",
    }
    vl = runtime_notices(config_from_dict(TrainConfig, values), load_plain_model(tiny_vl_model_dir))
    assert vl == []


# ---- quantized training ---------------------------------------------------------------------------------------


def test_fp8_qat_trains(tiny_model_dir, tmp_path):
    out = tmp_path / "fp8"
    summary, rows = train(
        out,
        model_name_or_path=str(tiny_model_dir),
        compute_type="fp8",
        learning_rate=3e-3,
        max_steps=40,
        save_steps=40,
    )
    assert summary.status == "succeeded"
    first, last = mean(rows, "loss", slice(0, 3)), mean(rows, "loss", slice(-5, None))
    print(f"FP8 QAT loss {first:.3f} -> {last:.3f}")
    assert last < 0.7 * first
    state = paddle.load(str(out / "checkpoint-40" / "model.pdparams"))
    scales = [float(v.numpy()[0]) for k, v in state.items() if k.endswith("act_scale")]
    assert len(scales) == 8 and all(s > 0 for s in scales)  # EMA activation scales are checkpointed
    # the final model at the root is a plain checkpoint (no QAT buffers)
    assert not any("act_scale" in k for k in engine.load_model(out).state_dict())


def test_wint8_lora_trains_on_frozen_int8_base(sft_run, eval_file, tmp_path):
    base, _, _ = sft_run
    out = tmp_path / "wint8"
    values = dict(
        model_name_or_path=str(base),
        fine_tuning="LoRA",
        compute_type="wint8",
        learning_rate=1e-2,
        max_steps=20,
        eval_dataset_path=str(eval_file),
    )
    # the int8 base before training, measured on the data the run trains on
    model, trainable = build_model(config_from_dict(TrainConfig, dict(values, train_dataset_path="x.jsonl")))
    assert all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    model.eval()
    before = evaluate_lm(model, eval_batches(base, eval_file))["eval_loss"]
    summary, _ = train(out, **values)
    assert summary.status == "succeeded"
    after = summary.final_metrics["eval_loss"]
    print(f"wint8 LoRA eval loss {before:.4f} -> {after:.4f}")
    assert after < before - 0.01
    # the run dir loads as int8 base + merged adapter, and gives the same loss
    reloaded = evaluate_lm(engine.load_model(out), eval_batches(base, eval_file))["eval_loss"]
    assert reloaded == pytest.approx(after, rel=1e-4)


# ---- small pieces ---------------------------------------------------------------------------------------------


def test_lr_schedules_warm_up_then_decay_to_min_lr():
    def cfg(kind):
        return config_from_dict(
            TrainConfig,
            dict(
                model_name_or_path="m",
                train_dataset_path="d.jsonl",
                learning_rate=1e-3,
                min_lr=1e-4,
                warmup_steps=10,
                lr_scheduler_type=kind,
            ),
        )

    for kind in ("cosine", "linear", "constant"):
        c = cfg(kind)
        assert lr_at(0, c, 110) == pytest.approx(1e-4) and lr_at(9, c, 110) == pytest.approx(1e-3)
    assert lr_at(60, cfg("cosine"), 110) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(60, cfg("linear"), 110) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(35, cfg("cosine"), 110) > lr_at(35, cfg("linear"), 110)
    assert lr_at(110, cfg("cosine"), 110) == pytest.approx(1e-4)
    assert lr_at(109, cfg("constant"), 110) == 1e-3


def test_lora_scales_rslora_and_lora_plus(tiny_model_dir):
    base = dict(model_name_or_path=str(tiny_model_dir), train_dataset_path="d.jsonl", fine_tuning="LoRA")
    cfg = config_from_dict(TrainConfig, dict(base, lora_rank=4, lora_alpha=-1, lora_plus_scale=8.0))
    model, trainable = build_model(cfg)
    layer = next(m for m in model.sublayers() if isinstance(m, LoRALinear))
    assert layer.scale == 2.0  # alpha -1 means 2 * rank, scale alpha / rank
    assert not layer.lora_B.numpy().any()  # B starts at zero: the run starts at the base model
    opt = build_optimizer(cfg, model, trainable)
    rates = {p.name: p.optimize_attr["learning_rate"] for g in opt._param_groups for p in g["params"]}
    assert rates[layer.lora_B.name] == 8.0 and rates[layer.lora_A.name] == 1.0
    rs = config_from_dict(TrainConfig, dict(base, lora_rank=16, lora_alpha=8, rslora=True))
    rs_layer = next(m for m in build_model(rs)[0].sublayers() if isinstance(m, LoRALinear))
    assert rs_layer.scale == pytest.approx(8 / 4)  # rsLoRA: alpha / sqrt(rank)


def test_preference_losses_match_their_formulas():
    z = paddle.to_tensor([-2.0, 0.0, 3.0])
    beta = 0.5

    def sig(x):
        return 1 / (1 + np.exp(-x))

    x = np.array([-2.0, 0.0, 3.0])
    np.testing.assert_allclose(
        preference_loss(z, "sigmoid", beta, 0.0).numpy(), -np.log(sig(beta * x)), rtol=1e-6
    )
    smoothed = -0.9 * np.log(sig(beta * x)) - 0.1 * np.log(sig(-beta * x))
    np.testing.assert_allclose(preference_loss(z, "sigmoid", beta, 0.1).numpy(), smoothed, rtol=1e-6)
    np.testing.assert_allclose(
        preference_loss(z, "ipo", beta, 0.0).numpy(), (x - 1 / (2 * beta)) ** 2, rtol=1e-6
    )
    np.testing.assert_allclose(
        preference_loss(z, "hinge", beta, 0.0).numpy(), np.maximum(0, 1 - beta * x), rtol=1e-6
    )


def test_lora_run_can_be_the_base_of_another_lora_run(lora_run, tmp_path):
    first, _, _ = lora_run
    out = tmp_path / "lora_on_lora"
    # learning rate 0 keeps the new adapter at B = 0, so the chain must reproduce the first run exactly
    summary, _ = train(out, model_name_or_path=str(first), fine_tuning="LoRA", learning_rate=0.0, max_steps=2)
    assert summary.status == "succeeded"
    assert json.loads((out / "adapter_config.json").read_text())["base_model"] == str(first.resolve())
    batch = demo_batch(first)
    np.testing.assert_allclose(
        logits(engine.load_model(out), batch), logits(engine.load_model(first), batch), atol=1e-5, rtol=0
    )


def test_every_stage_but_dpo_trains_the_language_model_objective():
    for stage in ("SFT", "PT", "VL-SFT", "OCR-VL-SFT"):
        assert type(build_objective(TrainConfig(stage=stage))) is LanguageModel
    dpo = build_objective(TrainConfig(stage="DPO", fine_tuning="LoRA"))
    assert type(dpo) is Preference and dpo.dpo.reference is None  # LoRA: the adapters switched off


def test_loading_a_lora_run_needs_nothing_of_the_training_package(lora_run):
    """engine.load_model reads LoRA and quantized directories with engine.models alone (layer contract)."""
    out, _, _ = lora_run
    code = (
        "import sys, engine\n"
        f"model = engine.load_model({str(out)!r})\n"
        "print(type(model).__name__, sorted(m for m in sys.modules if m.startswith('engine.train')))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "ErnieForCausalLM []"


def test_export_max_shard_size_in_gb(tiny_model_dir, tmp_path):
    """ERNIEKit's max_shard_size is a number of GB: 5 keeps the tiny model in one file, 0.001 (1 MB) splits it."""
    sizes = {}
    for value in ("5", "0.001"):
        out = tmp_path / f"export-{value}"
        cfg = load_export_config(
            None, [f"model_name_or_path={tiny_model_dir}", f"export_dir={out}", f"max_shard_size={value}"]
        )
        run_export(cfg)
        sizes[value] = sorted(p.stat().st_size for p in out.glob("*.safetensors"))
    assert len(sizes["5"]) == 1
    assert len(sizes["0.001"]) > 1 and max(sizes["0.001"]) <= 1_000_000 + 300_000  # one tensor may overflow
    assert sum(sizes["0.001"]) >= sizes["5"][0] * 0.99
