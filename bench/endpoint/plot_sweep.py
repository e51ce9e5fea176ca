"""The concurrency sweep as a picture: output tok/s and TTFT p50 against concurrency, direct
and through the governed endpoint, from a gpu_endpoint JSON written with --sweep.

    pip install matplotlib   # only this script needs it
    python -m bench.endpoint.plot_sweep bench/results/<run>-gpu_endpoint_sweep.json \
        docs/img/sweep.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("sweep_json", type=Path, help="a gpu_endpoint JSON written with --sweep")
    ap.add_argument("png", type=Path, help="where the picture goes")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src, dst = args.sweep_json, args.png
    report = json.loads(src.read_text())
    rows = sorted(
        (r for r in report["sweep"] if "skipped" not in r), key=lambda r: r["concurrency"]
    )
    load_point = int(report["config"]["concurrency"])
    if all(r["concurrency"] != load_point for r in rows):  # the load point's rounds, same worker
        rows.append(
            {"concurrency": load_point, "direct": report["direct"], "gateway": report["gateway"]}
        )
        rows.sort(key=lambda r: r["concurrency"])
    c = [r["concurrency"] for r in rows]
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("direct", "o-"), ("gateway", "s--")):
        label = "direct (NATS)" if mode == "direct" else "governed endpoint"
        tput.plot(c, [r[mode]["output_tokens_per_s"] for r in rows], style, label=label)
        ttft.plot(c, [r[mode]["ttft_s_p50"] for r in rows], style, label=label)
    for ax, title in ((tput, "output tok/s"), (ttft, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    config = report["config"]
    fig.suptitle(
        f"{config['preset']} ({config['quantize']} weights, {config['kv_dtype']} KV), "
        f"{config['prompt_tokens']} + {config['max_tokens']} tokens, 2 x C requests per point"
    )
    fig.tight_layout()
    dst.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(dst, dpi=110)
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
