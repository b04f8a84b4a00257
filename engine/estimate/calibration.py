"""The estimate's calibration: what the reference node measured and the constants of memory and time."""

from __future__ import annotations

GIB = 1024**3

# ---- calibration (measured on the reference node; bench/bench_estimate.py checks it) -------------------
# The reference node: 2-core AMD EPYC, Paddle 3.3.1 CPU build. Its doctor throughput probe (tiny model,
# batch 4 x 128, forward + backward + AdamW) runs at REFERENCE_PROBE_TOKENS_S while an ERNIE-4.5-0.3B
# step sustains REFERENCE_CPU_FLOPS in its matmuls. Another node (or the same one under another load) is
# assumed to run at (probe / reference) ** PROBE_EXPONENT of it. Measured on 2026-11-26 with the CPU step
# of then (docs/benchmarks.md): the 0.3B LoRA step times the probe gave the same product (31.2k and 31.1k)
# at loads 7.5 and 14.7, where the probe moved 3.6x, and 33k-38k in the earlier runs at loads 2-4.5: the
# step follows the probe in proportion (a square root had it at half the measured time at load 14.7).
# On a quiet box the probe reads 2.5-2.8x the reference and the 0.3B step gains only about 2x: the tiny
# probe is bound by per-op overhead, which a quiet box speeds up more than the big matmuls, which approach
# what the cores and memory give. PROBE_SATURATION bends the proportion there (p / (1 + p / S), scaled to 1
# at the reference). Fitted on 2026-11-28 over the 9 runs docs/benchmarks.md records with their probes (AMD
# EPYC at loads 1-16, Intel Xeon quiet; LoRA fp32/bf16/wint8, Full, stage1 on 2 ranks): the estimate is
# within 0.84-1.18 of each, where the plain proportion gave 0.74-1.08 (the quiet bf16 / wint8 runs low).
REFERENCE_PROBE_TOKENS_S = 4300.0
REFERENCE_CPU_FLOPS = 54e9
PROBE_EXPONENT = 1.0
PROBE_SATURATION = 10.0


def cpu_speed(probe: float | None) -> float:
    """This node's matmul speed as a multiple of the reference node's, from its throughput probe."""
    if not probe:
        return 1.0
    p = (probe / REFERENCE_PROBE_TOKENS_S) ** PROBE_EXPONENT
    if not PROBE_SATURATION:
        return p
    return p / (1 + p / PROBE_SATURATION) * (1 + 1 / PROBE_SATURATION)


# Per trainable weight and step on the reference CPU: gradient zero-fill, all-reduce bookkeeping, the norm
# for clipping and AdamW's update (memory-bound, so it does not scale with matmul speed).
REFERENCE_CPU_OPTIMIZER_S_PER_PARAM = 7.8e-9
# Per weight and step, emulated bf16 and weight-only bases upcast (dequantize) every held weight in forward
# and again in backward: bench/bench_memory.py's s/step over fp32 at 128 tokens.
REFERENCE_CPU_UPCAST_S_PER_PARAM = {"bf16": 2.8e-9, "wint8": 12e-9, "wint4/8": 12e-9}
# Python and kernel-launch cost of one decoder layer's forward + backward.
REFERENCE_CPU_LAYER_OVERHEAD_S = 0.005
# Resident memory of a trainer process before the model loads (Python, Paddle, tokenizer, data).
CPU_PROCESS_BASELINE_BYTES = 424 * 1024**2
# A GPU process's CUDA context and kernels' workspace on the device.
GPU_CONTEXT_BYTES = 1 * GIB
# Writing a checkpoint or model: serialisation plus disk on the reference node.
REFERENCE_SAVE_BYTES_S = 300e6
# Saving: paddle.save's copy of a checkpoint's tensors beside the live ones (share of the checkpoint's
# bytes), and save_model's fp32 numpy state plus the shard being written (share of the model's bytes).
SAVE_COPY = 0.9
FINAL_SAVE_COPY = 1.5
# Eager fp32 activations kept for backward per token and decoder layer, in floats, beyond the shape-based
# count below (allocator slack, dtype casts, norm statistics); calibrated against measured peaks.
ACTIVATION_SLACK = 1.0
# Copies of the [tokens, vocab] logits alive at the start of backward (logits, log-softmax, its gradient).
LOGIT_COPIES = 3
# The range around point values: memory is well determined by shapes; time depends on the node's load.
MEMORY_RANGE = (0.85, 1.2)
TIME_RANGE = (0.7, 1.5)
# Peak dense bf16 FLOP/s by GPU name (a substring of the device name the doctor reports).
GPU_PEAK_FLOPS = {
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40": 362e12,
    "4090": 165e12,
    "A10": 125e12,
    "V100": 125e12,
    "T4": 65e12,
}
GPU_DEFAULT_PEAK_FLOPS = 100e12
GPU_UTILISATION = 0.35  # share of peak a training step sustains (MFU)
# How far a node's own record may move the modelled step time (a bad record must not swing it wildly).
STEP_RATIO_BOUNDS = (0.25, 4.0)
