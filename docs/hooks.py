"""MkDocs hook (mkdocs.yml `hooks:`): adds the benchmark plots under benchmarks/results to the
site as img/results/<name>.png, so the pages show the current plots without copies in docs/."""

import pathlib

from mkdocs.structure.files import File

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def on_files(files, config):
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"img/results/{png.name}", abs_src_path=str(png)))
    return files
