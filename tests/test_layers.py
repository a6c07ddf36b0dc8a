"""What may import what: backend's folders are layers, compression sees one seam of the engine.

    settings, platform   <- model <- engine <- openai_api <- routing, serving   (<- gateway, eval)
    policies <- compression (<- gateway, eval)

Each backend folder may import only the folders listed for it below (every import counts, also
lazy and type-only ones); compression imports from backend only the engine's public types
(`ctxgate.backend.engine.api`) and `ctxgate.backend.platform`, and nothing of the gateway or eval.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALLOWED = {
    "settings": set(),
    "platform": set(),
    "model": {"platform", "settings"},
    "engine": {"platform", "settings", "model"},
    "openai_api": {"platform", "settings", "model", "engine"},
    "routing": {"platform", "settings", "model", "engine", "openai_api"},
    "serving": {"platform", "settings", "model", "engine", "openai_api"},
}
COMPRESSION_SEAM = ("ctxgate.backend.engine.api", "ctxgate.backend.platform")


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("ctxgate.")}


def test_backend_has_no_module_outside_a_job_folder():
    assert [p.name for p in (REPO / "backend").glob("*.py")] == ["__init__.py"]
    assert {p.name for p in (REPO / "backend").iterdir() if (p / "__init__.py").is_file()} == set(ALLOWED)


def layer_violations(folder: str, path: Path) -> list[str]:
    """The imports of `path`, a module of backend/<folder>, that point at a layer it may not use."""
    wrong = []
    for module in sorted(imported_modules(path)):
        parts = module.split(".")
        if parts[:2] == ["ctxgate", "backend"] and len(parts) > 2:
            if parts[2] != folder and parts[2] not in ALLOWED[folder]:
                wrong.append(f"{path.name} imports {module}")
        elif parts[1] in {"gateway", "compression", "policies", "eval", "cli", "client"}:
            wrong.append(f"{path.name} imports {module}")
    return wrong


def test_backend_folders_import_only_the_layers_below():
    wrong = [
        f"{folder}/{violation}"
        for folder in ALLOWED
        for path in (REPO / "backend" / folder).rglob("*.py")
        for violation in layer_violations(folder, path)
    ]
    assert wrong == []


def test_compression_sees_only_the_engine_seam_and_the_platform():
    wrong = []
    for path in (REPO / "compression").rglob("*.py"):
        for module in imported_modules(path):
            if module.startswith("ctxgate.backend.") and not module.startswith(COMPRESSION_SEAM):
                wrong.append(f"{path.relative_to(REPO)} imports {module}")
            if module.split(".")[1] in {"gateway", "eval"}:
                wrong.append(f"{path.relative_to(REPO)} imports {module}")
    assert wrong == []


def test_policies_import_nothing_else_of_ctxgate():
    wrong = [
        f"{path.relative_to(REPO)} imports {module}"
        for path in (REPO / "policies").rglob("*.py")
        for module in imported_modules(path)
        if not module.startswith("ctxgate.policies")
    ]
    assert wrong == []


def test_the_check_sees_an_upward_import(tmp_path):
    upward = tmp_path / "x.py"
    upward.write_text("def f():\n    from ctxgate.backend.serving.server import serve\n")
    assert layer_violations("engine", upward) == [
        "x.py imports ctxgate.backend.serving.server",
        "x.py imports ctxgate.backend.serving.server.serve",
    ]
    assert layer_violations("serving", upward) == []
