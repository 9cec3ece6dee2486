"""What the open console pages ask, without a browser: for each lmqtt-workers run of a bench compare
whose TMPDIR is argv[1], on worker 0's console (which asks worker 1 through its peer console):
the overview's event stream (a sample a second) and, every 2 s, /console/api/overview and
/console/api/clients (the overview and clients pages' polls). Ends when the port is gone."""
import glob, json, re, sys, threading, time, urllib.request
root, seconds = sys.argv[1], float(sys.argv[2])
seen = set()

def stream(base, stop):
    try:
        r = urllib.request.urlopen(base + "api/stream", timeout=10)
        while not stop.is_set():
            if not r.readline():
                break
    except Exception:
        pass

def run(base):
    stop = threading.Event()
    threading.Thread(target=stream, args=(base, stop), daemon=True).start()
    fails, n = 0, 0
    while fails < 5:
        try:
            o = json.load(urllib.request.urlopen(base + "api/overview", timeout=5))
            c = json.load(urllib.request.urlopen(base + "api/clients?q=", timeout=5))
            fails, n = 0, n + 1
            if n % 5 == 1:
                print(time.strftime("%H:%M:%S"), base, "fleet connections", o["fleet"]["totals"]["connections"],
                      "clients", c["shown"], "of", c["total"], "on", c["gateways"], "gateways", flush=True)
        except Exception:
            fails += 1
        time.sleep(2)
    stop.set()

deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for log in glob.glob(f"{root}/lmqtt-compare-*/lmqtt-workers-*/lmqtt-workers.log"):
        if log in seen:
            continue
        ports = [int(p) for p in re.findall(r"console:\s+http://127\.0\.0\.1:(\d+)/console/", open(log, errors="replace").read())]
        if len(ports) < 2:
            continue
        seen.add(log)
        base = f"http://127.0.0.1:{min(ports)}/console/"
        print(time.strftime("%H:%M:%S"), log, base, flush=True)
        threading.Thread(target=run, args=(base,), daemon=True).start()
    time.sleep(0.3)
