"""`make bench`: the microbenchmarks against stock PyTorch, on a GPU where there is one, else on
the CPU. Prints a table, writes a CSV (and a PNG plot) under benchmarks/results/.

Every benchmark times its providers side by side in interleaved rounds
(benchmarks.common.interleaved_timings) and reports each time ratio as the median of per-round
ratios with its 20-80% band and a verdict ("inconclusive" where the band contains 1); a provider
whose full step measured faster than its own forward, or than its forward plus backward timed
apart, gets a ``suspect`` column and a warning on stderr. Rows carry the 1-minute load average at
the start and end of their benchmark (``load_1min_start`` / ``load_1min_end``). The whole run
takes about half an hour on an idle 2-core CPU; ``--quick`` a few minutes per benchmark.

    python -m benchmarks.run [--quick] [--device cpu|cuda] [--out DIR]
"""

import argparse
import os
import sys

import torch

from benchmarks import (
    bench_attention,
    bench_checkpoint,
    bench_cross_entropy,
    bench_frontier,
    bench_layers,
    bench_long_context,
    bench_mlp,
    bench_norm,
    bench_packing,
)
from benchmarks.common import RESULTS_DIR, print_table, pyplot_or_none, write_csv


def plot(rows, path):
    """Bar chart: full-step (forward+backward) time relative to eager per case and provider, the
    median of the per-round ratios with its 20-80% band as error bars."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    full = [r for r in rows if r["mode"] == "full"]

    def case_of(r):
        return f"{r['block']}\n{r['rows']}x{r['hidden']} {r['dtype']}"

    cases = list(dict.fromkeys(case_of(r) for r in full))
    provs = list(dict.fromkeys(r["provider"] for r in full))
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(cases)), 4.5))
    width = 0.8 / len(provs)
    for i, p in enumerate(provs):
        vals, low, high = [], [], []
        for c in cases:
            match = [r for r in full if r["provider"] == p and case_of(r) == c]
            median, q20, q80 = ([match[0][f"time_vs_eager{q}"] for q in ("", "_q20", "_q80")] if match else (0, 0, 0))
            vals.append(median)
            low.append(median - q20)
            high.append(q80 - median)
        ax.bar([k + i * width for k in range(len(cases))], vals, width, yerr=[low, high], capsize=2, label=p)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(cases))])
    ax.set_xticklabels(cases, fontsize=7)
    ax.set_ylabel("forward+backward time / eager (median, 20-80% band)")
    ax.set_title(f"remat norms on {full[0]['device']}, commit {full[0]['commit']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smaller cases and two timing rounds (four on a GPU): a smoke test whose ratios and "
                             "flags claim little")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    parser.add_argument("--out", default=None, help=f"output folder (default {RESULTS_DIR})")
    parser.add_argument("--no-plots", action="store_true", help="write CSVs only")
    parser.add_argument("--only", choices=["norm", "mlp", "attention", "layers", "checkpoint", "cross_entropy",
                                           "frontier", "packing", "long_context"],
                        default=None, help="run one benchmark")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tag = ("gpu" if device.type == "cuda" else "cpu") + ("-quick" if args.quick else "")
    failures = []  # blocks a benchmark refused to time (its pre-timing check failed)
    if args.only in (None, "norm"):
        rows = bench_norm.run(device, quick=args.quick)
        print_table(rows, bench_norm.summary_columns)
        path = write_csv(rows, f"norm-{tag}.csv", args.out)
        png = None if args.no_plots else plot(rows, os.path.splitext(path)[0] + ".png")
        print(f"\nwrote {path}" + (f" and {png}" if png else ""))
        print(f"device: {rows[0]['device']}; measured copy bandwidth {rows[0]['copy_gbps']:.1f} GB/s; "
              f"commit {rows[0]['commit']}\n")
    for name, bench in (("mlp", bench_mlp), ("attention", bench_attention), ("layers", bench_layers),
                        ("cross_entropy", bench_cross_entropy), ("packing", bench_packing)):
        if args.only in (None, name):
            rows = bench.run(device, quick=args.quick)
            print_table(rows, bench.summary_columns)
            path = write_csv(rows, f"{name}-{tag}.csv", args.out)
            print(f"\nwrote {path}; device: {rows[0]['device']}; commit {rows[0]['commit']}\n")
            failures.extend(getattr(bench, "CHECK_FAILURES", []))
    if args.only in (None, "long_context"):
        # Estimated for a GPU (remat.planning.fit on fake CUDA tensors): the same numbers on any machine.
        # `make bench` runs the short version (the first case, three setups); `--only long_context`
        # the whole table: the five 8B cases take minutes each on the 2-core build machine, the MoE
        # case (48 layers of 128 experts) longer than a session allowed on 2026-12-08.
        quick = args.quick or args.only != "long_context"
        rows = bench_long_context.run(device, quick=quick)
        print_table(rows, bench_long_context.summary_columns)
        path = write_csv(rows, "long_context" + ("-quick" if quick else "") + ".csv", args.out)
        print(f"\nwrote {path}; {rows[0]['device']}; commit {rows[0]['commit']}\n")
    for name, bench in (("checkpoint", bench_checkpoint), ("frontier", bench_frontier)):
        if args.only in (None, name):
            rows = bench.run(device, quick=args.quick)
            print_table(rows, bench.summary_columns)
            path = write_csv(rows, f"{name}-{tag}.csv", args.out)
            png = None if args.no_plots else bench.plot(rows, os.path.splitext(path)[0] + ".png")
            print(f"\nwrote {path}" + (f" and {png}" if png else "") + f"; device: {rows[0]['device']}; "
                  f"commit {rows[0]['commit']}")
    if failures:
        print("\nNot timed:\n" + "\n".join(failures), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
