"""Packaging: what ``import gdsckpt`` pulls in, the declared dependencies, and the CI entry point."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

HEAVY = ("torch", "cupy", "kvikio", "nvidia.nvcomp", "nvidia", "jax")

_PROBE = """
import json, sys
{imports}
heavy = {heavy!r}
loaded = sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))
print(json.dumps(loaded))
"""


def _loaded_heavy_modules(imports: str, h: Any) -> list[str]:
    result = h.run_python("-c", _PROBE.format(imports=imports, heavy=HEAVY), cwd=Path("/"))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_gdsckpt_imports_no_array_or_gpu_library(h: Any) -> None:
    assert _loaded_heavy_modules("import gdsckpt\nassert gdsckpt.save and gdsckpt.load", h) == []


def test_import_of_every_cpu_module_imports_no_array_or_gpu_library(h: Any) -> None:
    imports = "\n".join(f"import {m}" for m in (
        "gdsckpt", "gdsckpt.api", "gdsckpt.state", "gdsckpt.config", "gdsckpt.errors", "gdsckpt.format",
        "gdsckpt.codecs", "gdsckpt.codecs.cpu", "gdsckpt.io", "gdsckpt.io.posix", "gdsckpt.pipeline.engine",
        "gdsckpt.pipeline.load", "gdsckpt.pipeline.save", "gdsckpt.pipeline.plan", "gdsckpt.cli.main"))
    assert _loaded_heavy_modules(imports, h) == []


def test_probe_detects_a_heavy_import(h: Any) -> None:
    """Guard: the probe above does see torch when something imports it."""
    assert "torch" in _loaded_heavy_modules("import gdsckpt, gdsckpt.demo", h)


def test_numpy_only_checkpoint_round_trips_without_torch(tmp_path: Path, h: Any) -> None:
    path = tmp_path / "np.gdsckpt"
    imports = f"""
import gdsckpt, numpy as np
state = {{"a": np.arange(10000, dtype=np.float32), "b": [np.float64(1.5), 3], "c": "x"}}
gdsckpt.save(state, {str(path)!r}, chunk_bytes=4096)
back = gdsckpt.load({str(path)!r})
assert back["a"].tobytes() == state["a"].tobytes() and back["b"] == state["b"] and back["c"] == "x"
gdsckpt.verify({str(path)!r}); gdsckpt.inspect({str(path)!r})
with gdsckpt.open({str(path)!r}) as ckpt:
    ckpt.get("a")
"""
    assert _loaded_heavy_modules(imports, h) == []
    assert path.exists()


def _readme_code_blocks() -> list[str]:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def _readme_test_command() -> str:
    commands = [line.strip() for block in _readme_code_blocks() for line in block.splitlines()
                if re.search(r"\bpytest\b", line) and not line.lstrip().startswith("#")]
    assert len(commands) == 1, f"README should show one test command line, found {commands}"
    return commands[0]


def test_readme_test_command_is_what_ci_runs(h: Any) -> None:
    command = _readme_test_command()
    assert "pytest" in command and "pip install" in command
    ci = h.REPO_ROOT / ".ci" / "run"
    lines = [line.strip() for line in ci.read_text(encoding="utf-8").splitlines()]
    assert command in lines, f"{ci} does not run the README's test command {command!r}"


def test_ci_script_is_an_executable_bash_script(h: Any) -> None:
    ci = h.REPO_ROOT / ".ci" / "run"
    assert os.access(ci, os.X_OK)
    text = ci.read_text(encoding="utf-8")
    assert text.startswith("#!") and "bash" in text.splitlines()[0]
    assert "set -e" in text or "set -euo pipefail" in text
    syntax = subprocess.run(["bash", "-n", str(ci)], check=False, capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_readme_demo_command_uses_the_module_entry_point() -> None:
    lines = [line for block in _readme_code_blocks() for line in block.splitlines() if "gdsckpt demo" in line]
    assert lines and all("python3 -m gdsckpt demo" in line for line in lines)


def test_readme_demo_command_installs_the_demo_extra_only() -> None:
    """The first command installs what the demo needs, not the test extra (pytest, lightning, ...)."""
    lines = [line for block in _readme_code_blocks() for line in block.splitlines() if "gdsckpt demo" in line]
    assert lines[0].startswith('python3 -m pip install -q -e ".[demo]" && '), lines[0]


def _third_party_imports(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports, other than gdsckpt's own and the standard library's."""
    import ast
    import sys

    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names and name != "gdsckpt"}


def test_demo_extra_holds_what_the_demo_imports(pyproject: dict[str, Any], h: Any) -> None:
    project = pyproject["project"]
    demo = _names(project["optional-dependencies"]["demo"])
    imported = _third_party_imports(h.REPO_ROOT / "gdsckpt" / "tools" / "demo.py")
    assert imported and imported <= demo | _names(project["dependencies"]), imported
    assert demo <= _names(project["optional-dependencies"]["test"]), "the tests run the demo too"
    assert len(demo) < len(project["optional-dependencies"]["test"])


def test_wheel_ships_the_presets(tmp_path: Path, h: Any) -> None:
    """A wheel built from this checkout holds the presets, so ``Config.preset`` works in a wheel install."""
    import shutil
    import zipfile

    from gdsckpt.config import preset_names

    pytest.importorskip("setuptools")
    source = tmp_path / "src"
    source.mkdir()
    # A copy: building writes build/ and egg-info beside the sources.
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy2(h.REPO_ROOT / name, source / name)
    shutil.copytree(h.REPO_ROOT / "gdsckpt", source / "gdsckpt",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (tmp_path / "dist").mkdir()
    build = ("import sys; from setuptools import build_meta; "
             "print(build_meta.build_wheel(sys.argv[1]))")
    result = h.run_python("-c", build, str(tmp_path / "dist"), cwd=source, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    wheel = tmp_path / "dist" / result.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if name.startswith("gdsckpt/presets/")}
    assert shipped == {f"gdsckpt/presets/{name}.toml" for name in preset_names()}
    assert len(shipped) == 4


@pytest.fixture(scope="module")
def pyproject(h: Any) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    with (h.REPO_ROOT / "pyproject.toml").open("rb") as handle:
        return tomllib.load(handle)


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_dependencies_cover_what_the_package_and_tests_import(pyproject: dict[str, Any]) -> None:
    project = pyproject["project"]
    assert {"numpy", "zstandard", "lz4", "crc32c"} <= _names(project["dependencies"])
    assert "torch" not in _names(project["dependencies"]), "torch must stay optional"
    test_extra = _names(project["optional-dependencies"]["test"])
    assert {"torch", "pytest", "hypothesis", "pytest-timeout"} <= test_extra


def test_pytest_configuration_is_strict(pyproject: dict[str, Any]) -> None:
    options = pyproject["tool"]["pytest"]["ini_options"]
    assert "--strict-markers" in shlex.split(options["addopts"])
    assert options["filterwarnings"][0] == "error"
    assert options["testpaths"] == ["tests"]


def test_version_and_public_names(pyproject: dict[str, Any]) -> None:
    import gdsckpt

    assert gdsckpt.__version__ == pyproject["project"]["version"]
    for name in gdsckpt.__all__:
        assert hasattr(gdsckpt, name), name
    assert pyproject["project"]["scripts"]["gdsckpt"] == "gdsckpt.cli.main:main"
    assert (Path(gdsckpt.__file__).parent / "py.typed").exists()


def test_console_entry_point_main_returns_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gdsckpt.cli.main import main

    bad = tmp_path / "bad.gdsckpt"
    bad.write_bytes(b"nope" * 2000)
    assert main(["verify", str(bad)]) == 1
    assert "not a gdsckpt checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        main(["nonsense"])
    assert caught.value.code == 2
