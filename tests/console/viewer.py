"""Keep the console open and updating while a benchmark runs (BENCHMARKS.md "Web console"):
headless Chromium with the overview (server-sent events, a sample a second) in one window and the
clients page (the whole client list every 2 s) in another, until the console's port closes or
--seconds pass.

    python3 tests/console/viewer.py http://127.0.0.1:19999/console/ --seconds 600
"""
from __future__ import annotations

import argparse
import signal
import socket
import sys
import time
import urllib.parse

from selenium import webdriver
from selenium.webdriver.chrome.service import Service


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--seconds", type=float, default=600)
    a = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))    # quit the browser (finally) on SIGTERM
    u = urllib.parse.urlsplit(a.url)
    deadline = time.monotonic() + a.seconds
    while True:                                    # wait for the server (bounded)
        try:
            socket.create_connection((u.hostname, u.port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for x in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(x)
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        d.get(a.url + "#overview")
        d.switch_to.new_window("window")
        d.get(a.url + "#clients")
        seen = 0
        windows = d.window_handles
        last_report = 0.0
        while time.monotonic() < deadline:
            if time.monotonic() - last_report > 5:       # what the pages show, as evidence they update
                last_report = time.monotonic()
                shown = []
                for w, css in zip(windows, ("#ov-connections", "#cl-count")):
                    try:
                        d.switch_to.window(w)
                        shown.append(d.execute_script(f"return document.querySelector('{css}').textContent"))
                    except Exception as e:  # noqa: BLE001 - a page reloading between runs
                        shown.append(f"? {type(e).__name__}")
                print(f"{time.strftime('%H:%M:%S')} overview connections={shown[0]!r} clients={shown[1]!r}",
                      flush=True)
            try:
                socket.create_connection((u.hostname, u.port), timeout=1).close()
                seen = 0
            except OSError:
                seen += 1
                if seen > 15:                    # the server is gone for good (the run ended)
                    break
            time.sleep(1)
    finally:
        d.quit()


if __name__ == "__main__":
    main()
