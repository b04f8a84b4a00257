"""Images named by URL in VL records (ERNIEKit's demo data names them so): fetched once into the dataset.

A fetched file lands in ``<dataset dir>/.remote/`` under a name made from the URL, so later reads (the
batches, a resumed run, the preview) find it there and never fetch again. Only http(s) is fetched, and only a
body that decodes as an image the VL processor accepts is kept. Record data names the URLs, so by default only
public addresses are fetched (a dataset must not make a worker reach into its own network);
``ERNIE_STUDIO_MEDIA_URLS`` chooses: ``public`` (default), ``any`` (also private addresses, e.g. an internal
image store) or ``off`` (nothing is fetched).

How one fetch is made safe (docs/deploy.md, "Security"):
- the host is encoded once (IDNA 2008 with UTS 46 mapping) and that one ASCII name is resolved, checked,
  sent as Host and SNI;
- it is resolved once, every address is checked, and the connection goes to the first checked address
  (``_PinnedBackend``): a second lookup that answers differently (DNS rebinding) is never made;
- no proxy from the environment (``HTTP_PROXY`` and the like are not read), no redirects;
- ``Accept-Encoding: identity`` and the raw body is counted, so no compressed reply is inflated in memory;
- one deadline for the whole fetch (connect, TLS, every read), so a trickling server is cut;
- at most ``MAX_URLS`` new fetches and ``MAX_DATASET_BYTES`` per dataset.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import socket
import ssl
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import certifi
import httpcore
import idna

from engine.data.messages import MEDIA
from engine.data.vl_processor import VisionInputError, load_image
from engine.messages import Word

CACHE_DIR = ".remote"
MAX_BYTES = 64 * 1024 * 1024  # one file
DEADLINE_S = 60.0  # one fetch, from the connection to the last byte
CONNECT_TIMEOUT_S = 10.0
MAX_URLS = 10_000  # new fetches per dataset
MAX_DATASET_BYTES = 4 * 1024**3  # bytes fetched per dataset
CHUNK = 64 * 1024
POLICIES = ("public", "any", "off")
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff"}

# Addresses that carry another address (IPv4 in IPv6, tunnels): the embedded address may be a private one,
# and whether a gateway forwards them is the network's business, so they are refused whatever they embed.
TRANSLATION_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "64:ff9b::/96",  # NAT64 (RFC 6052)
        "64:ff9b:1::/48",  # local-use NAT64 (RFC 8215)
        "2002::/16",  # 6to4 (RFC 3056)
        "2001::/32",  # Teredo (RFC 4380)
        "::ffff:0:0/96",  # IPv4-mapped
        "::/96",  # IPv4-compatible (deprecated), ::127.0.0.1 among them
        "::ffff:0:0:0/96",  # IPv4-translated (RFC 2765)
    )
)
# Non-global ranges Python's ``is_global`` has let through in some versions; checked explicitly.
NOT_PUBLIC_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.88.99.0/24",  # 6to4 relay anycast
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "::/128",
        "::1/128",
        "100::/64",
        "2001:db8::/32",
        "fc00::/7",
        "fe80::/10",
        "fec0::/10",
        "ff00::/8",
    )
)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class FetchError(ValueError):
    """A URL that could not be fetched; the message says why and what to do."""

    @property
    def message(self) -> str:
        """Why, as it was raised (a keyed ``Message`` where ``engine.data.messages`` has one)."""
        return self.args[0] if self.args and isinstance(self.args[0], str) else str(self)


def policy() -> str:
    value = os.environ.get("ERNIE_STUDIO_MEDIA_URLS", "public").strip().lower()
    if value not in POLICIES:
        raise FetchError(f"ERNIE_STUDIO_MEDIA_URLS={value!r}: use one of {', '.join(POLICIES)}")
    return value


def proxy() -> httpcore.URL | None:
    """The proxy the operator set for record URLs (``ERNIE_STUDIO_MEDIA_PROXY``, an ``http://host:port``
    URL); None when unset. Proxies in ``HTTP_PROXY`` and the like are never used."""
    value = os.environ.get("ERNIE_STUDIO_MEDIA_PROXY", "").strip()
    if not value:
        return None
    parts = urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme != "http" or not parts.hostname or port == -1 or parts.path not in ("", "/"):
        raise FetchError(
            f"ERNIE_STUDIO_MEDIA_PROXY={value!r}: give the proxy as http://host:port (an HTTP proxy; https "
            "record URLs go through it with CONNECT)"
        )
    if parts.username or parts.password:
        raise FetchError(
            "ERNIE_STUDIO_MEDIA_PROXY: credentials in the proxy URL are not supported; allow the workers' "
            "addresses at the proxy instead"
        )
    return httpcore.URL(scheme=b"http", host=parts.hostname.encode("idna"), port=port or 80, target=b"/")


def cached_path(url: str, base_dir: Path) -> Path:
    """Where the file of ``url`` is kept inside the dataset directory."""
    suffix = Path(urlsplit(url).path).suffix.lower()
    suffix = suffix if suffix in IMAGE_SUFFIXES else ""
    return base_dir / CACHE_DIR / (hashlib.sha256(url.encode()).hexdigest()[:32] + suffix)


def cached(url: str, base_dir: Path) -> Path | None:
    """The kept copy of ``url`` when it has been fetched; never fetches."""
    target = cached_path(url, base_dir)
    return target if target.is_file() else None


def ascii_host(host: str) -> str:
    """The one ASCII form of a URL's host, used for the address check, the connection, Host and SNI.

    Non-ASCII names are encoded by IDNA 2008 with UTS 46 mapping (``ß.example`` is ``xn--zca.example``, not
    IDNA 2003's ``ss.example``); a name that does not encode is refused.
    """
    host = host.rstrip(".").lower() if host.isascii() else host.rstrip(".")
    if host.isascii():
        return host
    try:
        return idna.encode(host, uts46=True).decode("ascii")
    except idna.IDNAError as e:
        raise FetchError(f"host {host!r} is not a valid internationalised domain name ({e})") from None


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` (ASCII) resolves to, in the resolver's order; the one lookup a fetch makes."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise FetchError(MEDIA("cannot_resolve", host=host, why=why)) from None
    addresses: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise FetchError(MEDIA("no_address", host=host))
    return addresses


def address_kind(address: IPAddress) -> str | None:
    """Why ``address`` is not a public one ("loopback", "translation or tunnelling", "private or reserved"),
    or None when it is."""
    if any(address in n for n in TRANSLATION_NETWORKS if n.version == address.version):
        embedded = getattr(address, "ipv4_mapped", None)
        if embedded is not None and embedded.is_loopback:
            return "loopback"
        return "translation or tunnelling"
    if address.is_loopback:
        return "loopback"
    if any(address in n for n in NOT_PUBLIC_NETWORKS if n.version == address.version):
        return "private or reserved"
    if not address.is_global or address.is_multicast or address.is_reserved or address.is_unspecified:
        return "private or reserved"
    return None


def check_addresses(host: str, addresses: Iterable[IPAddress]) -> None:
    """Refuse the host when any address it resolves to is not public."""
    for address in addresses:
        kind = address_kind(address)
        if kind is not None:
            raise FetchError(MEDIA("not_public", host=host, kind=Word(kind), address=str(address)))


@dataclass
class DatasetBudget:
    """What one dataset may still fetch: ``MAX_URLS`` new files and ``MAX_DATASET_BYTES`` bytes."""

    urls: int = 0
    bytes: int = 0

    def take_url(self) -> None:
        if self.urls >= MAX_URLS:
            raise FetchError(
                f"the dataset already fetched {MAX_URLS:,} image URLs, the most one dataset may fetch; "
                "save the images next to the data file (a .zip upload keeps them)"
            )
        self.urls += 1

    def allowance(self) -> int:
        """How many bytes the next file may have."""
        left = MAX_DATASET_BYTES - self.bytes
        if left <= 0:
            raise FetchError(
                f"the dataset already fetched {MAX_DATASET_BYTES:,} bytes of images, the most one dataset may "
                "fetch; save the images next to the data file (a .zip upload keeps them)"
            )
        return min(MAX_BYTES, left)


# The budgets of datasets fetched lazily in this process (a training run reading records); the studio's
# fetch job passes its own.
_budgets: dict[Path, DatasetBudget] = {}


def fetch(url: str, base_dir: Path, budget: DatasetBudget | None = None) -> Path:
    """The local copy of ``url`` inside ``base_dir`` (fetched now if it is not there yet)."""
    target = cached_path(url, base_dir)
    if target.is_file():
        return target
    mode = policy()
    if mode == "off":
        raise FetchError(MEDIA("urls_off"))
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError("only http(s) URLs are fetched")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise FetchError("the URL's port is not a number between 0 and 65535") from None
    host = ascii_host(parts.hostname)
    budget = budget if budget is not None else _budgets.setdefault(base_dir, DatasetBudget())
    budget.take_url()
    limit = budget.allowance()
    addresses = resolve(host, port)
    if mode == "public":
        check_addresses(host, addresses)
    target.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own: the studio's fetch job and a run may fetch the same URL at once.
    partial = target.with_name(f"{target.name}.{uuid.uuid4().hex[:8]}.part")
    try:
        _download(parts.scheme, host, port, _target(parts), addresses[0], partial, limit, budget)
        _check_image(partial)
        partial.replace(target)  # only a complete image ever has the final name
    finally:
        partial.unlink(missing_ok=True)
    return target


def fetch_all(
    urls: Iterable[str],
    base_dir: Path,
    progress: Callable[[int, int, int], Any] | None = None,
) -> dict[str, str]:
    """Fetch every URL not kept yet into ``base_dir`` under one dataset budget; returns {url: why} of the
    ones that failed. ``progress(done, total, bytes)`` is called after each URL; when it returns False
    (the job was deleted or taken over) the fetch stops."""
    unique = list(dict.fromkeys(urls))
    if len(unique) > MAX_URLS:
        raise FetchError(
            f"the dataset names {len(unique):,} image URLs; at most {MAX_URLS:,} are fetched per dataset: "
            "save the images next to the data file (a .zip upload keeps them)"
        )
    budget = DatasetBudget()
    failed: dict[str, str] = {}
    for i, url in enumerate(unique, 1):
        try:
            fetch(url, base_dir, budget)
        except FetchError as e:
            failed[url] = e.message
        if progress is not None and progress(i, len(unique), budget.bytes) is False:
            raise FetchError(f"stopped after {i} of {len(unique)} URLs")
    return failed


def _target(parts: Any) -> bytes:
    """The request target (path and query) as it goes on the wire: ASCII, percent-encoded."""
    path = quote(parts.path or "/", safe="/%:@!$&'()*+,;=-._~")
    query = quote(parts.query, safe="/%:@!$&'()*+,;=-._~?") if parts.query else ""
    return (path + ("?" + query if query else "")).encode("ascii")


def _check_image(path: Path) -> None:
    """Keep only what decodes as an image the VL processor accepts (header checks first, then the pixels)."""
    try:
        load_image(path)
    except VisionInputError as e:
        raise FetchError(
            MEDIA("not_accepted", msg_why=e.unlabelled(MEDIA("image_file", path=str(path))))
        ) from None


def tls_context() -> ssl.SSLContext:
    """The TLS settings of https record URLs: certificates verified against certifi's roots for the URL's
    name (httpcore's own default)."""
    return ssl.create_default_context(cafile=certifi.where())


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read, write and TLS handshake waits at most until one deadline."""

    def __init__(self, inner: httpcore.NetworkStream, deadline: float, sni: str | None = None) -> None:
        self.inner, self.deadline, self.sni = inner, deadline, sni

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ReadTimeout("deadline")
        return left

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.inner.read(max_bytes, self._left())

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.inner.write(buffer, self._left())

    def close(self) -> None:
        self.inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        # Through a proxy the request names the checked address, so TLS is told the name (SNI, certificate).
        name = self.sni or server_hostname
        return _DeadlineStream(self.inner.start_tls(ssl_context, name, self._left()), self.deadline)

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


@dataclass
class _PinnedBackend(httpcore.NetworkBackend):
    """Connects to the one checked address whatever host the request names (so Host and SNI keep the name);
    with the operator's proxy (``address`` None) it connects to the proxy, and ``sni`` names the host for TLS
    inside the tunnel."""

    address: IPAddress | None
    deadline: float
    sni: str | None = None
    inner: httpcore.NetworkBackend = field(default_factory=httpcore.SyncBackend)

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ConnectTimeout("deadline")
        target = host if self.address is None else str(self.address)
        stream = self.inner.connect_tcp(
            target, port, min(CONNECT_TIMEOUT_S, left), local_address, socket_options
        )
        return _DeadlineStream(stream, self.deadline, self.sni)

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:
        raise httpcore.ConnectError("record URLs are fetched over TCP only")

    def sleep(self, seconds: float) -> None:
        self.inner.sleep(seconds)


def _download(
    scheme: str,
    host: str,
    port: int,
    target: bytes,
    address: IPAddress,
    partial: Path,
    limit: int,
    budget: DatasetBudget,
) -> None:
    """GET the URL from ``address`` into ``partial``. The raw body is counted, into ``budget`` too, whether
    it is kept or not (``identity`` asked, nothing decoded); redirects are not followed (they could lead past
    the address check), and the whole exchange shares one deadline."""
    deadline = time.monotonic() + DEADLINE_S
    via = proxy()
    # Through the operator's proxy the request names the checked address itself (the proxy must not resolve
    # the name again), with the name in Host and, inside a CONNECT tunnel, in SNI.
    url = httpcore.URL(
        scheme=scheme.encode(),
        host=(host if via is None else f"[{address}]" if address.version == 6 else str(address)).encode(
            "ascii"
        ),
        port=port,
        target=target,
    )
    backend = _PinnedBackend(address, deadline) if via is None else _PinnedBackend(None, deadline, sni=host)
    name = f"[{host}]" if ":" in host else host  # an IPv6 literal
    default = port == (443 if scheme == "https" else 80)
    headers = [
        (b"Host", (name if default else f"{name}:{port}").encode("ascii")),
        (b"Accept", b"image/*"),
        (b"Accept-Encoding", b"identity"),
        (b"User-Agent", b"ernie-studio"),
    ]
    try:
        with (
            httpcore.ConnectionPool(
                max_connections=1,
                retries=0,
                network_backend=backend,
                ssl_context=tls_context(),
                proxy=None if via is None else httpcore.Proxy(url=via),
            ) as pool,
            pool.stream("GET", url, headers=headers) as r,
        ):
            if r.status != 200:
                reason = r.extensions.get("reason_phrase", b"").decode("ascii", "replace")
                answered = (
                    MEDIA("server_answered", code=r.status, reason=reason.rstrip())
                    if reason.rstrip()
                    else MEDIA("server_answered_code", code=r.status)
                )
                raise FetchError(answered)
            encoding = dict((k.lower(), v) for k, v in r.headers).get(b"content-encoding", b"identity")
            if encoding.strip().lower() not in (b"identity", b""):
                raise FetchError(MEDIA("encoded", encoding=encoding.decode("ascii", "replace")))
            size = 0
            with partial.open("wb") as f:
                for chunk in r.iter_stream():
                    size += len(chunk)
                    budget.bytes += len(chunk)
                    if size > limit:
                        raise FetchError(MEDIA("larger_than", limit=limit))
                    f.write(chunk)
    except httpcore.TimeoutException:
        if time.monotonic() >= deadline:
            raise FetchError(MEDIA("took_longer", seconds=DEADLINE_S)) from None
        raise FetchError("timed out connecting; does this worker have network access?") from None
    except (
        httpcore.NetworkError,
        httpcore.ProtocolError,
        httpcore.UnsupportedProtocol,
        ssl.SSLError,
        OSError,
    ) as e:
        raise FetchError(f"{e.__class__.__name__}: {e}; does this worker have network access?") from None
