"""What the agent tests' steering proxies share: forwarding a request (its body as the test
steered it) to `serve` and streaming the reply back to the agent as it comes, keeping the end of
each reply for a failure's message."""

from __future__ import annotations

import http.client
import http.server


class Forwarding(http.server.BaseHTTPRequestHandler):
    upstream: tuple[str, int]       # serve's host and port
    replies: list[str]              # "METHOD PATH STATUS: the reply's last bytes", in order

    def _forward(self, method: str, raw: bytes | None) -> None:
        conn = http.client.HTTPConnection(*self.upstream, timeout=900)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "content-length", "accept-encoding")}
        if raw is not None:
            headers["Content-Length"] = str(len(raw))
        conn.request(method, self.path, body=raw, headers=headers)
        reply = conn.getresponse()
        self.send_response(reply.status)
        for k, v in reply.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Connection", "close")
        self.end_headers()
        tail = b""
        while chunk := reply.read1(65536) if method != "HEAD" else b"":
            self.wfile.write(chunk)
            self.wfile.flush()
            tail = (tail + chunk)[-800:]
        self.replies.append(f"{method} {self.path} {reply.status}: "
                            + tail.decode("utf-8", "replace"))
        conn.close()

    def log_message(self, *args) -> None:
        pass
