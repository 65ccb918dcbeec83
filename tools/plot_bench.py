#!/usr/bin/python3
"""Plots relgen-bench serve results: latency percentiles against achieved throughput.

  /usr/bin/python3 tools/plot_bench.py results.json out.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    data = json.load(open(sys.argv[1]))
    rows = data["results"]
    x = [r["output_token_throughput"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title, scale, unit in ((axes[0], "ttft_s", "Time to first token", 1e3, "ms"),
                                        (axes[1], "tpot_s", "Time per output token", 1e3, "ms"),
                                        (axes[2], "e2e_s", "End-to-end latency", 1, "s")):
        for p, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, [r[key][p] * scale for r in rows], style, label=p)
        for r, xi in zip(rows, x):
            label = f'{r["rate"]:g}/s' if r["rate"] > 0 else f'c={r["concurrency"]}'
            ax.annotate(label, (xi, r[key]["p50"] * scale), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("output tokens/s (achieved)")
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f'relgen-bench serve: {data["num_requests"]} requests per load, prompt ~{data["prompt_len"]}, '
                 f'output ~{data["output_len"]} tokens')
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
