"""ERNIEKit YAML configs: accepted keys, typed overrides, and errors that say where and what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.train.config import ConfigError, ExportConfig, TrainConfig, load_config, load_export_config

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
        ConfigError, match=r"stage must be one of SFT, DPO, PT, VL-SFT, not 'SFTT' \(did you mean 'SFT'\?\)"
    ):
        load_config(write(tmp_path, BASE + "stage: SFTT\n"))
    with pytest.raises(ConfigError, match=r"run.yaml:3: max_steps must be int, got 'many'"):
        load_config(write(tmp_path, BASE + "max_steps: many\n"))
    with pytest.raises(
        ConfigError, match="compute_type wint8 freezes a quantized base, so it needs fine_tuning: LoRA"
    ):
        load_config(write(tmp_path, BASE + "compute_type: wint8\n"))
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
