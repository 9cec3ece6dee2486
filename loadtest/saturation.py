"""Who was saturated in one traffic result: the broker, the generator, or neither (a shared
machine). `lmqtt bench mqtt` prints it after every result, `bench compare` beside every figure
and under every table of its report, and `bench compare --selfcheck` (selfcheck.py) checks the
generator with it against Mosquitto."""
from __future__ import annotations

SATURATED = 0.9  # cores: a single-threaded broker at or above this is the limit
FLAT_OUT = ("fanout", "fanin", "pairs")


def verdict(r: dict, saturated: float = SATURATED) -> str:
    """One line: who was saturated in this traffic result (broker, generator, or neither)."""
    b = r.get("broker_cpu_cores")
    g = r.get("gen_cpu_cores")
    per = r.get("gen_cpu_cores_per_proc") or []
    bu = r.get("broker_cpu_us_per_msg")
    gu = r.get("gen_cpu_us_per_msg")
    if b is None or g is None or not per:
        return "unknown (no broker PID for CPU figures)"
    top = max(per)
    rate = (r.get("params") or {}).get("rate")
    if rate:
        behind = r.get("behind_schedule") or 0
        return (f"fixed rate {rate:,.0f} msg/s, so neither side is meant to be saturated: broker "
                f"{b:.2f} cores, generator {g:.2f} (busiest process {top:.2f})"
                + (f"; {behind} messages behind schedule — the rate was not held" if behind else
                   "; the rate was held"))
    figures = (f"broker {b:.2f} cores, generator {g:.2f} cores in {len(per)} processes "
               f"(busiest {top:.2f})" + (f"; {gu:.1f} vs {bu:.1f} µs CPU per delivered message"
                                          if gu is not None and bu is not None else ""))
    below = (gu is None or bu is None or gu < bu) and top < b
    if top >= saturated and top >= b:
        return f"generator-bound: a worker process is saturated — add --procs ({figures})"
    wait = r.get("broker_runq_wait_cores")
    if b < saturated and wait is not None and b + wait >= saturated:
        # a shared machine: the broker wanted a core and waited for it (run queue), so it was
        # the limit at the share of the CPU it was given
        figures += f"; the broker also waited {wait:.2f} cores' worth for a CPU"
        if below:
            return f"broker saturated at its share of a shared machine, generator below it ({figures})"
        return f"broker saturated at its share of a shared machine, generator not clearly below it ({figures})"
    if b >= saturated and below:
        return f"broker saturated, generator below it ({figures})"
    if b >= saturated:
        return f"broker saturated, but the generator is not clearly below it — add --procs ({figures})"
    if below:
        return (f"neither saturated (machine shared or closed loop too tight); generator below "
                f"the broker ({figures})")
    return f"neither saturated; generator not below the broker — add --procs ({figures})"
