"""Check the dependency lower bounds in pyproject.toml: install every ``name>=X`` dependency at exactly ``X`` in a
fresh virtual environment and run the test suite there.

    python benchmarks/lower_bounds.py --venv /tmp/lower-bounds --out docs/results/lower_bounds.json

torch is the exception: it is installed as ``--torch`` (default ``torch==2.13.0``, the CPU wheel of the README),
since the lowest torch on PyPI is a multi-GB CUDA build; its own lower bound stays unchecked. A bound that pip
cannot satisfy together with the others (say, a transformers release needs a newer safetensors) fails the
install, and the output names the conflict: raise that bound in pyproject.toml. The result file records the
versions installed and pytest's summary line; the exit status is pytest's (or pip's).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lower_bound_pins(dependencies: list[str], skip: tuple[str, ...] = ("torch",)) -> list[str]:
    """``name==X`` for every ``name>=X`` requirement (extras and other clauses ignored), except ``skip``."""
    pins = []
    for req in dependencies:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*>=\s*([^,;\s]+)", req)
        if m and m.group(1).lower() not in skip:
            pins.append(f"{m.group(1)}=={m.group(3)}")
    return pins


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, text=True, capture_output=True, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", required=True, help="a new folder for the virtual environment")
    parser.add_argument("--torch", default="torch==2.13.0")
    parser.add_argument("--pytest-args", default="-q -p no:cacheprovider", help="passed to pytest")
    parser.add_argument("--out", default="docs/results/lower_bounds.json")
    args = parser.parse_args()

    venv = Path(args.venv)
    if venv.exists():
        raise SystemExit(f"{venv} exists: give a new folder (this check never reuses or deletes one)")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = lower_bound_pins(project["dependencies"] + project["optional-dependencies"]["test"])
    py = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    result: dict = {"command": "python " + " ".join(sys.argv), "date": dt.datetime.now(dt.timezone.utc).isoformat(
        timespec="seconds"), "torch": args.torch, "pins": pins}
    for step in ([py, "-m", "pip", "install", "--quiet", args.torch],
                 [py, "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[test]", "-c", str(constraints)]):
        proc = run(step)
        if proc.returncode:
            result.update(status="install failed", pip_error=proc.stderr[-4000:])
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            print(proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
    freeze = run([py, "-m", "pip", "freeze"]).stdout.splitlines()
    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    wanted = {norm(p.split("==")[0]) for p in pins} | {"torch"}
    result["installed"] = sorted(line for line in freeze if norm(line.split("==")[0]) in wanted)
    proc = subprocess.run([py, "-m", "pytest", *shlex.split(args.pytest_args)], cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    result.update(status="tests passed" if proc.returncode == 0 else "tests failed",
                  pytest_summary=lines[-1] if lines else "", pytest_returncode=proc.returncode,
                  failures=[line for line in lines if line.startswith(("FAILED", "ERROR"))][:50])
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(result["pytest_summary"])
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
