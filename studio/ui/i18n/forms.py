"""The labels of the studio's forms, English and Chinese: the app, its tabs, Datasets and Train (keys
"app.", "tab.", "ds.", "tr."). `studio.ui.i18n` joins the tables."""

from __future__ import annotations

from engine.data.record_types import FORMATS
from engine.eval.config import BENCHMARK_TYPES

# key -> (English, Chinese). Keys ending in ".info" are tooltips (Gradio's ``info=``).
FORM_LABELS: dict[str, tuple[str, str]] = {
    "app.title": ("ERNIE Studio", "ERNIE Studio"),
    "app.subtitle": (
        "Fine-tune, align, compress and deploy ERNIE 4.5 models.",
        "微调、对齐、压缩并部署 ERNIE 4.5 模型。",
    ),
    "app.language": ("Language", "语言"),
    # tabs
    "tab.datasets": ("Datasets", "数据集"),
    "tab.train": ("Train", "训练"),
    "tab.runs": ("Runs", "任务"),
    "tab.compare": ("Compare", "对比"),
    "tab.deploy": ("Deploy & Chat", "部署与对话"),
    "tab.nodes": ("Nodes", "节点"),
    "tab.sweeps": ("Sweeps", "超参搜索"),
    # datasets
    "ds.upload": (
        "Upload a dataset (.jsonl / .json, a .zip with its images, or a benchmark .csv)",
        "上传数据集（.jsonl / .json、含图片的 .zip，或基准测试 .csv）",
    ),
    "ds.images": ("Images in this record", "本条记录中的图片"),
    "ds.name": ("Name", "名称"),
    "ds.name.info": ("Defaults to the file name.", "默认使用文件名。"),
    "ds.format": ("Format", "格式"),
    "ds.format.info": (
        f"auto detects {' / '.join(FORMATS)} and the benchmark files {' / '.join(BENCHMARK_TYPES)} from the "
        "first records.",
        f"auto 会根据前几条记录自动识别 {' / '.join(FORMATS)} 以及基准测试文件 {' / '.join(BENCHMARK_TYPES)}。",
    ),
    "ds.upload_btn": ("Upload and validate", "上传并校验"),
    "ds.list": ("Datasets", "数据集列表"),
    "ds.select": ("Dataset", "数据集"),
    "ds.refresh": ("Refresh", "刷新"),
    "ds.delete": ("Delete dataset", "删除数据集"),
    "ds.summary": ("Summary", "概要"),
    "ds.problems": ("Validation problems (file:line)", "校验问题（文件:行）"),
    "ds.preview": ("Preview", "预览"),
    "ds.view.raw": ("Raw record", "原始记录"),
    "ds.view.rendered": ("Chat template (trained part highlighted)", "对话模板（高亮部分计算损失）"),
    "ds.prev": ("◀ Previous", "◀ 上一条"),
    "ds.next": ("Next ▶", "下一条 ▶"),
    "ds.offset": ("Record #", "记录编号"),
    "ds.stats": ("Token lengths", "Token 长度分布"),
    "ds.tokenizer": ("Tokenizer (from model)", "分词器（来自模型）"),
    "ds.tokenizer.info": (
        "Lengths are counted with this model's real tokenizer and chat template.",
        "使用该模型真实的分词器和对话模板统计长度。",
    ),
    "ds.max_seq_len": ("max_seq_len", "max_seq_len"),
    "ds.max_seq_len.info": ("Share of samples longer than this gets reported.", "统计超过该长度的样本占比。"),
    "ds.stats_btn": ("Compute token lengths", "统计 Token 长度"),
    "ds.histogram": ("Samples per token length", "各长度区间的样本数"),
    # train
    "tr.base_model": ("Base model", "基础模型"),
    "tr.base_model.info": (
        "A preset, a model in the model folders, a previous run's output (run:<id>), or a model directory.",
        "预置模型、模型目录中的模型、历史任务的输出（run:<id>），或模型目录路径。",
    ),
    "tr.model_roots": ("Model folders", "模型目录"),
    "tr.download": ("Download", "下载"),
    "tr.model_roots.info": (
        "Local models are listed from these folders; add more with ERNIE_STUDIO_MODEL_ROOTS (':'-separated).",
        "本地模型从这些目录中列出；用 ERNIE_STUDIO_MODEL_ROOTS 添加更多目录（以 ':' 分隔）。",
    ),
    "tr.stage": ("Stage", "阶段"),
    # PaddleOCR-VL: the stage that fine-tunes it, named for what it trains
    "tr.stage.choice.OCR-VL-SFT": (
        "OCR-VL-SFT · Document OCR (PaddleOCR-VL)",
        "OCR-VL-SFT · 文档 OCR（PaddleOCR-VL）",
    ),
    "tr.fine_tuning": ("Fine-tuning", "微调方式"),
    "tr.compute_type": ("compute_type", "compute_type"),
    "tr.datasets": ("Training data", "训练数据"),
    "tr.datasets.info": ("Pick one or more uploaded datasets.", "选择一个或多个已上传的数据集。"),
    "tr.run_name": ("Run name", "任务名称"),
    "tr.num_devices": ("Devices", "设备数"),
    "tr.num_devices.info": (
        "GPUs (CPU: processes) in all, data-parallel, split evenly over the nodes; each takes the batch size "
        "per step.",
        "GPU 总数（CPU 节点为进程数），数据并行，平均分到各节点；每个设备每步处理一份 batch。",
    ),
    "tr.num_nodes": ("Nodes", "节点数"),
    "tr.num_nodes.info": (
        "Nodes the devices are split over; all start together or none does. Needs shared storage.",
        "设备所分布的节点数；所有节点一起启动或都不启动。需要共享存储。",
    ),
    "tr.hparams": ("Hyperparameters", "超参数"),
    "tr.learning_rate": ("learning_rate", "learning_rate"),
    "tr.max_steps": ("max_steps", "max_steps"),
    "tr.num_train_epochs": ("num_train_epochs", "num_train_epochs"),
    "tr.per_device_train_batch_size": ("per_device_train_batch_size", "per_device_train_batch_size"),
    "tr.gradient_accumulation_steps": ("gradient_accumulation_steps", "gradient_accumulation_steps"),
    "tr.max_seq_len": ("max_seq_len", "max_seq_len"),
    "tr.warmup_steps": ("warmup_steps", "warmup_steps"),
    "tr.lr_scheduler_type": ("lr_scheduler_type", "lr_scheduler_type"),
    "tr.weight_decay": ("weight_decay", "weight_decay"),
    "tr.logging_steps": ("logging_steps", "logging_steps"),
    "tr.save_steps": ("save_steps", "save_steps"),
    "tr.packing": ("packing", "packing"),
    "tr.seed": ("seed", "seed"),
    "tr.lora": ("LoRA", "LoRA"),
    "tr.lora_rank": ("lora_rank", "lora_rank"),
    "tr.lora_alpha": ("lora_alpha", "lora_alpha"),
    "tr.dpo": ("DPO", "DPO"),
    "tr.beta": ("beta", "beta"),
    "tr.loss_type": ("loss_type", "loss_type"),
    "tr.yaml": ("Equivalent ERNIEKit YAML", "等价的 ERNIEKit YAML"),
    "tr.yaml_download": ("Download YAML", "下载 YAML"),
    # "Import a YAML" (studio/ui/train_import.py)
    "tr.import": ("Import an ERNIEKit YAML into the form", "导入 ERNIEKit YAML 到表单"),
    "tr.import.file": ("Upload a .yaml / .yml config", "上传 .yaml / .yml 配置文件"),
    "tr.import.text": ("…or paste the YAML here", "……或在此粘贴 YAML"),
    "tr.import.btn": ("Import pasted YAML", "导入粘贴的 YAML"),
    "tr.import.failed": ("Not imported; the form is unchanged:", "未导入，表单未改动："),
    "tr.import.done": (
        "Imported {n} training keys: stage **{stage}**, fine-tuning **{fine_tuning}**, compute_type "
        "**{compute_type}**. Values the engine refuses are marked beside their fields.",
        "已导入 {n} 个训练参数：阶段 **{stage}**，微调方式 **{fine_tuning}**，compute_type **{compute_type}**。"
        "引擎拒绝的取值会标注在对应字段旁。",
    ),
    "tr.import.model.found": (
        "model `{path}` → base model **{name}**",
        "模型 `{path}` → 基础模型 **{name}**",
    ),
    "tr.import.model.missing": (
        "model `{path}`: the studio has no model of that name; pick the base model",
        "模型 `{path}`：Studio 中没有同名模型，请选择基础模型",
    ),
    "tr.import.missing": ("Missing datasets ({n})", "缺少的数据集（{n} 个）"),
    "tr.import.dataset.missing": (
        "no uploaded dataset has this file name or name; upload it (Datasets tab) and pick it under Training "
        "data",
        "没有文件名或名称与之相同的已上传数据集；请在“数据集”页上传，并在“训练数据”中选择",
    ),
    "tr.import.dataset.text": (
        "VL-SFT text-only data is not a field of the studio's runs; it is left out",
        "Studio 的任务没有 VL-SFT 纯文本数据字段；此项未导入",
    ),
    "tr.import.found": ("Datasets matched by name", "按名称匹配到的数据集"),
    "tr.import.format": (
        "the file says {file}, detected as {detected}",
        "文件写的是 {file}，检测为 {detected}",
    ),
    "tr.import.line": ("line {line}", "第 {line} 行"),
    "tr.import.studio": ("Set by the studio ({n})", "由 Studio 设置（{n} 个）"),
    "tr.import.set.output_dir": (
        "the studio writes every run under runs/<id>/output",
        "Studio 将每个任务写入 runs/<id>/output",
    ),
    "tr.import.set.logging_dir": (
        "the studio writes every run's logs under runs/<id>/output/logs",
        "Studio 将每个任务的日志写入 runs/<id>/output/logs",
    ),
    "tr.import.set.train_dataset_type": (
        "each dataset is read in the format detected at upload",
        "每个数据集按上传时检测到的格式读取",
    ),
    "tr.import.set.eval_dataset_type": (
        "each dataset is read in the format detected at upload",
        "每个数据集按上传时检测到的格式读取",
    ),
    "tr.import.set.eval_dataset_prob": ("evaluation datasets are weighed evenly", "评估数据集按相同权重使用"),
    "tr.import.na": ("Without effect on this run ({n})", "对本任务不生效（{n} 个）"),
    "tr.import.notices": ("ERNIEKit keys the engine announces ({n})", "引擎会提示的 ERNIEKit 参数（{n} 个）"),
    # "Start from": recipes and templates (studio/ui/train_templates.py)
    "tr.start": ("Start from a recipe or a saved template", "从配方或已保存的模板开始"),
    "tr.recipe": ("ERNIEKit recipe", "ERNIEKit 配方"),
    "tr.recipe.info": (
        "ERNIEKit's own example configs (PaddlePaddle/ERNIE examples/configs); loading one fills the form as an "
        "import does",
        "ERNIEKit 官方示例配置（PaddlePaddle/ERNIE examples/configs）；载入后像导入 YAML 一样填写表单",
    ),
    "tr.recipe.load": ("Start from this recipe", "从此配方开始"),
    "tr.recipe.none": ("Pick a recipe first.", "请先选择一个配方。"),
    "tr.recipe.source": (
        "From `{path}` at `{commit}` (ERNIEKit {version}); judged with the shape of {shape} at {seq} tokens.",
        "来自 `{path}`（提交 `{commit}`，ERNIEKit {version}）；按 {shape} 的结构、{seq} 个 token 评估。",
    ),
    "tr.verdict.no_nodes": (
        "No node has reported yet: the verdict needs the studio's nodes (start a worker).",
        "尚无节点上报：评估需要 Studio 的节点（请启动一个 worker）。",
    ),
    "tr.verdict.fits": (
        "✅ **Fits** {node} as written: peak {peak:.1f} GiB of {cap:.1f} GiB per device.",
        "✅ **按原配置可运行**于 {node}：峰值 {peak:.1f} GiB，每个设备 {cap:.1f} GiB。",
    ),
    "tr.verdict.proposal": (
        "⚠️ **Not as written** on {node} (peak {peak:.1f} GiB of {cap:.1f} GiB per device):",
        "⚠️ **按原配置无法运行**于 {node}（峰值 {peak:.1f} GiB，每个设备 {cap:.1f} GiB）：",
    ),
    "tr.verdict.does_not_fit": (
        "❌ **Does not fit** the studio's nodes ({cap:.1f} GiB per device) in any setting the planner weighs:",
        "❌ 在规划器考虑的任何设置下都**无法放入** Studio 的节点（每个设备 {cap:.1f} GiB）：",
    ),
    "tr.verdict.cannot_plan": ("❌ **The planner cannot plan it:**", "❌ **规划器无法为其规划：**"),
    "tr.verdict.proposed": (
        "The planner proposes `{keys}` (peak {peak:.1f} GiB of {cap:.1f} GiB).",
        "规划器建议 `{keys}`（峰值 {peak:.1f} GiB，容量 {cap:.1f} GiB）。",
    ),
    "tr.template": ("Saved template", "已保存的模板"),
    "tr.template.load": ("Start from this template", "从此模板开始"),
    "tr.template.delete": ("Delete template", "删除模板"),
    "tr.template.name": ("Template name", "模板名称"),
    "tr.template.save": ("Save the form as a template", "将表单保存为模板"),
    "tr.template.saved": ("Saved template {name} (#{id}).", "已保存模板 {name}（#{id}）。"),
    "tr.template.failed": ("Not saved:", "未保存："),
    "tr.template.none": ("Pick a template first.", "请先选择一个模板。"),
    "tr.template.loaded": ("Form filled from template {name}.", "已用模板 {name} 填写表单。"),
    "tr.template.missing": (
        "Datasets deleted since the template was saved (left out of the form; pick others): {ids}",
        "模板保存后已被删除的数据集（未填入表单，请另选）：{ids}",
    ),
    "tr.template.deleted": ("Deleted template #{id}.", "已删除模板 #{id}。"),
    "tr.estimate": ("Estimate", "资源估算"),
    "tr.estimate_btn": ("Estimate memory and time", "估算显存与时间"),
    "tr.launch": ("Launch run", "启动训练"),
    "tr.launch_status": ("Launch status", "启动状态"),
    "tr.group.data": ("Data", "数据"),
    "tr.group.schedule": ("Schedule and batch", "训练进度与批次"),
    "tr.group.optimizer": ("Optimizer and regularisation", "优化器与正则化"),
    "tr.group.lora": ("LoRA", "LoRA"),
    "tr.group.dpo": ("DPO", "DPO"),
    "tr.group.moe": ("MoE", "MoE"),
    "tr.group.precision": ("Precision and memory", "精度与显存"),
    "tr.group.elastic": ("Elastic MoE training", "弹性 MoE 训练"),
    "tr.group.gpas": ("GPAS", "GPAS"),
    "tr.group.evaluation": ("Evaluation and saving", "评估与保存"),
    "tr.group.logging": ("Logging", "日志"),
    "tr.group.run": ("Run", "任务"),
    "tr.more": ("More options", "更多选项"),
    "tr.search": ("Search options", "搜索选项"),
    "tr.search.info": (
        "Filters the options below by name or help text, in English or Chinese.",
        "按名称或说明（中文或英文）筛选下面的选项。",
    ),
    "tr.search.none": ("No option matches “{query}”.", "没有选项匹配“{query}”。"),
    "tr.dataset_probs": ("Dataset probabilities", "数据集采样概率"),
    "tr.dataset_probs.info": (
        "One sampling probability per training dataset, comma-separated; empty mixes them evenly.",
        "每个训练数据集一个采样概率，逗号分隔；留空则均匀混合。",
    ),
    "tr.eval_dataset_ids": ("Evaluation data (eval_steps)", "评估数据（按 eval_steps）"),
    "tr.eval_dataset_ids.info": (
        "Datasets evaluated every eval_steps and at the end; the same kind as the training data.",
        "每 eval_steps 步及训练结束时评估的数据集；与训练数据同类。",
    ),
    "tr.na": ("Not used here: {reasons}.", "此处不生效：{reasons}。"),
    "tr.na.stage": ("applies to stage {needed} only", "仅适用于阶段 {needed}"),
    "tr.na.adapters": ("applies to {needed} runs only", "仅适用于 {needed} 训练"),
    "tr.na.compute_type": ("applies with compute_type {needed} only", "仅在 compute_type 为 {needed} 时适用"),
    "tr.na.model.moe": ("applies to MoE models only", "仅适用于 MoE 模型"),
    "tr.na.model.vl": ("applies to multimodal (VL) models only", "仅适用于多模态（VL）模型"),
    "tr.na.model.text-moe": ("applies to text MoE models only", "仅适用于纯文本 MoE 模型"),
    "tr.problems": ("Fix before launching", "启动前请修正"),
    "tr.problem": ("⚠️ {message}", "⚠️ {message}"),
}
