"""Text made while the studio runs, English and Chinese."""

from __future__ import annotations

from studio.messages import STATUS_ZH

# Text made while the studio runs: statuses, summaries, notices and errors that handlers format (keys are
# "<area>.<name>"; fields in braces are filled by str.format). Kept apart from the component labels above.
RUNTIME_STRINGS: dict[str, tuple[str, str]] = {
    # statuses of runs, exports and deployments, and a sweep trial's Optuna state (studio.messages)
    **{f"status.{status}": (status, zh) for status, zh in STATUS_ZH.items()},
    "sw.refused": ("**The sweep was not queued:**", "**搜索未排队：**"),
    "sw.estimate": (
        "**{trials} trials**, {parallel} at a time: at most {steps} steps ({run_steps} a trial), about "
        "{total} in all (pruned trials end early).",
        "**{trials} 次试验**，每次同时 {parallel} 个：最多 {steps} 步（每次试验 {run_steps} 步），总计约 "
        "{total}（被剪枝的试验会提前结束）。",
    ),
    "sw.estimate.peak": (" Peak memory of a trial {peak:.2f} GiB.", " 单次试验峰值内存 {peak:.2f} GiB。"),
    "sw.queued": ("Sweep #{id} queued", "超参搜索 #{id} 已排队"),
    "sw.launched": (
        "Sweep #{id} **{name}** queued: {trials} trials. Follow it in the Sweeps tab.",
        "超参搜索 #{id} **{name}** 已排队：{trials} 次试验。可在“超参搜索”页查看。",
    ),
    "swp.summary": (
        "**#{id} {name}** — {status} · {objective} ({direction}) · trials {n}/{total}: {complete} complete, "
        "{pruned} pruned, {running} running · sampler {sampler}, pruner {pruner}",
        "**#{id} {name}** — {status} · {objective}（{direction}）· 试验 {n}/{total}：已完成 {complete}，"
        "已剪枝 {pruned}，运行中 {running} · 采样器 {sampler}，剪枝器 {pruner}",
    ),
    "swp.best": ("Best: trial {trial}, {value} ({params})", "最佳：试验 {trial}，{value}（{params}）"),
    "swp.stopped": ("Stopped asking for trials: {reason}", "已停止新增试验：{reason}"),
    "swp.none": (
        "No sweep yet: launch one from the Train tab's Sweep box.",
        "还没有超参搜索：请在“训练”页的超参搜索框中启动。",
    ),
    "swp.gone": ("Sweep #{id} no longer exists.", "超参搜索 #{id} 已不存在。"),
    "swp.cancelling": (
        "Cancelling sweep #{id}: its running trials stop.",
        "正在取消超参搜索 #{id}：运行中的试验将停止。",
    ),
    "swp.promoted": (
        "Trial {trial} (run #{run}) is the best: deployment #{id} starting.",
        "试验 {trial}（任务 #{run}）最佳：部署 #{id} 正在启动。",
    ),
    "swp.err.none": ("Pick a sweep first.", "请先选择一个超参搜索。"),
    # the model pickers' choices
    "model.kind.preset": ("preset", "预置"),
    "model.kind.official": ("official", "官方"),
    "model.kind.local": ("local", "本地"),
    "model.kind.run": ("run", "任务"),
    "model.kind.export": ("export", "导出"),
    "model.active": (" ({n} active)", "（激活 {n}）"),
    "model.bf16_size": (" · {gb:.1f} GB in bf16", " · bf16 权重 {gb:.1f} GB"),
    "model.not_downloaded": (" · not downloaded", " · 未下载"),
    "model.base_missing": (" · LoRA, base missing", " · LoRA，缺少基座"),
    # plot axes
    "plot.step": ("step", "步数"),
    "plot.value": ("value", "数值"),
    "plot.series": ("series", "曲线"),
    "plot.tokens": ("tokens", "Token 数"),
    "plot.samples": ("samples", "样本数"),
    # datasets
    "ds.msg.summary": (
        "**{name}** · file `{filename}` · {kib:.1f} KiB  \ndetected format **{format}** · kind **{kind}** · "
        "{records} records, {valid} valid",
        "**{name}** · 文件 `{filename}` · {kib:.1f} KiB  \n识别格式 **{format}** · 类型 **{kind}** · "
        "共 {records} 条记录，{valid} 条有效",
    ),
    "ds.msg.all_valid": ("✅ all records valid", "✅ 全部记录有效"),
    "ds.msg.some_invalid": (
        "⚠️ {bad} of {records} records have problems",
        "⚠️ {records} 条记录中有 {bad} 条存在问题",
    ),
    "ds.msg.no_record": (
        "no record #{n} (the file has {total} records)",
        "没有第 {n} 条记录（文件共 {total} 条）",
    ),
    "ds.msg.position": ("record **{n}** of {total}", "第 **{n}** 条，共 {total} 条"),
    "ds.msg.pick_tokenizer": (
        "pick a tokenizer model to render the chat template",
        "请选择分词器模型以渲染对话模板",
    ),
    "ds.msg.not_added": (
        "❌ **{filename} was not added.** {n} problem(s)",
        "❌ **{filename} 未添加。** 共 {n} 个问题",
    ),
    "ds.msg.not_added_format": (
        " — detected format **{format}** ({kind})",
        " — 识别格式 **{format}**（{kind}）",
    ),
    "ds.msg.added": (
        "✅ added **{name}** — detected format **{format}** ({kind}), {records} records",
        "✅ 已添加 **{name}** — 识别格式 **{format}**（{kind}），共 {records} 条记录",
    ),
    "ds.msg.added_info": (
        "{name}: {records} records, format {format}.",
        "{name}：{records} 条记录，格式 {format}。",
    ),
    "ds.msg.deleted": ("Deleted dataset #{id}.", "已删除数据集 #{id}。"),
    "ds.msg.stats_samples": ("{n} samples", "{n} 个样本"),
    "ds.msg.stats_tokens": (" tokens", " 个 Token"),
    "ds.msg.stats_truncated": (
        "**{share:.1f}%** of samples are longer than max_seq_len {max_seq_len} and get truncated",
        "**{share:.1f}%** 的样本长于 max_seq_len {max_seq_len}，会被截断",
    ),
    "ds.msg.stats_trained": ("{share:.1f}% of tokens carry loss", "{share:.1f}% 的 Token 计算损失"),
    "ds.msg.stats_turns": ("turns per sample: {turns}", "每个样本的轮数：{turns}"),
    "ds.msg.benchmark_stats": (
        "A {format} benchmark: its questions are scored on the Evaluate tab, never trained on.",
        "{format} 基准测试：在“评测”页打分，不用于训练。",
    ),
    "ds.msg.media_pending": (
        "Images named by URL: {done}/{total} fetched so far; a worker is fetching them (refresh to follow).",
        "按 URL 引用的图片：已获取 {done}/{total}；工作节点正在获取（刷新查看进度）。",
    ),
    "ds.msg.media_done": (
        "Images named by URL: {fetched} of {total} fetched by a worker.",
        "按 URL 引用的图片：工作节点已获取 {fetched}/{total}。",
    ),
    "ds.msg.media_failed": (
        "Images named by URL were not fetched: {error}",
        "按 URL 引用的图片未能获取：{error}",
    ),
    "ds.msg.not_fetched": (
        "not fetched yet: {url}",
        "尚未获取：{url}",
    ),
    "ds.msg.benchmark_render": (
        "A {format} benchmark: each question is scored as docs/evaluation.md shows, not in the chat template.",
        "{format} 基准测试：按 docs/evaluation.md 所述方式逐题打分，不套用对话模板。",
    ),
    "ds.msg.stats_counting": (
        "⏳ counting tokens of {records} records with {model}'s tokenizer…",
        "⏳ 正在用 {model} 的分词器统计 {records} 条记录的 Token…",
    ),
    "ds.stat.mean": ("mean", "平均"),
    "ds.stat.p50": ("p50", "中位数"),
    "ds.stat.p95": ("p95", "95 分位"),
    "ds.stat.max": ("max", "最大"),
    "ds.span.trained": ("trained", "计算损失"),
    "ds.err.no_file": ("Choose a .jsonl, .json or .zip file first.", "请先选择 .jsonl、.json 或 .zip 文件。"),
    "ds.err.no_dataset": ("Pick a dataset first.", "请先选择数据集。"),
    "ds.err.no_model": (
        "Pick the model whose tokenizer should count the tokens.",
        "请选择用于统计 Token 的分词器模型。",
    ),
    "ds.err.no_dataset_delete": ("Pick a dataset to delete.", "请选择要删除的数据集。"),
    # train
    "tr.msg.launched": (
        "✅ run **#{id} {name}** queued — {where}. Follow it in the Runs tab.",
        "✅ 任务 **#{id} {name}** 已排队 — {where}。可在“任务”页查看进度。",
    ),
    "tr.msg.position": ("position **{n}** in the queue", "排在队列第 **{n}** 位"),
    "tr.msg.starting": ("starting", "即将开始"),
    "tr.msg.queued": ("Run #{id} queued.", "任务 #{id} 已排队。"),
    "tr.msg.pick": (
        "# pick a base model and a dataset to see the config",
        "# 选择基础模型和数据集后显示配置",
    ),
    "tr.msg.invalid": ("# not valid yet: {message}", "# 配置尚不完整：{message}"),
    # runs
    "runs.msg.stage": ("stage **{stage}** · {tuning}", "阶段 **{stage}** · {tuning}"),
    "runs.msg.base": ("base `{base}`", "基础模型 `{base}`"),
    "runs.msg.step": ("step **{step}**", "第 **{step}** 步"),
    "runs.msg.eta": ("ETA {eta}", "剩余 {eta}"),
    "runs.msg.step_s": ("{s:.1f} s/step", "{s:.1f} 秒/步"),
    "runs.msg.queue_position": ("queue position **{n}**", "排队位置 **{n}**"),
    "runs.msg.attempt": ("attempt {n}", "第 {n} 次尝试"),
    "runs.msg.placement": ("nodes: {parts}", "节点：{parts}"),
    "runs.msg.placement_part": (
        "{node} holds ranks {ranks} ({status})",
        "{node} 承担 rank {ranks}（{status}）",
    ),
    "runs.msg.placement_open": ("node rank {rank} waits for a worker", "节点序号 {rank} 等待 worker"),
    "runs.msg.model": ("model: `{path}`", "模型：`{path}`"),
    "runs.msg.forgetting": (
        "**Forgetting check** (base → result, change with its {level}% interval): {parts}",
        "**遗忘检查**（基座 → 结果，变化及其 {level}% 置信区间）：{parts}",
    ),
    "runs.msg.forgetting_task": ("task {score}", "任务 {score}"),
    "runs.msg.forgetting_general": ("general {score}", "通用能力 {score}"),
    "runs.msg.forgetting_warning": (
        "⚠️ the general score fell by more than the margin {margin:g}: the fine-tune lost general ability",
        "⚠️ 通用能力得分下降超过阈值 {margin:g}：微调损失了通用能力",
    ),
    "runs.msg.memory": (
        "peak memory predicted {peak:.2f} GiB ({lo:.2f} – {hi:.2f}), measured {measured}",
        "峰值内存预估 {peak:.2f} GiB（{lo:.2f} – {hi:.2f}），实测 {measured}",
    ),
    "runs.msg.per_step": (
        "per step predicted {predicted:.2f} s, measured {measured}",
        "每步预估 {predicted:.2f} 秒，实测 {measured}",
    ),
    "runs.msg.gone": ("run #{id} no longer exists", "任务 #{id} 已不存在"),
    "runs.msg.cancelling": ("Cancelling run #{id}.", "正在取消任务 #{id}。"),
    "runs.msg.resumed": ("Resumed run #{id}.", "已恢复任务 #{id}。"),
    "runs.msg.deleted": ("Deleted run #{id}.", "已删除任务 #{id}。"),
    "runs.msg.export_queued": (
        "Export #{id} ({kind}) queued; its model appears under base models when it is done.",
        "导出 #{id}（{kind}）已排队；完成后其模型会出现在基础模型中。",
    ),
    "runs.msg.deploying": (
        "Deployment #{id} starting; chat with it in Deploy & Chat.",
        "部署 #{id} 正在启动；可在“部署与对话”中与之对话。",
    ),
    "runs.msg.gguf_export_queued": (
        "Export #{id} ({kind}) queued; each file's size and perplexity show below when it is done.",
        "导出 #{id}（{kind}）已排队；完成后下方显示每个文件的大小与困惑度。",
    ),
    "runs.msg.deploying_gguf": (
        "Deployment #{id} of GGUF {type} starting with llama.cpp; chat with it in Deploy & Chat.",
        "GGUF {type} 的部署 #{id} 正在用 llama.cpp 启动；可在“部署与对话”中与之对话。",
    ),
    "runs.err.no_gguf": (
        "This run has no finished GGUF export; export one as GGUF first.",
        "此任务还没有完成的 GGUF 导出；请先导出 GGUF。",
    ),
    "runs.msg.member_deploy_queued": (
        "Export #{id} of member {member} queued; it is deployed as soon as it is written, without this page. "
        "Chat with it in Deploy & Chat once the family table shows it running.",
        "成员 {member} 的导出 #{id} 已排队；导出完成后会自动部署，无需停留在本页。"
        "家族表显示“运行中”后即可在“部署与对话”中与之对话。",
    ),
    "runs.err.no_member": (
        "Click a row of the elastic family table to pick the member first.",
        "请先点击弹性模型家族表中的一行以选择成员。",
    ),
    "runs.deploy.exporting": ("exporting", "导出中"),
    "runs.deploy.export_failed": ("export failed", "导出失败"),
    "runs.deploy.deploying": ("deploying", "部署中"),
    "runs.deploy.removed": ("deployment removed", "部署已删除"),
    "runs.deploy.export_ref": (" (export #{id})", "（导出 #{id}）"),
    "runs.deploy.deployment_ref": (" (deployment #{id})", "（部署 #{id}）"),
    "runs.msg.member": ("{kind}, member {member}", "{kind}，成员 {member}"),
    "runs.msg.shards": ("{dtype} · {size} shards", "{dtype} · 分片上限 {size}"),
    "runs.err.no_run": ("Pick a run first.", "请先选择任务。"),
    "runs.err.no_finished_run": ("Pick a finished run first.", "请先选择已完成的任务。"),
    # deploy & chat
    "dep.msg.endpoint": (
        " · `{url}` (OpenAI-compatible, model `default`)",
        " · `{url}`（兼容 OpenAI，模型名 `default`）",
    ),
    "dep.msg.starting": ("Deployment #{id} is starting.", "部署 #{id} 正在启动。"),
    "dep.msg.no_worker": (
        " · waiting for a serve worker to take it (the Nodes tab shows which are ready)",
        " · 等待服务节点接手（“节点”页显示哪些节点已就绪）",
    ),
    "dep.msg.taken": (" · {worker} is starting its server", " · {worker} 正在启动服务"),
    "dep.msg.stopped_stream": ("⏹️ stopped", "⏹️ 已停止"),
    "dep.msg.empty_reply": (
        "_(The model ended its reply at once, with no text. A briefly trained model can; ignore_eos makes it "
        "write up to max_tokens.)_",
        "_（模型立即结束了回复，没有生成文字。训练步数很少的模型可能如此；勾选 ignore_eos 可让它一直写到 max_tokens。）_",
    ),
    "dep.err.no_run": ("Pick a finished run to deploy.", "请选择要部署的已完成任务。"),
    "dep.err.no_stop": ("Pick a deployment to stop.", "请选择要停止的部署。"),
    "dep.err.reply_failed": (
        "The reply stopped: {message} Your message is kept in the chat; send it again once the deployment runs.",
        "回复中断：{message} 你的消息保留在对话中；部署运行后可重新发送。",
    ),
    # train: the estimate
    "tr.est.peak": (
        "peak {where} **{peak:.2f} GiB** ({lo:.2f} – {hi:.2f})",
        "峰值{where} **{peak:.2f} GiB**（{lo:.2f} – {hi:.2f}）",
    ),
    "tr.est.where.device": ("device memory", "显存"),
    "tr.est.where.ram": ("RAM", "内存"),
    "tr.est.checked": (" · checked against **{node}**", " · 已对照节点 **{node}**"),
    "tr.est.memory": ("memory", "内存项"),
    "tr.est.part.weights": ("weights", "权重"),
    "tr.est.part.master_weights": ("master weights", "主权重"),
    "tr.est.part.gradients": ("gradients", "梯度"),
    "tr.est.part.optimizer": ("optimizer", "优化器状态"),
    "tr.est.part.activations": ("activations", "激活值"),
    "tr.est.part.load_peak": ("load peak", "加载峰值"),
    "tr.est.part.save_peak": ("save peak", "保存峰值"),
    "tr.est.trainable": (
        "trainable parameters **{trainable:,}** of {total:,} ({share:.2f}%)",
        "可训练参数 **{trainable:,}** / {total:,}（{share:.2f}%）",
    ),
    "tr.est.time": (
        "{steps:,} steps of ~{tokens:,.0f} tokens: **{step}** per step ({lo} – {hi}), ≈ **{total}** in all with "
        "{checkpoints} checkpoint(s) and the final save ({save})",
        "{steps:,} 步，每步约 {tokens:,.0f} 个 Token：每步 **{step}**（{lo} – {hi}），含 {checkpoints} 个检查点和"
        "最终保存（{save}）共约 **{total}**",
    ),
    "tr.est.disk": ("disk: {gb:.2f} GB", "磁盘：{gb:.2f} GB"),
    "tr.est.assumptions": ("assumptions", "估算依据"),
    "tr.plan.title": (
        "**Proposed settings** for {model} ({stage} {fine_tuning}, {seq:,} tokens a row) on the studio's "
        "{devices} {kind} device(s):",
        "**建议配置**：{model}（{stage} {fine_tuning}，每行 {seq:,} 个 Token），本工作室共 {devices} 个 {kind} 设备：",
    ),
    "tr.plan.fits": (
        "**{peak:.1f} GiB** per device of {cap:.1f} — `{keys}`",
        "每设备 **{peak:.1f} GiB**（可用 {cap:.1f}）— `{keys}`",
    ),
    "tr.plan.none": (
        "**Nothing fits** on {devices} device(s): at best {peak:.1f} GiB per device against {cap:.1f} GiB",
        "**没有可行配置**：{devices} 个设备上最少也需每设备 {peak:.1f} GiB，可用 {cap:.1f} GiB",
    ),
    "tr.plan.moe": (
        "{moe:.1f} GiB of it are what the MoE blocks keep under recompute (with expert parallelism the "
        "router, dispatch and combine are not replayed)",
        "其中 {moe:.1f} GiB 为重计算下 MoE 模块保留的激活值（专家并行时路由、分发与合并不重放）",
    ),
    "tr.plan.tp": (
        "it would fit with tensor_parallel_degree {tp} ({peak:.1f} GiB per device), which this engine does "
        "not have",
        "若使用 tensor_parallel_degree {tp} 可放下（每设备 {peak:.1f} GiB），但本引擎不支持张量并行",
    ),
    "tr.plan.tp_pp": (
        "it would fit with tensor_parallel_degree {tp} and pipeline_parallel_degree {pp} ({peak:.1f} GiB per "
        "device on the fullest stage), which this engine does not have",
        "若使用 tensor_parallel_degree {tp} 与 pipeline_parallel_degree {pp} 可放下（最满的流水线阶段每设备 "
        "{peak:.1f} GiB），但本引擎不支持张量并行与流水线并行",
    ),
    "tr.plan.over": ("{peak:.1f} GiB > {cap:.1f} GiB", "{peak:.1f} GiB > {cap:.1f} GiB"),
    "tr.plan.host": ("host RAM {host:.0f} GiB > {cap:.0f} GiB", "主机内存 {host:.0f} GiB > {cap:.0f} GiB"),
    "tr.plan.rejected": ("why the others do not fit", "其他配置为何不可行"),
    "tr.err.no_clone": ("Pick a run to clone.", "请选择要克隆的任务。"),
    "tr.err.no_dataset": ("pick at least one dataset", "请至少选择一个数据集"),
    "dl.msg.params": ("{n:.2f}B parameters", "{n:.2f}B 参数"),
    "dl.msg.official": ("an official model", "官方模型"),
    "dl.msg.downloaded": (
        "✅ **{name}** ({size}) is downloaded in `{path}`.",
        "✅ **{name}**（{size}）已下载到 `{path}`。",
    ),
    "dl.msg.listing": (
        "⏳ **{name}**: download {status}, listing the files…",
        "⏳ **{name}**：下载{status}，正在列出文件…",
    ),
    "dl.msg.progress": (
        "⏳ **{name}**: {share:.0%} ({done} of {total})",
        "⏳ **{name}**：{share:.0%}（{done} / {total}）",
    ),
    "dl.msg.failed": (
        "❌ the last download of **{name}** failed: {error}",
        "❌ **{name}** 上次下载失败：{error}",
    ),
    "dl.msg.missing": (
        "**{name}** ({size}) is not downloaded yet: **Download** fetches it from the hub.",
        "**{name}**（{size}）尚未下载：点击**下载**从模型仓库获取。",
    ),
    "dl.msg.started": ("Downloading {name}.", "正在下载 {name}。"),
    "dl.err.not_official": (
        "Pick an official model (marked [official]) to download.",
        "请选择要下载的官方模型（标有 [官方]）。",
    ),
    # compare
    "cmp.err.two_runs": ("Pick two or more runs to compare.", "请选择两个或更多任务进行对比。"),
    "cmp.err.ab": ("Pick deployments A and B and type a prompt.", "请选择部署 A 和 B 并输入提示词。"),
}
