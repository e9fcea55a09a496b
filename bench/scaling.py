"""The scaling curve: final latency against concurrent streams, one line per setup (e.g. per GPU count).

    qasr-bench stream --plot docs/scaling.png --from run-600.json run-1000.json run2gpu-2000.json

Each JSON is one `qasr-bench stream --out` run; its `config.label` (`--label "1 GPU"`) names the line it belongs to
(runs without one share a line named by their protocol). Plotted per run: p50/p95/p99 of the final latency after
the endpoint (the server's measure, the one the capacity target is stated in) against the clients it ran, and how
many of those clients the server refused (1013 or an HTTP refusal at the handshake: admission control), with the
share of finals that came back. Several runs of one label at one client count are plotted as separate points, so the
spread between runs shows (one run decides little near a capacity edge).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

REFUSED_CLOSE_CODES = {1013}  # try again later: server full / admission control
LATENCY_PERCENTILES = ("p50", "p95", "p99")


def refused(session: dict) -> bool:
    """A client the server turned away rather than served: closed with 1013, or an HTTP refusal (503) before the
    upgrade."""
    if session.get("close_code") in REFUSED_CLOSE_CODES:
        return True
    error = session.get("error") or ""
    return "503" in error or "1013" in error


def run_point(run: dict) -> dict:
    """One run's point on the curve: clients, final latency percentiles (ms), clients refused, finals returned."""
    sessions = run.get("sessions", [])
    latency = run["summary"].get("final_latency_ms", {"n": 0})
    totals = run["totals"]
    return {
        "clients": run["config"]["clients"],
        "latency": {p: latency.get(p) for p in LATENCY_PERCENTILES} if latency.get("n") else {},
        "refused": sum(1 for s in sessions if refused(s)),
        "finals": totals["finals"], "segments": totals["segments"], "missing_finals": totals["missing_finals"],
    }


def series(runs: list[dict]) -> dict[str, list[dict]]:
    """Points grouped by label, each group sorted by clients."""
    grouped: dict[str, list[dict]] = collections.defaultdict(list)
    for run in runs:
        config = run["config"]
        grouped[config.get("label") or config["protocol"]].append(run_point(run))
    return {label: sorted(points, key=lambda p: p["clients"]) for label, points in grouped.items()}


def load_runs(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        try:
            run = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"--from {path}: cannot read a stream run ({error})") from None
        if not isinstance(run, dict) or not {"config", "summary", "totals"} <= run.keys():
            raise SystemExit(f"--from {path}: not a `qasr-bench stream --out` result")
        runs.append(run)
    return runs


def plot_scaling(path: str, runs: list[dict], *, target_ms: float | None = 250.0) -> dict[str, list[dict]]:
    """Write the curve to `path` (PNG); returns the plotted series."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    lines = series(runs)
    fig, (latency_ax, refused_ax) = plt.subplots(1, 2, figsize=(13, 5))
    styles = {"p50": ":", "p95": "-", "p99": "--"}
    for i, (label, points) in enumerate(lines.items()):
        color = f"C{i}"
        for p in LATENCY_PERCENTILES:
            xs = [pt["clients"] for pt in points if pt["latency"]]
            ys = [pt["latency"][p] for pt in points if pt["latency"]]
            latency_ax.plot(xs, ys, styles[p], marker="o", color=color, label=f"{label} {p}")
        refused_ax.plot([pt["clients"] for pt in points], [pt["refused"] for pt in points], marker="o", color=color,
                        label=label)
    if target_ms:
        latency_ax.axhline(target_ms, color="grey", linewidth=0.8)
        latency_ax.annotate(f"target {target_ms:g} ms", (0.01, target_ms), xycoords=("axes fraction", "data"),
                            fontsize=8, color="grey", va="bottom")
    latency_ax.set(xlabel="concurrent streams", ylabel="final latency after the endpoint (ms)",
                   title="final latency vs streams")
    latency_ax.set_yscale("log")
    latency_ax.legend(fontsize=7)
    refused_ax.set(xlabel="concurrent streams (clients started)", ylabel="clients refused (1013 / 503)",
                   title="admission control: streams refused")
    refused_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return lines
