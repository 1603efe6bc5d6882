"""The GPU's clocks, power, temperature and utilization while a benchmark runs, and what they were in each run's
phases: to tell a run that was slower because its GPU ran slower (an H200 at its power cap lowers its SM clock)
from one whose GPU waited. On the mix the stage's generation was two-valued; this found the GPU waiting 3-6 s
mid-generation on decode steps with no CUDA graph, not its clocks (docs/benchmarks-history.md, 2026-12-03: decode graphs).

    python -m bench telemetry record --out telemetry.jsonl [--interval 0.2]     # until killed
    python -m bench telemetry by-run --telemetry telemetry.jsonl --runs gpu.jsonl [--strip]

``record`` samples NVML (pynvml, or the copy vLLM ships in vllm/third_party) every --interval seconds: the
wall clock, SM and memory clocks (MHz), power (W), temperature (°C), utilization (%) and the active clock
throttle reasons (NVML's bit mask). ``by-run`` reads ``bench/inference.py``'s ``{"run": ...}`` lines (each run's
``started_epoch`` and, for the stage, its timeline) and prints per run the means of clock, power, temperature and
utilization, and the share of samples held at the power cap or slowed for heat, over its generation and, for the
stage, over its first-token phase and the rest. ``--strip`` adds the utilization of each sample from 1 s before
generation to 0.5 s after it, one digit a sample (9: at least 90 % busy).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import statistics
import sys
import time


def _nvml():
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:  # vLLM ships its own copy; loaded by path so vLLM itself is not imported
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("no pynvml and no vLLM to take its copy from") from None
        path = f"{list(spec.submodule_search_locations)[0]}/third_party/pynvml.py"
        mod_spec = importlib.util.spec_from_file_location("pynvml", path)
        if mod_spec is None or mod_spec.loader is None:
            raise SystemExit(f"no pynvml and none at {path}") from None
        pynvml = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(pynvml)
    return pynvml


def record(out: str, interval: float, device: int = 0) -> None:
    nv = _nvml()
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(device)
    throttle = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with open(out, "a", buffering=1) as f:
        while not stop:
            util = nv.nvmlDeviceGetUtilizationRates(h)
            f.write(json.dumps({"t": round(time.time(), 3), "sm_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                "mem_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                                "power_w": round(nv.nvmlDeviceGetPowerUsage(h) / 1000, 1),
                                "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                                "util_gpu": util.gpu, "throttle": int(throttle(h))}) + "\n")
            time.sleep(interval)
    nv.nvmlShutdown()


# NVML's clock event reasons: software power cap; hardware slowdown, thermal (software, hardware) and power brake
THROTTLE = {"power_cap_share": 0x4, "thermal_or_hw_share": 0x8 | 0x20 | 0x40 | 0x80}


def windows(run: dict) -> dict[str, tuple[float, float]]:
    """The run's phases in wall-clock time: generation for every mode; first_token and the rest of generation
    from the stage's timeline."""
    if run.get("phases"):
        ph = {p["name"]: (p["start"], p["end"]) for p in run["phases"] if p.get("end")}
        out = {}
        if "first_token" in ph and "generation" in ph:
            out["generation"] = (ph["first_token"][0], ph["generation"][1])
            out["first_token"], out["rest"] = ph["first_token"], ph["generation"]
        return out
    t0, ready = run.get("started_epoch"), run.get("generate_start_s", run.get("engine_ready_s"))
    if t0 is None or ready is None:
        return {}
    return {"generation": (t0 + ready, t0 + ready + run["generate_s"])}


def mean_of(samples: list[dict], key: str) -> float | None:
    return round(statistics.fmean(s[key] for s in samples), 1) if samples else None


def util_strip(samples: list[dict], window: tuple[float, float]) -> str:
    return "".join(str(min(9, s["util_gpu"] // 10)) for s in samples if window[0] - 1 <= s["t"] <= window[1] + 0.5)


def by_run(telemetry: str, runs: str, *, strip: bool = False) -> list[dict]:
    samples = [json.loads(x) for x in open(telemetry) if x.strip()]
    rows = []
    for line in open(runs):
        run = json.loads(line).get("run")
        if not run:
            continue
        row = {"mode": run["mode"], "generate_s": round(run["generate_s"], 2)}
        phases = windows(run)
        for name, w in phases.items():
            inside = [s for s in samples if w[0] <= s["t"] <= w[1]]
            row[name] = {"s": round(w[1] - w[0], 2),
                         **{k: mean_of(inside, k) for k in ("sm_mhz", "power_w", "temp_c", "util_gpu")}}
            for reason, bits in THROTTLE.items():  # the share of its samples with the clock held down for that reason
                row[name][reason] = round(sum(bool(s["throttle"] & bits) for s in inside) / max(1, len(inside)), 2)
        if strip and "generation" in phases:
            row["util_strip"] = util_strip(samples, phases["generation"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--out", required=True)
    r.add_argument("--interval", type=float, default=0.2)
    b = sub.add_parser("by-run")
    b.add_argument("--telemetry", required=True)
    b.add_argument("--runs", required=True)
    b.add_argument("--strip", action="store_true", help="each run's utilization, one digit per sample")
    a = p.parse_args(argv)
    if a.cmd == "record":
        record(a.out, a.interval)
    else:
        for row in by_run(a.telemetry, a.runs, strip=a.strip):
            json.dump(row, sys.stdout)
            sys.stdout.write("\n")

