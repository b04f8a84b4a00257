"""ERNIEKit's keys as this engine meets them: its other names for fields (``ERNIEKIT_ALIASES``), the keys that
have no effect here, each with the reason a run announces (``ERNIEKIT_NOTICES``, ``EXPORT_NOTICES``,
``Notice``), and the model-parallel degrees it refuses (``REFUSED_DEGREES``).
"""

from __future__ import annotations

from dataclasses import dataclass

# ERNIEKit's names for keys this engine calls otherwise: the value is the field's on the right.
ERNIEKIT_ALIASES: dict[str, str] = {
    "apply_hadamard": "fp8_hadamard",
    "hadamard_block_size": "fp8_hadamard_block_size",
    "actscale_moving_rate": "fp8_scale_ema_rate",
    "moe_use_aux_free_update_coef": "moe_correction_bias_rate",
    "eval_strategy": "evaluation_strategy",
    "eval_iters": "max_evaluate_steps",
    "gradient_checkpointing": "recompute",
}

_PARALLEL = (
    "GPU model parallelism (tensor / pipeline / sharding / sequence); this engine trains data-parallel only "
    "(`paddle.distributed.launch --nproc_per_node N`)"
)
# Model-parallel degrees this engine cannot honour: above 1 the run would not be the one asked for, so
# such a config is refused instead of announced.
REFUSED_DEGREES = {"tensor_parallel_degree": "tensor", "pipeline_parallel_degree": "pipeline"}
_SHARDING_TUNING = (
    "tunes fleet's sharding (split_param, tensor fusion, communication buffers); `sharding` here runs "
    "fleet's DygraphShardingOptimizer with its defaults: the same updates"
)
_KERNEL = "chooses a fused GPU kernel; this engine's plain Paddle ops compute the same result"
_MEMORY = "a GPU memory saving; this engine keeps weights, gradients and optimizer state in one place"
_AMP = "compute_type chooses the precision here (bf16 / fp16: low-precision weights, fp32 master weights)"
_AMP_OPS = (
    "an AMP op list / master-gradient switch; this engine runs no auto_cast: the model itself computes norm "
    "statistics, rotary, attention softmax, the MoE router and the loss in fp32"
)
_CHECKPOINT = (
    "ERNIEKit's checkpoint format; this engine writes checkpoint-N/ (resumable) and the final model in "
    "Paddle layout (save_to_hf: true, the Hugging Face one)"
)
_MODEL_JSON = "the model's config.json decides this (multimodal, MoE, layers), not the training config"
_VL_DATA = (
    "ERNIEKit's VL data pipeline option; this engine's VL-SFT reads erniekit_vl records with its own "
    "image handling and chat template"
)
_OCR_DATA = (
    "ERNIEKit's OCR data pipeline option; stage OCR-VL-SFT here reads OCR pairs and erniekit_vl records and "
    "prepares their images with PaddleOCR-VL's own image processor (rescaled, normalised, float32)"
)
_LOADER = "data loading runs in the training process here; there are no loader workers to configure"
_DPO_VARIANT = "a DPO loss variant this engine does not implement (loss_type: sigmoid, ipo, hinge)"

# ERNIEKit keys that have no effect on this engine, each with the reason a run announces (one line, once,
# as a `notice` event, in train.log and in run_summary.json). Keys ERNIEKit's example configs use are all
# here or fields; a key neither ERNIEKit nor this engine knows is an error.
ERNIEKIT_NOTICES: dict[str, str] = {
    # parallelism and distributed plumbing
    "tensor_parallel_degree": _PARALLEL,
    "pipeline_parallel_degree": _PARALLEL,
    "sequence_parallel": _PARALLEL,
    "pipeline_parallel_config": _PARALLEL,
    "tensor_parallel_config": _PARALLEL,
    "sharding_parallel_config": _SHARDING_TUNING,
    "sharding_comm_buffer_size_MB": _SHARDING_TUNING,
    "virtual_pp_degree": _PARALLEL,
    "pp_need_data": _PARALLEL,
    "pp_need_data_degree": _PARALLEL,
    "pp_seg_method": _PARALLEL,
    "disable_pipeline_warmup": _PARALLEL,
    "moe_multimodal_dispatch_use_allgather": (
        "the expert-parallel dispatch here follows the backend: all-to-all on GPUs (NCCL), all_gather on "
        "gloo (CPU), both modality groups in one exchange"
    ),
    "use_sp_callback": "a sequence-parallel gradient hook; there is no sequence parallelism here",
    "tensor_parallel_output": "keeps the LM head's logits split across tensor-parallel ranks; "
    "there is no tensor parallelism here",
    "distributed_dataloader": _LOADER,
    "save_sharding_stage1_model_include_freeze_params": _CHECKPOINT,
    "load_sharded_model": _CHECKPOINT,
    "save_sharded_model": _CHECKPOINT,
    "unified_checkpoint": _CHECKPOINT,
    "unified_checkpoint_config": _CHECKPOINT,
    "disable_ckpt_quant": "checkpoints here hold optimizer state unquantized",
    "ignore_save_lr_and_optim": "checkpoints here always hold the optimizer state, so runs resume exactly",
    "ignore_load_lr_and_optim": "checkpoints here always hold the optimizer state, so runs resume exactly",
    "save_to_aistudio": "uploading is not part of training here; the run directory is local",
    "device": "the device comes from the Paddle build (GPU when compiled with CUDA, else CPU)",
    "FLAGS_use_stride_kernel": "a Paddle runtime flag (ERNIEKit's XPU configs set it); the config does not set "
    "Paddle flags here: export FLAGS_use_stride_kernel in the environment instead",
    "convert_from_hf": "a model directory's layout (Paddle or Hugging Face; PaddleOCR-VL's published or "
    "transformers' form) is recognised from its files and read either way",
    # fused kernels
    "fuse_rope": _KERNEL,
    "fuse_linear": _KERNEL,
    "fuse_rms_norm": _KERNEL,
    "fuse_softmax_mask": _KERNEL,
    "use_flash_attention": _KERNEL,
    "use_mem_eff_attn": _KERNEL,
    "use_sparse_flash_attn": _KERNEL,
    "use_sparse_head_and_loss_fn": _KERNEL,
    "use_fused_head_and_loss_fn": _KERNEL,
    "use_attn_mask_startend_row_indices": _KERNEL,
    "use_attn_mask_start_row_indices": _KERNEL,
    # memory
    "offload_optim": _MEMORY,
    "optim_shard_num": "shards ERNIEKit's optimizer state files across GPUs; optimizer state here is one file",
    "use_lowprecision_moment": "AdamW moments stay fp32 here (bf16 moments are a GPU memory saving)",
    "release_grads": _MEMORY,
    "pre_alloc_memory": _MEMORY,
    "gc_interval": _MEMORY,
    "recompute_use_reentrant": (
        "recompute here is always non-reentrant (Paddle's saved-tensor hooks); the same activations are "
        "rebuilt and the same gradients computed either way"
    ),
    "no_recompute_layers": "recompute here applies to every layer",
    "use_recompute_loss_fn": "the loss here is not recomputed",
    "loss_subbatch_seqlen": "computes the loss in chunks of this many tokens to save GPU memory; the loss here "
    "is computed over the whole sequence at once (the same value)",
    "refined_recompute": "chooses ops ERNIEKit keeps instead of recomputing (a memory / speed trade); "
    "recompute and recompute_granularity decide what is rebuilt here, with the same gradients",
    # mixed precision
    "bf16": _AMP,
    "fp16": _AMP,
    "fp16_opt_level": "compute_type bf16 / fp16 always train O2-style here (low-precision weights, fp32 "
    "master weights and AdamW moments)",
    "amp_master_grad": _AMP_OPS,
    "amp_custom_white_list": _AMP_OPS,
    "amp_custom_black_list": _AMP_OPS,
    "scale_loss": (
        "the initial fp16 loss scale; fp16 (GPU only) starts paddle.amp.GradScaler at 32768, ERNIEKit's "
        "default, and adapts it every step"
    ),
    # model structure decided by config.json
    "multimodal": _MODEL_JSON,
    "use_moe": _MODEL_JSON,
    "moe_use_hard_gate": _MODEL_JSON,
    "num_nextn_predict_layers": "multi-token prediction (MTP) layers are not trained here; ERNIEKit sets it 0",
    # data and loader
    "dataloader_num_workers": _LOADER,
    "prefetch_factor": _LOADER,
    "random_shuffle": "the training stream is always shuffled by seed",
    "greedy_intokens": "packing here is always first-fit-decreasing over a pool of samples",
    "buffer_size": "packing here draws from a pool of 8 batches' worth of samples",
    "padding": "a batch here is never padded to max_seq_len: its rows are padded to the longest one "
    "(ERNIEKit's padding: false)",
    "split_multi_turn": "a multi-turn sample trains every assistant turn in one sequence here",
    "dataset_name": "the reader follows from each file's records here (erniekit, erniekit_vl, chatml, ...)",
    "dataset_name_or_path": "datasets are named by train_dataset_path here",
    "dataset_type": "pre-tokenized pretraining shards are not read here; give PT data as train_dataset_path",
    "input_dir": "pre-tokenized pretraining shards are not read here; give PT data as train_dataset_path",
    "split": "pre-tokenized pretraining shards are not read here; give eval data as eval_dataset_path",
    "use_pic_id": _VL_DATA,
    "variable_resolution": _VL_DATA,
    "pad_to_max_seqlen": _VL_DATA,
    "render_timestamp": _VL_DATA,
    "serialize_output": _VL_DATA,
    "one_sample_in_one_seq": _VL_DATA,
    "add_sys_token": _VL_DATA,
    "same_data": _VL_DATA,
    "trigger_data_prob": _VL_DATA,
    "drop_history_with_k": _VL_DATA,
    "modality_ratio": _VL_DATA,
    "sft_replace_ids": _OCR_DATA,
    "sft_image_normalize": _OCR_DATA,
    "sft_image_rescale": _OCR_DATA,
    "image_dtype": _OCR_DATA,
    "chat_template": "the chat template comes from the model directory's tokenizer files",
    # optimisation details not implemented
    "attention_probs_dropout_prob": (
        "this engine's attention has no dropout on its probabilities; hidden_dropout_prob is applied"
    ),
    "layerwise_lr_decay_bound": "every layer here trains with the same learning rate",
    "visual_ld": "the vision encoder's layers share vit_lr_ratio here (no per-layer decay)",
    # trainer plumbing
    "do_predict": "prediction is `ernie-studio chat` / `serve` here, not part of training",
    "from_scratch": "training always starts from model_name_or_path (init-model makes a fresh model)",
    "continue_training": "a run resumes from its output_dir's newest checkpoint by itself",
    "overwrite_output_dir": "a run resumes from its output_dir's newest checkpoint by itself",
    "load_best_model_at_end": "the final model is the last step's (or the weight EMA with ema_decay)",
    "greater_is_better": "the final model is the last step's (or the weight EMA with ema_decay)",
    "metric_for_best_model": "the final model is the last step's (or the weight EMA with ema_decay)",
    "remove_unused_columns": "batches here carry only the model's inputs",
    # DPO variants
    "offset_alpha": _DPO_VARIANT,
    "simpo_gamma": _DPO_VARIANT,
    "dpop_lambda": _DPO_VARIANT,
    "ref_model_update_steps": "the DPO reference model stays frozen for the whole run",
}

# Export configs of ERNIEKit carry these besides training keys.
EXPORT_NOTICES: dict[str, str] = {
    "hf_hub_id": "uploading to the Hugging Face Hub is not done here; the export is written to export_dir",
}


@dataclass(frozen=True)
class Notice:
    """An accepted key that has no effect on this run, and why (one line in the run's events)."""

    key: str
    message: str

    def line(self) -> str:
        return f"notice: {self.key}: {self.message}"
