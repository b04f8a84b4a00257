"""The Chinese of the services messages (engine.messages catalogs), by key."""

from __future__ import annotations

ZH: dict[str, str] = {
    # studio.services.messages
    "services.at_field": "{field}：{problem}",
    "services.with_problems": "{head}\n{problems}",
    "services.template_name_empty": "name：为空；请给模板起个名字（最多 {n} 个字符）",
    "services.template_name_long": "name：{n} 个字符；模板名称最多 {max} 个字符",
    "services.template_name_unprintable": "name：含有控制字符或不可见的格式字符；请使用可打印的文字",
    "services.template_name_taken": "name：已有名为 {name!r} 的模板；请换个名字，或先删除那个模板",
    "services.template_name_taken_now": "name：已有名为 {name!r} 的模板；请换个名字",
    "services.templates_full": "Studio 最多保存 {n} 个模板；请先删除一些",
    "services.template_not_found": "模板 {id} 不存在；GET /api/v1/templates 列出全部模板",
    "services.template_unusable": "模板 {id}（{name!r}）已无法构成任务配置：{problem}；请删除它并重新保存表单",
    "services.template_refused": "spec：以此模板启动的任务会被拒绝：",
    "services.recipe_not_found": "recipe：没有名为 {name!r} 的配方；现有配方：{names}",
    "services.not_found": "{what} {id} 不存在",
    "services.nothing_to_cancel": "{what} {id} 已结束（{status}）；无需取消",
    "services.not_resumable": "{what} {id} 的状态为 {status}；只有失败或已取消的{what}可以恢复",
    "services.running_cancel_first": "{what} {id} 正在运行；请先取消",
    "services.not_succeeded": "{what} {id} 的状态为 {status}；请在其成功完成后再{verb}",
    "services.deployment_active": "部署 {id} 的状态为 {status}；请先停止",
    "services.deployment_not_running": "部署 {id} 的状态为 {status}；请在其运行后再对话",
    "services.deployment_no_answer": "部署 {id} 在 {url} 没有应答：{error}",
    "services.dataset_in_use": "数据集 {id} 正被排队或运行中的任务 {runs} 使用；请先取消它们",
    "services.dataset_kind": "{field}：数据集 {id}（{name}）为 {kind} 数据；阶段 {stage} 需要 {want} 数据",
    "services.file_empty": "文件 {name} 是空文件",
    "services.media_fetching": "数据集 {id}：按 URL 引用的图片仍在获取中（{done}/{total}）；获取完成后再查看统计",
    "services.upload_too_large": "文件 {name} 超过上传上限 {mb} MB；请拆分文件或调大 ERNIE_STUDIO_MAX_UPLOAD_MB",
    "services.import_too_large": "{where}：{size:,} 字节；导入的配置最多 {limit:,} 字节（ERNIEKit 的配置只有几 KB）",
    "services.import_not_utf8": "{where}：不是 UTF-8 文本（第 {byte} 字节）；请以 UTF-8 保存文件",
    "services.import_empty": "{where}：内容为空；请粘贴 ERNIEKit 训练配置（key: value 形式的行）",
    "services.import_documents": "{where}：出现第二个 YAML 文档（--- 之后）；一次只导入一个配置、一个文档",
    "services.import_anchors": "{where}：导入的配置不接受 YAML 锚点与别名（&name、*name）；请逐项写出取值",
    "services.import_tag": "{where}：导入的配置不接受 YAML 标签 {tag!r}；请写普通取值",
    "services.import_nested": "{where}：嵌套达 {depth} 层；配置是 key: value 形式的行（取值可以是列表），最多 {limit} 层",
    "services.import_not_yaml": "{where}：不是有效的 YAML：{problem}",
    "services.import_probs": "{where}：train_dataset_prob：{value!r} 不是以逗号分隔的数字",
    "services.ocr_stage_needs_ocr_model": (
        "stage：{stage} 用于微调 PaddleOCR-VL 模型，而 base_model {model!r} 不是；请选择 PaddleOCR-VL 模型"
        "（如预置的 tiny-ocr-vl）或其他阶段"
    ),
    "services.ocr_model_needs_ocr_stage": (
        "stage：base_model {model!r} 是 PaddleOCR-VL 模型，须用 {ocr_stage} 阶段训练（它的提示词格式和图像处理器），"
        "而不是 {stage}"
    ),
    # engine.train.messages
    "train.ocr_compute_type": (
        "compute_type {compute_type}：PaddleOCR-VL 在此只以 fp32、bf16 或 fp16 训练（FP8 量化感知训练和仅权重量化基座"
        "只用于 ERNIE 4.5 解码器）"
    ),
    "train.ocr_gpas": "gpas：PaddleOCR-VL 的解码器在此不接受 GPAS 门控；请保持 gpas 为 false",
}
