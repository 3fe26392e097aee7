"""``python -m remat info``: print what this installation can run.
``python -m remat fit CONFIG.json --gpu-memory 80GB ...``: what fits a GPU (remat.planning.fit)."""

import sys

USAGE = "usage: python -m remat info | python -m remat fit CONFIG.json --gpu-memory SIZE [options] (fit --help)"


def main(argv):
    if argv == ["info"]:
        from remat.info import info

        info()
        return 0
    if argv[:1] == ["fit"]:
        from remat.planning.fit import main as fit_main

        return fit_main(argv[1:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
