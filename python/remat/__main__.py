"""``python -m remat info``: print what this installation can run."""

import sys

from remat.info import info


def main(argv):
    if argv != ["info"]:
        print("usage: python -m remat info", file=sys.stderr)
        return 2
    info()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
