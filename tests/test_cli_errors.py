"""The command line's manners, through the installed ``gdsckpt`` console script in a subprocess:
``--version``, help text for every option without markup, one error line with one prefix, exit
code 2 for bad arguments and 1 for failures, tracebacks only with ``--verbose``, a quiet exit
when stdout's reader goes away, and a clear message where PyTorch is not installed."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gdsckpt
from gdsckpt.cli.main import build_parser
from gdsckpt.codecs.nvcomp import gpu_available

SCRIPT = Path(sysconfig.get_path("scripts")) / "gdsckpt"
COMMANDS = ("demo", "inspect", "verify", "rebase", "bench", "convert", "plan")


def gdsckpt_command(*args: str, h: Any, pythonpath: Path | None = None, cwd: Path | None = None,
                    timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the ``gdsckpt`` console script (``python -m gdsckpt`` where it is not installed) against
    this checkout; ``pythonpath`` goes first on the import path (to shadow a module)."""
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "gdsckpt"]
    env = h.subprocess_env()
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env["PYTHONPATH"]])
    return subprocess.run([*command, *args], check=False, capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=str(cwd or h.REPO_ROOT))


def assert_one_error_line(result: subprocess.CompletedProcess[str], command: str | None, code: int,
                          *fragments: str) -> str:
    """``result`` exited with ``code`` and printed exactly one line on stderr, ``gdsckpt <command>:
    error: ...``, holding every fragment; returns that line."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    prefix = f"gdsckpt {command}: error: " if command else "gdsckpt: error: "
    assert lines[0].startswith(prefix), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "c.gdsckpt"
    gdsckpt.save({"w": np.arange(5000, dtype=np.float32)}, path, chunk_bytes=4096)
    return path


def test_version(h: Any) -> None:
    result = gdsckpt_command("--version", h=h)
    assert result.returncode == 0 and result.stdout.strip() == f"gdsckpt {gdsckpt.__version__}", result


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_and_argument_has_help_text() -> None:
    parser = build_parser()
    commands = _subparsers(parser)
    assert set(commands) == set(COMMANDS)
    missing = [f"{name} {action.dest}" for name, sub in [("gdsckpt", parser), *commands.items()]
               for action in sub._actions
               if not isinstance(action, argparse._SubParsersAction) and not action.help]
    assert missing == []


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_plain_text(command: str | None, h: Any) -> None:
    result = gdsckpt_command(*([command] if command else []), "--help", h=h)
    assert result.returncode == 0, result.stderr
    for markup in ("``", ":mod:", ":func:", ":class:", ":meth:"):
        assert markup not in result.stdout, (markup, result.stdout)
    if command is None:
        assert "--version" in result.stdout and "PRESET" in result.stdout


@pytest.mark.parametrize("args, command, fragments", [
    ([], None, ["required: COMMAND"]),
    (["frobnicate"], None, ["invalid choice: 'frobnicate'"]),
    (["inspect"], "inspect", ["required: PATH"]),
    (["inspect", ""], "inspect", ["the path is empty"]),
    (["verify", ""], "verify", ["the path is empty"]),
    (["verify", "a", "b"], None, ["unrecognized arguments: b"]),
    (["demo", "--width", "-5"], "demo", ["--width", "must be >= 1, got '-5'"]),
    (["demo", "--width=-5"], "demo", ["--width", "must be >= 1, got '-5'"]),
    (["demo", "--width", "6"], "demo", ["width must be a positive multiple of 4"]),
    (["demo", "--depth", "0"], "demo", ["--depth", "must be >= 1"]),
    (["demo", "--device", "tpu"], "demo", ["device 'tpu' is invalid"]),
    # a missing --dir was named by the path of the temporary directory the demo makes inside it
    (["demo", "--dir", "no-such-directory"], "demo", ["directory 'no-such-directory' does not exist"]),
    (["bench", "--target", ".", "--size", "-1MiB"], "bench", ["--size", "not a byte size: '-1MiB'"]),
    (["bench", "--target", ".", "--size=-1MiB"], "bench", ["--size", "not a byte size: '-1MiB'"]),
    (["bench", "--target", ".", "--size", "-4096"], "bench", ["--size", "not a byte size: '-4096'"]),
    (["bench", "--target", ""], "bench", ["the path is empty"]),
    (["plan", "--params", "-7B"], "plan", ["--params", "not a count: '-7B'"]),
    # the plan's floats overflowed: exit 1 with an OverflowError
    (["plan", "--params", "1e400"], "plan", ["--params", "at most 1e+18", "'1e400'"]),
    (["plan"], "plan", ["give --params"]),
    # a price or GPU count near float's limit printed "$inf" / "$nan", and NaN into --json
    (["plan", "--params", "7B", "--gpu-hour-price", "1e308"], "plan", ["--gpu-hour-price", "at most 1e+12"]),
    (["plan", "--params", "7B", "--gpus", "99999999999999999999999"], "plan", ["--gpus", "at most 1e+12"]),
    (["plan", "--params", "7B", "--gpus", "2.5"], "plan", ["--gpus", "whole number >= 1"]),
    (["convert", "", "x.gdsckpt"], "convert", ["the path is empty"]),
    # "-" as a file name: convert x - wrote a file named "-", which convert - y then read
    (["convert", "x.gdsckpt", "-", "--to", "pt"], "convert", ["'-' (standard input or output) is not supported"]),
    (["convert", "-", "x.gdsckpt"], "convert", ["'-' (standard input or output) is not supported"]),
    (["verify", "-"], "verify", ["'-' (standard input or output) is not supported"]),
    # rebase's bad codec exited 1 with "ValueError: unknown codec", convert's 2
    (["rebase", "x.gdsckpt", "--codec", "bogus"], "rebase", ["unknown codec 'bogus'"]),
    (["--config", "fast-nvm", "verify", "x"], "verify", ["--config", "did you mean 'fast-nvme'?"]),
    (["--config", "missing.toml", "verify", "x"], "verify", ["--config", "missing.toml"]),
])
def test_usage_errors_exit_2_with_one_line(args: list[str], command: str | None, fragments: list[str],
                                           h: Any) -> None:
    assert_one_error_line(gdsckpt_command(*args, h=h), command, 2, *fragments)


def test_demo_cuda_without_cuda_is_a_usage_error(h: Any) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    assert_one_error_line(gdsckpt_command("demo", "--device", "cuda", h=h), "demo", 2,
                          "device 'cuda' asked for", "sees no CUDA device")


@pytest.mark.parametrize("command", ["inspect", "verify", "rebase"])
def test_failures_exit_1_with_one_line_and_a_traceback_only_when_verbose(command: str, tmp_path: Path,
                                                                          h: Any) -> None:
    foreign = tmp_path / "foreign.gdsckpt"
    foreign.write_bytes(b"\x00" * 9000)
    assert_one_error_line(gdsckpt_command(command, str(foreign), h=h), command, 1, "not a gdsckpt checkpoint")
    missing = gdsckpt_command(command, str(tmp_path / "absent.gdsckpt"), h=h)
    assert_one_error_line(missing, command, 1, "absent.gdsckpt")
    verbose = gdsckpt_command("--verbose", command, str(foreign), h=h)
    assert verbose.returncode == 1 and "Traceback (most recent call last)" in verbose.stderr
    assert verbose.stderr.splitlines()[-1].startswith(f"gdsckpt {command}: error: ")


def test_a_directory_is_a_failure_not_a_traceback(tmp_path: Path, h: Any) -> None:
    assert_one_error_line(gdsckpt_command("verify", str(tmp_path), h=h), "verify", 1, str(tmp_path))


def test_subcommand_errors_share_the_prefix(tmp_path: Path, h: Any) -> None:
    """bench and plan report through the library's logger: the line reads like every other."""
    missing = tmp_path / "no-such-dir"
    assert_one_error_line(gdsckpt_command("bench", "--target", str(missing), "--size", "1MiB", "--device",
                                          "cpu", "--out", str(tmp_path / "out"), h=h),
                          "bench", 1, "does not exist")
    assert_one_error_line(gdsckpt_command("plan", "--from", str(tmp_path / "absent.gdsckpt"), h=h),
                          "plan", 1, "absent.gdsckpt")
    assert_one_error_line(gdsckpt_command("plan", "--params", "7B", "--gpus", "8", "--writers", "9", h=h),
                          "plan", 2, "writers must be between 1 and gpus")


def test_stdout_closed_early_exits_quietly(tmp_path: Path, h: Any) -> None:
    """``gdsckpt inspect f | head -2``: far more output than a pipe holds, the reader gone after two
    lines: no BrokenPipeError, nothing on stderr, 141 as for ``cat``."""
    path = tmp_path / "many.gdsckpt"
    gdsckpt.save({f"layer{i}": np.full(4, i, dtype=np.float32) for i in range(3000)}, path, chunk_bytes=4096)
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "gdsckpt"]
    process = subprocess.Popen([*command, "inspect", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=h.subprocess_env(), cwd=str(h.REPO_ROOT))
    assert process.stdout is not None and process.stderr is not None
    head = [process.stdout.readline() for _ in range(2)]
    process.stdout.close()
    stderr = process.stderr.read().decode()
    process.stderr.close()
    assert process.wait(timeout=120) == 141, stderr
    assert all(head) and stderr == ""


def _without_torch(tmp_path: Path) -> Path:
    """A folder that, first on the import path, makes ``import torch`` fail as on a machine
    without PyTorch."""
    shadow = tmp_path / "no-torch"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'torch\'", name="torch")\n', encoding="utf-8")
    return shadow


@pytest.mark.parametrize("args, extra", [
    (["demo", "--width", "64", "--depth", "1"], "demo"),
    (["bench", "--target", "{tmp}", "--size", "1MiB", "--device", "cpu"], "bench"),
])
def test_commands_that_need_torch_name_the_extra(args: list[str], extra: str, tmp_path: Path, h: Any) -> None:
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    result = gdsckpt_command(*args, h=h, pythonpath=_without_torch(tmp_path))
    assert_one_error_line(result, args[0], 1, "needs torch", f"pip install 'gdsckpt[{extra}]'")
    assert "Traceback" not in result.stderr


def test_inspect_and_verify_work_without_torch(saved: Path, tmp_path: Path, h: Any) -> None:
    shadow = _without_torch(tmp_path)
    for command in ("inspect", "verify"):
        result = gdsckpt_command(command, str(saved), h=h, pythonpath=shadow)
        assert result.returncode == 0, result.stderr


def test_config_takes_a_preset_name_from_any_directory(saved: Path, tmp_path: Path, h: Any) -> None:
    assert gdsckpt.config.preset_names() == ("async-training", "fast-nvme", "portable", "shared-filesystem")
    for name in ("portable", "shared-filesystem", "async-training"):
        result = gdsckpt_command("--config", name, "verify", str(saved), h=h, cwd=tmp_path)
        assert result.returncode == 0, (name, result.stderr)
    # fast-nvme asks for the GPU engine: that it is refused on a CPU machine shows it was applied
    if not gpu_available():
        assert_one_error_line(gdsckpt_command("--config", "fast-nvme", "verify", str(saved), h=h, cwd=tmp_path),
                              "verify", 1, "engine='gpu'")


@pytest.mark.parametrize("kind", ["fifo", "huge", "directory"])
def test_a_config_that_is_not_a_small_regular_file_is_a_usage_error(kind: str, tmp_path: Path, h: Any) -> None:
    """``--config`` naming a FIFO hung the command for ever (the file was read with a plain
    ``open().read()``), and a large file (a checkpoint given by mistake) was read whole. Both are
    now a usage error naming the file, at once."""
    config = tmp_path / "config.toml"
    if kind == "fifo":
        os.mkfifo(config)
        fragment = "is not a regular file (a FIFO"
    elif kind == "directory":  # said "(a FIFO, a device or a socket)"
        config.mkdir()
        fragment = "is not a regular file (a directory)"
    else:
        config.write_bytes(b"#" * (2 << 20))
        fragment = "holds more than 1048576 bytes"
    result = gdsckpt_command("--config", str(config), "verify", "x.gdsckpt", h=h, timeout=60)
    assert_one_error_line(result, "verify", 2, "--config", str(config), fragment)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("args, command", [(["--version"], None), (["bench", "--help"], None),
                                           (["plan", "--params", "7B"], "plan")])
def test_output_lost_to_a_full_disk_is_a_failure(args: list[str], command: str | None, h: Any) -> None:
    """stdout on a full disk (/dev/full): exit 1 with one line, also for ``--version`` and
    ``--help``, whose output argparse wrote and whose failure it ignored (exit 0, nothing said)."""
    run = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "gdsckpt"]
    with open("/dev/full", "w") as full:
        result = subprocess.run([*run, *args], check=False, stdout=full, stderr=subprocess.PIPE, text=True,
                                timeout=120, env=h.subprocess_env(), cwd=str(h.REPO_ROOT))
    result.stdout = ""
    assert_one_error_line(result, command, 1, "No space left")


def test_stdout_closed_from_the_start_is_a_failure(h: Any) -> None:
    """Started with stdout closed (``>&-``): one error line, exit 1, instead of the internal
    ``AttributeError`` of flushing a stdout that is None."""
    run = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "gdsckpt"]
    result = subprocess.run([*run, "plan", "--params", "7B"], check=False, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, timeout=120, env=h.subprocess_env(),
                            cwd=str(h.REPO_ROOT), preexec_fn=lambda: os.close(1))
    assert_one_error_line(result, "plan", 1, "standard output is closed")


def test_a_usage_error_with_stdout_closed_keeps_its_code(h: Any) -> None:
    """``gdsckpt plan >&-`` (no model given): exit 2 with the usage error's one line, not 1 with a
    second line about the closed stdout, which the command never wrote to."""
    run = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "gdsckpt"]
    result = subprocess.run([*run, "plan"], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, timeout=120, env=h.subprocess_env(), cwd=str(h.REPO_ROOT),
                            preexec_fn=lambda: os.close(1))
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr


def test_convert_failures_show_a_traceback_only_when_verbose(tmp_path: Path, h: Any) -> None:
    """``convert`` printed its error line itself, so ``--verbose`` never showed the traceback the
    other commands show."""
    foreign = tmp_path / "foreign.gdsckpt"
    foreign.write_bytes(b"\x00" * 9000)
    out = str(tmp_path / "out.safetensors")
    assert_one_error_line(gdsckpt_command("convert", str(foreign), out, h=h), "convert", 1, "foreign.gdsckpt")
    verbose = gdsckpt_command("--verbose", "convert", str(foreign), out, h=h)
    assert verbose.returncode == 1 and "Traceback (most recent call last)" in verbose.stderr
    assert verbose.stderr.splitlines()[-1].startswith("gdsckpt convert: error: ")


def test_a_quiet_command_with_stdout_closed_succeeds(tmp_path: Path, h: Any) -> None:
    """``gdsckpt -q convert a b >&-`` wrote b and exited 1 ("standard output is closed") though a
    quiet conversion prints nothing; a command whose output is lost still fails."""
    torch = pytest.importorskip("torch")
    src, dst = tmp_path / "a.pt", tmp_path / "b.gdsckpt"
    torch.save({"w": torch.randn(100)}, src)
    run = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "gdsckpt"]

    def closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*run, *args], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=120, env=h.subprocess_env(), cwd=str(h.REPO_ROOT),
                              preexec_fn=lambda: os.close(1))

    quiet = closed_stdout("--quiet", "convert", str(src), str(dst))
    assert quiet.returncode == 0 and quiet.stderr == "" and dst.exists(), quiet.stderr
    loud = closed_stdout("convert", str(src), str(tmp_path / "c.gdsckpt"))
    assert_one_error_line(loud, "convert", 1, "standard output is closed")


def test_demo_killed_removes_its_temporary_directory(tmp_path: Path, h: Any) -> None:
    """``kill`` (SIGTERM) of a running demo left its temporary directory (the checkpoint and the
    torch.save file, tens of MB) behind; now it ends as Ctrl-C does: exit 130, nothing left."""
    pytest.importorskip("torch")
    run = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "gdsckpt"]
    process = subprocess.Popen([*run, "demo", "--width", "256", "--depth", "4", "--rounds", "50",
                                "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=h.subprocess_env(), cwd=str(h.REPO_ROOT))
    try:
        deadline = time.monotonic() + 120
        while not any(tmp_path.rglob("demo.*")) and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert process.poll() is None, "the demo ended before it wrote a file"
        process.send_signal(signal.SIGTERM)
        _out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err
    assert list(tmp_path.iterdir()) == []
    assert err.strip().splitlines()[-1] == "gdsckpt demo: error: interrupted", err


def test_a_bad_environment_variable_is_not_blamed_on_config(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A bad ``GDSCKPT_*`` variable was reported as "--config: ..." with no --config given."""
    from gdsckpt.cli.main import main

    monkeypatch.setenv("GDSCKPT_CHUNK_BYTES", "abc")
    assert main(["inspect", "missing.gdsckpt"]) == 2
    line = capsys.readouterr().err.strip()
    assert "GDSCKPT_CHUNK_BYTES" in line and "--config" not in line and "\n" not in line, line
