"""One namespace: every module imports ctxgate's packages as `ctxgate.<name>`, never bare.

Installed, the folders gateway/, backend/, compression/, policies/ and eval/ exist only inside
`ctxgate` (pyproject.toml's package-dir), so a bare `import backend` would find another project's
module, or none.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BARE = {"backend", "gateway", "compression", "policies", "eval"}


def _python_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [REPO / name for name in listed if (REPO / name).is_file()]


def bare_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] in BARE]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [node.module] if node.module.split(".")[0] in BARE else []
    return found


def test_the_scan_sees_every_form_of_a_bare_import():
    assert bare_imports(
        "import backend.engine.api as api\nfrom gateway import app\ndef f():\n    from eval.cli import main\n"
    ) == ["backend.engine.api", "gateway", "eval.cli"]
    assert bare_imports("from ctxgate.backend.engine import api\nimport ctxgate.gateway.app\n") == []


def test_no_module_imports_a_bare_top_level_package():
    files = _python_files()
    assert len(files) > 100
    offenders = {
        str(path.relative_to(REPO)): names for path in files if (names := bare_imports(path.read_text()))
    }
    assert offenders == {}


def test_the_source_tree_imports_its_own_folders(tmp_path):
    """A checkout on PYTHONPATH resolves ctxgate.gateway to its own gateway/ folder."""
    import ctxgate.compression.pipeline
    import ctxgate.gateway.app

    assert Path(ctxgate.gateway.app.__file__).resolve().parent == REPO / "gateway"
    assert Path(ctxgate.compression.pipeline.__file__).resolve().parent == REPO / "compression"
