"""The Chinese of the media messages (engine.messages catalogs), by key."""

from __future__ import annotations

ZH: dict[str, str] = {
    "media.at_line": "{file}:{line}：{msg}",
    "media.located": "{field}：{msg}",
    "media.labelled": "{label}：{msg}",
    "media.image_file": "图片文件 {path}",
    "media.image_named": "图片 {url!r}",
    "media.video_file": "视频文件 {path}",
    "media.image_bytes": "图片字节",
    "media.image": "图片",
    "media.not_fetched": "图片 {url!r} 无法获取：{msg_why}；也可把图片保存在数据文件旁边",
    # The reason phrase ("Not Found") is the English name of the status code the text already gives, so the
    # Chinese leaves it out: ``{reason:.0}`` formats it to nothing (str.format's precision 0).
    "media.server_answered": "服务器返回 HTTP {code}{reason:.0}",
    "media.server_answered_code": "服务器返回 HTTP {code}",
    "media.larger_than": "大于 {limit:,} 字节",
    "media.took_longer": "超过 {seconds:g} 秒（整次获取共用一个时限）",
    "media.not_accepted": "返回内容不是 VL 处理器接受的图片（{msg_why}）",
    "media.encoded": "服务器在要求不压缩后仍以 {encoding} 压缩返回；压缩的回复不会被解压",
    "media.urls_off": "已关闭按 URL 获取记录中的图片（ERNIE_STUDIO_MEDIA_URLS=off）",
    "media.not_public": (
        "{host} 是{kind}地址（{address}）；记录中的 URL 只从公网主机获取（ERNIE_STUDIO_MEDIA_URLS=any 允许内部图床）"
    ),
    # the resolver's reason is the system's own English (socket.gaierror), shown as it is
    "media.cannot_resolve": "无法解析 {host!r}（{why}）；此节点是否离线？",
    "media.no_address": "无法解析 {host!r}（没有地址）；此节点是否离线？",
    "media.not_pil_image": "不是可读取的图片（格式未知或不是图片）",
    # The detail is the decoder's own English error (PIL, zlib: "image file is truncated (3 bytes not
    # processed)"), which has no Chinese; the Chinese says what it means and leaves it out (``{detail:.0}``
    # formats it to nothing). The English, the logs and the REST API's key and fields keep it.
    "media.truncated": "文件被截断或已损坏{detail:.0}",
}
