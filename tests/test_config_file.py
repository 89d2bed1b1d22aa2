"""Config files (``Config.from_toml``, ``resolve_config``), the presets shipped in ``gdsckpt/presets/``
(``Config.preset``), and the
precedence of argument > config file > environment > default."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gdsckpt
from gdsckpt.codecs import PORTABLE_CODECS
from gdsckpt.config import Config, default_io_threads, parse_size, preset_names, resolve_config

ROOT = Path(__file__).resolve().parent.parent
PRESETS_DIR = ROOT / "gdsckpt" / "presets"
DOC = ROOT / "docs" / "configuration.md"

# What each preset sets, as docs/configuration.md states it; every other field keeps its default.
PRESETS = {
    "fast-nvme": {"codec": "ans", "engine": "gpu", "gpu_chunk_bytes": 16 << 20,
                       "max_staging_bytes": 2 << 30, "kvikio_threads": 32},
    "shared-filesystem": {"codec": "zstd", "engine": "auto", "io_threads": 16, "fsync": True},
    "portable": {"codec": "zstd", "engine": "auto", "byte_planes": "auto", "portable": True},
    "async-training": {"async_worker": "process", "async_engine": "cpu", "snapshot_gpu_bytes": 16 << 30},
}


def _write(tmp_path: Path, text: str, name: str = "settings.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _keys_set_by(path: Path) -> list[str]:
    return re.findall(r"^(\w+)\s*=", path.read_text(encoding="utf-8"), flags=re.MULTILINE)


# ---------------------------------------------------------------------------------------------
# the presets

def test_presets_folder_holds_exactly_the_documented_presets() -> None:
    assert sorted(p.stem for p in PRESETS_DIR.glob("*.toml")) == sorted(PRESETS)
    assert preset_names() == tuple(sorted(PRESETS))
    # one copy only: the old configs/ folder points to the package and holds no preset to drift
    assert list((ROOT / "configs").glob("*.toml")) == []


def test_preset_by_name_works_from_any_directory(tmp_path: Path, h: Any) -> None:
    probe = ("import gdsckpt, os; c = gdsckpt.Config.preset('shared-filesystem'); "
             "print(os.getcwd(), c.codec, c.io_threads)")
    result = h.run_python("-c", probe, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(tmp_path), "zstd", "16"]


def test_unknown_preset_names_the_presets() -> None:
    with pytest.raises(ValueError, match=r"preset 'fast-nvm' is unknown \(did you mean 'fast-nvme'\? expected one "
                                         r"of: async-training, fast-nvme, portable, shared-filesystem\)"):
        Config.preset("fast-nvm")


def test_resolve_config_takes_a_file_or_a_preset_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_config("portable") == Config.preset("portable")
    (tmp_path / "portable").write_text('codec = "lz4"\n', encoding="utf-8")  # a file of that name wins
    assert resolve_config("portable").codec == "lz4"
    assert resolve_config(str(PRESETS_DIR / "fast-nvme.toml")) == Config.preset("fast-nvme")
    with pytest.raises(ValueError, match="neither a file nor a preset"):
        resolve_config("no-such-preset")
    with pytest.raises(FileNotFoundError):
        resolve_config("settings.toml")  # looks like a path: read as one


def test_a_directory_named_like_a_preset_does_not_hide_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A project folder called ``portable/`` in the working directory made ``--config portable``
    fail with "not a regular file (a directory)": only a file of that name is read as one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "portable").mkdir()
    assert resolve_config("portable") == Config.preset("portable")
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="not a regular file"):
        resolve_config("mine")  # no preset of that name: the directory is named as the problem


@pytest.mark.parametrize("field, value, message", [
    ("chunk_bytes", "1.5GB", "chunk_bytes: not a byte size"),
    ("max_staging_bytes", "lots", "max_staging_bytes: not a byte size"),
    ("kvikio_task_size", True, "kvikio_task_size: not a byte size"),
    ("restore_staging_bytes", 1.0, "restore_staging_bytes: not a byte size"),
    ("snapshot_gpu_bytes", "-1MiB", "snapshot_gpu_bytes: not a byte size"),
    pytest.param("chunk_bytes", 10**5000, "chunk_bytes is out of range", id="chunk_bytes-5001-digits"),
    pytest.param("io_threads", 10**5000, "io_threads is out of range", id="io_threads-5001-digits"),
])
def test_a_bad_size_names_its_field(field: str, value: Any, message: str) -> None:
    """``Config(chunk_bytes="1.5GB")`` said "not a byte size: '1.5GB'" without the field (the
    environment and config files named it); an integer past Python's 4,300 digits failed inside
    the error message's own formatting."""
    with pytest.raises(ValueError, match=re.escape(message)):
        Config(**{field: value})
    with pytest.raises(ValueError, match=re.escape(message)):
        Config().replace(**{field: value})


def test_from_toml_of_the_old_preset_path_points_to_the_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative path is relative to the current directory; where it named a preset's old file,
    the error says how to get the preset from anywhere."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"Config.preset\('fast-nvme'\), --config fast-nvme"):
        Config.from_toml("configs/fast-nvme.toml")
    _write(tmp_path, "io_threads = 3\n", "mine.toml")
    assert Config.from_toml("mine.toml").io_threads == 3


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_loads_with_the_documented_values(name: str) -> None:
    path = PRESETS_DIR / f"{name}.toml"
    assert sorted(_keys_set_by(path)) == sorted(PRESETS[name])
    loaded = Config.preset(name, base=Config())
    assert loaded == Config().replace(**PRESETS[name]) == Config.from_toml(path, base=Config())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_explains_every_value_in_a_comment_above_it(name: str) -> None:
    lines = (PRESETS_DIR / f"{name}.toml").read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines):
        if re.match(r"^\w+\s*=", line):
            assert number > 0 and lines[number - 1].startswith("#"), f"{name}:{number + 1}: no comment"


def _doc_cell(cell: str, default: Any) -> Any:
    """A value of the presets table in docs/configuration.md, as a Config field value."""
    text = cell.strip().strip("`")
    if text == "—":
        return default
    if text == "min(8, cores)":
        return default_io_threads()
    if text.startswith('"'):
        return text.strip('"')
    if text in ("true", "false"):
        return text == "true"
    return parse_size(text)


def test_presets_table_of_the_docs_matches_the_files_and_the_defaults() -> None:
    section = DOC.read_text(encoding="utf-8").split("## Presets", 1)[1]
    header, *rows = [line for line in section.splitlines() if line.startswith("| ")]
    columns = [cell.strip().strip("`") for cell in header.strip("|").split("|")]
    assert columns == ["field", "default", *PRESETS]
    loaded = {name: Config.preset(name, base=Config()) for name in PRESETS}
    documented: set[str] = set()
    for row in rows:
        field, default, *values = [cell.strip() for cell in row.strip("|").split("|")]
        expected_default = getattr(Config(), field)
        assert _doc_cell(default, None) == expected_default, field
        for name, cell in zip(PRESETS, values):
            assert _doc_cell(cell, expected_default) == getattr(loaded[name], field), (name, field)
        documented.add(field)
    assert documented == {key for values in PRESETS.values() for key in values}


def test_portable_preset_saves_on_the_cpu_engine_in_portable_codecs_and_loads_bit_exact(
        tmp_path: Path, h: Any) -> None:
    torch = pytest.importorskip("torch")
    config = Config.preset("portable")
    generator = torch.Generator().manual_seed(7)
    state = {
        "model": {"w": (torch.randn(256, 512, generator=generator) * 0.02).to(torch.bfloat16),
                  "master": torch.randn(256, 512, generator=generator) * 0.02},
        "exp_avg_sq": np.abs(np.random.default_rng(7).standard_normal(70_000)).astype(np.float32) * 1e-6,
        "step": 12,
    }
    path = tmp_path / "portable.gdsckpt"
    report = gdsckpt.save(state, path, config=config)
    assert report.engine == "cpu" and report.codec == "zstd"
    stages = {stage.split("/")[0] for label in report.chains for stage in label.split("+")}
    assert stages <= {*PORTABLE_CODECS, "byteplanes"} and "zstd" in stages, report.chains
    assert report.ratio > 1.05  # zstd did compress the bf16 / fp32 data
    h.assert_same(state, gdsckpt.load(path, config=config))
    gdsckpt.verify(path)


def test_fast_nvme_preset_refuses_to_save_without_a_gpu(tmp_path: Path) -> None:
    """``engine = "gpu"``: no silent fall back to the CPU engine where no GPU is usable."""
    from gdsckpt.codecs.nvcomp import gpu_available

    if gpu_available():
        pytest.skip("a GPU is usable here: the preset saves on it")
    config = Config.preset("fast-nvme")
    with pytest.raises(gdsckpt.CodecUnavailableError, match="engine='gpu'"):
        gdsckpt.save({"w": np.ones(1024, dtype=np.float32)}, tmp_path / "x.gdsckpt", config=config)
    assert not (tmp_path / "x.gdsckpt").exists()


# ---------------------------------------------------------------------------------------------
# precedence: argument > config file > GDSCKPT_* environment > default

STATE_BYTES = 256 << 10
ENV_CHUNK, FILE_CHUNK, ARGUMENT_CHUNK = 64 << 10, 32 << 10, 16 << 10


@pytest.mark.parametrize("env, file, argument, expected", [
    (False, False, False, 4 << 20),
    (True, False, False, ENV_CHUNK),
    (False, True, False, FILE_CHUNK),
    (True, True, False, FILE_CHUNK),
    (False, False, True, ARGUMENT_CHUNK),
    (True, False, True, ARGUMENT_CHUNK),
    (False, True, True, ARGUMENT_CHUNK),
    (True, True, True, ARGUMENT_CHUNK),
])
def test_argument_beats_file_beats_environment_beats_default(
        env: bool, file: bool, argument: bool, expected: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        h: Any) -> None:
    if env:
        monkeypatch.setenv("GDSCKPT_CHUNK_BYTES", f"{ENV_CHUNK}")
        monkeypatch.setenv("GDSCKPT_IO_THREADS", "3")  # the file leaves it alone: it must survive
    config_path = _write(tmp_path, f'chunk_bytes = "{FILE_CHUNK >> 10}KiB"\n') if file else None
    config = resolve_config(config_path)
    assert config.io_threads == (3 if env else Config().io_threads)
    path = tmp_path / "ckpt.gdsckpt"
    state = {"w": np.arange(STATE_BYTES // 4, dtype=np.float32)}
    gdsckpt.save(state, path, chunk_bytes=ARGUMENT_CHUNK if argument else None, config=config)
    chunks = h.read_index(path).chunks
    assert len(chunks) == max(1, STATE_BYTES // expected)
    assert max(chunk.raw for chunk in chunks) == min(expected, STATE_BYTES)
    h.assert_same(state, gdsckpt.load(path))


def test_resolve_config_without_a_file_is_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GDSCKPT_LEVEL", "5")
    assert resolve_config(None) == Config.from_env() == Config(level=5)


def test_base_replaces_the_environment_beneath_the_file(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GDSCKPT_IO_THREADS", "3")
    path = _write(tmp_path, "fsync = false\n")
    assert Config.from_toml(path, base=Config(io_threads=5)) == Config(io_threads=5, fsync=False)
    assert Config.from_toml(path) == Config(io_threads=3, fsync=False)


# ---------------------------------------------------------------------------------------------
# values and errors

def test_every_field_reads_from_its_native_type_and_from_text(tmp_path: Path) -> None:
    native = _write(tmp_path, """
codec = "lz4"
chunk_bytes = 8192
gpu_chunk_bytes = "8MiB"
pack_below = "4k"
byte_planes = "never"
level = 3
codec_threads = 2
io_threads = 4
max_inflight_bytes = "64MiB"
o_direct = false
fsync = false
timeout = 30
engine = "cpu"
max_staging_bytes = "512MiB"
restore_staging_bytes = "2GiB"
snapshot_gpu_bytes = 0
async_worker = "process"
async_engine = "gpu"
kvikio_threads = 8
kvikio_task_size = "1MiB"
storage_gbps = 2
s3_endpoint = "http://127.0.0.1:9000"
portable = true
""")
    expected = Config(codec="lz4", chunk_bytes=8192, gpu_chunk_bytes=8 << 20, pack_below=4096,
                      byte_planes="never", level=3, codec_threads=2, io_threads=4,
                      max_inflight_bytes=64 << 20, o_direct=False, fsync=False, timeout=30.0, engine="cpu",
                      max_staging_bytes=512 << 20, restore_staging_bytes=2 << 30, snapshot_gpu_bytes=0,
                      async_worker="process", async_engine="gpu", kvikio_threads=8,
                      kvikio_task_size=1 << 20, storage_gbps=2.0, s3_endpoint="http://127.0.0.1:9000",
                      portable=True)
    loaded = Config.from_toml(native, base=Config())
    assert loaded == expected
    assert {f.name for f in fields(Config)} == set(_keys_set_by(native))
    assert isinstance(loaded.timeout, float) and isinstance(loaded.storage_gbps, float)
    # Strings are read as the environment variables' text is.
    text = _write(tmp_path, 'level = "none"\no_direct = "auto"\nfsync = "off"\nio_threads = "6"\n'
                            'kvikio_task_size = ""\nstorage_gbps = "1.5"\n', "text.toml")
    assert Config.from_toml(text, base=Config(level=3)) == Config(o_direct="auto", fsync=False, io_threads=6,
                                                                  storage_gbps=1.5)


def test_an_empty_file_changes_nothing(tmp_path: Path) -> None:
    path = _write(tmp_path, "# nothing set\n")
    assert Config.from_toml(path, base=Config(io_threads=2)) == Config(io_threads=2)


@pytest.mark.parametrize("text, message", [
    ("chunk_byte = 8192\n",
     r"unknown key 'chunk_byte' \(did you mean 'chunk_bytes'\? valid keys: codec, chunk_bytes, "),
    ("[gdsckpt]\ncodec = 'zstd'\n", r"unknown key 'gdsckpt' \(keys go at the top level: no tables\)"),
    ("codec = 'zsdt'\n", r"codec='zsdt' is invalid \(expected one of: .*zstd"),
    ("engine = 'tpu'\n", r"engine='tpu' is invalid \(expected one of: auto, cpu, gpu\)"),
    ("byte_planes = 'often'\n", r"byte_planes='often' is invalid \(expected one of: auto, always, never\)"),
    ("chunk_bytes = '4 parsecs'\n", r"chunk_bytes='4 parsecs' is invalid \(expected an integer number of"),
    ("chunk_bytes = 1000\n", r"chunk_bytes must be a multiple of 4096"),
    ("chunk_bytes = true\n", r"chunk_bytes = True has the wrong type \(expected an integer number of bytes"),
    ("io_threads = 2.5\n", r"io_threads = 2.5 has the wrong type \(expected an integer\)"),
    ("io_threads = 0\n", r"io_threads must be an integer from 1 to 1024, got 0"),
    ("fsync = 1\n", r"fsync = 1 has the wrong type \(expected true or false\)"),
    ("fsync = 'maybe'\n", r"fsync='maybe' is invalid \(expected true or false, or as text one of: 1, true"),
    ("o_direct = 'sometimes'\n", r"o_direct='sometimes' is invalid \(expected true, false or \"auto\""),
    ("level = 'high'\n", r"level='high' is invalid \(expected an integer or \"none\"\)"),
    ("timeout = [1, 2]\n", r"timeout = \[1, 2\] has the wrong type \(expected a number\)"),
    ("codec = 'zstd'\ncodec = 'lz4'\n", r"not valid TOML"),
    ("codec = zstd\n", r"not valid TOML"),
])
def test_bad_file_raises_value_error_naming_the_file_the_key_and_the_choices(
        tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": .*" + message):
        Config.from_toml(path, base=Config())


def test_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        resolve_config(tmp_path / "missing.toml")


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"GDSCKPT_FSYNC: fsync='maybe' is invalid"):
        Config.from_env({"GDSCKPT_FSYNC": "maybe"})


# ---------------------------------------------------------------------------------------------
# the field table: one in config.py's docstring, the same in docs/configuration.md

def _table_rows(text: str) -> list[str]:
    start = text.index("| field | default | meaning |")
    rows = []
    for line in text[start:].splitlines():
        if not line.startswith("|"):
            break
        rows.append(line.replace("``", "`"))
    return rows


def _default_from_doc(text: str) -> Any:
    value = text.strip("`")
    if value == "min(8, cores)":
        return default_io_threads()
    if value.startswith('"'):
        return value.strip('"')
    if value in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[value]
    return parse_size(value)


def test_field_table_is_the_same_in_the_docstring_and_the_docs_and_matches_config() -> None:
    import gdsckpt.config

    code_rows = _table_rows(gdsckpt.config.__doc__ or "")
    assert _table_rows(DOC.read_text(encoding="utf-8")) == code_rows
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in code_rows[2:]]
    assert [row[0] for row in cells] == [f.name for f in fields(Config)]
    defaults = Config()
    for name, default, _meaning in cells:
        assert _default_from_doc(default) == getattr(defaults, name), name


@pytest.mark.parametrize("change", [{"fsync": "no"}, {"fsync": 0}, {"portable": "false"}, {"timeout": 0},
                                    {"timeout": -1.0}, {"timeout": float("nan")}, {"timeout": float("inf")},
                                    {"timeout": True}, {"timeout": "5"}])
def test_config_refuses_a_flag_or_timeout_of_the_wrong_kind(change: dict[str, Any]) -> None:
    """``fsync="no"`` (as a plugin's ``storage_options`` may pass it) was taken as true and a
    timeout of 0 or NaN as a bound: each is now a ``ValueError`` naming the field."""
    name = next(iter(change))
    with pytest.raises(ValueError, match=f"^{name} must be"):
        Config(**change)
    assert Config(fsync=False).fsync is False and Config(timeout=0.5).timeout == 0.5


@pytest.mark.parametrize("change, message", [
    ({"timeout": 1e10}, r"^timeout must be a positive number of seconds of at most"),
    ({"codec_threads": 10**6}, r"^codec_threads must be an integer from 0 to 1024"),
    ({"codec_threads": 2.5}, r"^codec_threads must be an integer"),
    ({"io_threads": True}, r"^io_threads must be an integer"),
    ({"kvikio_threads": -5}, r"^kvikio_threads must be an integer"),
    ({"pack_below": -1}, r"pack_below"),
    ({"kvikio_task_size": -1}, r"kvikio_task_size"),
    ({"storage_gbps": float("nan")}, r"^storage_gbps must be a positive number"),
    ({"storage_gbps": "fast"}, r"^storage_gbps must be a positive number"),
    ({"storage_gbps": -1.0}, r"^storage_gbps must be a positive number"),
    ({"s3_endpoint": 5}, r"^s3_endpoint must be a URL string"),
    ({"o_direct": 1}, r"^o_direct=1 is invalid"),
    ({"codec": "bogus"}, r"unknown codec 'bogus'"),
    ({"codec": 3}, r"^codec must be a codec name"),
    ({"level": "3"}, r"^level must be an integer"),
    ({"level": 3.5}, r"^level must be an integer"),
    ({"level": 100}, r"^level=100 is not a valid zstd compression level"),
])
def test_config_refuses_at_construction_what_a_save_would_fail_on(change: dict[str, Any], message: str) -> None:
    """Each was accepted and failed only once a save ran: a timeout beyond what a lock can wait
    (``OverflowError`` from every save), a million codec threads (started until the OS refused,
    then every later save in the process failed), a level the codec refuses (after a file
    object's header was written), ``storage_gbps=nan`` (every chunk stored uncompressed,
    silently), and text where numbers belong."""
    with pytest.raises(ValueError, match=message):
        Config(**change)
    assert Config(codec_threads=1024, level=3, storage_gbps=2.5, o_direct=True).o_direct is True
