"""SSRF probes through `image_url`: every probe must be refused (a 4xx with a message)
and no probe may reach the canary, a TCP listener on 127.0.0.1 that counts connections.

Two servers: the default media rules (https only, public addresses only), and a laxer
one (`--allow-http-media --allowed-media-networks 127.0.0.2/32`) whose one allowed
address hosts a redirector: a redirect chain that starts there and ends on loopback,
link-local, a decimal IP or file:// must still be refused at the hop. A control image
from the allowed address must be answered (so the refusals are the rules', not a
broken fetch).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, urlsplit

from benchmarks.reliability.common import (
    Outcome,
    chat_body,
    client,
    count,
    gather_limited,
    png_bytes,
    print_table,
    send,
    user_message,
)
from benchmarks.reliability.server import ServerProcess

# Hosts that all mean loopback, private, link-local or otherwise non-public.
LOOPBACK_SPELLINGS = [
    "127.0.0.1", "127.1", "127.0.1", "127.255.255.254", "0.0.0.0", "0",
    "2130706433", "0x7f000001", "0x7f.0.0.1", "0177.0.0.1", "0177.0.0.01", "017700000001",
    "127.000.000.001", "localhost", "LOCALHOST", "localhost.", "vm",
    "[::1]", "[::]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[0:0:0:0:0:ffff:7f00:1]",
    "[::127.0.0.1]", "[::ffff:0:127.0.0.1]", "[::ffff:0:7f00:1]", "[64:ff9b::127.0.0.1]",
    "[64:ff9b:1::7f00:1]", "[2002:7f00:1::]", "[2001::80ff:fffe]",
]  # fmt: skip
PRIVATE_HOSTS = [
    "10.0.0.1", "172.16.0.1", "192.168.0.1", "169.254.169.254", "[fe80::1]", "[fe80::1%25lo]",
    "100.64.0.1", "[fc00::1]", "[fd00::1]", "224.0.0.1", "255.255.255.255", "198.18.0.1",
    "[::ffff:169.254.169.254]", "[::ffff:10.0.0.1]", "2852039166", "0xa9fea9fe",
]  # fmt: skip


class Canary:
    """A TCP listener on 127.0.0.1 that counts connections and answers any HTTP with a
    valid PNG, so a probe that got through would be answered, not just refused."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.hits = 0
        self._png = png_bytes(1)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            try:
                conn.settimeout(1.0)
                conn.recv(4096)
                head = (
                    "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\n"
                    f"Content-Length: {len(self._png)}\r\n\r\n"
                )
                conn.sendall(head.encode() + self._png)
            except OSError:
                pass
            finally:
                conn.close()

    def close(self) -> None:
        self.sock.close()


class Redirector:
    """HTTP on 127.0.0.2: /r?to=URL answers 302 to URL; /img.png a real PNG."""

    def __init__(self) -> None:
        png = png_bytes(2)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                parts = urlsplit(self.path)
                if parts.path == "/r":
                    self.send_response(302)
                    self.send_header("Location", parse_qs(parts.query)["to"][0])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.2", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, to: str | None = None) -> str:
        base = f"http://127.0.0.2:{self.port}"
        return f"{base}/img.png" if to is None else f"{base}/r?to={quote(to, safe='')}"

    def close(self) -> None:
        self.server.shutdown()


def direct_probes(port: int) -> list[tuple[str, str]]:
    """(label, url): each host spelled for https and http, plus URL-parsing tricks."""
    probes = []
    for group, hosts in (("loopback", LOOPBACK_SPELLINGS), ("private", PRIVATE_HOSTS)):
        for host in hosts:
            for scheme in ("https", "http"):
                probes.append((f"{group}/{scheme}", f"{scheme}://{host}:{port}/x.png"))
    tricks = [
        f"https://example.com@127.0.0.1:{port}/x.png", f"http://user:pw@127.0.0.1:{port}/",
        f"https://127.0.0.1:{port}#@example.com/", f"https://127.0.0.1:{port}\\@example.com/",
        f"HTTPS://127.0.0.1:{port}/x.png", f" https://127.0.0.1:{port}/x.png",
        f"https:/127.0.0.1:{port}/x.png", f"https:127.0.0.1:{port}/x.png",
        f"https:\\\\127.0.0.1:{port}/x.png", f"//127.0.0.1:{port}/x.png",
        f"gopher://127.0.0.1:{port}/_x", f"ftp://127.0.0.1:{port}/x.png",
        f"dict://127.0.0.1:{port}/x", "file:///etc/passwd", "file://localhost/etc/passwd",
        "file:///proc/self/environ", f"http://127.0.0.1:{port}%2f@example.com/",
        f"http://[::ffff:127.0.0.1]:{port}/", f"https://127.0.0.1.:{port}/x.png",
    ]  # fmt: skip
    probes += [("tricks", url) for url in tricks]
    return probes


def redirect_probes(redirector: Redirector, port: int) -> list[tuple[str, str]]:
    ends = [f"http://127.0.0.1:{port}/x.png", f"http://2130706433:{port}/x.png",
            f"http://0x7f000001:{port}/x.png", f"http://[::ffff:127.0.0.1]:{port}/x.png",
            f"http://localhost:{port}/x.png", f"http://vm:{port}/x.png",
            "http://169.254.169.254/latest/meta-data/", "file:///etc/passwd",
            f"https://127.0.0.1:{port}/x.png", f"gopher://127.0.0.1:{port}/_x"]  # fmt: skip
    probes = [("redirect/1hop", redirector.url(end)) for end in ends]
    probes += [("redirect/2hops", redirector.url(redirector.url(end))) for end in ends[:4]]
    # Relative Location that keeps the allowed host but the path, then a hop to loopback.
    probes.append(("redirect/3hops", redirector.url(redirector.url(redirector.url(ends[0])))))
    probes += [("dns/loopback_name", f"http://{h}:{port}/x.png") for h in ("localhost", "vm")]
    return probes


def connect_attempted(outcome: Outcome) -> bool:
    """The server dialled the probe's address (a refusal must come before any connection):
    a failed connection, an HTTP status from the far end, or a fetch timeout."""
    message = outcome.message or ""
    return "cannot fetch" in message or "returned HTTP" in message or outcome.status == 504


async def _probe_all(url: str, probes: list[tuple[str, str]], expect: str) -> list[Outcome]:
    async with client(url, timeout=60) as http:
        coros = [send(http, chat_body(user_message("what is this", [u]), 2), label, expect)
                 for label, u in probes]  # fmt: skip
        outcomes = await gather_limited(coros, 8)
    for outcome, (_, u) in zip(outcomes, probes, strict=True):
        outcome.message = f"{u} -> {outcome.message}"
    return outcomes


def run_ssrf(root=None) -> dict:
    kw = {"root": root} if root is not None else {}
    canary, redirector = Canary(), Redirector()
    try:
        probes = direct_probes(canary.port)
        with ServerProcess("--default-max-tokens", "2", **kw) as server:
            default = asyncio.run(_probe_all(server.url, probes, "4xx"))
            default_cmd = server.command
        lax_probes = probes + redirect_probes(redirector, canary.port)
        lax_args = ("--default-max-tokens", "2", "--allow-http-media",
                    "--allowed-media-networks", "127.0.0.2/32", "--media-timeout", "5")  # fmt: skip
        with ServerProcess(*lax_args, **kw) as server:
            lax = asyncio.run(_probe_all(server.url, lax_probes, "4xx"))
            control = asyncio.run(_probe_all(server.url, [("control", redirector.url())], "ok"))
            lax_cmd = server.command
    finally:
        canary.close()
        redirector.close()
    for o in lax:
        o.label = "lax:" + o.label
    outcomes = default + lax + control
    probes_only = default + lax
    refused = sum(1 for o in probes_only if o.verdict == "4xx" and o.message)
    # A redirect's first hop to the allowed redirector is a legitimate connection; its
    # Location's host must then be refused without one (the message names that hop).
    attempted = [o.message for o in probes_only if connect_attempted(o)]
    print_table("ssrf probes (default rules, then http + 127.0.0.2/32 allowed)", outcomes)
    print(f"refused {refused}/{len(probes_only)}; dialled {len(attempted)}; "
          f"canary connections {canary.hits}; "
          f"control answered {control[0].verdict == 'ok'}")  # fmt: skip
    c = count(outcomes)
    passed = (refused == len(probes_only) and canary.hits == 0 and not attempted
              and control[0].verdict == "ok" and c["unexpected"] == 0)  # fmt: skip
    return {
        "passed": passed,
        "num_probes": len(probes_only),
        "num_refused": refused,
        "refused_fraction": refused / len(probes_only),
        "canary_connections": canary.hits,
        "num_dialled": len(attempted),
        "dialled": attempted,
        "control_answered": control[0].verdict == "ok",
        "counts": c,
        "not_refused": [o.message for o in probes_only if o.verdict != "4xx"],
        "answers": [f"{o.label}: {o.status} {o.message}" for o in probes_only],
        "server_commands": [default_cmd, lax_cmd],
    }
