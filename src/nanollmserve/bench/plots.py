"""PNG plots of the benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_s: list[float], label: str) -> None:
    if not values_s:
        return
    xs = sorted(v * 1000 for v in values_s)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def plot_serve(result: dict, raw: list[list], path: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) of each run; with a concurrency sweep, a fifth
    panel with output throughput and p50 TTFT against concurrency."""
    plt = _pyplot()
    runs = result.get("sweep") or [result]
    sweep = "sweep" in result
    panels = 5 if sweep else 4
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8))
    metrics = [
        ("TTFT", lambda r: [x.ttft for x in r if x.success]),
        ("TPOT", lambda r: [x.tpot for x in r if x.success and x.tpot is not None]),
        ("ITL", lambda r: [g for x in r if x.success for g in x.itl]),
        ("E2E latency", lambda r: [x.e2e for x in r if x.success]),
    ]
    for ax, (name, values) in zip(axes, metrics, strict=False):
        for run, results in zip(runs, raw, strict=True):
            label = f"concurrency {run['max_concurrency'] or 'unbounded'}"
            _cdf(ax, values(results), label)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if sweep:
        ax = axes[4]
        levels = [run["max_concurrency"] for run in runs]
        ax.plot(levels, [run["output_throughput"] for run in runs], "o-", label="output tok/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title("Throughput vs concurrency")
        twin = ax.twinx()
        twin.plot(levels, [run["ttft_ms"]["p50"] for run in runs], "s--", color="tab:red")
        twin.set_ylabel("p50 TTFT (ms)", color="tab:red")
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"bench serve: {result['model']} via {result['backend']}/{result['endpoint']}, "
        f"{result['workload']} workload, {result['num_prompts']} requests"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(
    title: str, labels: list[str], series: list[tuple[str, list[float]]], path: str
) -> None:
    """One panel per (metric name, value per label): bar charts side by side."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(series), figsize=(4.8 * len(series), 4.2))
    axes = [axes] if len(series) == 1 else axes
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for ax, (name, values) in zip(axes, series, strict=True):
        bars = ax.bar(
            range(len(labels)), values, color=[colors[i % len(colors)] for i in range(len(labels))]
        )
        ax.set_xticks(range(len(labels)), labels, rotation=25, ha="right", fontsize=8)
        ax.set_title(name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
