"""The English of what the data code tells a person about images: those named by URL (engine.data.remote)
and files the decoder cannot read (engine.data.vl_processor, vl_video, formats_vl). The Chinese is in
studio/messages/zh_media.py under the same keys."""

from __future__ import annotations

from engine.messages import Catalog

MEDIA = Catalog(
    "media",
    {
        # where a problem is: the data file and line, then the record's field
        "at_line": "{file}:{line}: {msg}",
        "located": "{field}: {msg}",
        # an input named in front of what is wrong with it (vl_processor's labels)
        "labelled": "{label}: {msg}",
        "image_file": "image file {path}",
        "image_named": "image {url!r}",
        "video_file": "video file {path}",
        "image_bytes": "image bytes",
        "image": "image",
        # a URL that could not be fetched, and why (engine.data.remote.FetchError)
        "not_fetched": "image {url!r} could not be fetched: {msg_why}; or save it next to the data file",
        "server_answered": "the server answered {code} {reason}",
        "server_answered_code": "the server answered {code}",
        "larger_than": "larger than {limit:,} bytes",
        "took_longer": "took longer than {seconds:g} s (one deadline for the whole fetch)",
        "not_accepted": "the answer is not an image the VL processor accepts ({msg_why})",
        "encoded": (
            "the server sent the body {encoding}-encoded after being asked for identity; compressed replies "
            "are not decoded"
        ),
        "urls_off": "fetching record URLs is turned off (ERNIE_STUDIO_MEDIA_URLS=off)",
        "not_public": (
            "{host} is a {kind} address ({address}); record URLs are fetched from public hosts only "
            "(ERNIE_STUDIO_MEDIA_URLS=any allows an internal image store)"
        ),
        "cannot_resolve": "cannot resolve {host!r} ({why}); is this worker offline?",
        "no_address": "cannot resolve {host!r} (no address); is this worker offline?",
        # files the decoder cannot read; ``detail`` is the decoder's own English error (or what we found)
        "not_pil_image": "not an image PIL can read (unknown format or not an image)",
        "truncated": "truncated or corrupt ({detail})",
    },
)
