"""Plots a results file of ``benchmarks/serve.py``: output throughput, TTFT and ITL (median and p99)
against the request rate, on a log axis where ``inf`` (all requests at once) is the last, labelled point.

    python benchmarks/plot_serve.py benchmarks/results/serve_cuda_qwen2-0.5b.json   # writes serve_cuda_qwen2-0.5b.png

matplotlib is not a NovaInfer dependency: install it to plot (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

# Where ``inf`` sits on the log axis: this factor past the largest finite rate.
INF_GAP = 4.0


def rate_positions(rates: list[float | str]) -> tuple[list[float], list[str]]:
    """x positions and tick labels of the rates (numbers or ``"inf"``) on a log axis."""
    finite = [float(r) for r in rates if r != "inf"]
    inf_at = max(finite) * INF_GAP if finite else 1.0
    positions = [inf_at if r == "inf" else float(r) for r in rates]
    return positions, ["inf" if r == "inf" else f"{float(r):g}" for r in rates]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_serve.py needs matplotlib, which NovaInfer does not depend on: "
                         "pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt



def _title(report: dict[str, Any]) -> str:
    model = report.get("model") or {}
    name = model.get("preset") or (Path(model["path"]).name if model.get("path") else "remote server")
    machine = report.get("gpu") or (report.get("machine") or {}).get("cpu_model", "")
    workload = report["workload"]
    return (f"{name} on {machine}, commit {report.get('commit')}: {workload['num_prompts']} prompts, "
            f"{workload['output_len']} output tokens each")


def plot(report: dict[str, Any], out: Path) -> Path:
    """Three panels sharing the rate axis: output tok/s (with the offline companion's, when measured),
    TTFT and ITL in ms (median solid, p99 dashed). Of several rounds, the first (a fresh server's)."""
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    first_round = [r for r in report["results"] if r.get("round", 1) == 1]  # files of before --rounds have none
    runs = sorted(first_round, key=lambda r: math.inf if r["request_rate"] == "inf" else r["request_rate"])
    x, labels = rate_positions([r["request_rate"] for r in runs])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
    throughput, ttft, itl = axes
    throughput.plot(x, [r["output_throughput_tok_per_s"] for r in runs], "o-", label="served")
    offline = report.get("offline_companion")
    if offline:
        throughput.axhline(offline["output_throughput_tok_per_s"], color="gray", linestyle=":",
                           label="offline LLM.generate")
        throughput.legend()
    throughput.set_ylabel("output tokens / s")
    throughput.set_ylim(bottom=0)
    for ax, key, name in ((ttft, "ttft_ms", "TTFT"), (itl, "itl_ms", "ITL")):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            ax.plot(x, [r[key][stat] for r in runs], style, label=f"{name} {'p50' if stat == 'median' else stat}")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.legend()
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(x, labels)
        ax.xaxis.set_minor_locator(NullLocator())  # the ticks are the measured rates
        ax.set_xlabel("request rate (requests / s; inf: all at once)")
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(_title(report), fontsize=10)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a results file written by benchmarks/serve.py")
    p.add_argument("--output", default=None, help="the PNG to write (default: the results file's name, .png)")
    args = p.parse_args(argv)
    path = Path(args.results)
    report = json.loads(path.read_text())
    if not isinstance(report.get("results"), list):
        raise SystemExit(f"{args.results} holds no per-rate results list (written by an older serve.py?)")
    out = plot(report, Path(args.output) if args.output else path.with_suffix(".png"))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
