"""ERNIEKit's own example configs run through `ernie-studio train` / `export` on tiny models.

The configs are grouped like ERNIEKit's files (PaddlePaddle/ERNIE `examples/configs/`; the snapshot of its
keys is tests/engine/data/erniekit_keys.json, and test_erniekit_keys.py shows what each honoured key does),
with ERNIEKit's values; only paths (tiny models, this repository's demo
data) and the sizes that would make a test slow (max_steps, max_seq_len, gradient_accumulation_steps,
save/eval intervals) differ. Every key must be reflected in the run's effective config
(train_config.json) or announced in its notices (run_summary.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine.train.config_load import load_config, load_export_config
from engine.train.erniekit_keys import ERNIEKIT_ALIASES
from engine.train.options import ConfigError
from engine.train.run_dir import list_checkpoints, prune_checkpoints

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"

AMP_LISTS = """\
amp_custom_white_list:
  - lookup_table
  - lookup_table_v2
  - flash_attn
  - matmul
  - matmul_v2
  - fused_gemm_epilogue
amp_custom_black_list:
  - reduce_sum
  - softmax_with_cross_entropy
  - c_softmax_with_cross_entropy
  - elementwise_div
  - sin
  - cos
"""

# The finetuning block every text config of ERNIEKit shares (run_sft_8k.yaml); @...@ are filled per run.
BASE = (
    """\
model_name_or_path: @MODEL@
output_dir: @OUT@
seed: 23
do_train: True
do_eval: True
distributed_dataloader: False
dataloader_num_workers: 1
batch_size: 1
num_train_epochs: 1
max_steps: 3
max_evaluate_steps: 2
eval_steps: 2
evaluation_strategy: steps
save_steps: 1
save_total_limit: 2
save_strategy: steps
logging_steps: 1
release_grads: True
gradient_accumulation_steps: 2
logging_dir: ./vdl_log
disable_tqdm: True
warmup_steps: 20
lr_scheduler_type: cosine
min_lr: 1.0e-6
layerwise_lr_decay_bound: 1.0
weight_decay: 0.1
adam_epsilon: 1.0e-8
adam_beta1: 0.9
adam_beta2: 0.95
offload_optim: True
tensor_parallel_degree: 1
pipeline_parallel_degree: 1
sharding_parallel_degree: 1
sharding: stage1
sequence_parallel: True
pipeline_parallel_config: enable_delay_scale_loss enable_release_grads disable_partial_send_recv
recompute: False
recompute_use_reentrant: True
fp16_opt_level: O2
disable_ckpt_quant: True
amp_master_grad: True
unified_checkpoint: True
unified_checkpoint_config: async_save
fuse_rope: True
use_sparse_head_and_loss_fn: True
"""
    + AMP_LISTS
)

SFT_DATA = """\
train_dataset_type: "erniekit"
eval_dataset_type: "erniekit"
train_dataset_path: "@DATA@/sft_demo.jsonl"
train_dataset_prob: "1.0"
eval_dataset_path: "@DATA@/sft_demo.jsonl"
eval_dataset_prob: "1.0"
max_seq_len: 256
"""

DPO_DATA = """\
train_dataset_type: "erniekit"
eval_dataset_type: "erniekit"
train_dataset_path: "@DATA@/dpo_demo.jsonl"
train_dataset_prob: "1.0"
eval_dataset_path: "@DATA@/dpo_demo.jsonl"
eval_dataset_prob: "1.0"
max_seq_len: 256
num_samples_each_epoch: 6000000
mix_strategy: random
packing: true
stage: DPO
learning_rate: 5.0e-7
attention_probs_dropout_prob: 0.1
hidden_dropout_prob: 0.1
dropout_warmup_steps: 100
offset_alpha: 0.0
scale_loss: 8192
use_sp_callback: True
tensor_parallel_config: "sync_param sync_grad sync_moment"
"""

# ERNIEKit's VL-SFT block (VL-28B-A3B sft/run_sft_8k.yaml, the Thinking variant's chat_template).
VL_BASE = """\
stage: VL-SFT
model_name_or_path: @MODEL@
output_dir: @OUT@
multimodal: true
fuse_linear: true
fuse_rms_norm: false
use_flash_attention: 1
use_moe: true
use_sparse_head_and_loss_fn: false
use_recompute_loss_fn: false
moe_group: "mp"
moe_use_aux_free_update_coef: 0.0
moe_aux_loss_lambda: 0.0
moe_use_aux_free: true
moe_use_hard_gate: true
moe_multimodal_dispatch_use_allgather: v2-alltoall-unpad-text
max_seq_len: 256
num_samples_each_epoch: 10000000
modality_ratio: "[1,1]"
variable_resolution: 1
pad_to_max_seqlen: 8192
render_timestamp: true
serialize_output: false
one_sample_in_one_seq: true
chat_template: "ernie_vl_thinking"
dataloader_num_workers: 1
do_train: true
batch_size: 1
prefetch_factor: 10
seed: 42
gradient_accumulation_steps: 2
max_steps: 2
save_steps: 10000
logging_steps: 1
weight_decay: 0.1
warmup_steps: 100
add_sys_token: true
same_data: true
freeze_config: "freeze_vision"
trigger_data_prob: 1.0
from_scratch: 0
load_sharded_model: true
save_sharded_model: true
gc_interval: 100000
drop_history_with_k: true
overwrite_output_dir: true
lr_scheduler_type: "cosine"
min_lr: 1.0e-06
moe_gate_lr_ratio: 0.01
visual_ld: 0.9
vit_lr_ratio: 0.9
adam_beta2: 0.95
adam_beta1: 0.9
adam_epsilon: 1.0e-08
scale_loss: 4096
sequence_parallel: 1
use_sp_callback: true
tensor_parallel_degree: 1
pipeline_parallel_degree: 1
pp_need_data: true
pp_need_data_degree: 2
virtual_pp_degree: 1
tensor_parallel_config: "sync_param sync_grad sync_moment"
pipeline_parallel_config: "enable_offload_queue enable_delay_scale_loss enable_overlap_p2p_comm"
disable_pipeline_warmup: false
sharding: "stage1"
# the recipe splits its optimizer state over 8 GPUs; sharding on this test's one device is refused
sharding_parallel_degree: 1
sharding_parallel_config: "split_param enable_fuse_optimizer_states"
sharding_comm_buffer_size_MB: 2048
save_sharding_stage1_model_include_freeze_params: true
offload_optim: true
tensorwise_offload_optimizer: true
unified_checkpoint_config: ignore_merge_optimizer
use_recompute_moe: true
recompute: true
recompute_granularity: full
pre_alloc_memory: 60
bf16: true
fp16_opt_level: "O2"
amp_master_grad: 1
unified_checkpoint: true
"""

# name -> (model preset, config text); runs in this order (export reads the sft_lora run).
RUNS = {
    "sft_full": (
        "tiny",
        SFT_DATA
        + BASE
        + """\
num_samples_each_epoch: 6000000
use_pic_id: False
multimodal: true
use_flash_attention: True
stage: SFT
fine_tuning: Full
moe_group: mp
learning_rate: 1.0e-5
from_scratch: 0
optim: adamw_custom
tensorwise_offload_optimizer: True
recompute_granularity: "full"
compute_type: bf16
""",
    ),
    "sft_lora_function_call": (
        "tiny",
        SFT_DATA.replace("erniekit", "chatml").replace("sft_demo", "chatml_demo")
        + BASE
        + """\
stage: SFT
fine_tuning: LoRA
lora_rank: 32
learning_rate: 3.0e-4
optim: adamw_custom
tensorwise_offload_optimizer: True
compute_type: bf16
""",
    ),
    "sft_wint8mix_lora_thinking": (
        "tiny-moe",
        SFT_DATA.replace("erniekit", "messages").replace("sft_demo", "chatml_demo")
        + BASE
        + """\
split_multi_turn: True
stage: SFT
fine_tuning: LoRA
lora_rank: 32
learning_rate: 3.0e-4
compute_type: wint4/8
""",
    ),
    "dpo_full": (
        "tiny",
        DPO_DATA
        + BASE
        + """\
fine_tuning: Full
use_fused_head_and_loss_fn: True
evaluation_strategy: epoch
save_strategy: epoch
compute_type: bf16
""",
    ),
    "dpo_wint8mix_lora": (
        "tiny-moe",
        DPO_DATA
        + BASE
        + """\
fine_tuning: LoRA
lora_rank: 32
lora_alpha: 128
lora_plus_scale: 12
rslora: True
fuse_linear: True
pp_seg_method: [0,7,10,14]
compute_type: wint4/8
""",
    ),
    "pt_offline_keys": (
        "tiny-moe",
        """\
train_dataset_type: "erniekit"
eval_dataset_type: "erniekit"
train_dataset_path: "@DATA@/pt_demo.jsonl"
train_dataset_prob: "1.0"
eval_dataset_path: "@DATA@/pt_demo.jsonl"
eval_dataset_prob: "1.0"
dataset_type: "pretrain"
input_dir: "0.4 ./examples/pre-training/demo_data/data-1-part0 0.6 ./examples/pre-training/demo_data/data-1-part0"
split: "998,1,1"
max_seq_len: 256
num_samples_each_epoch: 6000000
eval_iters: 2
stage: PT
fine_tuning: Full
learning_rate: 1.0e-5
compute_type: bf16
""".replace('"erniekit"', '"text"')
        + BASE,
    ),
    "sft_fp8": (
        "tiny",
        SFT_DATA
        + BASE
        + """\
num_samples_each_epoch: 6000000
mix_strategy: random
packing: true
stage: SFT
fine_tuning: Full
moe_group: mp
num_nextn_predict_layers: 0
learning_rate: 1.0e-5
optim: adamw_custom
optim_shard_num: 8
pp_seg_method: [0,29,57]
compute_type: fp8
apply_hadamard: True
use_lowprecision_moment: True
tensorwise_offload_optimizer: True
ignore_save_lr_and_optim: True
ignore_load_lr_and_optim: True
""",
    ),
    "vl_sft": (
        "tiny-vl",
        VL_BASE
        + """\
fine_tuning: Full
train_dataset_path: "@DATA@/vl_demo.jsonl"
train_dataset_prob: "1.0"
text_dataset_path: ""
text_dataset_prob: ""
learning_rate: 1.0e-05
""",
    ),
    "vl_function_call_lora": (
        "tiny-vl",
        VL_BASE
        + """\
fine_tuning: LoRA
lora_rank: 32
dataset_name: "FunctionCallSFTReader"
train_dataset_path: ""
train_dataset_prob: ""
text_dataset_path: "@DATA@/chatml_demo.jsonl"
text_dataset_prob: "1.0"
learning_rate: 3.0e-04
""",
    ),
    "eval_only": (
        "tiny",
        """\
eval_dataset_type: "erniekit"
eval_dataset_path: "@DATA@/sft_demo.jsonl"
eval_dataset_prob: "1.0"
max_seq_len: 256
num_samples_each_epoch: 6000000
mix_strategy: random
packing: true
model_name_or_path: @MODEL@
fine_tuning: LoRA
lora_rank: 32
fuse_rope: True
seed: 23
do_train: False
do_eval: True
max_evaluate_steps: 2
distributed_dataloader: False
dataloader_num_workers: 1
batch_size: 1
logging_dir: ./vdl_log
output_dir: @OUT@
disable_tqdm: True
tensor_parallel_degree: 1
sharding: stage1
recompute: True
compute_type: bf16
""",
    ),
}

EXPORT = """\
model_name_or_path: @MODEL@
fine_tuning: LoRA
max_shard_size: 5
hf_hub_id: null
output_dir: @OUT@
tensor_parallel_degree: 1
pipeline_parallel_degree: 1
sharding_parallel_degree: 1
sharding: stage1
pipeline_parallel_config: disable_partial_send_recv enable_clear_every_step_cache
sequence_parallel: True
compute_type: bf16
fp16_opt_level: O2
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def _fill(text: str, model: Path, out: Path) -> str:
    return text.replace("@MODEL@", str(model)).replace("@OUT@", str(out)).replace("@DATA@", str(DATA))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, tiny_moe_model_dir, tiny_vl_model_dir) -> dict[str, dict]:
    """Every config through the real CLI, once: {name: {path, proc, out}}."""
    models = {"tiny": tiny_model_dir, "tiny-moe": tiny_moe_model_dir, "tiny-vl": tiny_vl_model_dir}
    work = tmp_path_factory.mktemp("erniekit")
    done: dict[str, dict] = {}
    for name, (preset, text) in RUNS.items():
        out = work / f"out_{name}"
        path = work / f"{name}.yaml"
        path.write_text(_fill(text, models[preset], out))
        done[name] = {"path": path, "out": out, "proc": _cli("train", str(path), cwd=work)}
    out = work / "out_sft_lora_function_call"
    path = work / "export.yaml"
    path.write_text(_fill(EXPORT, tiny_model_dir, out))
    done["export"] = {"path": path, "out": out, "proc": _cli("export", str(path), "lora=True", cwd=work)}
    return done


def _same(got, want) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return bool(got) == bool(want)
    if isinstance(want, int | float) and isinstance(got, int | float):
        return float(got) == float(want)
    return got == want or str(got) == str(want)


@pytest.mark.parametrize("name", list(RUNS))
def test_erniekit_config_runs_and_every_key_is_honoured_or_announced(runs, name):
    run = runs[name]
    proc = run["proc"]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((run["out"] / "run_summary.json").read_text())
    if summary["notices"]:  # written at the start for the studio's worker, the same list
        assert json.loads((run["out"] / "notices.json").read_text())["notices"] == summary["notices"]
    assert summary["status"] == "succeeded"
    effective = json.loads((run["out"] / "train_config.json").read_text())
    announced = {n["key"] for n in summary["notices"]}
    for n in summary["notices"]:  # each notice once, in the log too
        assert proc.stdout.count(f"notice: {n['key']}: {n['message']}") == 1
    for key, value in yaml.safe_load(run["path"].read_text()).items():
        target = ERNIEKIT_ALIASES.get(key, key)
        if key in announced:
            continue
        assert target in effective, f"{name}: {key} is neither in the effective config nor announced"
        assert _same(effective[target], value), (
            f"{name}: {key}={value!r} but the run used {effective[target]!r}"
        )


def test_what_the_honoured_keys_did(runs):
    # save_total_limit 2 with save_steps 1 over 3 steps: the two newest checkpoints stay
    assert [p.name for p in list_checkpoints(runs["sft_full"]["out"])] == ["checkpoint-2", "checkpoint-3"]
    # eval_steps 2 and the last step evaluate, each on max_evaluate_steps batches
    rows = [json.loads(line) for line in (runs["sft_full"]["out"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2, 3]
    # do_train: false evaluates once and writes no model
    rows = [
        json.loads(line) for line in (runs["eval_only"]["out"] / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [0] and "eval_loss" in rows[0]
    assert not (runs["eval_only"]["out"] / "model.safetensors").exists()
    # the node and the model answer some keys at run time
    notices = json.loads((runs["vl_function_call_lora"]["out"] / "run_summary.json").read_text())["notices"]
    assert {
        "key": "freeze_config",
        "message": "a LoRA run trains adapters only; the base stays frozen anyway",
    } in (notices)


def test_erniekit_export_config_runs_and_announces_what_it_does_not_use(runs):
    run = runs["export"]
    assert run["proc"].returncode == 0, run["proc"].stderr[-3000:]
    cfg = load_export_config(run["path"], ["lora=True"])
    assert cfg.max_shard_size == "5GB" and cfg.lora
    export = json.loads((run["out"] / "export" / "export_summary.json").read_text())
    announced = {n["key"] for n in export["notices"]}
    assert {"hf_hub_id", "fine_tuning", "tensor_parallel_degree", "compute_type"} <= announced
    assert "notice: hf_hub_id:" in run["proc"].stdout


def test_three_unknown_keys_are_reported_in_one_error(tmp_path):
    text = _fill(RUNS["sft_full"][1], Path("models/tiny"), tmp_path / "out")
    path = tmp_path / "run.yaml"
    path.write_text("optimm: adamw\n" + text + "scale_los: 8192\ntensorwise_offload: true\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    lines = str(e.value).splitlines()
    assert lines[0] == "3 unknown keys:"
    assert lines[1] == f"{path}:1: unknown key 'optimm'; did you mean 'optim'?"
    assert lines[2].startswith(f"{path}:") and "unknown key 'scale_los'" in lines[2]
    assert "unknown key 'tensorwise_offload'" in lines[3]


@pytest.mark.parametrize("key", ["tensor_parallel_degree", "pipeline_parallel_degree"])
def test_model_parallel_degrees_above_one_are_refused(tmp_path, key):
    # The recipe's own values (4 and 2) would be announced and then ignored: the run would not be the one
    # asked for (one device per rank must hold the whole model), so validation refuses them by name.
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model_name_or_path: m\ntrain_dataset_path: d.jsonl\n{key}: 4\nsharding: stage1\n")
    with pytest.raises(ConfigError, match=f"{key}: 4 asks for .* parallelism.*set it to 1"):
        load_config(cfg)
    assert [n.key for n in load_config(cfg, [f"{key}=1"]).notices] == [key]  # sharding is a field


def test_optim_other_than_adamw_is_a_clear_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"model_name_or_path: m\ntrain_dataset_path: {DATA}/sft_demo.jsonl\noptim: adafactor\n")
    with pytest.raises(ConfigError, match="optim must be one of adamw, adamw_custom, not 'adafactor'"):
        load_config(path)


def test_save_total_limit_never_deletes_the_newest(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-4.tmp").mkdir()  # being written: not a checkpoint yet
    assert [p.name for p in prune_checkpoints(tmp_path, 0)] == ["checkpoint-1", "checkpoint-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4.tmp"]


def test_hidden_dropout_follows_erniekit_warmup_and_depth_and_is_off_in_eval(tiny_model_dir):
    import paddle

    from engine import load_model
    from engine.train.config import TrainConfig
    from engine.train.trainer import dropout_at, set_dropout

    cfg = TrainConfig(hidden_dropout_prob=0.2, dropout_warmup_steps=100)
    assert dropout_at(50, cfg, layer=1, num_layers=2) == pytest.approx(0.05)
    assert dropout_at(500, cfg, layer=0, num_layers=2) == 0.0  # the first layer never drops
    model = load_model(tiny_model_dir, "float32")
    ids = paddle.to_tensor([[5, 6, 7, 8]])
    model.eval()
    plain = model(ids).logits.numpy()
    set_dropout(model, cfg, 500)
    assert (model(ids).logits.numpy() == plain).all()  # eval mode: dropout is off
    model.train()
    assert not (model(ids).logits.numpy() == plain).all()
