"""Messages the services and the engine build from parts, matched to their Chinese by pattern."""

from __future__ import annotations

import re

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
