"""Type-check the product packages with pyright (basedpyright), as they are installed.

pyright has no notion of setuptools' package-dir mapping (pyproject.toml maps gateway/ to
ctxgate.gateway, ...) and cannot follow the editable install's import hook, so it cannot tell that
`ctxgate.gateway.app` is gateway/app.py. This builds the installed layout as a tree of links under
build/pyright/ (real folders, one link per source file, the packages setup.py ships) and checks that
tree: every file then has one module name, the one its importers use. Diagnostics are printed with the
links' targets, the paths in the repository. Settings live in pyproject.toml ([tool.basedpyright]).

    python tools/typecheck.py [extra basedpyright arguments]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "pyright"


def package_folders() -> dict[str, Path]:
    """Each shipped package's dotted name and its folder in the repository, as setup.py lists them."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders: dict[str, Path] = {}
    for name, folder in mapping.items():
        base = ROOT / folder
        if (base / "__init__.py").is_file():
            folders[name] = base
            for sub in find_packages(str(base)):
                folders[f"{name}.{sub}"] = base.joinpath(*sub.split("."))
    return folders


def build_tree() -> dict[str, str]:
    """Links every package's source files into TREE; returns link prefix -> repository prefix."""
    shutil.rmtree(TREE, ignore_errors=True)
    prefixes: dict[str, str] = {}
    for name, folder in package_folders().items():
        target = TREE.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in [*folder.glob("*.py"), *folder.glob("*.pyi")]:
            (target / source.name).symlink_to(source)
        prefixes[f"{target}/"] = f"{folder.relative_to(ROOT)}/"
    return prefixes


def main() -> int:
    prefixes = build_tree()
    # The longest link prefix first: ctxgate/backend/engine/ before ctxgate/backend/.
    ordered = sorted(prefixes.items(), key=lambda item: len(item[0]), reverse=True)
    result = subprocess.run(
        [sys.executable, "-m", "basedpyright", "--pythonpath", sys.executable, *sys.argv[1:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    for line in (result.stdout + result.stderr).splitlines():
        for link, source in ordered:
            line = line.replace(link, source)
        print(line)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
