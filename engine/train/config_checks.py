"""What a training config works out from its own values: the values the trainer reads together (``lora``,
``dataset_spec``, the sharding and expert-parallel degrees) and ``validate()``, the checks that need nothing
but the config. ``TrainConfig`` (engine.train.config) declares the fields and takes these as its base class.
"""

from __future__ import annotations

import re

from engine.models.config import WEIGHT_ONLY_COMPUTE_TYPES
from engine.train.messages import TRAIN
from engine.train.options import (
    DATASET_TYPE_NAMES,
    FREEZE_OPTIONS,
    MOE_GROUPS_ALL_RANKS,
    SHARDING_STAGES,
    SHARDING_WORDS,
    ConfigError,
    check_fields,
    choice,
    comma_list,
    split_words,
)
from engine.train.scalars import report_to_problems
from engine.train.stages import ELASTIC_STAGES, find_stage


class TrainConfigChecks:
    """TrainConfig's derived values and checks; the fields they read are TrainConfig's."""

    @property
    def holds_reference(self) -> bool:
        """The stage compares against a reference model and the run keeps one (not reference_free)."""
        stage = find_stage(self.stage)
        return stage is not None and stage.needs_reference and not self.reference_free

    @property
    def lora(self) -> bool:
        return self.fine_tuning == "LoRA" or self.compute_type in WEIGHT_ONLY_COMPUTE_TYPES

    @property
    def frozen(self) -> list[str]:
        """The parts freeze_config names (``freeze_vision``, ``freeze_lm``)."""
        return [p for p in re.split(r"[\s,]+", self.freeze_config) if p]

    @property
    def effective_lora_alpha(self) -> float:
        return 2.0 * self.lora_rank if self.lora_alpha == -1 else self.lora_alpha

    def dataset_spec(self, split: str = "train") -> dict[str, str]:
        """ERNIEKit's three dataset keys of a split for ``engine.data.build_train_data`` (always named
        ``train_*`` there); the train split also mixes in ``text_dataset_path`` (ERNIEKit's VL text data)."""
        paths = comma_list(getattr(self, f"{split}_dataset_path"))
        types = [
            DATASET_TYPE_NAMES.get(t, t)
            for t in comma_list(getattr(self, f"{split}_dataset_type") or self.train_dataset_type)
        ]
        probs = comma_list(getattr(self, f"{split}_dataset_prob"))
        if split == "train" and self.text_dataset_path:
            types = (types * len(paths) if len(types) == 1 else types) or ["auto"] * len(paths)
            probs = probs or ["1.0"] * len(paths)
            text = comma_list(self.text_dataset_path)
            probs = probs if paths else []
            paths, types = paths + text, types + ["auto"] * len(text)
            probs = probs + (comma_list(self.text_dataset_prob) or ["1.0"] * len(text))
        return {
            "train_dataset_type": ",".join(types),
            "train_dataset_path": ",".join(paths),
            "train_dataset_prob": ",".join(probs),
        }

    def _data_problems(self) -> list[str]:
        if self.do_train and not self.train_dataset_path and not self.text_dataset_path:
            return ["train_dataset_path is required (comma-separated files for mixing)"]
        if not self.do_train and not (self.do_eval and self.eval_dataset_path):
            return ["do_train: false only evaluates: set do_eval: true and eval_dataset_path"]
        return []

    def validate(self) -> list[str]:
        problems = check_fields(self) + self._ocr_problems()
        if not self.model_name_or_path:
            problems.append(
                "model_name_or_path is required: a model directory (e.g. from `ernie-studio init-model`)"
            )
        problems += self._data_problems()
        problems += report_to_problems(self.report_to)
        for item in self.frozen:
            choice(problems, "freeze_config", item, FREEZE_OPTIONS)
        if self.hidden_dropout_prob >= 1:
            problems.append(f"hidden_dropout_prob must be below 1, got {self.hidden_dropout_prob}")
        if self.max_steps < 1 and self.num_train_epochs <= 0:
            problems.append("set max_steps >= 1 or num_train_epochs > 0")
        if not 0 <= self.ema_decay < 1:
            problems.append(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if not 0 <= self.label_smoothing < 0.5:
            problems.append(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.dpo_reference_dtype != "run" and not (self.holds_reference and not self.lora):
            problems.append(
                f"dpo_reference_dtype {self.dpo_reference_dtype}: only a Full DPO run with a reference holds a "
                "reference model (a LoRA run's reference is its base with the adapters off); remove the key"
            )
        if self.compute_type in WEIGHT_ONLY_COMPUTE_TYPES and self.fine_tuning != "LoRA":
            problems.append(
                f"compute_type {self.compute_type} freezes a quantized base, so it needs fine_tuning: LoRA"
            )
        if self.fp8_hadamard_block_size < 1 or self.fp8_hadamard_block_size & (
            self.fp8_hadamard_block_size - 1
        ):
            problems.append(
                f"fp8_hadamard_block_size must be a power of two, got {self.fp8_hadamard_block_size}"
            )
        problems += self._expert_parallel_problems()
        return problems + self._elastic_problems() + self._sharding_problems()

    def _ocr_problems(self) -> list[str]:
        """What PaddleOCR-VL (stage OCR-VL-SFT) does not train with here, by key."""
        stage = find_stage(self.stage)
        if stage is None or not stage.trains_paddleocr_vl:
            return []
        problems = []
        if self.compute_type not in ("fp32", "bf16", "fp16"):
            problems.append(TRAIN("ocr_compute_type", compute_type=self.compute_type))
        if self.gpas:
            problems.append(TRAIN("ocr_gpas"))
        if self.text_dataset_path:
            problems.append(
                f"text_dataset_path: an {self.stage} record needs an image; mix no text-only data in"
            )
        return problems

    def _expert_parallel_problems(self) -> list[str]:
        problems = []
        splits = self.expert_parallel_degree > 1 or self.moe_group in MOE_GROUPS_ALL_RANKS
        if self.elastic and splits:
            problems.append(
                "expert_parallel_degree / moe_group: elastic training samples sub-models over the experts; "
                "it runs with every expert in each process (leave expert_parallel_degree at 1)"
            )
        if self.sharding_stage and splits:
            problems.append(
                "sharding with expert_parallel_degree / moe_group: the split optimizer state and the split "
                "experts are not combined here yet; use one of them"
            )
        return problems

    @property
    def sharding_stage(self) -> int:
        """0 (no sharding), 1 or 2, as ``sharding`` names it (validate() has refused anything else)."""
        words = split_words(self.sharding)
        return next((int(w[-1]) for w in words if w in SHARDING_STAGES), 0)

    def sharding_degree(self, devices: int) -> int:
        """Ranks one optimizer-state split spans on ``devices`` devices (1: no sharding)."""
        if not self.sharding_stage:
            return 1
        return devices if self.sharding_parallel_degree == -1 else self.sharding_parallel_degree

    def _sharding_problems(self) -> list[str]:
        words = split_words(self.sharding)
        problems = []
        for w in words:
            if w == "stage3":
                problems.append(
                    "sharding: stage3 (weights split over the devices) is not supported here; use stage1 "
                    "(optimizer state) or stage2 (optimizer state and gradients)"
                )
            elif w not in SHARDING_WORDS:
                problems.append(f"sharding: {w!r} is not one of {', '.join(SHARDING_WORDS)}")
        return problems or self._sharding_combination_problems(words)

    def _sharding_combination_problems(self, words: list[str]) -> list[str]:
        problems = []
        stages = [w for w in words if w in SHARDING_STAGES]
        if len(stages) > 1:
            problems.append(f"sharding: name one stage, got {' and '.join(stages)}")
        if "offload" in words:
            # GroupShardedOptimizerStage2.__init__ asserts fp16 weights when offloading (Paddle 3.3)
            problems.append(
                "sharding: offload: Paddle's stage-2 offload runs with fp16 weights only, and fp16 does not "
                "run with sharding here; keep the optimizer state in host memory with "
                "tensorwise_offload_optimizer: true (GPU) instead"
            )
        if self.sharding_parallel_degree == 0:
            problems.append("sharding_parallel_degree must be -1 (all devices) or a number of devices >= 1")
        if self.sharding_parallel_degree > 1 and not stages:
            problems.append(
                f"sharding_parallel_degree: {self.sharding_parallel_degree} needs sharding: stage1 or stage2"
            )
        if stages and self.compute_type == "fp16":
            problems.append(
                "sharding: compute_type fp16's loss scaling does not run over split optimizer state here; "
                "use compute_type bf16"
            )
        if stages and self.gpas_gate_grad_clip > 0:
            problems.append(
                "sharding: gpas_gate_grad_clip clips the gates' gradients, which the split optimizer holds "
                "on one device each; set gpas_gate_grad_clip: 0 or leave sharding out"
            )
        return problems

    def expert_degree(self, world: int) -> int:
        """The expert-parallel degree on ``world`` ranks, from expert_parallel_degree and moe_group."""
        degree = self.expert_parallel_degree
        if self.moe_group in MOE_GROUPS_ALL_RANKS:
            if degree > 1 and degree != world:
                raise ConfigError(
                    f"expert_parallel_degree: {degree} and moe_group: {self.moe_group} (all {world} ranks) "
                    "disagree; give one of them"
                )
            degree = world
        if world % degree:
            raise ConfigError(
                f"expert_parallel_degree: {degree} does not divide the {world} rank(s) of this run; "
                "train on a multiple of it (the studio's num_devices, or --nproc_per_node)"
            )
        return degree

    def elastic_choices(self, key: str) -> list[int]:
        """The numbers one ``elastic_*_choices`` key lists (ValueError when they are not numbers)."""
        return [int(v) for v in comma_list(str(getattr(self, key)))]

    def _elastic_problems(self) -> list[str]:
        """What can be checked without the model (engine.train.elastic checks the rest against it)."""
        keys = ("elastic_depth_choices", "elastic_experts_choices", "elastic_topk_choices")
        problems = []
        for key in keys:
            try:
                values = self.elastic_choices(key)
            except ValueError:
                problems.append(
                    f"{key} must be whole numbers separated by commas, got {getattr(self, key)!r}"
                )
                continue
            low = [v for v in values if v < (2 if key == "elastic_depth_choices" else 1)]
            if low:
                what = (
                    "a sub-model keeps the first and the last layer"
                    if key == "elastic_depth_choices"
                    else (
                        "zero experts would leave the MoE layers empty"
                        if key == "elastic_experts_choices"
                        else "k' >= 1"
                    )
                )
                problems.append(f"{key}: {low[0]} is too small ({what})")
        if not self.elastic:
            given = [k for k in (*keys, "elastic_full_share") if getattr(self, k) not in ("", 0.5)]
            if given:
                problems.append(
                    f"{given[0]} is set but elastic is false; set elastic: true to train sub-models"
                )
            return problems
        if self.stage not in ELASTIC_STAGES:
            problems.append(
                f"elastic: stage {self.stage} is not supported; elastic training runs {' and '.join(ELASTIC_STAGES)}"
            )
        if self.elastic_full_share < 1 and not any(getattr(self, k) for k in keys):
            problems.append(
                "elastic: true needs at least one of elastic_depth_choices, elastic_experts_choices, elastic_topk_choices"
            )
        return problems
