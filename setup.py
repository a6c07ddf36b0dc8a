"""Package discovery for the one `ctxgate` namespace.

pyproject.toml maps each top-level folder into `ctxgate` (`[tool.setuptools.package-dir]`); this
lists the packages found under each mapped folder, so a new subpackage ships without an edit here,
and a folder left out of a build context (the Docker image has no eval/) is simply not packaged.
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]

packages = []
for name, folder in PACKAGE_DIR.items():
    if (ROOT / folder / "__init__.py").is_file():
        packages += [name, *(f"{name}.{sub}" for sub in find_packages(str(ROOT / folder)))]

setup(packages=packages, package_dir={name: PACKAGE_DIR[name] for name in packages if name in PACKAGE_DIR})
