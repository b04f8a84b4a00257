"""ERNIEKit YAML configs: accepted keys, typed overrides, and errors that say where and what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.train.config import TrainConfig
from engine.train.config_load import load_config, load_export_config
from engine.train.export_config import ExportConfig
from engine.train.options import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


BASE = "model_name_or_path: models/tiny\ntrain_dataset_path: examples/data/sft_demo.jsonl\n"


def test_erniekit_config_loads_with_its_keys(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            BASE
            + "stage: DPO\nfine_tuning: LoRA\nlora_rank: 16\nlora_alpha: -1\nper_device_train_batch_size: 2\n"
            "learning_rate: 1.0e-5\nbf16: true\ntensor_parallel_degree: 1\nuse_flash_attention: true\n"
            "train_dataset_prob: 1.0\ncompute_type: bf16\n",
        )
    )
    assert cfg.stage == "DPO" and cfg.lora and cfg.lora_rank == 16
    assert cfg.effective_lora_alpha == 32.0
    assert cfg.batch_size == 2  # per_device_train_batch_size is ERNIEKit's name for it
    assert cfg.learning_rate == 1e-5 and cfg.train_dataset_prob == "1.0"


# The shape of ERNIEKit's run_sft_8k.yaml for ERNIE-4.5-0.3B: GPU parallelism and kernel keys included.
ERNIEKIT_SFT = """
train_dataset_type: "erniekit"
eval_dataset_type: "erniekit"
train_dataset_path: "./examples/data/sft-train.jsonl"
train_dataset_prob: "1.0"
eval_dataset_path: "./examples/data/sft-eval.jsonl"
eval_dataset_prob: "1.0"
max_seq_len: 8192
num_samples_each_epoch: 6000000
model_name_or_path: baidu/ERNIE-4.5-0.3B-Paddle
fine_tuning: Full
fuse_rope: True
use_sparse_head_and_loss_fn: True
stage: SFT
seed: 23
do_train: True
do_eval: True
distributed_dataloader: False
dataloader_num_workers: 1
batch_size: 1
num_train_epochs: 1
max_steps: 100
max_evaluate_steps: 10000
eval_steps: 10000
evaluation_strategy: steps
save_steps: 10000000
save_total_limit: 5
save_strategy: steps
logging_steps: 1
release_grads: True
gradient_accumulation_steps: 8
logging_dir: ./vdl_log
output_dir: ./output
disable_tqdm: True
warmup_steps: 20
learning_rate: 1.0e-5
lr_scheduler_type: cosine
min_lr: 1.0e-6
layerwise_lr_decay_bound: 1.0
weight_decay: 0.1
adam_epsilon: 1.0e-8
adam_beta1: 0.9
adam_beta2: 0.95
tensor_parallel_degree: 1
pipeline_parallel_degree: 1
sharding_parallel_degree: 1
sharding: stage1
sequence_parallel: True
pipeline_parallel_config: disable_partial_send_recv enable_clear_every_step_cache
recompute: False
recompute_use_reentrant: True
compute_type: bf16
fp16_opt_level: O2
disable_ckpt_quant: True
amp_master_grad: True
amp_custom_white_list:
  - lookup_table
  - flash_attn
amp_custom_black_list:
  - reduce_sum
unified_checkpoint: True
unified_checkpoint_config: async_save
"""


def test_a_full_erniekit_sft_config_loads(tmp_path):
    cfg = load_config(write(tmp_path, ERNIEKIT_SFT))
    assert (cfg.stage, cfg.fine_tuning, cfg.compute_type) == ("SFT", "Full", "bf16")
    assert cfg.gradient_accumulation_steps == 8 and cfg.adam_beta2 == 0.95 and cfg.min_lr == 1e-6
    assert cfg.eval_dataset_path == "./examples/data/sft-eval.jsonl" and cfg.max_seq_len == 8192


def test_overrides_are_typed(tmp_path):
    cfg = load_config(
        write(tmp_path, BASE),
        [
            "max_steps=100",
            "learning_rate=3e-4",
            "packing=true",
            "lora_target_modules=qkv_proj,o_proj",
            "rslora=1",
        ],
    )
    assert cfg.max_steps == 100 and isinstance(cfg.max_steps, int)
    assert cfg.learning_rate == 3e-4 and cfg.packing is True and cfg.rslora is True
    assert cfg.lora_target_modules == ["qkv_proj", "o_proj"]
    cfg = load_config(write(tmp_path, BASE), ["moe_aux_loss_lambda=null", "train_dataset_prob=0.7,0.3"])
    assert cfg.moe_aux_loss_lambda is None and cfg.train_dataset_prob == "0.7,0.3"


def test_unknown_key_names_file_line_and_suggests(tmp_path):
    path = write(tmp_path, BASE + "learning_rat: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert f"{path}:3" in str(e.value) and "'learning_rat'" in str(e.value)
    assert "did you mean 'learning_rate'" in str(e.value)
    with pytest.raises(ConfigError, match=r"override 'lora_rnk=4'.*did you mean 'lora_rank'"):
        load_config(write(tmp_path, BASE), ["lora_rnk=4"])


def test_values_are_validated_with_clear_messages(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"stage must be one of SFT, DPO, PT, VL-SFT, OCR-VL-SFT, not 'SFTT' \(did you mean 'SFT'\?\)",
    ):
        load_config(write(tmp_path, BASE + "stage: SFTT\n"))
    with pytest.raises(ConfigError, match=r"run.yaml:3: max_steps must be int, got 'many'"):
        load_config(write(tmp_path, BASE + "max_steps: many\n"))
    with pytest.raises(
        ConfigError, match="compute_type wint8 freezes a quantized base, so it needs fine_tuning: LoRA"
    ):
        load_config(write(tmp_path, BASE + "compute_type: wint8\nfine_tuning: Full\n"))
    with pytest.raises(ConfigError, match="model_name_or_path is required"):
        load_config(write(tmp_path, "train_dataset_path: a.jsonl\n"))
    with pytest.raises(ConfigError, match="key=value"):
        load_config(write(tmp_path, BASE), ["max_steps"])
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1, 2\n"))


def test_export_config_accepts_a_training_config(tmp_path):
    cfg = load_export_config(write(tmp_path, BASE + "output_dir: out/x\nlearning_rate: 0.1\n"), ["lora=True"])
    assert isinstance(cfg, ExportConfig) and cfg.lora and cfg.export_dir == str(Path("out/x") / "export")
    with pytest.raises(ConfigError, match="did you mean 'layout'"):
        load_export_config(write(tmp_path, BASE), ["layot=hf"])
    with pytest.raises(ConfigError, match="layout must be one of paddle, hf"):
        load_export_config(write(tmp_path, BASE), ["layout=torch"])


def test_cli_reports_config_errors_and_exits_2(tmp_path):
    path = write(tmp_path, BASE + "stage: SFTT\n")
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "train", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "stage must be one of SFT, DPO, PT, VL-SFT" in proc.stderr


def test_example_configs_are_valid():
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        if path.name.startswith("export"):
            load_export_config(path)
        else:
            assert isinstance(load_config(path), TrainConfig), path


def test_defaults_follow_stage_and_fine_tuning(tmp_path):
    """Keys a config leaves out get the engine's one set of defaults, which depend on stage and Full/LoRA."""
    from engine.train.options import field_info
    from engine.train.run_checks import defaults_for
    from engine.train.stages import STAGE_DEFAULTS

    cfg = load_config(write(tmp_path, BASE))
    assert cfg.fine_tuning == "LoRA"  # ERNIEKit's own default
    assert cfg.learning_rate == 1e-4 and cfg.packing is False
    full = load_config(write(tmp_path, BASE + "fine_tuning: Full\n"))
    assert full.learning_rate == 1e-5
    pt = load_config(write(tmp_path, BASE + "stage: PT\nfine_tuning: Full\n"))
    assert pt.learning_rate == 3e-5 and pt.packing is True
    # a value the config gives wins over the stage default
    assert load_config(write(tmp_path, BASE + "stage: PT\npacking: false\n")).packing is False
    for (stage, ft), values in STAGE_DEFAULTS.items():
        d = defaults_for(stage, ft)
        assert {k: d[k] for k in values} == values
        assert d["stage"] == stage and d["fine_tuning"] == ft
    assert field_info(TrainConfig, "lr_scheduler_type")["choices"] == ("cosine", "linear", "constant")
    assert field_info(TrainConfig, "max_seq_len")["minimum"] == 1
    assert field_info(TrainConfig, "learning_rate")["help"]


def test_bounds_come_from_the_schema(tmp_path):
    with pytest.raises(ConfigError, match=r"adam_beta2 must be <= 1, got 1\.5"):
        load_config(write(tmp_path, BASE + "adam_beta2: 1.5\n"))
    with pytest.raises(ConfigError, match="max_steps must be >= -1, got -2"):
        load_config(write(tmp_path, BASE + "max_steps: -2\n"))
    # values that would hold a worker for hours or make no sense (issue 15's probes), refused with the key
    for line, message in [
        ("max_steps: 9223372036854775807", "max_steps must be <= 100000000"),
        ("per_device_train_batch_size: 1000000000", "per_device_train_batch_size must be <= 4096"),
        ("max_seq_len: 1000000000", "max_seq_len must be <= 1048576"),
        ("learning_rate: 1.0e308", "learning_rate must be <= 1, got 1e[+]308"),
        ("learning_rate: .nan", "learning_rate must be a finite number"),
        ("seed: -1", "seed must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(write(tmp_path, BASE + line + "\n"))
    with pytest.raises(ConfigError, match="dtype must be one of float32, bfloat16, float16"):
        load_export_config(None, ["output_dir=out", "dtype=int3"])


def test_docs_carry_the_schema_tables():
    """docs/training.md's key tables are the schema's, so the docs cannot drift from the defaults."""
    import re

    from engine.serve.cli import erniekit_chat_table
    from engine.train.config_docs import erniekit_keys_table, keys_table, stage_defaults_table

    doc = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    for name, table in [
        ("train", keys_table(TrainConfig)),
        ("stage", stage_defaults_table()),
        ("export", keys_table(ExportConfig)),
        ("erniekit", erniekit_keys_table()),
        ("chat", erniekit_chat_table()),
    ]:
        found = re.search(rf"<!-- keys:{name} -->\n(.*?)\n<!-- /keys:{name} -->", doc, re.S)
        assert found, f"docs/training.md lacks the <!-- keys:{name} --> table"
        assert found.group(1) == table, (
            f"docs/training.md's {name} table differs from the schema; regenerate it"
        )


def test_every_unknown_key_is_reported_at_once(tmp_path):
    path = write(tmp_path, BASE + "learning_rat: 1e-4\nmax_step: 10\nwarmup: 3\nseed: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, ["packng=true"])
    message = str(e.value)
    assert message.startswith("4 unknown keys:")
    assert f"{path}:3: unknown key 'learning_rat'; did you mean 'learning_rate'?" in message
    assert f"{path}:4: unknown key 'max_step'; did you mean 'max_steps'?" in message
    assert f"{path}:5: unknown key 'warmup'" in message
    assert "override 'packng=true': unknown key 'packng'; did you mean 'packing'?" in message
    lines = message.splitlines()
    assert [i for i, line in enumerate(lines) if "learning_rat" in line] < [
        i for i, line in enumerate(lines) if "max_step'" in line
    ]


def test_max_shard_size_is_in_gb_when_a_bare_number_as_in_erniekit(tmp_path):
    assert load_export_config(None, ["output_dir=out", "max_shard_size=5"]).max_shard_size == "5GB"
    assert load_export_config(None, ["output_dir=out", "max_shard_size=0.001"]).max_shard_size == "0.001GB"
    yaml_int = write(tmp_path, "output_dir: out\nmax_shard_size: 5\n")
    assert load_export_config(yaml_int).max_shard_size == "5GB"
    assert load_export_config(None, ["output_dir=out", "max_shard_size=500MB"]).max_shard_size == "500MB"
    with pytest.raises(ConfigError, match="max_shard_size must be a size like 5GB"):
        load_export_config(None, ["output_dir=out", "max_shard_size=five"])


def test_read_keys_is_load_configs_reading_of_a_text(tmp_path):
    """The YAML text reader and key sorting the studio's import uses are load_config's own: the same values,
    notices, unknown keys with their lines, and wrong values by key."""
    from engine.train.config_load import read_keys, read_yaml_text

    text = "stage: OCR-SFT\neval_iters: 3\nfuse_rope: true\nlora_rank: 4\n"
    path = tmp_path / "run.yaml"
    path.write_text(text + "model_name_or_path: m\ntrain_dataset_path: d.jsonl\n")
    cfg = load_config(path)
    values, lines = read_yaml_text(text, "run.yaml")
    keys = read_keys(TrainConfig, values, "run.yaml", lines)
    assert keys.values == {"stage": "OCR-VL-SFT", "max_evaluate_steps": 3, "lora_rank": 4}
    assert all(getattr(cfg, k) == v for k, v in keys.values.items())
    assert [n.key for n in keys.notices] == [n.key for n in cfg.notices] == ["stage", "fuse_rope"]
    values, lines = read_yaml_text("seed: x\nlearning_rat: 1\n", "b.yaml")
    bad = read_keys(TrainConfig, values, "b.yaml", lines)
    assert bad.unknown == ["b.yaml:2: unknown key 'learning_rat'; did you mean 'learning_rate'?"]
    assert bad.wrong == {"seed": "b.yaml:1: seed must be int, got 'x'"}


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["layout=hf"], "quantization: quantized exports are written in the Paddle layout"),
        (["dtype=bfloat16"], "dtype: a wint8 export stores quantized weights with fp32 scales"),
    ],
)
def test_a_ptq_export_refuses_choices_it_would_not_honour(overrides, problem):
    """PTQ writes its own weights in the Paddle layout: a layout or dtype beside it is refused at load (the
    CLI and the studio alike), not dropped or refused after the model was quantized."""
    with pytest.raises(ConfigError, match=problem):
        load_export_config(None, ["output_dir=out", "quantization=wint8", *overrides])
    assert load_export_config(None, ["output_dir=out", "quantization=wint8"]).dtype == "float32"
