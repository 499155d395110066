"""The picture in BENCHMARKS.md, from what `bench.run`, `bench.paced` and
`bench.capacity` left in bench/results/:

    python -m bench.plot        # writes docs/benchmarks.png
"""

from __future__ import annotations

from pathlib import Path

import orjson

from bench.run import RESULTS, ROOT

GOAL, OURS, REFERENCE = "#a0522d", "#1f6f5c", "#999999"


def load(name: str) -> dict | None:
    path = RESULTS / name
    return orjson.loads(path.read_bytes()) if path.exists() else None


def main(out: Path = ROOT / "docs" / "benchmarks.png") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.4))
    run, paced = load("run.json") or {}, load("paced.json")

    if "throughput" in run:
        t = run["throughput"]
        names = ["model direct", "SSE", "WebSocket"]
        values = [t["raw"]["tokens_per_s"], t["sse"]["tokens_per_s"], t["ws"]["tokens_per_s"]]
        axes[0].bar(names, values, color=[REFERENCE, OURS, OURS])
        axes[0].axhline(25000, color=GOAL, linestyle="--", label="goal 25k/s")
        axes[0].set_title("Burst: tokens/s through one core\n(model writes 64 tokens at a time)")
        axes[0].legend()

    if paced:
        results = paced["results"]
        names = list(results)
        values = [results[n]["us_per_token"] for n in names]
        colors = [REFERENCE if n in ("passthrough", "relay") else OURS for n in names]
        axes[1].barh(names, values, color=colors)
        axes[1].axvline(70, color=GOAL, linestyle="--", label="goal 70 µs")
        axes[1].invert_yaxis()
        a = paced["args"]
        axes[1].set_title(
            f"Paced: server CPU µs per token\n({a['streams']} streams, one token per write, "
            f"{a['interval_ms']:g} ms apart)"
        )
        axes[1].legend()

    for name, style in (("capacity-1.json", "-"), ("capacity-2.json", "--")):
        capacity = load(name)
        if not capacity:
            continue
        rows = [r for r in capacity["rows"] if r["together_s"] > 0]
        axes[2].plot(
            [r["streams"] for r in rows],
            [r["p99_ms"] for r in rows],
            style,
            marker="o",
            color=OURS,
            label=f"{rows[0]['workers'] if rows else '?'} worker(s)",
        )
        for row in rows:
            latencies = row["latencies_ms"]
            if latencies and row["workers"] == 1:
                ys = [i / len(latencies) for i in range(len(latencies))]
                axes[3].plot(latencies, ys, label=f"{row['streams']} streams")
    axes[2].axhline(50, color=GOAL, linestyle="--", label="goal p99 50 ms")
    axes[2].axhline(100, color=GOAL, linestyle=":", label="p99 100 ms")
    axes[2].set_yscale("log")
    axes[2].set_title("Added latency p99 at 20 tokens/s per stream\n(all streams running)")
    axes[2].set_xlabel("concurrent streams")
    axes[2].set_ylabel("ms")
    axes[2].legend()
    axes[3].set_xscale("log")
    axes[3].axvline(50, color=GOAL, linestyle="--")
    axes[3].set_title("Added latency, one worker\n(model sent → client read)")
    axes[3].set_xlabel("ms")
    axes[3].set_ylabel("fraction of tokens")
    axes[3].legend()

    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
