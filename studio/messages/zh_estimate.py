"""The Chinese of the estimate messages (engine.messages catalogs), by key."""

from __future__ import annotations

ZH: dict[str, str] = {
    # the notes (engine.estimate.messages)
    "estimate.weights_train": "{trainable:,} / {total:,} 个权重参与训练（{kind}）；每个 Token 激活 {active:,} 个",
    "estimate.fp16_needs_gpu": "fp16 需要 GPU（损失缩放）；此节点会拒绝该任务",
    "estimate.bf16_emulated": "CPU 上的 bf16 为模拟：以 bf16 存储权重，以 fp32 计算，主权重与动量为 fp32",
    "estimate.no_token_stats": "数据尚无 Token 统计：每个样本按 {cap} 个 Token 估算",
    "estimate.packing": "打包：每行 {cap} 个 Token，平均容纳约 {per_row:.1f} 个长 {mean:.0f} 个 Token 的样本",
    "estimate.data": (
        "数据：{n:,} 个样本，平均 {mean:.0f} / p95 {p95:.0f} / 最长 {longest} 个 Token（按 max_seq_len {cap} "
        "截断）；每步 {rows} 行补齐到约 {width:.0f} 个 Token，长样本约 {memory_width:.0f}"
    ),
    "estimate.epochs_without_stats": "按轮次训练但数据集尚无统计：按每轮 1 步估算",
    "estimate.gpu_rate": "GPU {gpu}：持续 {tflops:.0f} TFLOP/s（峰值 {peak_tflops:.0f} 的 {util:.0%}）",
    "estimate.cpu_rate_probed": (
        "CPU：矩阵乘 {gflops:.0f} GFLOP/s，即参考节点的 {reference_gflops:.0f} 按本节点 doctor 吞吐探测与参考值之比"
        "缩放（{probe:,.0f} 对 {reference_probe:,.0f} Token/秒）"
    ),
    "estimate.cpu_rate_assumed": "CPU：此节点没有吞吐探测结果；按参考节点的 {gflops:.0f} GFLOP/s 估算",
    "estimate.step_record": (
        "此节点最近 {runs} 个任务的实际步时为模型估算的 {ratio:.2f} 倍：每步 {model_step_s:.2f} 秒按 "
        "{step_s:.2f} 秒计"
    ),
    "estimate.saves_adapter": (
        "保存：{checkpoints} 个 {checkpoint_gb:.2f} GB 的检查点和 {final_gb:.2f} GB 的最终适配器，约 {mb_s:.0f} MB/秒"
    ),
    "estimate.saves_model": (
        "保存：{checkpoints} 个 {checkpoint_gb:.2f} GB 的检查点和 {final_gb:.2f} GB 的最终模型，约 {mb_s:.0f} MB/秒"
    ),
    "estimate.evaluation": "评估：{evals} 次，每次 {batches} 个批次，约 {seconds:.0f} 秒",
    "estimate.data_parallel": "{n} 个数据并行进程，各持完整模型与优化器",
    "estimate.data_parallel_cpu": (
        "{n} 个数据并行进程，各持完整模型与优化器；在同一 CPU 节点上共享其内存（{gib:.1f} GiB）与核心"
    ),
    "estimate.host_offload": "主机内存：卸载的优化器状态每进程约 {rank_gib:.1f} GiB（{n} 个进程共 {total_gib:.1f} GiB）",
    # the studio's notes (studio.services.estimates)
    "estimate.datasets_without_stats": "{n} 个数据集尚无 Token 统计：其样本按其他数据集的长度计",
    "estimate.not_checked": "服务此队列的工作进程尚未上报：未对照节点检查",
    # the check against a node
    "estimate.will_not_fit": (
        "放不下：任务峰值约需 {need_gib:.1f} GiB（至少 {low_gib:.1f}），而{where}不足；可试 LoRA、compute_type bf16 "
        "或 wint8、重计算、更短的 max_seq_len 或更小的 batch_size"
    ),
    "estimate.may_not_fit": (
        "可能放不下：任务峰值约需 {need_gib:.1f} GiB，而{where}只有 {have_gib:.1f}；估算下限可以放下"
    ),
    "estimate.may_not_load": "可能放不下：加载约需 {need_gib:.1f} GiB，{node} 的主机内存只有 {have_gib:.1f} GiB",
    "estimate.node_ram": " {node} 的内存（{have_gib:.1f} GiB）",
    "estimate.node_device": " {node} 的一块设备（{gpu}，{have_gib:.1f} GiB）",
    # the planner's refusal
    "estimate.sharding_one_device": (
        "sharding：{sharding} 把优化器状态切分到各数据并行进程，而该任务只有一个设备；请去掉 sharding，或把 "
        "num_devices 设为 2 或更多"
    ),
}
