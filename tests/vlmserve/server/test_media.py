"""Media fetch rules: data: URLs, file:// under the allowed dir, SSRF address checks,
redirect re-checks, byte cap and timeout. All traffic stays on 127.0.0.1: a private
or public address is refused by the check before any connection is attempted."""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from encoders.errors import ImageDecodeError, ImageTooLargeError
from vlmserve.server.media import (
    MediaError,
    MediaPolicy,
    MediaTimeoutError,
    MediaTooLargeError,
    can_use_address,
    can_use_host,
    check_image_header,
    file_url,
    ip_literal,
    load_media,
    resolve_checked,
)

LOOPBACK_ONLY = {"allowed_networks": ("127.0.0.1/32",), "allow_http": True, "timeout_s": 2.0}


def png_bytes(width: int = 8, height: int = 6) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


class ImageHost:
    """A loopback HTTP server with the paths the tests need; counts its hits."""

    def __init__(self, bind: str = "127.0.0.1") -> None:
        host = self
        self.hits: list[str] = []
        self.image = png_bytes()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # http.server names it so
                host.hits.append(self.path)
                route, _, arg = self.path.partition("?")
                if route == "/img.png":
                    self._send(200, host.image)
                elif route == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", arg)
                    self.end_headers()
                elif route == "/slow":
                    time.sleep(float(arg))
                    self._send(200, host.image)
                elif route == "/big-declared":
                    self._send(200, b"x" * 5000)
                elif route == "/big-chunked":
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for _ in range(10):
                        self.wfile.write(b"200\r\n" + b"y" * 0x200 + b"\r\n")
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self._send(404, b"no")

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer((bind, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def image_host():
    host = ImageHost()
    yield host
    host.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fetch(url: str, **policy) -> bytes:
    return asyncio.run(load_media(url, MediaPolicy(**policy)))


# --- data: and file:// ------------------------------------------------------------------


def test_data_url_round_trips_and_bad_payloads_are_400():
    data = png_bytes()
    assert fetch("data:image/png;base64," + base64.b64encode(data).decode()) == data
    with pytest.raises(MediaError, match="not valid base64"):
        fetch("data:image/png;base64,@@@not-base64@@@")
    with pytest.raises(MediaError, match="data:<type>;base64"):
        fetch("data:image/png,rawbytes")
    with pytest.raises(MediaTooLargeError) as info:
        fetch("data:image/png;base64," + "A" * 4000, max_bytes=1000)
    assert info.value.status == 413


def test_file_urls_only_under_the_allowed_dir(tmp_path):
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "a.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(b"secret")
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    root = str(allowed)
    assert fetch(file_url(allowed / "sub" / "a.png"), allowed_local_dir=root) == png_bytes()
    for url in (
        file_url(tmp_path / "secret.png"),
        f"file://{allowed}/sub/../../secret.png",  # `..` out of the root
        file_url(allowed / "link.png"),  # a symlink pointing out of the root
    ):
        with pytest.raises(MediaError, match="outside the allowed media path") as info:
            fetch(url, allowed_local_dir=root)
        assert "secret.png" not in str(info.value) or "link.png" not in url  # never the target
    with pytest.raises(MediaError, match="disabled"):
        fetch(file_url(allowed / "sub" / "a.png"))
    with pytest.raises(MediaError, match="must not name a host"):
        fetch(f"file://otherhost{allowed}/sub/a.png", allowed_local_dir=root)
    with pytest.raises(MediaError, match="cannot read"):
        fetch(file_url(allowed / "missing.png"), allowed_local_dir=root)


def test_unknown_and_plain_http_schemes_are_refused_by_default():
    for url in ("ftp://example.com/a.png", "http://example.com/a.png", "gopher://x", "a.png"):
        with pytest.raises(MediaError, match="scheme"):
            fetch(url)


# --- address and host rules ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "usable"),
    [
        ("8.8.8.8", True),
        ("2606:4700::1111", True),
        ("127.0.0.1", False),
        ("127.5.5.5", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.1.1", False),
        ("169.254.169.254", False),  # cloud metadata
        ("100.64.0.1", False),  # carrier-grade NAT
        ("0.0.0.0", False),
        ("224.0.0.1", False),
        ("::1", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped loopback
        ("::", False),
        ("::127.0.0.1", False),  # IPv4-compatible loopback
        ("::ffff:10.0.0.1", False),
        ("64:ff9b::7f00:1", False),  # NAT64 of 127.0.0.1
        ("64:ff9b::a9fe:a9fe", False),  # NAT64 of 169.254.169.254
        ("64:ff9b::808:808", True),  # NAT64 of 8.8.8.8
        ("2002:7f00:1::1", False),  # 6to4 of 127.0.0.1
        ("2002:c0a8:101::1", False),  # 6to4 of 192.168.1.1
    ],
)
def test_only_public_addresses_are_usable_by_default(address, usable):
    assert can_use_address(ipaddress.ip_address(address), MediaPolicy()) is usable


def test_allowed_networks_exempt_only_themselves():
    policy = MediaPolicy(allowed_networks=("127.0.0.1/32", "10.0.0.0/8"))
    assert can_use_address(ipaddress.ip_address("127.0.0.1"), policy)
    assert can_use_address(ipaddress.ip_address("10.9.9.9"), policy)
    assert not can_use_address(ipaddress.ip_address("127.0.0.2"), policy)
    assert not can_use_address(ipaddress.ip_address("192.168.0.1"), policy)
    with pytest.raises(ValueError, match="not-a-net"):
        MediaPolicy(allowed_networks=("not-a-net",))


def test_domain_allow_list_matches_the_domain_and_its_subdomains():
    policy = MediaPolicy(allowed_domains=("Example.com",))
    assert can_use_host("example.com", policy)
    assert can_use_host("img.cdn.example.com.", policy)
    assert not can_use_host("evilexample.com", policy)
    assert not can_use_host("example.com.evil.net", policy)
    assert can_use_host("anything.org", MediaPolicy())


def test_host_outside_the_allow_list_is_refused_before_any_dns_lookup(monkeypatch):
    async def no_dns(*args, **kwargs):
        raise AssertionError("a DNS lookup was attempted")

    async def run() -> None:
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", no_dns)
        with pytest.raises(MediaError, match="allow-list"):
            await load_media("https://evil.example/x.png", MediaPolicy(allowed_domains=("ok.org",)))

    asyncio.run(run())


@pytest.mark.parametrize(
    "url",
    [
        "https://127.0.0.1:{port}/img.png",
        "https://[::1]:{port}/img.png",
        "https://10.20.30.40/img.png",
        "https://169.254.169.254/latest/meta-data",
        "https://[::ffff:127.0.0.1]:{port}/img.png",
    ],
)
def test_private_addresses_are_refused_before_connecting(url, image_host):
    before = len(image_host.hits)
    with pytest.raises(MediaError, match="non-public address"):
        fetch(url.format(port=image_host.port))
    assert len(image_host.hits) == before


def test_resolve_checked_returns_the_checked_literal():
    policy = MediaPolicy(allowed_networks=("127.0.0.1/32",))
    ip = asyncio.run(resolve_checked("127.0.0.1", 80, policy))
    assert str(ip) == "127.0.0.1"


# --- fetching over loopback (explicitly allowed) ------------------------------------------


def test_fetch_from_an_allowed_loopback_host(image_host):
    assert fetch(image_host.url("/img.png"), **LOOPBACK_ONLY) == image_host.image
    redirect = image_host.url("/redirect?" + image_host.url("/img.png"))
    assert fetch(redirect, **LOOPBACK_ONLY) == image_host.image


def test_each_redirect_hop_is_checked_again(image_host):
    before = len(image_host.hits)
    with pytest.raises(MediaError, match="non-public address"):
        fetch(image_host.url("/redirect?http://10.0.0.1/img.png"), **LOOPBACK_ONLY)
    with pytest.raises(MediaError, match="allow-list"):
        fetch(
            image_host.url("/redirect?http://localhost/img.png"),
            allowed_domains=("127.0.0.1",), **LOOPBACK_ONLY,
        )  # fmt: skip
    with pytest.raises(MediaError, match="redirect to a 'ftp' URL"):
        fetch(image_host.url("/redirect?ftp://127.0.0.1/img.png"), **LOOPBACK_ONLY)
    assert len(image_host.hits) == before + 3  # only the first hops reached the host
    hop = image_host.url("/redirect?" + image_host.url("/img.png"))
    with pytest.raises(MediaError, match="more than 0 redirects"):
        fetch(hop, max_redirects=0, **LOOPBACK_ONLY)


def test_byte_cap_on_declared_and_streamed_length(image_host):
    with pytest.raises(MediaTooLargeError, match="5000 bytes"):
        fetch(image_host.url("/big-declared"), max_bytes=1000, **LOOPBACK_ONLY)
    with pytest.raises(MediaTooLargeError, match="over the cap of 1000"):
        fetch(image_host.url("/big-chunked"), max_bytes=1000, **LOOPBACK_ONLY)


def test_timeout_is_504_and_errors_name_the_url(image_host):
    policy = {**LOOPBACK_ONLY, "timeout_s": 0.3}
    with pytest.raises(MediaTimeoutError) as info:
        fetch(image_host.url("/slow?1.5"), **policy)
    assert info.value.status == 504
    with pytest.raises(MediaError, match="HTTP 404"):
        fetch(image_host.url("/nothing"), **LOOPBACK_ONLY)
    with pytest.raises(MediaError, match="cannot fetch"):
        fetch(f"http://127.0.0.1:{closed_port()}/img.png", **LOOPBACK_ONLY)


# --- header check --------------------------------------------------------------------------


def test_image_header_check_reads_size_and_refuses_non_images():
    assert check_image_header(png_bytes(30, 20), max_pixels=10_000) == (30, 20)
    with pytest.raises(ImageTooLargeError) as info:
        check_image_header(png_bytes(200, 100), max_pixels=10_000)
    assert info.value.status == 413
    with pytest.raises(ImageDecodeError):
        check_image_header(b"GIF89a but not really", max_pixels=10_000)
    with pytest.raises(ImageDecodeError, match="empty"):
        check_image_header(b"", max_pixels=10_000)


# --- SSRF probes: each refused by default, before any connection or DNS lookup ------------

NUMERIC_LOOPBACK = ["2130706433", "0x7f.1", "017700000001", "127.1", "0x7f000001", "0177.0.0.1",
                    "127.0.0.1.", "0"]  # fmt: skip


@pytest.mark.parametrize("host", NUMERIC_LOOPBACK)
def test_decimal_octal_and_hex_spellings_are_the_address_they_spell(host, image_host, monkeypatch):
    assert ip_literal(host) in (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("0.0.0.0"))

    async def no_dns(*args, **kwargs):
        raise AssertionError("a numeric host went to DNS")

    async def run() -> None:
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", no_dns)
        with pytest.raises(MediaError, match="non-public address"):
            await load_media(f"https://{host}:{image_host.port}/img.png", MediaPolicy())
        with pytest.raises(MediaError, match="non-public address"):
            await load_media(f"http://{host}:{image_host.port}/img.png",
                             MediaPolicy(allow_http=True))  # fmt: skip

    before = len(image_host.hits)
    asyncio.run(run())
    assert len(image_host.hits) == before


def test_numeric_spellings_of_an_allowed_address_still_reach_it(image_host):
    """The spelling is read as the address (so the allow-list applies to it, not a name)."""
    url = f"http://2130706433:{image_host.port}/img.png"
    assert fetch(url, **LOOPBACK_ONLY) == image_host.image
    with pytest.raises(MediaError, match="not a valid address"):
        fetch("https://0x1ffffffff/img.png")


@pytest.mark.parametrize(
    "host",
    ["[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[::127.0.0.1]", "[64:ff9b::7f00:1]",
     "[2002:7f00:1::1]", "[::1]", "[fe80::1%25lo]", "169.254.169.254", "100.100.100.200",
     "10.0.0.1", "192.168.0.1", "[fd00::1]", "0.0.0.0"],
)  # fmt: skip
def test_private_loopback_link_local_and_mapped_addresses_are_refused(host, image_host):
    before = len(image_host.hits)
    with pytest.raises(MediaError, match="non-public address"):
        fetch(f"https://{host}:{image_host.port}/img.png")
    assert len(image_host.hits) == before


def test_a_name_that_resolves_to_loopback_is_refused():
    """A real DNS answer (localhost -> 127.0.0.1 / ::1) is checked, not the name."""
    with pytest.raises(MediaError, match="non-public address"):
        fetch("https://localhost/img.png")
    with pytest.raises(MediaError, match="non-public address"):
        fetch("http://localhost/img.png", allow_http=True)


def test_a_redirect_chain_ending_on_loopback_is_refused(image_host):
    """Two allowed hops (127.0.0.1), then loopback outside the allowed network: the last
    host never sees a request, however its address is spelt."""
    other = ImageHost(bind="127.0.0.2")
    try:
        before = len(other.hits)
        for target in (f"http://127.0.0.2:{other.port}/img.png",
                       f"http://2130706434:{other.port}/img.png",
                       f"http://[::ffff:127.0.0.2]:{other.port}/img.png",
                       f"http://0x7f.0.0.2:{other.port}/img.png"):  # fmt: skip
            hop2 = image_host.url("/redirect?" + target)
            with pytest.raises(MediaError, match="non-public address"):
                fetch(image_host.url("/redirect?" + hop2), **LOOPBACK_ONLY)
        assert len(other.hits) == before
        direct = f"http://127.0.0.2:{other.port}/img.png"  # the peer is up: refusal is policy
        assert fetch(direct, allowed_networks=("127.0.0.2/32",), allow_http=True) == other.image
    finally:
        other.close()


def test_an_invalid_port_is_a_400():
    with pytest.raises(MediaError, match="invalid port"):
        fetch("https://8.8.8.8:99999/img.png")
