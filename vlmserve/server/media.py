"""Safe media fetch for `image_url`: `data:` base64, `https://` and allow-listed `file://`.

What must stay true for a remote URL (SSRF rules):
- the host passes the domain allow-list (when one is set) before any DNS lookup;
- a host written as a number in any spelling inet_aton takes (2130706433, 0x7f.1,
  017700000001, 127.1) is that IPv4 address, checked as one (no DNS lookup);
- every address the host resolves to is public (`ipaddress.is_global`, and so is every
  IPv4 address embedded in an IPv6 one: mapped, compatible, 6to4, NAT64, Teredo) unless
  it lies in an explicitly allowed network, and the connection goes to that checked
  address (the URL is pinned to the IP; Host header and TLS SNI keep the name), so a
  second DNS answer cannot swap in a private address;
- redirects are followed by hand, each hop checked like the first;
- a total deadline (504 when passed) and a byte cap (413), checked on Content-Length
  and again while streaming; no proxies from the environment.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import httpx

from encoders.errors import RequestError
from encoders.image_io import read_header

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class MediaError(RequestError):
    """A media URL that cannot be used: refused by policy, unreachable, bad payload."""


class MediaTooLargeError(MediaError):
    status = 413


class MediaTimeoutError(MediaError):
    status = 504


@dataclass(frozen=True)
class MediaPolicy:
    """What `image_url` may point to. The defaults refuse everything but public https
    hosts and `data:` URLs."""

    timeout_s: float = 10.0  # whole fetch, redirects included
    max_bytes: int = 20 << 20
    max_redirects: int = 3
    # Empty: any public host. "example.com" allows it and its subdomains.
    allowed_domains: tuple[str, ...] = ()
    # CIDRs exempt from the public-address rule, e.g. ("127.0.0.0/8",) for tests.
    allowed_networks: tuple[str, ...] = ()
    allow_http: bool = False
    allowed_local_dir: str | None = None  # file:// URLs must resolve under it
    max_image_pixels: int = 64_000_000

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")
        if self.max_bytes < 1:
            raise ValueError(f"max_bytes={self.max_bytes} must be >= 1")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects={self.max_redirects} must be >= 0")
        for net in self.allowed_networks:
            ipaddress.ip_network(net)  # ValueError names the bad network
        if self.allowed_local_dir is not None and not Path(self.allowed_local_dir).is_dir():
            raise ValueError(f"allowed local media path {self.allowed_local_dir!r} is not a dir")
        object.__setattr__(
            self, "allowed_domains", tuple(d.lower().strip(".") for d in self.allowed_domains)
        )


async def load_media(url: str, policy: MediaPolicy) -> bytes:
    """The bytes behind an `image_url`. Raises MediaError (400/413/504)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return parse_data_url(url, policy.max_bytes)
    if scheme == "file":
        return await asyncio.to_thread(read_local_file, url, policy)
    if scheme == "https" or (scheme == "http" and policy.allow_http):
        try:
            return await asyncio.wait_for(_fetch(url, policy), policy.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException) as e:
            raise MediaTimeoutError(f"fetching {url!r} took over {policy.timeout_s:g} s") from e
    allowed = "https, data" + (", http" if policy.allow_http else "")
    allowed += ", file" if policy.allowed_local_dir else ""
    raise MediaError(f"image URL scheme {scheme!r} is not allowed (allowed: {allowed})")


def parse_data_url(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise MediaError("a data: image URL must be data:<type>;base64,<payload>")
    if len(payload) * 3 // 4 > max_bytes:
        raise MediaTooLargeError(f"data: URL holds over {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"data: URL is not valid base64: {e}") from e


def read_local_file(url: str, policy: MediaPolicy) -> bytes:
    """file:// only under the allowed directory, after resolving links and `..`."""
    if policy.allowed_local_dir is None:
        raise MediaError("file:// image URLs are disabled (see --allowed-local-media-path)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"file:// URL must not name a host, got {parts.netloc!r}")
    root = Path(policy.allowed_local_dir).resolve()
    given = unquote(parts.path)
    path = Path(given).resolve()
    # Messages name the path as the client wrote it: the resolved one could reveal where
    # a link points on this machine.
    if not path.is_relative_to(root):
        raise MediaError(f"file {given!r} is outside the allowed media path")
    try:
        size = path.stat().st_size
        if size > policy.max_bytes:
            raise MediaTooLargeError(f"file is {size} bytes, over the cap of {policy.max_bytes}")
        return path.read_bytes()
    except OSError as e:
        raise MediaError(f"cannot read {given!r}: {e.strerror}") from e


# NAT64 (RFC 6052, 8215) and SIIT's IPv4-translated ::ffff:0:a.b.c.d (RFC 2765): the low
# 32 bits are the IPv4 address a translator routes to.
_NAT64 = (
    ipaddress.ip_network("64:ff9b::/96"),
    ipaddress.ip_network("64:ff9b:1::/48"),
    ipaddress.ip_network("::ffff:0:0:0/96"),
)
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (and may be routed to): IPv4-mapped,
    IPv4-compatible, IPv4-translated (SIIT), 6to4, NAT64 and both Teredo ends."""
    found = [ip.ipv4_mapped, ip.sixtofour, *(ip.teredo or ())]
    if ip in _IPV4_COMPATIBLE or any(ip in net for net in _NAT64):
        found.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return [v4 for v4 in found if v4 is not None]


def can_use_address(ip: IPAddress, policy: MediaPolicy) -> bool:
    """Public addresses, or ones inside an explicitly allowed network. An IPv6 address
    that carries an IPv4 one is judged by that too."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if any(ip in ipaddress.ip_network(net) for net in policy.allowed_networks):
        return True
    if isinstance(ip, ipaddress.IPv6Address):
        if not all(can_use_address(v4, policy) for v4 in embedded_ipv4(ip)):
            return False
    return ip.is_global and not ip.is_multicast


# What inet_aton (and so getaddrinfo) reads as an IPv4 address: 1-4 dot-separated
# decimal, octal (leading 0) or hex (0x) numbers, e.g. 2130706433, 0x7f.1, 017700000001.
_NUMERIC_HOST = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}\.?$", re.I)


def ip_literal(host: str) -> IPAddress | None:
    """`host` as an address when it is one in any spelling the resolver would accept
    (dotted quad, IPv6, or the decimal/octal/hex inet_aton forms); None for a name."""
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        pass
    if _NUMERIC_HOST.match(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host.rstrip(".")))
        except OSError:
            return None  # numeric but out of range: the resolver refuses it too
    return None


def can_use_host(host: str, policy: MediaPolicy) -> bool:
    if not policy.allowed_domains:
        return True
    host = host.lower().strip(".")
    return any(host == d or host.endswith("." + d) for d in policy.allowed_domains)


async def resolve_checked(host: str, port: int, policy: MediaPolicy) -> IPAddress:
    """The address to connect to: every address of `host` must pass the rules."""
    if not can_use_host(host, policy):
        raise MediaError(f"host {host!r} is not in the media domain allow-list")
    if (literal := ip_literal(host)) is not None:
        addresses = [literal]
    elif _NUMERIC_HOST.match(host):
        raise MediaError(f"host {host!r} is not a valid address")
    else:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
        except OSError as e:
            raise MediaError(f"cannot resolve host {host!r}: {e}") from e
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    refused = [str(ip) for ip in addresses if not can_use_address(ip, policy)]
    if refused or not addresses:
        raise MediaError(f"host {host!r} resolves to a non-public address ({', '.join(refused)})")
    return addresses[0]


async def _fetch(url: str, policy: MediaPolicy) -> bytes:
    timeout = httpx.Timeout(policy.timeout_s)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        for _ in range(policy.max_redirects + 1):
            parts = urlsplit(url)
            scheme = parts.scheme.lower()
            if scheme != "https" and not (scheme == "http" and policy.allow_http):
                raise MediaError(f"redirect to a {scheme!r} URL is not allowed")
            if not parts.hostname:
                raise MediaError(f"image URL {url!r} has no host")
            try:
                port = parts.port or (443 if scheme == "https" else 80)
            except ValueError as e:  # a port out of range or not a number
                raise MediaError(f"image URL {url!r} has an invalid port") from e
            ip = await resolve_checked(parts.hostname, port, policy)
            pinned = httpx.URL(url).copy_with(host=str(ip))
            extensions = {"sni_hostname": parts.hostname} if scheme == "https" else {}
            request = client.build_request(
                "GET", pinned, headers={"Host": parts.netloc.rsplit("@", 1)[-1]},
                extensions=extensions,
            )  # fmt: skip
            try:
                response = await client.send(request, stream=True)
            except httpx.TimeoutException:
                raise
            except httpx.HTTPError as e:
                raise MediaError(f"cannot fetch {url!r}: {e}") from e
            try:
                if response.is_redirect and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise MediaError(f"fetching {url!r} returned HTTP {response.status_code}")
                return await _read_capped(response, policy.max_bytes)
            finally:
                await response.aclose()
    raise MediaError(f"more than {policy.max_redirects} redirects")


async def _read_capped(response: httpx.Response, max_bytes: int) -> bytes:
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise MediaTooLargeError(f"image is {declared} bytes, over the cap of {max_bytes}")
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > max_bytes:
            raise MediaTooLargeError(f"image is over the cap of {max_bytes} bytes")
    return bytes(data)


def check_image_header(data: bytes, max_pixels: int) -> tuple[int, int]:
    """(width, height) as the model sees them (EXIF orientation applied), from the
    header only, with the engine's own opener and checks (`encoders.image_io`): refuses
    unsupported formats and broken headers (400) and images over the pixel cap (413)
    before anything is decoded."""
    header = read_header(data, max_pixels)
    return header.width, header.height


def file_url(path: str | os.PathLike) -> str:
    return Path(path).resolve().as_uri()
