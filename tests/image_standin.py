"""A loopback stand-in for the host that ERNIEKit's VL demo data names its images on (``https://nlp-sr-share
.bj.bcebos.com/data/ernie4.5/demo_images/...``): ``ImageHost`` serves the files it is given at their paths,
redirects where told, and answers 404 for anything else; it counts every request."""

from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image


def picture(rgb: tuple[int, int, int], size: tuple[int, int] = (56, 84), format: str = "PNG") -> bytes:
    """A one-colour picture of ``size`` (height, width) in ``format``."""
    buf = io.BytesIO()
    Image.fromarray(np.full((*size, 3), rgb, np.uint8)).save(buf, format=format)
    return buf.getvalue()


class ImageHost:
    """``files`` (path -> (bytes, content type)) served over HTTP on 127.0.0.1; ``redirects`` (path -> path)
    answer 302. ``hits`` lists the paths asked for, in order."""

    def __init__(self, files: dict[str, tuple[bytes, str]], redirects: dict[str, str] | None = None) -> None:
        self.files, self.redirects = files, redirects or {}
        self.hits: list[str] = []
        self.hosts: list[str] = []  # the Host header of each request
        host = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                host.hits.append(self.path)
                host.hosts.append(self.headers.get("Host", ""))
                if self.path in host.files:
                    body, kind = host.files[self.path]
                    self.send_response(200)
                    self.send_header("Content-Type", kind)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path in host.redirects:
                    self.send_response(302)
                    self.send_header("Location", host.redirects[self.path])
                    self.end_headers()
                else:
                    self.send_error(404)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
