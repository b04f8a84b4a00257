"""The estimate's texts for a person: what it assumed (its notes), whether the run fits its node, and the
planner's refusal of sharding on one device. The UI shows them by key (studio.messages.zh_estimate)."""

from __future__ import annotations

from engine.messages import Catalog

ESTIMATE = Catalog(
    "estimate",
    {
        # the notes (Estimate.assumptions)
        "weights_train": "{trainable:,} of {total:,} weights train ({kind}); {active:,} active per token",
        "fp16_needs_gpu": "fp16 needs a GPU (loss scaling); this node would refuse the run",
        "bf16_emulated": (
            "bf16 on a CPU is emulated: bf16 weight storage, fp32 compute, fp32 master weights and moments"
        ),
        "no_token_stats": "no token statistics of the data yet: every sample assumed {cap} tokens long",
        "packing": "packing: rows of {cap} tokens holding ~{per_row:.1f} samples of {mean:.0f} tokens on average",
        "data": (
            "data: {n:,} samples, mean {mean:.0f} / p95 {p95:.0f} / max {longest} tokens (cut at max_seq_len "
            "{cap}); a step of {rows} row(s) pads to ~{width:.0f} tokens, long ones to ~{memory_width:.0f}"
        ),
        "epochs_without_stats": "training by epochs over datasets without statistics: 1 step per epoch assumed",
        "gpu_rate": "GPU {gpu}: {tflops:.0f} TFLOP/s sustained ({util:.0%} of {peak_tflops:.0f})",
        "cpu_rate_probed": (
            "CPU: {gflops:.0f} GFLOP/s in matmuls, the reference node's {reference_gflops:.0f} scaled by this "
            "node's doctor throughput probe against the reference ({probe:,.0f} vs {reference_probe:,.0f} "
            "tokens/s)"
        ),
        "cpu_rate_assumed": (
            "CPU: no throughput probe from this node; the reference node's {gflops:.0f} GFLOP/s assumed"
        ),
        "step_record": (
            "this node's recent runs took {ratio:.2f}x the modelled step time ({runs} run(s)): "
            "{model_step_s:.2f} s a step becomes {step_s:.2f} s"
        ),
        "saves_adapter": (
            "saves: {checkpoints} checkpoint(s) of {checkpoint_gb:.2f} GB and a final adapter of "
            "{final_gb:.2f} GB at ~{mb_s:.0f} MB/s"
        ),
        "saves_model": (
            "saves: {checkpoints} checkpoint(s) of {checkpoint_gb:.2f} GB and a final model of "
            "{final_gb:.2f} GB at ~{mb_s:.0f} MB/s"
        ),
        "evaluation": "evaluation: {evals} pass(es) over {batches} batch(es), ~{seconds:.0f} s each",
        "data_parallel": "{n} data-parallel ranks, each holding the whole model and optimizer",
        "data_parallel_cpu": (
            "{n} data-parallel ranks, each holding the whole model and optimizer; on one CPU node they share "
            "its RAM ({gib:.1f} GiB) and cores"
        ),
        "host_offload": (
            "host RAM: the offloaded optimizer state, {rank_gib:.1f} GiB per rank ({total_gib:.1f} GiB for {n})"
        ),
        # the studio's notes (studio.services.estimates)
        "datasets_without_stats": (
            "{n} dataset(s) without token statistics yet: their samples count as long as the others'"
        ),
        "not_checked": "no worker serving this queue has reported: not checked against a node",
        # the check against a node (fit_warning); `where` is node_ram or node_device
        "will_not_fit": (
            "will not fit: the run needs about {need_gib:.1f} GiB at its peak (at least {low_gib:.1f}) and "
            "{where} holds less; try LoRA, compute_type bf16 or wint8, recompute, a shorter max_seq_len or a "
            "smaller batch_size"
        ),
        "may_not_fit": (
            "may not fit: the run needs about {need_gib:.1f} GiB at its peak and {where} holds {have_gib:.1f}; "
            "the estimate's low end fits"
        ),
        "may_not_load": (
            "may not fit: loading takes about {need_gib:.1f} GiB of {node}'s host RAM ({have_gib:.1f} GiB)"
        ),
        "node_ram": "{node}'s RAM ({have_gib:.1f} GiB)",
        "node_device": "one device of {node} ({gpu}, {have_gib:.1f} GiB)",
        # the planner's refusal (engine.estimate.checks)
        "sharding_one_device": (
            "sharding: {sharding} splits the optimizer state over data-parallel ranks and the run has one "
            "device; leave sharding out or ask for num_devices of 2 or more"
        ),
    },
)
