"""Images named by URL in VL records: fetched once into the dataset directory, public hosts only by default,
and clear errors when the worker is offline, the server refuses, or the file is too large.

The attacks of issue 27 run against a fake resolver (``socket.getaddrinfo`` answering what a hostile DNS
would) and local stand-in servers; ``socket.create_connection`` is watched so that every connection attempt is
recorded and none leaves the machine."""

from __future__ import annotations

import contextlib
import gzip
import json
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import zstandard
from image_standin import ImageHost, picture

from engine.data import remote
from engine.data.formats import parse_record
from engine.data.formats_vl import probe_video
from engine.data.vl_processor import VisionInputError
from studio.messages import localize


@pytest.fixture
def image_server():
    """A local HTTP server with one PNG at /red.png, a 404 elsewhere and a redirect at /moved.png."""
    png = picture((200, 20, 20))
    host = ImageHost({"/red.png": (png, "image/png")}, redirects={"/moved.png": "/red.png"})
    yield host.url, png, host.hits
    host.close()


def record(url: str) -> dict:
    return {
        "image_info": [{"matched_text_index": 0, "image_url": url}],
        "text_info": [{"text": "Colour?", "tag": "mask"}, {"text": "Red.", "tag": "no_mask"}],
    }


def test_a_url_image_is_fetched_once_into_the_dataset(image_server, tmp_path, monkeypatch):
    base, png, hits = image_server
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")  # the test server is on loopback
    ex = parse_record(record(f"{base}/red.png"), "erniekit_vl", "sft", tmp_path, fetch_urls=True)
    (path,) = ex.turns[0].media
    assert path.parent == tmp_path / ".remote" and path.read_bytes() == png
    parse_record(record(f"{base}/red.png"), "erniekit_vl", "sft", tmp_path, fetch_urls=True)
    assert hits == ["/red.png"]  # the second read used the copy
    assert [p.name for p in (tmp_path / ".remote").iterdir()] == [path.name]  # no partial file left


def test_url_problems_are_located_errors(image_server, tmp_path, monkeypatch):
    base, _, _ = image_server

    chinese: list[str] = []

    def problem(url: str) -> str:
        with pytest.raises(ValueError) as e:
            parse_record(record(url), "erniekit_vl", "sft", tmp_path, fetch_urls=True)
        (keyed,) = e.value.problems  # a keyed message: the Datasets tab shows it in the reader's language
        assert keyed.key == "media.located" and keyed.fields["msg"].key == "media.not_fetched"
        chinese.append(localize(keyed, "zh"))
        return str(e.value)

    # by default loopback / private hosts are not fetched: a dataset must not reach into the network
    assert "127.0.0.1 is a loopback address (127.0.0.1); record URLs are fetched from public hosts only" in (
        problem(f"{base}/red.png")
    )
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    assert "could not be fetched: the server answered 404 Not Found" in problem(f"{base}/nope.png")
    # a redirect is not followed (it could lead past the address check)
    assert "the server answered 302 Found" in problem(f"{base}/moved.png")
    monkeypatch.setattr(remote, "MAX_BYTES", 100)
    assert "larger than 100 bytes" in problem(f"{base}/red.png")
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "off")
    assert "fetching record URLs is turned off (ERNIE_STUDIO_MEDIA_URLS=off)" in problem(f"{base}/red.png")
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "public")
    offline = problem("https://no-such-host.invalid/cat.png")
    assert "cannot resolve 'no-such-host.invalid'" in offline and "is this worker offline?" in offline
    assert "or save it next to the data file" in offline
    assert not (tmp_path / ".remote").exists() or all(
        not p.name.endswith(".part") for p in (tmp_path / ".remote").iterdir()
    )
    json.dumps(offline)  # a plain message
    at = f"image_info[0]：图片 '{base}/red.png' 无法获取："
    assert chinese[0].startswith(at + "127.0.0.1 是回环地址（127.0.0.1）；记录中的 URL 只从公网主机获取"), (
        chinese
    )
    assert chinese[1:4] == [
        f"image_info[0]：图片 '{base}/nope.png' 无法获取：服务器返回 HTTP 404；也可把图片保存在数据文件旁边",
        f"image_info[0]：图片 '{base}/moved.png' 无法获取：服务器返回 HTTP 302；也可把图片保存在数据文件旁边",
        at + "大于 100 字节；也可把图片保存在数据文件旁边",
    ], chinese
    assert (
        chinese[4]
        == at + "已关闭按 URL 获取记录中的图片（ERNIE_STUDIO_MEDIA_URLS=off）；也可把图片保存在数据文件旁边"
    )
    assert chinese[5].startswith(
        "image_info[0]：图片 'https://no-such-host.invalid/cat.png' 无法获取：无法解析 "
    )
    assert chinese[5].endswith("；此节点是否离线？；也可把图片保存在数据文件旁边"), chinese


def test_a_record_read_without_fetching_never_fetches(image_server, tmp_path, monkeypatch):
    """A preview or an upload's validation reads records without fetching: the URL passes unchecked."""
    base, _, hits = image_server
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    ex = parse_record(record(f"{base}/red.png"), "erniekit_vl", "sft", tmp_path)
    assert ex.turns[0].media == [Path(f"{base}/red.png")] and hits == []
    assert not (tmp_path / ".remote").exists()


# ---- the SSRF attacks of issue 27, item 2 -------------------------------------------------------------------
PUBLIC = "93.184.215.14"  # any global address: the watch below refuses to connect to it


class Listener:
    """A TCP listener on 127.0.0.1 that counts the connections it accepts and closes them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listener():
    server = Listener()
    yield server
    server.close()


@pytest.fixture
def dns(monkeypatch):
    """A fake resolver: ``dns.answers[name]`` is a list of answers, one per lookup (the last one repeats);
    ``dns.asked`` lists the names looked up. Non-ASCII names arrive as the operating system would see them
    from a ``str`` (IDNA 2003, as Python's socket module encodes them)."""
    real = socket.getaddrinfo

    class Resolver:
        def __init__(self) -> None:
            self.answers: dict[str, list[list[str]]] = {}
            self.asked: list[str] = []

        def __call__(self, host, port, *args, **kwargs):
            name = host.decode() if isinstance(host, bytes) else host
            name = name if name.isascii() else name.encode("idna").decode()
            if name not in self.answers:
                return real(host, port, *args, **kwargs)
            self.asked.append(name)
            queue = self.answers[name]
            addresses = queue.pop(0) if len(queue) > 1 else queue[0]
            return [
                (
                    socket.AF_INET6 if ":" in a else socket.AF_INET,
                    socket.SOCK_STREAM,
                    6,
                    "",
                    (a, int(port or 0)),
                )
                for a in addresses
            ]

    resolver = Resolver()
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    return resolver


@pytest.fixture
def connections(monkeypatch):
    """Every ``socket.create_connection`` address, in order; connecting to anything but loopback is refused
    here, so no test traffic leaves the machine."""
    real = socket.create_connection
    seen: list[tuple[str, int]] = []

    def watched(address, *args, **kwargs):
        seen.append((address[0], address[1]))
        try:
            literal = remote.ipaddress.ip_address(address[0])
        except ValueError:
            literal = None
        if literal is not None and not literal.is_loopback:
            raise ConnectionRefusedError(f"test: no connection to {literal}")
        return real(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", watched)
    return seen


def test_dns_rebinding_connects_to_the_checked_address_only(tmp_path, dns, connections, listener):
    # public at the check, loopback at any later lookup: the fetch must never look up twice
    dns.answers["rebind.example"] = [[PUBLIC], ["127.0.0.1"]]
    with pytest.raises(remote.FetchError):
        remote.fetch(f"http://rebind.example:{listener.port}/a.png", tmp_path)
    assert dns.asked == ["rebind.example"]
    assert connections == [(PUBLIC, listener.port)] and listener.accepted == 0


def test_every_address_of_one_answer_is_checked(tmp_path, dns, connections, listener):
    dns.answers["mixed.example"] = [[PUBLIC, "127.0.0.1"]]
    with pytest.raises(remote.FetchError) as e:
        remote.fetch(f"http://mixed.example:{listener.port}/a.png", tmp_path)
    assert "mixed.example is a loopback address (127.0.0.1)" in str(e.value)
    assert connections == [] and listener.accepted == 0


def test_an_idn_host_is_checked_and_fetched_as_one_name(tmp_path, dns, connections, listener):
    # IDNA 2003 maps ß.example to ss.example (public here); IDNA 2008 to xn--zca.example (loopback here)
    dns.answers["ss.example"] = [[PUBLIC]]
    dns.answers["xn--zca.example"] = [["127.0.0.1"]]
    with pytest.raises(remote.FetchError) as e:
        remote.fetch(f"http://ß.example:{listener.port}/a.png", tmp_path)
    assert "xn--zca.example is a loopback address (127.0.0.1)" in str(e.value)
    assert dns.asked == ["xn--zca.example"] and connections == [] and listener.accepted == 0


def test_an_idn_host_reaches_its_server_under_its_one_name(tmp_path, dns, monkeypatch):
    png = picture((10, 200, 10))
    host = ImageHost({"/g.png": (png, "image/png")})
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    dns.answers["xn--zca.example"] = [["127.0.0.1"]]
    try:
        port = host.url.rsplit(":", 1)[1]
        path = remote.fetch(f"http://ß.example:{port}/g.png", tmp_path)
        assert path.read_bytes() == png and host.hosts == [f"xn--zca.example:{port}"]
    finally:
        host.close()


@pytest.mark.parametrize(
    "address",
    [
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "64:ff9b:1::a00:1",  # local-use NAT64
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
        "::127.0.0.1",  # IPv4-compatible
        "::ffff:127.0.0.1",  # IPv4-mapped
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
        "100.64.0.1",  # carrier-grade NAT
    ],
)
def test_translation_and_tunnel_addresses_are_refused(tmp_path, dns, connections, address):
    dns.answers["images.example"] = [[address]]
    with pytest.raises(remote.FetchError) as e:
        remote.fetch("http://images.example/a.png", tmp_path)
    assert f"address ({remote.ipaddress.ip_address(address)})" in str(e.value)
    assert "record URLs are fetched from public hosts only" in str(e.value)
    assert connections == []


def test_a_proxy_from_the_environment_is_not_used(tmp_path, dns, connections, listener, monkeypatch):
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, f"http://127.0.0.1:{listener.port}")
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    dns.answers["images.example"] = [[PUBLIC]]
    with pytest.raises(remote.FetchError):
        remote.fetch("http://images.example/a.png", tmp_path)
    assert connections == [(PUBLIC, 80)] and listener.accepted == 0


def test_the_operators_proxy_is_asked_for_the_checked_address(tmp_path, dns, connections, monkeypatch):
    """ERNIE_STUDIO_MEDIA_PROXY: the request names the checked address (the proxy does not resolve the name
    again) and carries the name in Host; a name that resolves to a private address never reaches it."""
    png = picture((20, 20, 200))
    seen: list[tuple[str, str]] = []

    def forward(h) -> None:
        seen.append((h.path, h.headers.get("Host", "")))
        _send(h, png, Content_Type="image/png")

    proxy = Reply(forward)
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_PROXY", proxy.url)
    dns.answers["images.example"] = [[PUBLIC]]
    dns.answers["inside.example"] = [["10.0.0.7"]]
    try:
        path = remote.fetch("http://images.example/a.png?x=1", tmp_path)
        with pytest.raises(remote.FetchError) as e:
            remote.fetch("http://inside.example/a.png", tmp_path)
    finally:
        proxy.close()
    assert path.read_bytes() == png and seen == [(f"http://{PUBLIC}:80/a.png?x=1", "images.example")]
    assert "inside.example is a private or reserved address (10.0.0.7)" in str(e.value)
    assert dns.asked == ["images.example", "inside.example"]
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_PROXY", "socks5://127.0.0.1:1080")
    with pytest.raises(remote.FetchError) as e:
        remote.fetch("http://images.example/b.png", tmp_path)
    assert "ERNIE_STUDIO_MEDIA_PROXY='socks5://127.0.0.1:1080': give the proxy as http://host:port" in str(
        e.value
    )


# ---- what a server sends back (issue 27, items 2 and 5) ----------------------------------------------------
class Reply:
    """A loopback HTTP server whose GET runs ``answer(handler)``."""

    def __init__(self, answer) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _send(handler, body: bytes, **headers: str) -> None:
    handler.send_response(200)
    for k, v in {"Content-Length": str(len(body)), **headers}.items():
        handler.send_header(k.replace("_", "-"), v)
    handler.end_headers()
    handler.wfile.write(body)


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_compression_bomb_stays_under_twice_the_cap(tmp_path, monkeypatch, encoding):
    cap = 1024 * 1024
    inflated = b"\0" * (64 * cap)
    body = (
        gzip.compress(inflated, 9) if encoding == "gzip" else zstandard.ZstdCompressor(19).compress(inflated)
    )
    server = Reply(lambda h: _send(h, body, Content_Type="image/png", Content_Encoding=encoding))
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    monkeypatch.setattr(remote, "MAX_BYTES", cap)
    del inflated
    tracemalloc.start()
    try:
        with pytest.raises(remote.FetchError) as e:
            remote.fetch(f"{server.url}/bomb.png", tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        server.close()
    assert peak < 2 * cap, f"{peak:,} bytes at peak"
    assert "-encoded after being asked for identity" in str(e.value)
    assert (
        localize(e.value.message, "zh")
        == f"服务器在要求不压缩后仍以 {encoding} 压缩返回；压缩的回复不会被解压"
    )
    assert not any((tmp_path / ".remote").glob("*"))


def test_a_trickling_server_is_cut_at_the_deadline(tmp_path, monkeypatch):
    def trickle(h) -> None:
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        for _ in range(100000):
            h.wfile.write(b"\0")
            h.wfile.flush()
            time.sleep(0.05)

    server = Reply(trickle)
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    monkeypatch.setattr(remote, "DEADLINE_S", 0.5)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            remote.fetch(f"{server.url}/slow.png", tmp_path)
        except BaseException as e:  # handed to the test thread
            outcome.append(e)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)  # each read of the trickle is quick: only a deadline for the whole fetch ends it
    try:
        assert not worker.is_alive(), "the fetch was still reading the trickle"
        (error,) = outcome
        assert isinstance(error, remote.FetchError) and "took longer than 0.5 s" in str(error)
        assert localize(error.message, "zh") == "超过 0.5 秒（整次获取共用一个时限）"
    finally:
        server.close()


def test_only_a_body_that_decodes_as_an_image_is_kept(tmp_path, monkeypatch):
    page = b"<html><script>alert(1)</script></html>"
    server = Reply(lambda h: _send(h, page, Content_Type="image/png"))
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    try:
        with pytest.raises(remote.FetchError) as e:
            remote.fetch(f"{server.url}/evil.png", tmp_path)
    finally:
        server.close()
    assert "not an image the VL processor accepts" in str(e.value)
    assert (
        localize(e.value.message, "zh")
        == "返回内容不是 VL 处理器接受的图片（不是可读取的图片（格式未知或不是图片））"
    )
    assert not any((tmp_path / ".remote").glob("*"))


def test_urls_and_bytes_per_dataset_are_capped(tmp_path, monkeypatch):
    png = picture((200, 20, 20))
    host = ImageHost({f"/{n}.png": (png, "image/png") for n in "abc"})
    urls = [f"{host.url}/{n}.png" for n in "abc"]
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    monkeypatch.setattr(remote, "MAX_URLS", 2)
    try:
        with pytest.raises(remote.FetchError) as e:
            remote.fetch_all(urls, tmp_path)
        assert "names 3 image URLs; at most 2 are fetched per dataset" in str(e.value) and host.hits == []
        monkeypatch.setattr(remote, "MAX_URLS", 10)
        monkeypatch.setattr(remote, "MAX_DATASET_BYTES", len(png))
        seen: list[tuple[int, int, int]] = []
        failed = remote.fetch_all(urls, tmp_path, lambda *p: seen.append(p))
        # a body refused as too large still counts against the dataset's bytes
        monkeypatch.setattr(remote, "MAX_BYTES", 100)
        budget = remote.DatasetBudget()
        with pytest.raises(remote.FetchError, match="larger than 100 bytes"):
            remote.fetch(urls[2], tmp_path / "again", budget)
        assert budget.bytes > 100 and budget.urls == 1
    finally:
        host.close()
    assert list(failed) == urls[1:] and host.hits == ["/a.png", "/c.png"]
    assert all(f"already fetched {len(png):,} bytes of images" in why for why in failed.values())
    assert seen == [(1, 3, len(png)), (2, 3, len(png)), (3, 3, len(png))]


def test_a_fetch_whose_job_is_gone_stops(image_server, tmp_path, monkeypatch):
    base, _, hits = image_server
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    with pytest.raises(remote.FetchError) as e:
        remote.fetch_all([f"{base}/red.png", f"{base}/nope.png"], tmp_path, lambda *_: False)
    assert "stopped after 1 of 2 URLs" in str(e.value) and hits == ["/red.png"]


# ---- the animation probe (issue 27, item 5) -----------------------------------------------------------------
def canvas_bomb(width: int = 10_000, height: int = 10_000, frames: int = 4) -> bytes:
    """A GIF whose header declares a ``width`` x ``height`` canvas, holding ``frames`` one-pixel frames."""
    out = b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0)
    for _ in range(frames):
        out += b"\x21\xf9\x04\x04" + struct.pack("<H", 10) + b"\x00\x00"  # graphic control: 100 ms
        out += b"\x2c" + struct.pack("<HHHHB", 0, 0, 1, 1, 0x80)  # a 1x1 frame with 2 local colours
        out += b"\x00\x00\x00\xff\xff\xff" + b"\x02\x02\x44\x01\x00"
    return out + b"\x3b"


PROBE = """
import resource, sys, time
from pathlib import Path
from PIL import ImageFile
from engine.data.formats_vl import probe_video
decoded = []
load = ImageFile.ImageFile.load
ImageFile.ImageFile.load = lambda self: decoded.append(1) or load(self)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cpu = time.process_time()
try:
    print(probe_video(Path(sys.argv[1])))
except Exception as e:
    print(type(e).__name__, e)
cpu = time.process_time() - cpu
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, len(decoded), round(cpu * 1000))
"""


def test_a_gif_canvas_bomb_is_refused_from_its_header(tmp_path):
    gif = tmp_path / "bomb.gif"
    gif.write_bytes(canvas_bomb())
    assert len(gif.read_bytes()) == 130
    with pytest.raises(VisionInputError) as e:
        probe_video(gif)
    assert "10000x10000 pixels (100,000,000) is more than max_image_pixels=64,000,000" in str(e.value)
    # peak memory of a fresh process, and whether any frame was decoded on the way to the refusal
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", PROBE, str(gif)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    grown, decoded, cpu_ms = map(int, out[-1].split())
    assert out[0].startswith("VisionInputError") and decoded == 0
    assert grown < 50 * 1024 * 1024, f"{grown:,} bytes"
    # the process's CPU time for the refusal (not wall-clock): about 10 ms measured; seeking through the
    # frames first took 2 s and 914 MB
    assert cpu_ms < 100, f"{cpu_ms} ms of CPU"


def test_an_animation_within_the_limits_is_probed_without_decoding_a_frame(tmp_path):
    """40 one-pixel frames on a 16 MP canvas: seeking would compose each on the canvas; the frame count and
    timing come from the blocks instead."""
    gif = tmp_path / "big_canvas.gif"
    gif.write_bytes(canvas_bomb(4000, 4000, 40))
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", PROBE, str(gif)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    grown, decoded, _ = map(int, out[-1].split())
    assert "num_frames=40, width=4000, height=4000, fps=10.0" in out[0] and decoded == 0
    assert grown < 50 * 1024 * 1024, f"{grown:,} bytes"


# ---- https: the certificate is checked for the name while the connection goes to the checked address -------
@pytest.fixture
def tls(tmp_path, monkeypatch):
    """A CA trusted for record URLs in this test, and a server certificate for images.example only."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder().subject_name(name("test CA")).issuer_name(name("test CA"))
        .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder().subject_name(name("images.example")).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(2).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("images.example")]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = tmp_path / "server.pem"
    pem.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    trusted = ssl.create_default_context(cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    monkeypatch.setattr(remote, "tls_context", lambda: trusted)
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(pem)
    return server_side


def https_image_server(server_side, png: bytes):
    """A loopback HTTPS server answering ``png``; returns it and the (SNI, Host) of each request."""
    seen: list[tuple[str | None, str]] = []
    sni: list[str | None] = []
    server_side.sni_callback = lambda sock, name, ctx: sni.append(name)

    def answer(h) -> None:
        seen.append((sni[-1] if sni else None, h.headers.get("Host", "")))
        _send(h, png, Content_Type="image/png")

    server = Reply(answer)
    server.server.socket = server_side.wrap_socket(server.server.socket, server_side=True)
    return server, seen


def test_https_is_verified_for_the_name_on_the_checked_address(tmp_path, dns, tls, monkeypatch):
    png = picture((200, 200, 20))
    server, seen = https_image_server(tls, png)
    port = server.server.server_address[1]
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    dns.answers["images.example"] = [["127.0.0.1"]]
    dns.answers["other.example"] = [["127.0.0.1"]]
    try:
        path = remote.fetch(f"https://images.example:{port}/a.png", tmp_path)
        with pytest.raises(remote.FetchError) as e:  # the certificate names images.example only
            remote.fetch(f"https://other.example:{port}/a.png", tmp_path)
    finally:
        server.close()
    assert path.read_bytes() == png and seen == [("images.example", f"images.example:{port}")]
    assert "CERTIFICATE_VERIFY_FAILED" in str(e.value) or "certificate" in str(e.value).lower()


class ConnectProxy:
    """A loopback HTTP CONNECT proxy that records each CONNECT target and then relays bytes both ways."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.targets: list[str] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._tunnel, args=(client,), daemon=True).start()

    def _tunnel(self, client: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            head += client.recv(4096)
        target = head.split(b" ")[1].decode()
        self.targets.append(target)
        host, port = target.rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)))
        client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")

        def pipe(a: socket.socket, b: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := a.recv(65536):
                    b.sendall(data)
            with contextlib.suppress(OSError):
                b.shutdown(socket.SHUT_WR)

        threading.Thread(target=pipe, args=(upstream, client), daemon=True).start()
        pipe(client, upstream)

    def close(self) -> None:
        self.sock.close()


def test_https_through_the_operators_proxy_tunnels_to_the_checked_address(tmp_path, dns, tls, monkeypatch):
    png = picture((20, 200, 200))
    server, seen = https_image_server(tls, png)
    port = server.server.server_address[1]
    proxy = ConnectProxy()
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_URLS", "any")
    monkeypatch.setenv("ERNIE_STUDIO_MEDIA_PROXY", proxy.url)
    dns.answers["images.example"] = [["127.0.0.1"]]
    try:
        path = remote.fetch(f"https://images.example:{port}/a.png", tmp_path)
    finally:
        server.close()
        proxy.close()
    assert path.read_bytes() == png and proxy.targets == [f"127.0.0.1:{port}"]
    assert seen == [("images.example", f"images.example:{port}")]
