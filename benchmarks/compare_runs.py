"""Do two runs of a benchmark agree? (DESIGN.md section 8: a ratio that flips between runs is a
measurement defect.) Matches the rows of two CSVs written by the same benchmark and, for every
time ratio column with a spread (``time_vs_<label>`` with ``_q20`` / ``_q80``), lists the rows
whose 20-80% bands do not overlap, and those whose verdicts contradict each other ("faster" in
one run, "slower" in the other). Exits 1 if any row disagrees.

    python -m benchmarks.compare_runs A.csv B.csv
"""

import argparse
import csv
import sys

# Columns that say which measurement a row is (every other column is measured or a tag).
IDENTITY_COLUMNS = ("block", "model", "run", "configuration", "strategy", "blocks", "rows", "tokens", "hidden",
                    "inter", "intermediate", "experts", "top_k", "heads", "kv_heads", "batch", "length", "head_dim",
                    "causal", "window", "softcap", "vocab", "depth", "rank", "lora_dropout", "dtype", "provider",
                    "mode")


def ratio_columns(fields):
    """The ``time_vs_<label>`` columns of a CSV header that come with their 20% and 80% quantiles."""
    return [c for c in fields if c.startswith("time_vs_") and f"{c}_q20" in fields and f"{c}_q80" in fields]


def _key(row, identity):
    return tuple(row[c] for c in identity)


def disagreements(rows_a, rows_b):
    """[(row key as a dict, column, (median, q20, q80) of run A, the same of run B, why)] for every
    ratio measured in both runs whose bands are disjoint or whose verdicts contradict. Rows are
    matched on IDENTITY_COLUMNS; raises ValueError if the two runs do not hold the same rows (a
    different benchmark or settings) or a key is not unique."""
    if not rows_a or not rows_b:
        raise ValueError("both runs need at least one row")
    fields = list(rows_a[0])
    if set(fields) != set(rows_b[0]):
        raise ValueError("the two CSVs have different columns: not runs of the same benchmark")
    identity = [c for c in IDENTITY_COLUMNS if c in fields]
    by_key = {}
    for name, rows in (("A", rows_a), ("B", rows_b)):
        keyed = {_key(r, identity): r for r in rows}
        if len(keyed) != len(rows):
            raise ValueError(f"run {name}: rows are not unique by {identity}")
        by_key[name] = keyed
    if by_key["A"].keys() != by_key["B"].keys():
        raise ValueError("the two runs measured different rows (other cases, providers or --quick)")
    out = []
    for key, row_a in by_key["A"].items():
        row_b = by_key["B"][key]
        for column in ratio_columns(fields):
            if row_a[column] == "" or row_b[column] == "":
                continue
            a = tuple(float(row_a[c]) for c in (column, f"{column}_q20", f"{column}_q80"))
            b = tuple(float(row_b[c]) for c in (column, f"{column}_q20", f"{column}_q80"))
            verdicts = {row_a.get(f"{column}_verdict"), row_b.get(f"{column}_verdict")}
            if a[2] < b[1] or b[2] < a[1]:
                out.append((dict(zip(identity, key)), column, a, b, "bands disjoint"))
            elif verdicts == {"faster", "slower"}:
                out.append((dict(zip(identity, key)), column, a, b, "verdicts contradict"))
    return out


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _band(values):
    return f"{values[0]:.3f} [{values[1]:.3f}, {values[2]:.3f}]"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", help="CSV of the first run")
    parser.add_argument("second", help="CSV of the second run of the same benchmark")
    args = parser.parse_args(argv)
    rows_a, rows_b = _read(args.first), _read(args.second)
    found = disagreements(rows_a, rows_b)
    for key, column, a, b, why in found:
        row = " ".join(f"{k}={v}" for k, v in key.items() if v != "")
        print(f"{row}: {column} {_band(a)} vs {_band(b)}: {why}")
    compared = sum(1 for r in rows_a for c in ratio_columns(list(rows_a[0])) if r[c] != "")
    print(f"{len(found)} of {compared} ratios disagree between {args.first} and {args.second}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
