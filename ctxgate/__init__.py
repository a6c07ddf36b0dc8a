"""ctxgate: a RAG prompt-budget gateway with its own inference engine.

The version is defined once, in pyproject.toml; this reads it from the installed metadata.
"""

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

try:
    __version__ = version("ctxgate")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


# In a source checkout the subpackages are the folders beside this one (pyproject.toml maps them
# into `ctxgate` when installed): look for them there too, so the tree runs uninstalled and a
# checkout on PYTHONPATH imports its own folders rather than an editable install's.
_SOURCE_ROOT = Path(__file__).resolve().parent.parent
if (
    not (Path(__file__).resolve().parent / "gateway").is_dir()
    and (_SOURCE_ROOT / "gateway" / "__init__.py").is_file()
):
    __path__.append(str(_SOURCE_ROOT))
