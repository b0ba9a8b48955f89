"""The CLI as a user installs it: from the wheel, not from this checkout.

The wheel is built from the repository (``pip wheel .``; the benchmarks that need a
checkout stay out of it) and unpacked into a folder. A Python started with ``-S``
(no site hooks, so this checkout's editable install is not on the path) sees that
folder first, then the dependencies of this venv. There, ``hicache --help`` and the
``--help`` of every command and sub-command must run, and every module of the
wheel's bench, cli and admin packages (what the commands import when they run) must
import: a command whose module the wheel leaves out fails here.
"""

from __future__ import annotations

import json
import site
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

CHILD = r"""
import json, sys
wheel_dir, deps = sys.argv[1], json.loads(sys.argv[2])
sys.path[:0] = [wheel_dir, *deps]
import hicache
assert hicache.__file__.startswith(wheel_dir), hicache.__file__
import typer
from typer.testing import CliRunner
from hicache.integration.cli.main import app

def commands(cmd, path):
    yield path
    if hasattr(cmd, "commands"):  # a group (typer's own click)
        for name, sub in sorted(cmd.commands.items()):
            yield from commands(sub, [*path, name])

runner = CliRunner()
ran = []
for path in commands(typer.main.get_command(app), []):
    result = runner.invoke(app, [*path, "--help"])
    if result.exit_code != 0:
        print("FAILED", path, result.output, repr(result.exception), file=sys.stderr)
        sys.exit(1)
    ran.append(" ".join(path))
# What the commands import when they run (lazily, so --help does not): every module
# of the wheel's bench, cli and admin packages.
import importlib, pathlib
root = pathlib.Path(wheel_dir)
for part in ("bench", "cli", "admin"):
    for f in sorted((root / "hicache" / "integration" / part).rglob("*.py")):
        name = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        importlib.import_module(name)
        ran.append(name)
print(json.dumps(ran))
"""


def test_every_cli_command_runs_from_the_installed_wheel(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps",
                    "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
                   check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("vllm_hicache-*.whl")
    installed = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(installed)
        names = zf.namelist()
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        assert "hicache = hicache.integration.cli.main:main" in zf.read(entry).decode()
    assert not any("/bench/micro/" in n or "/bench/peers/" in n for n in names)
    deps = site.getsitepackages()
    got = subprocess.run([sys.executable, "-S", "-c", CHILD, str(installed), json.dumps(deps)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    ran = json.loads(got.stdout.strip().splitlines()[-1])
    # the top level, each sub-app and their commands
    assert "" in ran and "admin" in ran and "bench" in ran and "admin stats" in ran
    assert len([r for r in ran if not r.startswith("hicache.")]) >= 10, ran
    assert "hicache.integration.bench.client" in ran and "hicache.integration.cli.main" in ran
