"""The training config's schema: ``TrainConfig``, every key a run takes, each declared with ``option()`` (its
default, help text, choices, bounds and the Train form's facts). Field names are ERNIEKit's, so configs users
already have keep working.

Beside it: ``options`` (choices, bounds, ``option()``, the schema's readers), ``erniekit_keys`` (aliases,
notices), ``config_checks`` (``validate()`` and derived values), ``run_checks`` (against devices and the model),
``export_config``, ``config_load`` (YAML and overrides) and ``config_docs`` (the docs' tables).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from engine.models.config import ELASTIC_DEPTH_PATTERNS, WEIGHT_ONLY_COMPUTE_TYPES
from engine.train.config_checks import TrainConfigChecks
from engine.train.erniekit_keys import Notice
from engine.train.options import (
    COMPUTE_TYPES,
    DPO_LOSSES,
    DPO_REFERENCE_DTYPES,
    DPO_RUNS,
    ELASTIC_RUNS,
    FINE_TUNING,
    FP8_RUNS,
    GPAS_RUNS,
    IMAGE_RUNS,
    LORA_RUNS,
    LORA_TARGETS,
    LORA_VL_TARGETS,
    MAX_BATCH_SIZE,
    MAX_DEVICES,
    MAX_EPOCHS,
    MAX_LORA_RANK,
    MAX_SEQ_LEN,
    MAX_STEPS,
    MIX_STRATEGIES,
    MOE_GROUPS,
    MOE_MODELS,
    OPTIMIZERS,
    RECOMPUTE_GRANULARITIES,
    REFERENCE_RUNS,
    SCHEDULERS,
    STRATEGIES,
    VL_SFT_RUNS,
    Applies,
    comma_list,
    option,
)
from engine.train.scalars import REPORT_TO
from engine.train.stages import DEFAULT_STAGE, STAGE_DEFAULTS, STAGES


@dataclass
class TrainConfig(TrainConfigChecks):
    """Everything one training run needs. Keys and defaults follow ERNIEKit's YAML configs."""

    model_name_or_path: str = option("", "A model directory (config.json, weights, tokenizer).", group="run")
    stage: str = option(DEFAULT_STAGE, "Training stage.", choices=STAGES, group="run")
    fine_tuning: str = option(
        "LoRA", "Train all weights (Full) or low-rank adapters (LoRA).", choices=FINE_TUNING, group="run"
    )
    output_dir: str = option(
        "./output", "Run directory: metrics, checkpoints and the final model.", group="run"
    )
    save_to_hf: bool = option(
        False,
        "Full runs: write the final model in the Hugging Face layout (PyTorch names; PaddleOCR-VL: "
        "transformers' config.json form) instead of the Paddle one (PaddleOCR-VL: its published form).",
        group="run",
        applies=Applies(adapters=False),
    )
    logging_dir: str = option(
        "",
        "Where report_to's TensorBoard / VisualDL / MLflow logs go (a folder per tool); empty means output_dir.",
        group="logging",
    )
    report_to: list[str] | None = option(  # noqa: RUF009 (a field with a default_factory)
        help="Scalar logs besides metrics.jsonl: visualdl (ERNIEKit's default), tensorboard, all (both), "
        "mlflow (with the tracking extra), or none; comma-separated.",
        choices=REPORT_TO,
        factory=lambda: ["visualdl"],
        group="logging",
    )
    # data
    train_dataset_type: str = option("", "Format of each training file (comma-separated).", group="data")
    train_dataset_path: str = option("", "Training files, comma-separated for mixing.", group="data")
    train_dataset_prob: str = option("1.0", "Sampling probability of each training file.", group="data")
    eval_dataset_type: str = option("", "Format of each evaluation file.", group="data")
    eval_dataset_path: str = option("", "Evaluation files, comma-separated.", group="data")
    eval_dataset_prob: str = option("1.0", "Sampling probability of each evaluation file.", group="data")
    text_dataset_path: str = option(
        "",
        "VL-SFT: text-only training files mixed in with the image data.",
        group="data",
        applies=VL_SFT_RUNS,
    )
    text_dataset_prob: str = option(
        "", "Sampling probability of each text_dataset_path file.", group="data", applies=VL_SFT_RUNS
    )
    min_pixels: int = option(
        0,
        "VL-SFT / OCR-VL-SFT: smallest image area after resizing, in pixels; 0 = the model's processor "
        "setting.",
        minimum=0,
        group="data",
        applies=IMAGE_RUNS,
    )
    max_pixels: int = option(
        0,
        "VL-SFT / OCR-VL-SFT: largest image area after resizing, in pixels; 0 = the model's processor "
        "setting.",
        minimum=0,
        group="data",
        applies=IMAGE_RUNS,
    )
    num_samples_each_epoch: int = option(
        0,
        "Samples in one epoch (ERNIEKit's epoch) when training by epochs; 0 is one pass.",
        minimum=0,
        group="data",
    )
    max_seq_len: int = option(
        2048,
        "Longer samples drop their oldest turns first.",
        minimum=1,
        maximum=MAX_SEQ_LEN,
        group="data",
        common=True,
    )
    max_prompt_len: int = option(
        1024,
        "DPO: longest prompt kept before the responses.",
        minimum=1,
        maximum=MAX_SEQ_LEN,
        group="dpo",
        applies=DPO_RUNS,
    )
    packing: bool | None = option(
        None,
        "Pack short samples into one sequence (no cross-attention); default per stage.",
        group="data",
        common=True,
    )
    mix_strategy: str = option(
        "random", "How several training files are mixed.", choices=MIX_STRATEGIES, group="data"
    )
    packing_size: int = option(
        0,
        "With packing: at most this many samples in one max_seq_len row (ERNIEKit's OCR configs); 0 packs "
        "as many as fit.",
        minimum=0,
        maximum=MAX_BATCH_SIZE,
        group="data",
    )
    # batch and optimiser
    batch_size: int = option(
        1,
        "Samples (or packed sequences) per step per device.",
        minimum=1,
        maximum=MAX_BATCH_SIZE,
        group="schedule",
    )
    per_device_train_batch_size: int = option(
        0,
        "ERNIEKit's name for batch_size (wins when set).",
        minimum=0,
        maximum=MAX_BATCH_SIZE,
        group="schedule",
        common=True,
    )
    per_device_eval_batch_size: int = option(
        0, "Evaluation batch size; 0 means batch_size.", minimum=0, maximum=MAX_BATCH_SIZE, group="evaluation"
    )
    gradient_accumulation_steps: int = option(
        1,
        "Micro-batches summed per optimizer step.",
        minimum=1,
        maximum=MAX_STEPS,
        group="schedule",
        common=True,
    )
    learning_rate: float | None = option(
        None,
        "Peak learning rate after warm-up; default per stage and fine-tuning.",
        minimum=0,
        maximum=1,
        group="schedule",
        common=True,
    )
    lr_scheduler_type: str = option(
        "cosine", "Learning-rate schedule after warm-up.", choices=SCHEDULERS, group="schedule", common=True
    )
    min_lr: float = option(
        0.0, "Learning rate at the end of the schedule.", minimum=0, maximum=1, group="schedule"
    )
    warmup_steps: int = option(
        0,
        "Linear warm-up from 0 to learning_rate.",
        minimum=0,
        maximum=MAX_STEPS,
        group="schedule",
        common=True,
    )
    warmup_ratio: float = option(
        0.0,
        "Warm-up as a share of all steps (when warmup_steps is 0).",
        minimum=0,
        maximum=1,
        group="schedule",
    )
    max_steps: int = option(
        -1,
        "Optimizer steps; -1 (or 0) trains num_train_epochs.",
        minimum=-1,
        maximum=MAX_STEPS,
        group="schedule",
        common=True,
    )
    num_train_epochs: float = option(
        1.0,
        "Passes over the data; used when max_steps is -1.",
        minimum=0,
        maximum=MAX_EPOCHS,
        group="schedule",
        common=True,
    )
    optim: str = option(
        "adamw",
        "Optimizer; adamw_custom (ERNIEKit's AdamW) is the same update.",
        choices=OPTIMIZERS,
        group="optimizer",
    )
    weight_decay: float = option(0.0, "AdamW weight decay.", minimum=0, group="optimizer", common=True)
    adam_beta1: float = option(0.9, "AdamW beta1.", minimum=0, maximum=1, group="optimizer")
    adam_beta2: float = option(0.999, "AdamW beta2.", minimum=0, maximum=1, group="optimizer")
    adam_epsilon: float = option(1e-8, "AdamW epsilon.", minimum=0, group="optimizer")
    max_grad_norm: float = option(
        1.0, "Gradient clipping by global norm; 0 turns it off.", minimum=0, group="optimizer"
    )
    moe_gate_lr_ratio: float = option(
        1.0,
        "Learning-rate multiplier of the MoE routers (Full runs).",
        minimum=0,
        group="optimizer",
        applies=Applies(adapters=False, model="moe"),
    )
    vit_lr_ratio: float = option(
        1.0,
        "Learning-rate multiplier of the vision encoder (VL, Full runs).",
        minimum=0,
        group="optimizer",
        applies=Applies(adapters=False, model="vl"),
    )
    freeze_config: str = option(
        "",
        "Weights that stay frozen in Full runs: freeze_vision and/or freeze_lm (space or comma separated).",
        group="optimizer",
        applies=Applies(adapters=False, model="vl"),
    )
    hidden_dropout_prob: float = option(
        0.0,
        "Dropout on each decoder layer's attention and FFN outputs; layer i of N drops p*i/N.",
        minimum=0,
        group="optimizer",
    )
    dropout_warmup_steps: int = option(
        0,
        "Dropout rises linearly from 0 to hidden_dropout_prob over these steps.",
        minimum=0,
        group="optimizer",
    )
    ema_decay: float = option(
        0.0, "Exponential moving average of the weights; 0 turns it off.", minimum=0, group="optimizer"
    )
    seed: int = option(
        42,
        "Seed for initialisation, shuffling and dropout.",
        minimum=0,
        maximum=2**32 - 1,
        group="schedule",
        common=True,
    )
    recompute: bool = option(
        False, "Recompute activations in backward (less memory, more time).", group="precision"
    )
    recompute_granularity: str = option(
        "full",
        "What recompute rebuilds in backward: full (every block of each decoder layer: attention, dense FFN "
        "and MoE), full_attn (the attention blocks), core_attn (the softmax attention inside them).",
        choices=RECOMPUTE_GRANULARITIES,
        group="precision",
    )
    use_recompute_moe: bool = option(
        True,
        "Under recompute, rebuild the MoE blocks too (router, routed and shared experts), whatever the "
        "granularity; false keeps their activations. With expert parallelism only the routed and shared "
        "experts are rebuilt (the exchange is never replayed); those runs say so.",
        group="precision",
        applies=MOE_MODELS,
    )
    compute_type: str = option(
        "fp32",
        "bf16/fp16 hold the weights in that precision with fp32 master weights (bf16 is emulated where "
        "there are no bf16 kernels, fp16 needs a GPU); wint8/wint4 quantize the frozen base (LoRA); fp8 is "
        "FP8 QAT.",
        choices=COMPUTE_TYPES,
        group="precision",
        common=True,
    )
    # what runs, logging, checkpoints
    do_train: bool = option(
        True, "Train; false only evaluates the model (needs do_eval and an eval set).", group="evaluation"
    )
    do_eval: bool = option(True, "Evaluate on the eval set when one is given.", group="evaluation")
    evaluation_strategy: str = option(
        "steps",
        "When to evaluate while training: every eval_steps, every epoch, or no.",
        choices=STRATEGIES,
        group="evaluation",
    )
    max_evaluate_steps: int = option(
        -1,
        "Batches per evaluation; -1 (or 0) evaluates the whole eval set.",
        minimum=-1,
        maximum=MAX_STEPS,
        group="evaluation",
    )
    save_strategy: str = option(
        "steps",
        "When to checkpoint: every save_steps, every epoch, or no (last step only).",
        choices=STRATEGIES,
        group="evaluation",
    )
    save_total_limit: int = option(
        0,
        "Keep the newest N checkpoints, deleting older ones; 0 keeps all.",
        minimum=0,
        maximum=MAX_STEPS,
        group="evaluation",
    )
    logging_steps: int = option(
        1, "Write a metrics point every N steps.", minimum=1, maximum=MAX_STEPS, group="logging", common=True
    )
    save_steps: int = option(
        500,
        "Resumable checkpoint every N steps.",
        minimum=1,
        maximum=MAX_STEPS,
        group="evaluation",
        common=True,
    )
    eval_steps: int = option(
        0,
        "Evaluate every N steps (evaluation_strategy steps); 0 evaluates at the end only.",
        minimum=0,
        maximum=MAX_STEPS,
        group="evaluation",
    )
    disable_tqdm: bool = option(False, "No progress bar on stdout.", group="logging")
    # LoRA
    lora_rank: int = option(
        8,
        "Rank of the low-rank update.",
        minimum=1,
        maximum=MAX_LORA_RANK,
        group="lora",
        common=True,
        applies=LORA_RUNS,
    )
    lora_alpha: float = option(
        -1.0, "LoRA scale numerator; -1 means 2 x rank.", group="lora", common=True, applies=LORA_RUNS
    )
    lora_plus_scale: float = option(
        1.0, "LoRA+: learning-rate multiplier of the B matrices.", minimum=0, group="lora", applies=LORA_RUNS
    )
    rslora: bool = option(
        False, "Rank-stabilised LoRA scaling (alpha / sqrt(rank)).", group="lora", applies=LORA_RUNS
    )
    lora_target_modules: list[str] = option(  # noqa: RUF009 (a field with a default_factory)
        help="Linear layers that get adapters; VL models also take vision, and resampler (ERNIE 4.5 VL) or "
        "projector (PaddleOCR-VL).",
        choices=LORA_TARGETS + LORA_VL_TARGETS,
        factory=lambda: list(LORA_TARGETS),
        group="lora",
        applies=LORA_RUNS,
    )
    # DPO
    beta: float = option(
        0.1,
        "Strength of the KL anchor to the reference model.",
        minimum=0,
        group="dpo",
        common=True,
        applies=DPO_RUNS,
    )
    loss_type: str = option(
        "sigmoid", "DPO loss.", choices=DPO_LOSSES, group="dpo", common=True, applies=DPO_RUNS
    )
    pref_loss_ratio: float = option(
        1.0, "Weight of the preference loss.", minimum=0, group="dpo", applies=DPO_RUNS
    )
    sft_loss_ratio: float = option(
        0.0, "Weight of the SFT loss on the chosen response.", minimum=0, group="dpo", applies=DPO_RUNS
    )
    label_smoothing: float = option(
        0.0, "Conservative DPO: assumed share of flipped labels.", minimum=0, group="dpo", applies=DPO_RUNS
    )
    reference_free: bool = option(False, "DPO without a reference model.", group="dpo", applies=DPO_RUNS)
    dpo_reference_dtype: str = option(
        "run",
        "Full DPO: how the frozen reference model is held: run (as the run holds its weights: fp32, or bf16 "
        "with compute_type bf16), fp32, or its linears weight-only wint8 / wint4 (less memory, an "
        "approximate reference). LoRA DPO has no second model: its reference is the base with the adapters "
        "switched off.",
        choices=DPO_REFERENCE_DTYPES,
        group="dpo",
        applies=REFERENCE_RUNS,
    )
    # MoE (None keeps the value in the model's config.json)
    moe_aux_loss_lambda: float | None = option(
        None,
        "Weight of the load-balancing loss; empty keeps the model's config.json value.",
        minimum=0,
        group="moe",
        applies=MOE_MODELS,
    )
    moe_z_loss_lambda: float | None = option(
        None,
        "Weight of the router z-loss; empty keeps the model's config.json value.",
        minimum=0,
        group="moe",
        applies=MOE_MODELS,
    )
    moe_orthogonal_loss_lambda: float | None = option(
        None,
        "Weight of the router orthogonal loss; empty keeps the model's config.json value.",
        minimum=0,
        group="moe",
        applies=MOE_MODELS,
    )
    moe_use_aux_free: bool | None = option(
        None,
        "Balance experts with correction biases (aux-free); empty keeps the model's config.json value.",
        group="moe",
        applies=MOE_MODELS,
    )
    moe_correction_bias_rate: float = option(
        1e-3, "Step size of the aux-free bias update.", minimum=0, group="moe", applies=MOE_MODELS
    )
    expert_parallel_degree: int = option(
        1,
        "Expert parallelism: split each MoE layer's routed experts over this many ranks (a divisor of the "
        "expert count and of the run's ranks); tokens travel to their expert's rank and back.",
        minimum=1,
        maximum=MAX_DEVICES,
        group="moe",
        applies=MOE_MODELS,
    )
    moe_group: str = option(
        "dummy",
        "ERNIEKit's expert-parallel group: dp (or data, world) splits the experts over all ranks; mp (model, "
        "tp) over the tensor-parallel group, one rank here; dummy (none) does not split.",
        choices=MOE_GROUPS,
        group="moe",
        applies=MOE_MODELS,
    )
    # GPAS (engine.models.gpas)
    gpas: bool = option(
        False,
        "GPAS: a learnable gate after every residual add scales activations down while gradients pass "
        "unchanged; starts as the plain model (Full runs; a model trained with GPAS keeps its gates).",
        group="gpas",
        applies=GPAS_RUNS,
    )
    gpas_gate_grad_clip: float = option(
        0.0,
        "GPAS: clip the gates' gradients by this global norm after max_grad_norm (the reference's "
        "clip_gate_grad, 0.01 for its 1B and 7B runs); 0 turns it off.",
        minimum=0,
        group="gpas",
        applies=GPAS_RUNS,
    )
    # elastic MoE training (engine.train.elastic)
    elastic: bool = option(
        False,
        "Elastic MoE training: each step trains a sub-model sampled over depth, experts and top-k, so one "
        "run yields a family of smaller models (PT / SFT on a text MoE model).",
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    elastic_depth_choices: str = option(
        "",
        "Elastic: depths (decoder layers kept; the first and the last always stay) a sub-model may have, "
        "comma-separated, e.g. 20,24; empty keeps every layer.",
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    elastic_depth_pattern: str = option(
        "contiguous",
        "Elastic: which layers a shallower sub-model drops: one contiguous block before the last layer, "
        "or evenly strided ones.",
        choices=ELASTIC_DEPTH_PATTERNS,
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    elastic_experts_choices: str = option(
        "",
        "Elastic: routed experts per MoE layer a sub-model may keep (the first N; the router renormalises "
        "over them), comma-separated, e.g. 32,48; empty keeps every expert.",
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    elastic_topk_choices: str = option(
        "",
        "Elastic: experts per token (k' <= moe_k) a sub-model may route to, comma-separated, e.g. 2,4; "
        "empty keeps moe_k.",
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    elastic_full_share: float = option(
        0.5,
        "Elastic: share of steps that train the full model; the others train a sub-model sampled uniformly "
        "from the elastic_* lists.",
        minimum=0,
        maximum=1,
        group="elastic",
        applies=ELASTIC_RUNS,
    )
    # quantization-aware training and weight-only bases
    fp8_hadamard: bool = option(
        True,
        "FP8 QAT: rotate blocks with a Hadamard transform before quantizing.",
        group="precision",
        applies=FP8_RUNS,
    )
    fp8_hadamard_block_size: int = option(
        32, "FP8 QAT: Hadamard block size (a power of two).", minimum=1, group="precision", applies=FP8_RUNS
    )
    fp8_scale_ema_rate: float = option(
        0.01, "FP8 QAT: EMA rate of activation scales.", minimum=0, group="precision", applies=FP8_RUNS
    )
    # sharded optimizer state over the data-parallel ranks (engine.train.sharding)
    sharding: str = option(
        "",
        "Split the optimizer state over the data-parallel devices: stage1 (AdamW state; CPU and GPU) or "
        "stage2 (gradients too; GPU only). Needs 2 or more devices; empty trains plain data-parallel.",
        group="precision",
    )
    sharding_parallel_degree: int = option(
        -1,
        "Devices one optimizer-state split spans: -1 is all of the run's devices, 1 turns sharding off; "
        "it must divide the run's devices (the rest replicate the split data-parallel).",
        minimum=-1,
        maximum=MAX_DEVICES,
        group="precision",
    )
    tensorwise_offload_optimizer: bool = option(
        False,
        "GPU: keep AdamW's moments in host memory and bring each weight's to the device only for its "
        "update (on CPU they live in host memory already).",
        group="precision",
    )
    weight_quant_group_size: int = option(
        -1,
        "Weight-only bases: group size; -1 is per channel.",
        group="precision",
        applies=Applies(compute_types=WEIGHT_ONLY_COMPUTE_TYPES),
    )

    # Accepted ERNIEKit keys without effect here (set by the loader; not a key of the config itself).
    notices: typing.ClassVar[list[Notice]]

    def __post_init__(self) -> None:
        self.notices = []
        if self.per_device_train_batch_size:
            self.batch_size = self.per_device_train_batch_size
        if not self.logging_dir:
            self.logging_dir = self.output_dir
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = comma_list(self.lora_target_modules)
        if isinstance(self.report_to, str) or self.report_to is None:  # `report_to=none` arrives as None
            self.report_to = comma_list(self.report_to or "none")
        for key, value in STAGE_DEFAULTS.get((self.stage, self.fine_tuning), {}).items():
            if getattr(self, key) is None:
                setattr(self, key, value)
