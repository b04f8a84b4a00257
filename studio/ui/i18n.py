"""English and Chinese UI text, and the registry that relabels every component when the language changes.

Gradio's own ``gr.I18n`` follows the browser locale only; ERNIEKit's users switch by hand, so labels are
set on the server: each builder creates components through :class:`Texts`, which remembers which text
key goes to which property, and the language switch returns one ``gr.update`` per registered component.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import gradio as gr
import pandas as pd
from gradio.context import LocalContext

from engine.data.formats import FORMATS, KINDS
from engine.data.paddleocr_vl_processor import TASK_PROMPTS
from engine.eval.config import BENCHMARK_TYPES
from engine.train.config import COMPUTE_TYPES, FINE_TUNING, SCHEDULERS, STAGES, TrainConfig

LANGUAGES = {"en": "English", "zh": "中文"}
DEFAULT_LANGUAGE = "en"

# key -> (English, Chinese). Keys ending in ".info" are tooltips (Gradio's ``info=``).
STRINGS: dict[str, tuple[str, str]] = {
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
    # runs
    "runs.table": ("Runs", "任务列表"),
    "runs.select": ("Run", "任务"),
    "runs.status": ("Status", "状态"),
    "runs.loss": ("Loss", "损失"),
    "runs.lr": ("Learning rate", "学习率"),
    "runs.throughput": ("Tokens per second", "每秒 Token 数"),
    "runs.extra": (
        "Stage metrics (DPO / MoE / eval) or gradient norm",
        "阶段指标（DPO / MoE / 评估）或梯度范数",
    ),
    "runs.logs": ("Log tail", "日志末尾"),
    "runs.checkpoints": ("Checkpoints", "检查点"),
    "runs.cancel": ("Cancel", "取消"),
    "runs.resume": ("Resume", "恢复"),
    "runs.clone": ("Clone into Train", "复制到训练页"),
    "runs.delete": ("Delete", "删除"),
    "runs.export": ("Export", "导出"),
    "runs.export_kind": ("Export", "导出方式"),
    "runs.export_kind.info": (
        "merge: fold LoRA into the base; layout: write Paddle or Hugging Face keys; ptq: weight-only int8/int4.",
        "merge：将 LoRA 合并进基座；layout：以 Paddle 或 Hugging Face 格式保存；ptq：仅权重 int8/int4 量化。",
    ),
    "runs.export_dtype": ("Weights dtype", "权重精度"),
    "runs.export_dtype.info": (
        "bfloat16 / float16 halve the files; PTQ exports keep their own quantized weights.",
        "bfloat16 / float16 使文件减半；PTQ 导出使用自身的量化权重。",
    ),
    "runs.export_shard": ("Largest shard", "最大分片"),
    "runs.export_shard.info": (
        "Largest safetensors file, e.g. 5GB or 500MB (a number alone means GB).",
        "单个 safetensors 文件的上限，如 5GB 或 500MB（只写数字表示 GB）。",
    ),
    "runs.export_btn": ("Start export", "开始导出"),
    "runs.family": (
        "Elastic family: sub-models this run trained (click a row to pick that member, then export it or "
        "export and deploy it in one click)",
        "弹性模型家族：本次训练得到的子模型（点击一行选择该成员，再导出，或一键导出并部署）",
    ),
    "runs.family_plot": (
        "Size against quality: eval loss by active weights",
        "规模与质量：各成员的验证损失与激活参数量",
    ),
    "runs.export_member": ("Elastic member (empty: the whole model)", "弹性成员（留空：完整模型）"),
    "runs.export_member.info": (
        "d<depth>-e<experts>-k<top-k>: a smaller model cut out of the elastic run, no training needed.",
        "d<层数>-e<专家数>-k<top-k>：从弹性训练中直接裁出的小模型，无需再训练。",
    ),
    "runs.member_deploy": ("Export and deploy this member", "导出并部署该成员"),
    "runs.exports": ("Exports (listed among base models when done)", "导出结果（完成后出现在基础模型中）"),
    "runs.deploy_btn": ("Deploy this run", "部署该任务"),
    "runs.gguf_pick": ("GGUF file to serve", "要部署的 GGUF 文件"),
    "runs.gguf_pick.info": (
        "Served by llama.cpp; empty picks the newest export's q8_0.",
        "由 llama.cpp 提供服务；留空则使用最新导出的 q8_0。",
    ),
    "runs.gguf_deploy": ("Deploy GGUF (llama.cpp)", "部署 GGUF（llama.cpp）"),
    "runs.action": ("Last action", "最近操作"),
    "runs.config": ("Config", "配置"),
    # compare
    "cmp.runs": ("Runs to compare", "对比的任务"),
    "cmp.runs.info": ("Pick two or more.", "选择两个或更多任务。"),
    "cmp.metric": ("Metric", "指标"),
    "cmp.btn": ("Compare", "对比"),
    "cmp.curves": ("Curves aligned by step", "按步对齐的曲线"),
    "cmp.diff": ("Config differences", "配置差异"),
    "cmp.final": ("Final metrics", "最终指标"),
    "cmp.ab": ("A/B chat", "A/B 对话"),
    "cmp.deploy_a": ("Deployment A", "部署 A"),
    "cmp.deploy_b": ("Deployment B", "部署 B"),
    "cmp.prompt": ("Prompt (sent to both)", "提示词（同时发送给两者）"),
    "cmp.send": ("Send to both", "同时发送"),
    "cmp.chat_a": ("A", "A"),
    "cmp.chat_b": ("B", "B"),
    # deploy & chat
    "dep.run": ("Finished run or model directory", "已完成的任务或模型目录"),
    "dep.btn": ("Deploy", "部署"),
    "dep.table": ("Deployments", "部署列表"),
    "dep.select": ("Deployment", "部署"),
    "dep.status": ("Status", "状态"),
    "dep.stop": ("Stop deployment", "停止部署"),
    "dep.system": ("System prompt", "系统提示词"),
    "dep.temperature": ("temperature", "temperature"),
    "dep.temperature.info": ("0 = greedy.", "0 表示贪心解码。"),
    "dep.top_p": ("top_p", "top_p"),
    "dep.max_tokens": ("max_tokens", "max_tokens"),
    "dep.advanced": ("Advanced", "高级"),
    "dep.seed": ("seed", "seed"),
    "dep.seed.info": (
        "Same seed, same sampled reply; empty = random.",
        "相同的 seed 得到相同的采样结果；留空表示随机。",
    ),
    "dep.ignore_eos": ("ignore_eos", "ignore_eos"),
    "dep.ignore_eos.info": (
        "Keep generating to max_tokens past the end-of-sentence token (throughput checks).",
        "忽略结束符，一直生成到 max_tokens（用于吞吐测试）。",
    ),
    "dep.thinking": ("Thinking", "思考"),
    # PaddleOCR-VL deployments: the task prompts it was trained with, one click away
    "dep.task_prompt": ("Task prompt (PaddleOCR-VL)", "任务提示词（PaddleOCR-VL）"),
    "dep.task_prompt.info": (
        "Puts the prompt the model was trained with in the message box: attach a document image with 📎, pick "
        "the task, Send. The model answers with the text, table, formula or chart it reads.",
        "把模型训练时使用的提示词填入消息框：用 📎 附加文档图片，选择任务，点击发送。模型会返回它识别出的文字、表格、"
        "公式或图表。",
    ),
    "dep.thinking.info": (
        "Let the model think before it answers (its reasoning shows in the reply). Off, FastDeploy's VL "
        "models answer directly.",
        "让模型先思考再回答（思考过程显示在回复中）。关闭时，FastDeploy 部署的多模态模型直接回答。",
    ),
    "dep.chat": ("Chat", "对话"),
    "dep.message": ("Message", "消息"),
    "dep.images_on": (
        "🖼️ This deployment's model reads images: attach pictures with 📎 in the message box. Each stays "
        "with its turn and is sent again with the rest of the conversation.",
        "🖼️ 该部署的模型可以读取图片：点击消息框中的 📎 附加图片。图片保留在其所在的轮次中，"
        "并随之后的对话一并重新发送。",
    ),
    "dep.images_off": (
        "This deployment's model takes text only; deploy an ERNIE 4.5 VL model to chat about images.",
        "该部署的模型仅支持文本；如需围绕图片对话，请部署 ERNIE 4.5 VL 模型。",
    ),
    "dep.err.no_deployment": ("Pick a running deployment first.", "请先选择一个运行中的部署。"),
    "dep.err.empty": ("Type a message first.", "请先输入消息。"),
    "dep.err.text_only": (
        "This deployment's model takes text only, so {names} cannot be sent. Remove the image, or pick a "
        "deployment of an ERNIE 4.5 VL model.",
        "该部署的模型仅支持文本，无法发送 {names}。请移除图片，或选择 ERNIE 4.5 VL 模型的部署。",
    ),
    "dep.err.history_images": (
        "This conversation holds images from earlier turns, and this deployment's model takes text only. "
        "Clear the chat, or pick a deployment of an ERNIE 4.5 VL model.",
        "当前对话的历史轮次中含有图片，而该部署的模型仅支持文本。请清空对话，或选择 ERNIE 4.5 VL 模型的部署。",
    ),
    "dep.err.too_large": (
        "{name} is {size:.1f} MB; an attached image may be at most {limit} MB. Downscale or compress it and "
        "attach it again.",
        "{name} 大小为 {size:.1f} MB，附加的图片最大为 {limit} MB。请缩小或压缩后重新附加。",
    ),
    "dep.err.not_image": (
        "{name} is not an image (a PNG, JPEG, WebP, GIF, BMP or TIFF file); only images can be attached.",
        "{name} 不是图片（PNG、JPEG、WebP、GIF、BMP 或 TIFF 文件）；只能附加图片。",
    ),
    "dep.err.too_many_pixels": (
        "{name} has too many pixels to open safely; downscale it and attach it again.",
        "{name} 像素过多，无法安全打开；请缩小后重新附加。",
    ),
    "dep.err.image_gone": (
        "{name} from an earlier turn is no longer on the server; clear the chat and attach it again.",
        "之前轮次中的 {name} 已不在服务器上；请清空对话后重新附加。",
    ),
    "dep.send": ("Send", "发送"),
    "dep.stop_gen": ("Stop", "停止"),
    "dep.clear": ("Clear", "清空"),
    "common.refresh": ("Refresh", "刷新"),
    "common.none": ("Nothing here yet.", "暂无内容。"),
    # nodes
    "nodes.help": (
        "Every worker checks its node with `ernie-studio doctor` when it starts and takes runs and "
        "deployments only when every check passed. A worker silent for a while is shown offline.",
        "每个 worker 启动时用 `ernie-studio doctor` 自检节点，全部检查通过后才接收训练和部署任务。"
        "一段时间没有心跳的 worker 显示为离线。",
    ),
    "nodes.refresh": ("Refresh", "刷新"),
    "nodes.table": ("Workers and their nodes", "Worker 与节点"),
    "nodes.checks": ("Doctor checks", "自检结果"),
    # the Train tab's Sweep mode (studio/ui/sweep_box.py)
    "sw.box": ("Sweep: search hyperparameters with Optuna", "超参搜索：用 Optuna 搜索超参数"),
    "sw.help": (
        "The form is the base run of every trial (it needs evaluation data); each row below is a key Optuna "
        "chooses per trial. Choices are separated by commas.",
        "上面的表单是每次试验的基础任务（需要验证数据）；下面每一行是 Optuna 为每次试验选择的一个配置项。"
        "多个选项用逗号分隔。",
    ),
    "sw.key": ("Searched key", "搜索的配置项"),
    "sw.kind": ("Kind", "取值方式"),
    "sw.low": ("Low", "下限"),
    "sw.high": ("High", "上限"),
    "sw.choices": ("Choices", "候选值"),
    "sw.n_trials": ("Trials", "试验次数"),
    "sw.parallelism": ("At once", "同时运行数"),
    "sw.parallelism.info": (
        "Trials queued at once (at most the training workers).",
        "同时排队的试验数（不超过训练工作进程数）。",
    ),
    "sw.objective": ("Objective", "优化目标"),
    "sw.direction": ("Direction", "方向"),
    "sw.sampler": ("Sampler", "采样器"),
    "sw.pruner": ("Pruner", "剪枝器"),
    "sw.max_wall_s": ("Budget: wall time (s, 0 = none)", "预算：总时长（秒，0 为不限）"),
    "sw.max_total_steps": ("Budget: total steps (0 = none)", "预算：总步数（0 为不限）"),
    "sw.estimate_btn": ("Estimate the sweep", "估算搜索开销"),
    "sw.launch": ("Launch sweep", "启动搜索"),
    # the Sweeps tab (studio/ui/sweeps_tab.py)
    "swp.table": ("Sweeps", "超参搜索列表"),
    "swp.select": ("Sweep", "超参搜索"),
    "swp.cancel": ("Cancel sweep", "取消搜索"),
    "swp.promote": ("Promote best: deploy and chat", "采用最佳试验：部署并对话"),
    "swp.leaderboard": ("Leaderboard", "排行榜"),
    "swp.objective_plot": ("Objective over trials", "各试验的目标值"),
    "swp.importance": ("Parameter importance (Optuna)", "参数重要性（Optuna）"),
    "swp.config": ("Search space and settings", "搜索空间与设置"),
    # table column headers ("col." + the English header the row builders use)
    "col.id": ("id", "编号"),
    "col.trials": ("trials", "试验次数"),
    "col.trial": ("trial", "试验"),
    "col.params": ("params", "参数"),
    "col.objective": ("objective", "目标值"),
    "col.trial state": ("trial state", "试验状态"),
    "col.run": ("run", "任务"),
    "col.name": ("name", "名称"),
    "col.format": ("format", "格式"),
    "col.kind": ("kind", "类型"),
    "col.records": ("records", "记录数"),
    "col.valid": ("valid", "有效数"),
    "col.problems": ("problems", "问题数"),
    "col.uploaded": ("uploaded", "上传时间"),
    "col.line": ("line", "行"),
    "col.problem": ("problem", "问题"),
    "col.stage": ("stage", "阶段"),
    "col.tuning": ("tuning", "微调方式"),
    "col.status": ("status", "状态"),
    "col.progress": ("progress", "进度"),
    "col.loss": ("loss", "损失"),
    "col.ETA": ("ETA", "剩余时间"),
    "col.created": ("created", "创建时间"),
    "col.step": ("step", "步数"),
    "col.path": ("path", "路径"),
    "col.saved": ("saved", "保存时间"),
    "col.layout": ("layout", "格式布局"),
    "col.ptq": ("ptq", "量化"),
    "col.dtype": ("dtype", "精度"),
    "col.perplexity": ("perplexity", "困惑度"),
    "col.model dir": ("model dir", "模型目录"),
    "col.member": ("member", "成员"),
    "col.depth": ("depth", "层数"),
    "col.experts": ("experts", "专家数"),
    "col.top-k": ("top-k", "每词专家数"),
    "col.weights": ("weights", "参数量"),
    "col.active weights": ("active weights", "激活参数量"),
    "col.steps": ("steps", "训练步数"),
    "col.eval loss": ("eval loss", "验证损失"),
    "col.decode tok/s": ("decode tok/s", "解码速度 (token/s)"),
    "col.deployment": ("deployment", "部署状态"),
    "col.key": ("key", "配置项"),
    "col.metric": ("metric", "指标"),
    "col.backend": ("backend", "后端"),
    "col.url": ("url", "地址"),
    "col.model": ("model", "模型"),
    "col.started": ("started", "启动时间"),
    "col.worker": ("worker", "工作进程"),
    "col.state": ("state", "节点状态"),
    "col.devices": ("devices", "设备"),
    "col.memory": ("memory", "内存"),
    "col.busy": ("busy", "占用"),
    "col.queues": ("queues", "队列"),
    "col.doctor": ("doctor", "自检"),
    "col.heartbeat": ("heartbeat", "最近心跳"),
    "col.check": ("check", "检查项"),
    "col.result": ("result", "结果"),
    "col.detail": ("detail", "详情"),
    "col.seconds": ("seconds", "耗时（秒）"),
    # evaluate (studio/ui/evaluate_tab.py)
    "tab.evaluate": ("Evaluate", "评测"),
    "ev.new": ("New evaluation", "新建评测"),
    "ev.models": ("Models", "模型"),
    "ev.models.info": (
        "Base models, run results (run:<id>) and exports.",
        "基座模型、训练结果（run:<id>）和导出模型。",
    ),
    "ev.datasets": ("Eval datasets", "评测数据集"),
    "ev.datasets.info": (
        "Chat records (each record's last answer is the reference) or benchmark files (multiple choice, "
        "GSM8K).",
        "对话记录（每条记录的最后一个回答作为参考答案）或基准测试文件（多项选择、GSM8K）。",
    ),
    "ev.metrics": ("Metrics", "指标"),
    "ev.max_new_tokens": ("Max new tokens", "最大生成长度"),
    "ev.launch": ("Evaluate", "开始评测"),
    "ev.refresh": ("Refresh", "刷新"),
    "ev.list": ("Evaluations", "评测列表"),
    "ev.pick": ("Compare evaluations", "对比评测"),
    "ev.results": ("Results side by side (95% interval)", "结果对比（95% 置信区间）"),
    "ev.a": ("Samples of A", "样本 A"),
    "ev.b": ("Compared with B", "对比 B"),
    "ev.only_differ": ("Only where A and B differ", "只看 A 与 B 不同的样本"),
    "ev.samples": (
        "Samples (where A and B differ first; click a row)",
        "样本（不同的排在前面；点击一行查看）",
    ),
    "ev.compare": ("Evaluations of these runs", "这些任务的评测"),
    "ev.after": ("Evaluate after training", "训练后评测"),
    "ev.after_on": ("Evaluate the base and the result", "评测基座与训练结果"),
    "ev.holdout": ("Held-out records", "留出记录数"),
    "ev.holdout.info": (
        "Drawn at random (the run's seed) from the training data and never trained on.",
        "按任务的随机种子从训练数据中抽取，不参与训练。",
    ),
    "ev.after_datasets": ("Eval datasets (optional)", "评测数据集（可选）"),
    "ev.judge": ("LLM as judge (optional)", "大模型评审（可选）"),
    "ev.judge_deployment": ("Judge: a running deployment", "评审：运行中的部署"),
    "ev.judge_deployment.info": (
        "A model this studio serves judges; no key needed.",
        "由本工作室部署的模型评审，无需密钥。",
    ),
    "ev.judge_url": ("or an external judge URL", "或外部评审地址"),
    "ev.judge_url.info": (
        "Any OpenAI-compatible endpoint, e.g. https://api.example.com/v1.",
        "任意兼容 OpenAI 的接口，例如 https://api.example.com/v1。",
    ),
    "ev.judge_model": ("Judge model name", "评审模型名称"),
    "ev.judge_key": ("API key of the external judge", "外部评审的 API 密钥"),
    "ev.judge_key.info": (
        "Kept out of the eval's config; only the worker that scores reads it.",
        "不写入评测配置，只有执行评测的 Worker 读取。",
    ),
    "ev.judge_mode": ("Judge mode", "评审方式"),
    "ev.judge_mode.info": (
        "score: rate each answer 1-10; pairwise: compare with the baseline both ways round (win rate).",
        "score：每个回答打 1-10 分；pairwise：与基线双向交换位置比较（胜率）。",
    ),
    "ev.judge_baseline": ("Pairwise baseline (an eval)", "成对比较的基线（一次评测）"),
    "ev.judge_baseline.info": (
        "Its predictions on the same datasets; empty compares with the references.",
        "使用它在相同数据集上的预测；留空则与参考答案比较。",
    ),
    "ev.err.no_judge": (
        "Pick a judge (a running deployment or an external URL) for the judge mode, model, key or baseline.",
        "请先选择评审（运行中的部署或外部地址），再设置评审方式、模型、密钥或基线。",
    ),
    "col.sample": ("sample", "样本"),
    "col.reference": ("reference", "参考答案"),
    "col.prediction A": ("prediction A", "预测 A"),
    "col.prediction B": ("prediction B", "预测 B"),
    "col.differ": ("differ", "不同"),
}

# Text made while the studio runs: statuses, summaries, notices and errors that handlers format (keys are
# "<area>.<name>"; fields in braces are filled by str.format). Kept apart from the component labels above.
RUNTIME_STRINGS: dict[str, tuple[str, str]] = {
    # statuses of runs, exports and deployments
    "status.queued": ("queued", "排队中"),
    "status.running": ("running", "运行中"),
    "status.succeeded": ("succeeded", "已完成"),
    "status.failed": ("failed", "失败"),
    "status.cancelled": ("cancelled", "已取消"),
    "status.starting": ("starting", "启动中"),
    "status.stopping": ("stopping", "停止中"),
    "status.stopped": ("stopped", "已停止"),
    # a sweep trial's Optuna state
    "status.complete": ("complete", "已完成"),
    "status.pruned": ("pruned", "已剪枝"),
    "status.fail": ("fail", "失败"),
    "status.waiting": ("waiting", "等待中"),
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
    "dep.msg.stopped_stream": ("⏹️ stopped", "⏹️ 已停止"),
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
STRINGS.update(RUNTIME_STRINGS)

# Messages the services and the engine build from parts (estimate notes, fit warnings, refusals) -> Chinese, by
# pattern: the REST API keeps them in English, the UI shows them in the session's language. A pattern matches
# a whole message; its named groups fill the Chinese text, and groups named ``msg...`` are messages
# themselves, translated in turn. A message no pattern matches is shown as it is.
_N = r"[\d,.]+"
MESSAGE_PATTERNS: list[tuple[str, str]] = [
    # the estimate's notes (engine.estimate, studio.services.estimates)
    (
        rf"(?P<trainable>{_N}) of (?P<total>{_N}) weights train \((?P<kind>[^)]*)\); (?P<active>{_N}) active per token",
        "{trainable} / {total} 个权重参与训练（{kind}）；每个 Token 激活 {active} 个",
    ),
    (
        r"fp16 needs a GPU \(loss scaling\); this node would refuse the run",
        "fp16 需要 GPU（损失缩放）；此节点会拒绝该任务",
    ),
    (
        r"bf16 on a CPU is emulated: bf16 weight storage, fp32 compute, fp32 master weights and moments",
        "CPU 上的 bf16 为模拟：以 bf16 存储权重，以 fp32 计算，主权重与动量为 fp32",
    ),
    (
        r"no token statistics of the data yet: every sample assumed (?P<cap>\d+) tokens long",
        "数据尚无 Token 统计：每个样本按 {cap} 个 Token 估算",
    ),
    (
        rf"packing: rows of (?P<cap>\d+) tokens holding ~(?P<per>{_N}) samples of (?P<mean>{_N}) tokens on average",
        "打包：每行 {cap} 个 Token，平均容纳约 {per} 个长 {mean} 个 Token 的样本",
    ),
    (
        rf"data: (?P<n>{_N}) samples, mean (?P<mean>{_N}) / p95 (?P<p95>{_N}) / max (?P<max>{_N}) tokens \(cut at "
        rf"max_seq_len (?P<cap>\d+)\); a step of (?P<rows>\d+) row\(s\) pads to ~(?P<w>{_N}) tokens, long ones to "
        rf"~(?P<mw>{_N})",
        "数据：{n} 个样本，平均 {mean} / p95 {p95} / 最长 {max} 个 Token（按 max_seq_len {cap} 截断）；每步 {rows} 行"
        "补齐到约 {w} 个 Token，长样本约 {mw}",
    ),
    (
        r"training by epochs over datasets without statistics: 1 step per epoch assumed",
        "按轮次训练但数据集尚无统计：按每轮 1 步估算",
    ),
    (
        rf"GPU (?P<gpu>.+): (?P<rate>{_N}) TFLOP/s sustained \((?P<util>{_N})% of (?P<peak>{_N})\)",
        "GPU {gpu}：持续 {rate} TFLOP/s（峰值 {peak} 的 {util}%）",
    ),
    (
        rf"CPU: (?P<rate>{_N}) GFLOP/s in matmuls, the reference node's (?P<ref>{_N}) scaled by "
        rf"this node's doctor throughput probe against the reference \((?P<probe>{_N}) vs (?P<refp>{_N}) tokens/s\)",
        "CPU：矩阵乘 {rate} GFLOP/s，即参考节点的 {ref} 按本节点 doctor 吞吐探测与参考值之比缩放"
        "（{probe} 对 {refp} Token/秒）",
    ),
    (
        rf"CPU: no throughput probe from this node; the reference node's (?P<rate>{_N}) GFLOP/s assumed",
        "CPU：此节点没有吞吐探测结果；按参考节点的 {rate} GFLOP/s 估算",
    ),
    (
        rf"saves: (?P<n>\d+) checkpoint\(s\) of (?P<gb>{_N}) GB and a final adapter of (?P<final>{_N}) GB at "
        rf"~(?P<rate>{_N}) MB/s",
        "保存：{n} 个 {gb} GB 的检查点和 {final} GB 的最终适配器，约 {rate} MB/秒",
    ),
    (
        rf"saves: (?P<n>\d+) checkpoint\(s\) of (?P<gb>{_N}) GB and a final model of (?P<final>{_N}) GB at "
        rf"~(?P<rate>{_N}) MB/s",
        "保存：{n} 个 {gb} GB 的检查点和 {final} GB 的最终模型，约 {rate} MB/秒",
    ),
    (
        rf"evaluation: (?P<n>\d+) pass\(es\) over (?P<b>\d+) batch\(es\), ~(?P<s>{_N}) s each",
        "评估：{n} 次，每次 {b} 个批次，约 {s} 秒",
    ),
    (
        rf"(?P<n>\d+) data-parallel ranks, each holding the whole model and optimizer; on one CPU node they share "
        rf"its RAM \((?P<gib>{_N}) GiB\) and cores",
        "{n} 个数据并行进程，各持完整模型与优化器；在同一 CPU 节点上共享其内存（{gib} GiB）与核心",
    ),
    (
        r"(?P<n>\d+) data-parallel ranks, each holding the whole model and optimizer",
        "{n} 个数据并行进程，各持完整模型与优化器",
    ),
    (
        rf"this node's recent runs took (?P<r>{_N})x the modelled step time \((?P<n>\d+) run\(s\)\): "
        rf"(?P<a>{_N}) s a step becomes (?P<b>{_N}) s",
        "此节点最近 {n} 个任务的实际步时为模型估算的 {r} 倍：每步 {a} 秒按 {b} 秒计",
    ),
    (
        rf"host RAM: the offloaded optimizer state, (?P<a>{_N}) GiB per rank \((?P<b>{_N}) GiB for (?P<n>\d+)\)",
        "主机内存：卸载的优化器状态每进程约 {a} GiB（{n} 个进程共 {b} GiB）",
    ),
    (
        r"(?P<n>\d+) dataset\(s\) without token statistics yet: their samples count as long as the others'",
        "{n} 个数据集尚无 Token 统计：其样本按其他数据集的长度计",
    ),
    (
        r"no worker serving this queue has reported: not checked against a node",
        "服务此队列的工作进程尚未上报：未对照节点检查",
    ),
    # the estimate's warnings (engine.estimate.fit_warning); msg_where is one of the two below
    (
        rf"will not fit: the run needs about (?P<need>{_N}) GiB at its peak \(at least (?P<lo>{_N})\) and "
        r"(?P<msg_where>.+) holds less; try LoRA, compute_type bf16 or wint8, recompute, a shorter max_seq_len or "
        r"a smaller batch_size",
        "放不下：任务峰值约需 {need} GiB（至少 {lo}），而{msg_where}不足；可试 LoRA、compute_type bf16 或 wint8、"
        "重计算、更短的 max_seq_len 或更小的 batch_size",
    ),
    (
        rf"may not fit: the run needs about (?P<need>{_N}) GiB at its peak and (?P<msg_where>.+) holds "
        rf"(?P<have>{_N}); the estimate's low end fits",
        "可能放不下：任务峰值约需 {need} GiB，而{msg_where}只有 {have}；估算下限可以放下",
    ),
    (
        rf"may not fit: loading takes about (?P<need>{_N}) GiB of (?P<node>.+)'s host RAM \((?P<have>{_N}) GiB\)",
        "可能放不下：加载约需 {need} GiB，{node} 的主机内存只有 {have} GiB",
    ),
    (rf"(?P<node>.+)'s RAM \((?P<have>{_N}) GiB\)", " {node} 的内存（{have} GiB）"),
    (
        rf"one device of (?P<node>.+) \((?P<gpu>.+), (?P<have>{_N}) GiB\)",
        " {node} 的一块设备（{gpu}，{have} GiB）",
    ),
    # templates and recipes (studio.services.templates, studio.services.recipes)
    (
        r"name: empty; give the template a name \(up to (?P<n>\d+) characters\)",
        "name：为空；请给模板起个名字（最多 {n} 个字符）",
    ),
    (
        r"name: (?P<n>\d+) characters; a template's name has at most (?P<max>\d+)",
        "name：{n} 个字符；模板名称最多 {max} 个字符",
    ),
    (
        r"name: holds a control or invisible format character; use printable text",
        "name：含有控制字符或不可见的格式字符；请使用可打印的文字",
    ),
    (
        r"name: a template named (?P<name>.+) exists; pick another name or delete that one first",
        "name：已有名为 {name} 的模板；请换个名字，或先删除那个模板",
    ),
    (
        r"name: a template named (?P<name>.+) exists; pick another name",
        "name：已有名为 {name} 的模板；请换个名字",
    ),
    (
        r"the studio keeps at most (?P<n>\d+) templates; delete some first",
        "Studio 最多保存 {n} 个模板；请先删除一些",
    ),
    (
        r"sharding: (?P<sharding>\S+) splits the optimizer state over data-parallel ranks and the run has one "
        r"device; leave sharding out or ask for num_devices of 2 or more",
        "sharding：{sharding} 把优化器状态切分到各数据并行进程，而该任务只有一个设备；请去掉 sharding，或把 "
        "num_devices 设为 2 或更多",
    ),
    (
        r"template (?P<id>\d+) not found; GET /api/v1/templates lists them",
        "模板 {id} 不存在；GET /api/v1/templates 列出全部模板",
    ),
    (
        r"template (?P<id>\d+) \((?P<name>.+)\) no longer makes a run spec: (?P<problem>.+); delete it and "
        r"save the form again",
        "模板 {id}（{name}）已无法构成任务配置：{problem}；请删除它并重新保存表单",
    ),
    (r"spec: a run of this template would be refused:", "spec：以此模板启动的任务会被拒绝："),
    (
        r"recipe: no recipe is named (?P<name>.+); the recipes are (?P<names>.+)",
        "recipe：没有名为 {name} 的配方；现有配方：{names}",
    ),
    # refusals of the services that the tabs show
    (
        r"(?P<what>dataset|run|deployment|export|eval) (?P<id>\d+) does not exist",
        "{what} {id} 不存在",
    ),
    (
        r"run (?P<id>\d+) already ended \((?P<status>\w+)\); nothing to cancel",
        "任务 {id} 已结束（{status}）；无需取消",
    ),
    (
        r"run (?P<id>\d+) is (?P<status>\w+); only failed or cancelled runs can be resumed",
        "任务 {id} 的状态为 {status}；只有失败或已取消的任务可以恢复",
    ),
    (r"run (?P<id>\d+) is running; cancel it first", "任务 {id} 正在运行；请先取消"),
    (
        r"run (?P<id>\d+) is (?P<status>\w+); (?P<verb>deploy|export) it once it has succeeded",
        "任务 {id} 的状态为 {status}；请在其成功完成后再{verb}",
    ),
    (
        r"deployment (?P<id>\d+) is (?P<status>\w+); stop it first",
        "部署 {id} 的状态为 {status}；请先停止",
    ),
    (
        r"deployment (?P<id>\d+) is (?P<status>\w+); chat once it is running",
        "部署 {id} 的状态为 {status}；请在其运行后再对话",
    ),
    (
        r"deployment (?P<id>\d+) did not answer at (?P<url>\S+): (?P<error>.*)",
        "部署 {id} 在 {url} 没有应答：{error}",
    ),
    (
        r"dataset (?P<id>\d+) is used by queued or running run\(s\) (?P<runs>\[[\d, ]*\]); cancel them first",
        "数据集 {id} 正被排队或运行中的任务 {runs} 使用；请先取消它们",
    ),
    (
        r"(?P<field>[\w.\[\]]+): dataset (?P<id>\d+) \((?P<name>.*)\) holds (?P<kind>\w+) records; stage "
        r"(?P<stage>[\w-]+) needs (?P<want>\w+) data",
        "{field}：数据集 {id}（{name}）为 {kind} 数据；阶段 {stage} 需要 {want} 数据",
    ),
    (r"file: (?P<name>.+) is empty", "文件 {name} 是空文件"),
    (
        r"dataset (?P<id>\d+): its images named by URL are still being fetched \((?P<done>\d+)/(?P<total>\d+)\); "
        r"ask for statistics once the fetch has finished",
        "数据集 {id}：按 URL 引用的图片仍在获取中（{done}/{total}）；获取完成后再查看统计",
    ),
    (
        r"file: (?P<name>.+) is larger than the upload limit of (?P<mb>\d+) MB; split it or raise "
        r"ERNIE_STUDIO_MAX_UPLOAD_MB",
        "文件 {name} 超过上传上限 {mb} MB；请拆分文件或调大 ERNIE_STUDIO_MAX_UPLOAD_MB",
    ),
    # images named by URL (engine.data.remote), as a dataset's problems show them
    (
        r"(?P<field>[\w.]+\[\d+\]): (?P<msg>image '.*)",
        "{field}：{msg}",
    ),
    (
        r"image (?P<url>'[^']*') could not be fetched: (?P<msg_why>.+); or save it next to the data file",
        "图片 {url} 无法获取：{msg_why}；也可把图片保存在数据文件旁边",
    ),
    (r"the server answered (?P<code>\d+)(?: .*)?", "服务器返回 HTTP {code}"),
    (r"larger than (?P<n>[\d,]+) bytes", "大于 {n} 字节"),
    (
        r"took longer than (?P<s>[\d.]+) s \(one deadline for the whole fetch\)",
        "超过 {s} 秒（整次获取共用一个时限）",
    ),
    (
        r"the answer is not an image the VL processor accepts \((?P<msg_why>.*)\)",
        "返回内容不是 VL 处理器接受的图片（{msg_why}）",
    ),
    (
        r"the server sent the body (?P<enc>\S+)-encoded after being asked for identity; compressed replies are "
        r"not decoded",
        "服务器在要求不压缩后仍以 {enc} 压缩返回；压缩的回复不会被解压",
    ),
    (
        r"fetching record URLs is turned off \(ERNIE_STUDIO_MEDIA_URLS=off\)",
        "已关闭按 URL 获取记录中的图片（ERNIE_STUDIO_MEDIA_URLS=off）",
    ),
    (
        r"(?P<host>\S+) is a (?P<kind>loopback|private or reserved|translation or tunnelling) address \((?P<address>[^)]*)\); record URLs "
        r"are fetched from public hosts only \(ERNIE_STUDIO_MEDIA_URLS=any allows an internal image store\)",
        "{host} 是{kind}地址（{address}）；记录中的 URL 只从公网主机获取（ERNIE_STUDIO_MEDIA_URLS=any 允许内部图床）",
    ),
    (
        r"cannot resolve (?P<host>'[^']*') \((?P<error>.*)\); is this worker offline\?",
        "无法解析 {host}（{error}）；此节点是否离线？",
    ),
    (r"image (?P<url>'[^']*'): not an image PIL can read \(.*\)", "图片 {url} 不是可读取的图片"),
    (r"not an image PIL can read \(.*\)", "不是可读取的图片"),
    # the Train tab's YAML import (studio.services.config_import)
    (
        rf"(?P<where>.+?): (?P<size>{_N}) bytes; a config to import may hold at most (?P<limit>{_N}) bytes "
        r"\(ERNIEKit's configs are a few KB\)",
        "{where}：{size} 字节；导入的配置最多 {limit} 字节（ERNIEKit 的配置只有几 KB）",
    ),
    (
        r"(?P<where>.+?): not UTF-8 text \(byte (?P<byte>\d+)\); save the file as UTF-8",
        "{where}：不是 UTF-8 文本（第 {byte} 字节）；请以 UTF-8 保存文件",
    ),
    (
        r"(?P<where>.+?): empty; paste an ERNIEKit training config \(key: value lines\)",
        "{where}：内容为空；请粘贴 ERNIEKit 训练配置（key: value 形式的行）",
    ),
    (
        r"(?P<where>.+?): a second YAML document \(after ---\); import one config, one document",
        "{where}：出现第二个 YAML 文档（--- 之后）；一次只导入一个配置、一个文档",
    ),
    (
        r"(?P<where>.+?): YAML anchors and aliases \(&name, \*name\) are not accepted in an imported config; "
        r"write each value out",
        "{where}：导入的配置不接受 YAML 锚点与别名（&name、*name）；请逐项写出取值",
    ),
    (
        r"(?P<where>.+?): YAML tag (?P<tag>'[^']*') is not accepted in an imported config; write plain values",
        "{where}：导入的配置不接受 YAML 标签 {tag}；请写普通取值",
    ),
    (
        r"(?P<where>.+?): nested (?P<depth>\d+) levels deep; a config is key: value lines \(a value may be a "
        r"list\), at most (?P<limit>\d+) levels",
        "{where}：嵌套达 {depth} 层；配置是 key: value 形式的行（取值可以是列表），最多 {limit} 层",
    ),
    (r"(?P<where>.+?): not valid YAML: (?P<problem>.*)", "{where}：不是有效的 YAML：{problem}"),
    (
        r"(?P<where>.+?): train_dataset_prob: (?P<value>.*) is not numbers separated by commas",
        "{where}：train_dataset_prob：{value} 不是以逗号分隔的数字",
    ),
    (r"truncated or corrupt \(.*\)", "文件被截断或已损坏"),
    # PaddleOCR-VL: the stage against the base model's family (studio.services.runs), what it does not train with
    (
        r"stage: OCR-VL-SFT fine-tunes PaddleOCR-VL models, and base_model (?P<model>'.*') is not one; pick a "
        r"PaddleOCR-VL model \(such as the tiny-ocr-vl preset\) or another stage",
        "stage：OCR-VL-SFT 用于微调 PaddleOCR-VL 模型，而 base_model {model} 不是；请选择 PaddleOCR-VL 模型"
        "（如预置的 tiny-ocr-vl）或其他阶段",
    ),
    (
        r"stage: base_model (?P<model>'.*') is a PaddleOCR-VL model, which trains with stage OCR-VL-SFT \(its "
        r"prompt form and image processor\), not (?P<stage>\S+)",
        "stage：base_model {model} 是 PaddleOCR-VL 模型，须用 OCR-VL-SFT 阶段训练（它的提示词格式和图像处理器），"
        "而不是 {stage}",
    ),
    (
        r"compute_type (?P<ct>\S+): PaddleOCR-VL trains in fp32, bf16 or fp16 here \(FP8 QAT and weight-only "
        r"bases are ERNIE 4\.5 decoders' only\)",
        "compute_type {ct}：PaddleOCR-VL 在此只以 fp32、bf16 或 fp16 训练（FP8 量化感知训练和仅权重量化基座只用于 "
        "ERNIE 4.5 解码器）",
    ),
    (
        r"gpas: PaddleOCR-VL's decoder takes no GPAS gates here; leave gpas false",
        "gpas：PaddleOCR-VL 的解码器在此不接受 GPAS 门控；请保持 gpas 为 false",
    ),
]
# Words a pattern's groups carry that are text, not data: what a refusal names, and the address kinds.
_MESSAGE_WORDS = {
    "dataset": "数据集",
    "run": "任务",
    "deployment": "部署",
    "export": "导出",
    "deploy": "部署",
    "eval": "评估",
    "loopback": "回环",
    "private or reserved": "私有或保留",
    "translation or tunnelling": "地址转换或隧道",
}
_MESSAGE_PATTERNS = [(re.compile(pattern, re.S), zh) for pattern, zh in MESSAGE_PATTERNS]


# Tooltips of the Train tab's config keys: the English is the engine's help text (the schema is the one
# source, so `ernie-studio train` users and the studio read the same words); the Chinese is kept here.
CONFIG_HELP_ZH: dict[str, str] = {
    "compute_type": "bf16/fp16 以该精度训练；wint8/wint4 量化冻结的基座（LoRA）；fp8 为 FP8 量化感知训练。",
    "learning_rate": "预热后的峰值学习率；默认值随阶段和微调方式而定。",
    "max_steps": "优化步数；-1（或 0）表示按 num_train_epochs 训练。",
    "num_train_epochs": "遍历数据的轮数；max_steps 为 -1 时生效。",
    "per_device_train_batch_size": "ERNIEKit 中 batch_size 的名称（设置后以它为准）。",
    "gradient_accumulation_steps": "每次优化累积的微批次数。",
    "max_seq_len": "超长样本优先丢弃最早的对话轮次。",
    "warmup_steps": "学习率从 0 线性预热到 learning_rate。",
    "logging_steps": "每 N 步记录一次指标。",
    "save_steps": "每 N 步保存一次可恢复的检查点。",
    "packing": "将短样本打包进同一序列（互不可见）；默认值随阶段而定。",
    "packing_size": "打包时每个 max_seq_len 序列最多容纳的样本数（ERNIEKit 的 OCR 配置）；0 表示能放多少放多少。",
    "save_to_hf": "全参训练：最终模型按 Hugging Face 布局保存（PyTorch 名称；PaddleOCR-VL 为 transformers 的 "
    "config.json 形式），而非 Paddle 布局（PaddleOCR-VL 为其官方发布形式）。",
    "lora_rank": "低秩更新的秩。",
    "lora_alpha": "LoRA 缩放系数的分子；-1 表示 2 × rank。",
    "beta": "相对参考模型的 KL 约束强度。",
    "model_name_or_path": "模型目录（config.json、权重、分词器）。",
    "stage": "训练阶段。",
    "fine_tuning": "训练全部权重（Full）或低秩适配器（LoRA）。",
    "output_dir": "任务目录：指标、检查点和最终模型。",
    "logging_dir": "report_to 的 TensorBoard / VisualDL / MLflow 日志目录（每个工具一个子目录）；留空即 output_dir。",
    "report_to": "metrics.jsonl 之外的标量日志：visualdl（ERNIEKit 默认）、tensorboard、all（两者）、mlflow（需 tracking 扩展）或 none；逗号分隔。",
    "train_dataset_type": "每个训练文件的格式（逗号分隔）。",
    "train_dataset_path": "训练文件，多个文件用逗号分隔以混合。",
    "train_dataset_prob": "每个训练文件的采样概率。",
    "eval_dataset_type": "每个评估文件的格式。",
    "eval_dataset_path": "评估文件，逗号分隔。",
    "eval_dataset_prob": "每个评估文件的采样概率。",
    "text_dataset_path": "VL-SFT：与图像数据混合的纯文本训练文件。",
    "text_dataset_prob": "每个 text_dataset_path 文件的采样概率。",
    "min_pixels": "VL-SFT：缩放后图像的最小面积（像素）；0 表示使用模型处理器的设置。",
    "max_pixels": "VL-SFT：缩放后图像的最大面积（像素）；0 表示使用模型处理器的设置。",
    "num_samples_each_epoch": "按轮训练时一轮的样本数（ERNIEKit 的 epoch）；0 表示遍历一次。",
    "max_prompt_len": "DPO：回答之前保留的最长提示长度。",
    "mix_strategy": "多个训练文件的混合方式。",
    "batch_size": "每个设备每步的样本数（或打包后的序列数）。",
    "per_device_eval_batch_size": "评估的 batch 大小；0 表示同 batch_size。",
    "lr_scheduler_type": "预热之后的学习率调度方式。",
    "min_lr": "调度结束时的学习率。",
    "warmup_ratio": "预热步数占总步数的比例（warmup_steps 为 0 时生效）。",
    "optim": "优化器；adamw_custom（ERNIEKit 的 AdamW）的更新与 adamw 相同。",
    "weight_decay": "AdamW 权重衰减。",
    "adam_beta1": "AdamW 的 beta1。",
    "adam_beta2": "AdamW 的 beta2。",
    "adam_epsilon": "AdamW 的 epsilon。",
    "max_grad_norm": "按全局范数裁剪梯度；0 表示关闭。",
    "moe_gate_lr_ratio": "MoE 路由器的学习率倍数（Full 训练）。",
    "vit_lr_ratio": "视觉编码器的学习率倍数（VL 模型，Full 训练）。",
    "freeze_config": "Full 训练中保持冻结的权重：freeze_vision 和/或 freeze_lm（空格或逗号分隔）。",
    "hidden_dropout_prob": "每个解码层注意力和 FFN 输出上的 dropout；N 层中第 i 层的概率为 p*i/N。",
    "dropout_warmup_steps": "dropout 在这些步内从 0 线性升到 hidden_dropout_prob。",
    "ema_decay": "权重的指数滑动平均；0 表示关闭。",
    "seed": "初始化、打乱数据和 dropout 使用的随机种子。",
    "recompute": "反向传播时重算激活（省显存，耗时更多）。",
    "recompute_granularity": "recompute 在反向时重建的部分：full（每个解码层的全部模块：注意力、稠密 FFN 和 MoE）、full_attn（注意力模块）、core_attn（其中的 softmax 注意力）。",
    "use_recompute_moe": "开启 recompute 时也重建 MoE 模块（路由器、路由专家和共享专家），与粒度无关；false 则保留其激活。专家并行时只重建路由专家和共享专家（不重放通信），此类任务会提示。",
    "do_train": "训练；false 时只评估模型（需要 do_eval 和评估集）。",
    "do_eval": "给出评估集时进行评估。",
    "evaluation_strategy": "训练中何时评估：每 eval_steps 步、每轮，或 no（不评估）。",
    "max_evaluate_steps": "每次评估的批次数；-1（或 0）表示评估整个评估集。",
    "save_strategy": "何时保存检查点：每 save_steps 步、每轮，或 no（只在最后一步）。",
    "save_total_limit": "只保留最新的 N 个检查点，删除更早的；0 表示全部保留。",
    "eval_steps": "每 N 步评估一次（evaluation_strategy 为 steps 时）；0 表示只在结束时评估。",
    "disable_tqdm": "标准输出中不显示进度条。",
    "lora_plus_scale": "LoRA+：B 矩阵的学习率倍数。",
    "rslora": "秩稳定的 LoRA 缩放（alpha / sqrt(rank)）。",
    "lora_target_modules": "加适配器的线性层；VL 模型还可选 vision 和 resampler。",
    "loss_type": "DPO 损失函数。",
    "pref_loss_ratio": "偏好损失的权重。",
    "sft_loss_ratio": "chosen 回答上 SFT 损失的权重。",
    "label_smoothing": "保守 DPO：假定标签被翻转的比例。",
    "reference_free": "不使用参考模型的 DPO。",
    "dpo_reference_dtype": "Full DPO 中冻结参考模型的保存方式：run（与训练权重相同：fp32，或 compute_type bf16 时为 bf16）、fp32，或其线性层仅权重量化为 wint8 / wint4（更省显存，参考模型为近似）。LoRA DPO 没有第二个模型：其参考模型是关闭适配器后的基座。",
    "moe_aux_loss_lambda": "负载均衡损失的权重；留空沿用模型 config.json 中的值。",
    "moe_z_loss_lambda": "路由器 z-loss 的权重；留空沿用模型 config.json 中的值。",
    "moe_orthogonal_loss_lambda": "路由器正交损失的权重；留空沿用模型 config.json 中的值。",
    "moe_use_aux_free": "用修正偏置平衡专家负载（aux-free）；留空沿用模型 config.json 中的值。",
    "moe_correction_bias_rate": "aux-free 偏置更新的步长。",
    "expert_parallel_degree": "专家并行：把每个 MoE 层的路由专家分到这么多个 rank 上（须整除专家数和任务的 rank 数）；token 发送到其专家所在的 rank 再返回。",
    "moe_group": "ERNIEKit 的专家并行组：dp（或 data、world）把专家分到所有 rank；mp（model、tp）分到张量并行组，此处为一个 rank；dummy（none）不拆分。",
    "gpas": "GPAS：每次残差相加后加一个可学习的门控，缩小激活而梯度不变；起始时与原模型相同（Full 训练；用 GPAS 训练的模型保留其门控）。",
    "gpas_gate_grad_clip": "GPAS：在 max_grad_norm 之后按此全局范数裁剪门控的梯度（参考实现的 clip_gate_grad，其 1B 和 7B 训练取 0.01）；0 表示关闭。",
    "elastic": "弹性 MoE 训练：每步训练一个在层数、专家数和 top-k 上采样的子模型，一次训练得到一族更小的模型（文本 MoE 模型上的 PT / SFT）。",
    "elastic_depth_choices": "弹性：子模型可取的层数（保留的解码层；第一层和最后一层始终保留），逗号分隔，如 20,24；留空保留所有层。",
    "elastic_depth_pattern": "弹性：较浅的子模型去掉哪些层：最后一层之前的一段连续层，或均匀间隔的层。",
    "elastic_experts_choices": "弹性：子模型每个 MoE 层可保留的路由专家数（前 N 个；路由器在其上重新归一化），逗号分隔，如 32,48；留空保留所有专家。",
    "elastic_topk_choices": "弹性：子模型每个 token 可路由的专家数（k' <= moe_k），逗号分隔，如 2,4；留空保持 moe_k。",
    "elastic_full_share": "弹性：训练完整模型的步数比例；其余步从 elastic_* 列表中均匀采样子模型训练。",
    "fp8_hadamard": "FP8 量化感知训练：量化前用 Hadamard 变换旋转各块。",
    "fp8_hadamard_block_size": "FP8 量化感知训练：Hadamard 块大小（2 的幂）。",
    "fp8_scale_ema_rate": "FP8 量化感知训练：激活缩放因子的 EMA 速率。",
    "sharding": "把优化器状态切分到数据并行设备上：stage1（AdamW 状态；CPU 和 GPU）或 stage2（还有梯度；仅 GPU）。需要 2 个或更多设备；留空为普通数据并行。",
    "sharding_parallel_degree": "一份优化器状态切分跨越的设备数：-1 为任务的全部设备，1 表示关闭切分；须整除任务的设备数（其余设备以数据并行复制该切分）。",
    "tensorwise_offload_optimizer": "GPU：把 AdamW 的动量放在主机内存，只在更新某个权重时把它的动量搬到设备上（CPU 上本就在主机内存中）。",
    "weight_quant_group_size": "仅权重量化的基座：分组大小；-1 表示按通道。",
}


def config_texts(cls: type) -> dict[str, tuple[str, str]]:
    """The texts of every key of a config schema: its name as the label (the same in both languages: it is
    what YAML files say) and the engine's help as the English tooltip. A key the schema gains shows its
    English help in Chinese until CONFIG_HELP_ZH has it (tests/studio/test_train_form.py asks for it)."""
    out: dict[str, tuple[str, str]] = {}
    for f in dataclasses.fields(cls):
        out[f"tr.{f.name}"] = (f.name, f.name)
        out[f"tr.{f.name}.info"] = (f.metadata["help"], CONFIG_HELP_ZH.get(f.name, f.metadata["help"]))
    return out


STRINGS.update(
    {k: v for k, v in config_texts(TrainConfig).items() if k not in STRINGS or k.endswith(".info")}
)

# A shown header (in either language) -> the English header it stands for.
_HEADER_SOURCE = {
    shown: key[len("col.") :] for key, pair in STRINGS.items() if key.startswith("col.") for shown in pair
}
# The language each browser session last switched to, by Gradio session hash. Callbacks read it to
# translate table headers, since a Dataframe's headers come from the value a callback returns.
_SESSION_LANGUAGE: OrderedDict[str, str] = OrderedDict()
_SESSION_LANGUAGE_MAX = 10_000


def text(key: str, lang: str = DEFAULT_LANGUAGE, **fields: Any) -> str:
    """The text for ``key`` in ``lang`` (English when the language is unknown), ``fields`` filled in."""
    en, zh = STRINGS[key]
    chosen = zh if lang == "zh" else en
    return chosen.format(**fields) if fields else chosen


def localize_message(message: str, lang: str = DEFAULT_LANGUAGE) -> str:
    """A message a service or the engine wrote (in English) as the UI shows it in ``lang``: translated by the
    first of ``MESSAGE_PATTERNS`` that matches it whole, else as it is. The REST API never translates."""
    if lang != "zh":
        return message
    for pattern, zh in _MESSAGE_PATTERNS:
        m = pattern.fullmatch(message)
        if m is not None:
            fields = {
                k: localize_message(v, lang)
                if k.startswith("msg")
                else status_text(v, lang)
                if k == "status"
                else _MESSAGE_WORDS.get(v, v)
                for k, v in m.groupdict().items()
            }
            return zh.format(**fields)
    return message


def status_text(status: str, lang: str = DEFAULT_LANGUAGE) -> str:
    """A run's, export's or deployment's status in ``lang`` (an unknown one is shown as stored)."""
    key = f"status.{status}"
    return text(key, lang) if key in STRINGS else status


def header(column: str, lang: str) -> str:
    """A table header in ``lang``; ``column`` may be shown in either language, unknown ones are kept."""
    source = _HEADER_SOURCE.get(column)
    return text(f"col.{source}", lang) if source is not None else column


def headers_in(frame: pd.DataFrame, lang: str) -> bool:
    """Whether every column header of ``frame`` is already shown in ``lang``."""
    return all(header(str(c), lang) == str(c) for c in frame.columns)


def localize_frame(frame: pd.DataFrame, lang: str) -> pd.DataFrame:
    """``frame`` with its column headers in ``lang``."""
    return frame.rename(columns={c: header(str(c), lang) for c in frame.columns})


def _session_hash() -> str | None:
    request = LocalContext.request.get(None)
    return getattr(request, "session_hash", None) if request is not None else None


def remember_language(lang: str) -> None:
    """Record ``lang`` for the browser session of the running callback (no-op outside a callback)."""
    session = _session_hash()
    if session is None:
        return
    _SESSION_LANGUAGE[session] = lang if lang in LANGUAGES else DEFAULT_LANGUAGE
    _SESSION_LANGUAGE.move_to_end(session)
    while len(_SESSION_LANGUAGE) > _SESSION_LANGUAGE_MAX:
        _SESSION_LANGUAGE.popitem(last=False)


def current_language() -> str:
    """The language of the browser session whose callback is running (the default outside one)."""
    session = _session_hash()
    return _SESSION_LANGUAGE.get(session, DEFAULT_LANGUAGE) if session else DEFAULT_LANGUAGE


class Texts:
    """Creates components with translated labels and relabels all of them when the language changes."""

    def __init__(self, lang: str = DEFAULT_LANGUAGE):
        self.lang = lang
        # (component, {property: key})
        self._bound: list[tuple[gr.components.Component | gr.blocks.BlockContext, dict[str, str]]] = []
        self.tables: list[gr.Dataframe] = []
        # Components that show Gradio's own texts ("Drop File Here"): drawn again after a language switch.
        self.uploads: list[gr.File] = []

    def __call__(self, key: str) -> str:
        return text(key, self.lang)

    def make(
        self,
        factory: Callable[..., Any],
        key: str,
        *,
        prop: str = "label",
        also: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``factory(label=text(key), info=text(key + '.info') if present, **kwargs)``, remembered for relabelling.

        ``also`` names more translated properties, e.g. a plot's ``{"x_title": "plot.step"}``.
        """
        props = {prop: key, **(also or {})}
        kwargs.update({p: self(k) for p, k in props.items()})
        if prop == "label" and f"{key}.info" in STRINGS and "info" not in kwargs:
            props["info"] = f"{key}.info"
            kwargs["info"] = self(f"{key}.info")
        component = factory(**kwargs)
        self._bound.append((component, props))
        if isinstance(component, gr.Dataframe):
            self.tables.append(component)
        if isinstance(component, gr.File):
            self.uploads.append(component)
        return component

    def bind(self, component: Any, **props: str) -> Any:
        """Remember that ``component``'s properties (e.g. ``label="tab.runs"``) come from text keys."""
        self._bound.append((component, props))
        return component

    @property
    def components(self) -> list[Any]:
        return [c for c, _ in self._bound]

    def updates(self, lang: str, frames: list[Any] | None = None) -> list[dict[str, Any]]:
        """One ``gr.update`` per bound component, in :attr:`components` order.

        ``frames`` are the current values of :attr:`tables`; those whose headers are not all in ``lang`` come
        back translated. The others get no value: ``frames`` are what the page held when the event was sent,
        and a table filled meanwhile (the page's load events run beside the language restore) must not be set
        back to that older value (a fresh page lost its Nodes table that way, keeping only its header).
        """
        lang = lang if lang in LANGUAGES else DEFAULT_LANGUAGE
        values = dict(zip(map(id, self.tables), frames or [], strict=False))
        out = []
        for component, props in self._bound:
            update = gr.update(**{p: text(k, lang) for p, k in props.items()})
            frame = values.get(id(component))
            if isinstance(frame, pd.DataFrame) and not headers_in(frame, lang):
                update["value"] = localize_frame(frame, lang)
            out.append(update)
        return out

    def localize_tables(self, demo: gr.Blocks) -> None:
        """Make every event that fills a table return it with headers in its session's language.

        Called once the Blocks is built, so no tab has to pass the language through its callbacks.
        """
        table_ids = {t._id for t in self.tables}
        for block_fn in demo.fns.values():
            fn = block_fn.fn
            outputs = [getattr(o, "_id", None) in table_ids for o in block_fn.outputs]
            if fn is None or not any(outputs) or inspect.isgeneratorfunction(fn):
                continue
            if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
                continue
            block_fn.fn = _localizing(fn, outputs)


def _localizing(fn: Callable[..., Any], is_table: list[bool]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        lang = current_language()
        single = len(is_table) == 1
        values = [result] if single else result
        if not isinstance(values, list | tuple) or len(values) != len(is_table):
            return result
        fixed = [_localize_value(v, lang) if table else v for v, table in zip(values, is_table, strict=True)]
        return fixed[0] if single else type(values)(fixed) if isinstance(values, tuple) else fixed

    return wrapper


def _localize_value(value: Any, lang: str) -> Any:
    if isinstance(value, pd.DataFrame):
        return localize_frame(value, lang)
    if isinstance(value, dict) and isinstance(value.get("value"), pd.DataFrame):
        return {**value, "value": localize_frame(value["value"], lang)}
    return value


# ---- checking a page for untranslated text -----------------------------------------------------------------

# A shown word: letters only (tokens with digits, "_", "/", ".", ":" or "@" are identifiers, paths, numbers).
_TOKEN = re.compile(r"[^\s,;()\[\]{}<>\"'`*|·—–:：，。；（）“”、!?！？…]+")
_WORD = re.compile(r"^[A-Za-z][A-Za-z'-]*[A-Za-z]$")
_URL = re.compile(r"[A-Za-z][A-Za-z+.-]*://\S+")
_FIELD = re.compile(r"\{[^{}]*\}")  # a str.format field of a text, filled at run time
_TAG = re.compile(r"</?[A-Za-z][^<>]*>")  # markup (a Markdown text's <details>) is not shown as text


def kept_words() -> set[str]:
    """Words every language shows as they are: what the Chinese texts keep in Latin letters (LoRA, Token,
    ERNIE, KiB, ...) and the engine's identifiers (formats, data kinds, stages, fine-tuning kinds, compute
    types, schedulers), lower-cased."""
    words: set[str] = set()
    for zh in [*(zh for _, zh in STRINGS.values()), *(zh for _, zh in MESSAGE_PATTERNS)]:
        words.update(w.lower() for w in _words(_FIELD.sub(" ", zh)))
    kinds = [k for ks in KINDS.values() for k in ks] + ["benchmark"]  # studio.services.datasets.BENCHMARK
    for names in (FORMATS, BENCHMARK_TYPES, kinds, STAGES, FINE_TUNING):
        words.update(n.lower() for n in names)
    words.update(n.lower() for n in (*COMPUTE_TYPES, *SCHEDULERS))
    # PaddleOCR-VL's task prompts (Deploy & Chat offers them): the words the model was trained with
    words.update(w.lower() for prompt in TASK_PROMPTS.values() for w in _words(prompt))
    return words


def _words(shown: str) -> list[str]:
    return [t for t in _TOKEN.findall(_URL.sub(" ", _TAG.sub(" ", shown))) if _WORD.match(t)]


def untranslated_words(shown: str, data: Any = ()) -> list[str]:
    """Words of ``shown`` (text a page in Chinese shows) that no Chinese text of the table keeps and that
    are not among ``data`` (names and values the person gave, such as dataset and run names): English
    that reached the page without a translation."""
    allowed = kept_words() | {w.lower() for value in data for w in _words(str(value))}
    return [w for w in _words(shown) if w.lower() not in allowed]
