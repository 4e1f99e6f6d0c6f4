"""`grpo serve`'s answer to a client that left before it (its request timeout ran out, its trainer
was killed): one line in the log, no traceback, and the server goes on answering."""

from __future__ import annotations

import logging
import socket
import threading
import time

from grpo.rollout.server_http import HTTPClient
from grpo.serve.http import listen, make_handler


def test_a_client_gone_before_its_answer_is_one_line_and_the_server_goes_on(caplog, capsys):
    answering = threading.Event()

    def slow(body, headers):
        answering.set()
        time.sleep(0.3)  # the client closes its socket meanwhile
        return 200, {"text": "x" * (1 << 20)}  # more than a closed socket takes

    def fine(body, headers):
        return 200, {"ok": True}

    routes = {("POST", "/slow"): slow, ("POST", "/fine"): fine}
    serving = listen("127.0.0.1", 0, make_handler(routes, "key")).start_thread()
    try:
        with caplog.at_level(logging.INFO, logger="grpo.serve.http"):
            with socket.create_connection((serving.host, serving.port)) as sock:
                sock.sendall(
                    b"POST /slow HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
                )
                assert answering.wait(10)
                sock.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
            deadline = time.monotonic() + 10
            while "left before its answer" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "POST /slow: the client left before its answer" in caplog.text
        assert "Traceback" not in capsys.readouterr().err
        answer = HTTPClient(serving.url, "key").call("POST", "/fine", {}, timeout=10, key="test")
        assert answer == {"ok": True}
    finally:
        serving.shutdown()
