"""Helpers of the integration tests: the HTTP service process (http_service.py) and reading what it got."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.support import ROOT, free_port, listening


class HttpService:
    """tests/integrations/http_service.py as a real process on a free loopback port."""

    def __init__(self, folder) -> None:
        self.port = free_port()
        self.rules_path = os.path.join(str(folder), f"rules-{self.port}.json")
        self.log_path = os.path.join(str(folder), f"requests-{self.port}.jsonl")
        self.proc: subprocess.Popen | None = None
        self.set_rules({})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "HttpService":
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integrations.http_service", "--port", str(self.port),
                                      "--rules", self.rules_path, "--log", self.log_path], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert listening("127.0.0.1", self.port, 20, self.proc), "the HTTP service did not start"
        return self

    def set_rules(self, rules: dict) -> None:
        tmp = self.rules_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rules, f)
        os.replace(tmp, self.rules_path)

    def requests(self, path: str | None = None) -> list[dict]:
        try:
            with open(self.log_path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except OSError:
            return []
        return [r["body"] for r in rows if path is None or r["path"].endswith(path)]

    def wait_requests(self, path: str, n: int, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(got := self.requests(path)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    stop = kill
