"""Start-up time: how long until a fresh process can generate, offline and served.

Each run is a new process, as a user's is: ``LLM(model)`` constructed in ``python -c`` (seconds from
the interpreter's first line to the engine ready, and the process's whole wall time), and ``novainfer
serve`` polled until ``/health`` answers 200. Runs use a NovaInfer cache of their own (a temporary
``NOVAINFER_CACHE``): the first run of each kind starts with it empty (what a first start pays), the
later ones find what the earlier ones kept there (a GGUF file's derived config and tokenizer). The
processes import the package Python finds first from the current directory: to time another
checkout, run this script from that checkout's directory.

    python benchmarks/startup.py                       # the built-in SmolLM2 on CPU
    python benchmarks/startup.py --model tiny --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_output_arguments, load_average, run_facts, scrub_path, write_results

_OFFLINE = """
import time
started = time.perf_counter()
from novainfer import LLM
imported = time.perf_counter()
llm = LLM({model!r}, device={device!r})
ready = time.perf_counter()
print("STARTUP", imported - started, ready - started)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2", help="what `novainfer serve` and LLM() take: a built-in name, "
                   "a model directory or a GGUF file")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=3, help="starts of each kind (the first with an empty cache)")
    p.add_argument("--no-serve", action="store_true", help="offline starts only")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take")
    add_output_arguments(p, "startup_<device>_<model>")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def offline_start(args: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    """One ``LLM(model)`` in a new process: seconds to import, to ready, and the process's wall time."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _OFFLINE.format(model=args.model, device=args.device)], env=env,
                          capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    line = next((line for line in done.stdout.splitlines() if line.startswith("STARTUP ")), None)
    if done.returncode or line is None:
        raise RuntimeError(f"LLM({args.model!r}) failed to start: {done.stderr[-2000:]}")
    imported, ready = map(float, line.split()[1:])
    return {"import_s": round(imported, 3), "ready_s": round(ready, 3), "process_wall_s": round(wall, 3)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def served_start(args: argparse.Namespace, env: dict[str, str]) -> dict[str, float]:
    """One ``novainfer serve`` in a new process: seconds until the port answers and until /health is 200."""
    port = _free_port()
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "novainfer.entrypoints.cli.main", "serve", args.model,
                               "--port", str(port), "--device", args.device], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    listening = None
    try:
        while time.perf_counter() - started < args.timeout:
            if server.poll() is not None:
                raise RuntimeError(f"novainfer serve exited with {server.returncode}: {server.stderr.read()[-2000:]}")
            status = _health(port)
            now = time.perf_counter() - started
            if status is not None and listening is None:
                listening = now
            if status == 200:
                return {"listening_s": round(listening, 3), "healthy_s": round(now, 3)}
            time.sleep(0.1)
        raise RuntimeError(f"novainfer serve was not healthy within {args.timeout} s")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def timed_starts(args: argparse.Namespace, start, cache: Path) -> dict[str, Any]:
    """``--repeats`` starts by ``start`` on one fresh cache: the first (empty cache) and the median of the rest."""
    env = {**os.environ, "NOVAINFER_CACHE": str(cache)}
    runs = [start(args, env) for _ in range(args.repeats)]
    for run in runs:
        print("  ", json.dumps(run), flush=True)
    later = {key: round(statistics.median(run[key] for run in runs[1:]), 3) for key in runs[0]} if len(runs) > 1 \
        else None
    return {"first_start_empty_cache": runs[0], "later_starts_median": later, "runs": runs}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    load_at_start = load_average()
    results: dict[str, Any] = {"benchmark": "start-up time of a fresh process: LLM() ready, novainfer serve healthy",
                               "model": scrub_path(args.model), "device": args.device, "repeats": args.repeats}
    kinds = {"offline": offline_start} if args.no_serve else {"offline": offline_start, "served": served_start}
    for kind, start in kinds.items():
        print(f"{kind} starts of {args.model} on {args.device}:", flush=True)
        with tempfile.TemporaryDirectory(prefix="novainfer-startup-") as cache:
            results[kind] = timed_starts(args, start, Path(cache))
    results.update(run_facts(args.device, load_at_start, argv, __file__))
    path = write_results(args.output or f"startup_{args.device}_{Path(args.model).stem}", results, args.results_dir)
    print(f"results: {scrub_path(str(path))}")
    return results


if __name__ == "__main__":
    main()
