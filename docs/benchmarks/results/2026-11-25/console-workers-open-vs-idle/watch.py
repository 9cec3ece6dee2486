"""Open the console (tests/console/viewer.py) of each lmqtt-workers run of a bench compare whose
TMPDIR is argv[1], on worker 0's console (which aggregates worker 1 through its peer console)."""
import glob, re, subprocess, sys, time
root, seconds = sys.argv[1], float(sys.argv[2])
seen, procs = set(), []
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for log in glob.glob(f"{root}/lmqtt-compare-*/lmqtt-workers-*/lmqtt-workers.log"):
        if log in seen:
            continue
        ports = [int(p) for p in re.findall(r"console:\s+http://127\.0\.0\.1:(\d+)/console/", open(log, errors="replace").read())]
        if len(ports) < 2:
            continue
        seen.add(log)
        url = f"http://127.0.0.1:{min(ports)}/console/"
        print(time.strftime("%H:%M:%S"), log, url, flush=True)
        procs.append(subprocess.Popen([sys.executable, "/work/main/tests/console/viewer.py", url, "--seconds", "200"]))
    time.sleep(0.3)
    if procs and all(p.poll() is not None for p in procs) and not glob.glob(f"{root}/lmqtt-compare-*"):
        break
for p in procs:
    if p.poll() is None:
        p.terminate()
