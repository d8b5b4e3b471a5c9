"""The native CPU kernel's build step (strata.ops.cpu_native): a real C source shipped as package data, compiled
on first use into the user's cache (reused afterwards), one clear line when no compiler exists."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import strata.ops.cpu_native as native
from strata import StrataError


def test_the_source_is_a_file_shipped_as_package_data():
    assert native.SOURCE_FILE.name == "cpu_native.c" and native.SOURCE_FILE.is_file()
    assert "strata_native_experts" in native.source()
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    shipped = pyproject.split("[tool.setuptools.package-data]")[1].split("\n[")[0]
    assert '"ops/*.c"' in shipped and '"ops/*.h"' in shipped
    for h in native.HEADER_FILES:  # the headers the source includes ship beside it
        assert h.is_file() and h.suffix == ".h" and f'#include "{h.name}"' in native.source()


def test_no_compiler_is_one_clear_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "strata-no-such-cc")
    monkeypatch.setenv("PATH", str(tmp_path))  # neither cc nor gcc on it
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_why", native._why)  # (restored after: later tests see this machine's kernel)
    with caplog.at_level("INFO", logger="strata"):
        assert native.load() is None
    why = native.unavailable()
    assert "no C compiler" in why and "\n" not in why
    # said where a user sees it (a warning, as a failed build is): the CPU lane is several times slower without it
    said = [r for r in caplog.records if r.name == "strata" and "no C compiler" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"
    from gguf import GGMLQuantizationType as Q

    from strata.experts.cpu_lane import CpuLane
    from strata.experts.resident import ExpertWeights
    from strata.quant import random_qtensor

    ew = ExpertWeights(*(random_qtensor(Q.Q4_K, s) for s in ((2, 256, 256), (2, 256, 256), (2, 256, 256))))
    with pytest.raises(StrataError, match="no C compiler"):
        CpuLane({0: ew}, kernel="native")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_the_build_is_cached_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    assert native.build() is not None
    built = list((tmp_path / "native").glob("experts-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert native.build() is not None  # the cached build: not compiled again
    assert list((tmp_path / "native").glob("experts-*.so")) == built and built[0].stat().st_mtime_ns == stamp


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_a_changed_header_is_a_new_build(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path / "cache"))
    assert native.build() is not None
    changed = []
    for h in native.HEADER_FILES:
        (tmp_path / h.name).write_text(h.read_text() + "\n/* changed */\n")
        changed.append(tmp_path / h.name)
    monkeypatch.setattr(native, "HEADER_FILES", tuple(changed))
    assert native.build() is not None
    assert len(list((tmp_path / "cache" / "native").glob("experts-*.so"))) == 2


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_a_cache_that_cannot_be_written_gets_a_build_for_this_run(monkeypatch, tmp_path, caplog):
    """A read-only, full or misconfigured cache: the kernel is still built and loaded (one warning line saying
    where it could not be kept), not dropped for torch's kernels, several times slower."""
    (tmp_path / "a-file").write_text("")
    cache = tmp_path / "a-file" / "cache"  # (a path under a file: unwritable, even for root)
    monkeypatch.setenv("STRATA_CACHE_DIR", str(cache))
    with caplog.at_level("INFO", logger="strata"):
        lib = native.build()
    assert lib is not None and hasattr(lib, "strata_native_experts")
    said = [r.getMessage() for r in caplog.records if r.name == "strata"]
    assert len(said) == 1 and "built for this run only" in said[0] and str(cache / "native") in said[0], said
