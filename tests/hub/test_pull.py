"""`strata pull` from the (fake) hub: file choice, layout, markers, poisoned markers, interrupted runs."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from strata import StrataError
from strata.hub import resolve_model
from strata.hub.plan import hf_plan
from strata.hub.pull import PullOptions, Reporter, pull
from strata.hub.verify import marker_path, read_marker

from .conftest import REPO, sha
from .test_pull_faults import Q8, SHARD2, assert_exact, dest

SHARDS = [f"Tiny-MoE-Q4_K_M-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]


def _pull(hub, tmp_path, spec, opts, reporter, **kw):
    return pull(spec, models_dir=tmp_path / "models", endpoint=hub.url, token=False, opts=opts, reporter=reporter, **kw)


def test_hub_listing_through_huggingface_hub(hub, tmp_path, model_set):
    files = hf_plan(REPO, "Q4_K_M", tmp_path, endpoint=hub.url, token=False)
    assert [f.name for f in files] == SHARDS
    commit = hub.repos[REPO].commit
    for f in files:
        assert f.size == len(model_set[f.name]) and f.sha256 == sha(model_set[f.name])
        assert f.url == f"{hub.url}/{REPO}/resolve/{commit}/{f.name}"  # every shard pinned to one commit
        assert f.dest == tmp_path / REPO / f.name
    (readme,) = hf_plan(REPO, "README.md", tmp_path, endpoint=hub.url, token=False)
    assert readme.sha256 is None and readme.git_sha1 is not None  # non-LFS: checked by git blob id


def test_pull_quant_then_resolve(hub, tmp_path, opts, reporter, model_set):
    out = _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert [p.name for p in out] == SHARDS
    for p in out:
        assert_exact(p, model_set[p.name])
        m = json.loads(marker_path(p).read_text())
        assert set(m) >= {"size", "sha256", "source", "time"} and m["source"].startswith(f"hf:{REPO}@")
    assert resolve_model(f"{REPO}:Q4_K_M", tmp_path / "models") == out
    assert resolve_model(f"{REPO}:q4_k_m", tmp_path / "models") == out
    assert resolve_model(f"{REPO}:{SHARD2}", tmp_path / "models") == out
    assert resolve_model(str(out[0])) == out  # a first-shard path brings its set
    assert resolve_model(str(out[1])) == out  # and so does any other part, as the loader opens the whole set
    # Running it again fetches nothing.
    n = len(hub.gets())
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert len(hub.gets()) == n


def test_git_blob_id_checked_for_small_files(hub, tmp_path, opts, reporter):
    (out,) = _pull(hub, tmp_path, f"{REPO}:README.md", opts, reporter)
    assert out.read_bytes() == b"# tiny\n" and read_marker(out).verified_against == "git-sha1"
    # The server's bytes change while its listing keeps the old blob id (same size): refused.
    hub.repos[REPO].meta["README.md"] = {"blobId": _git(b"# tiny\n")}
    hub.repos[REPO].files["README.md"] = b"# tinY\n"
    with pytest.raises(StrataError, match="git blob id"):
        pull(f"{REPO}:README.md", models_dir=tmp_path / "m2", endpoint=hub.url, token=False, opts=opts)


def _git(data: bytes) -> str:
    import hashlib

    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_selection_errors(hub, tmp_path, opts, reporter):
    with pytest.raises(StrataError, match=r"no file .* matches 'Q2_K'; available: Tiny-MoE-Q4_K_M, Tiny-MoE-Q8_0"):
        _pull(hub, tmp_path, f"{REPO}:Q2_K", opts, reporter)
    with pytest.raises(StrataError, match="matches 2 models"):
        _pull(hub, tmp_path, REPO, opts, reporter)
    with pytest.raises(StrataError, match="no such model repository"):
        _pull(hub, tmp_path, "acme/nothing:Q4_K_M", opts, reporter)
    with pytest.raises(StrataError, match="apply to URL downloads"):
        _pull(hub, tmp_path, f"{REPO}:Q8_0", opts, reporter, sha256=["00" * 32])
    hub.repos[REPO].files.pop(SHARD2)
    with pytest.raises(StrataError, match=r"incomplete split GGUF set \(have parts \[1, 3\] of 3\)"):
        _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)


# --- markers --------------------------------------------------------------------------------------------


def _poison(path, size: int, sha256: str) -> None:
    marker_path(path).write_text(json.dumps({"size": size, "sha256": sha256, "source": "x", "time": "t"}))


def test_poisoned_marker_on_short_file_is_repaired(hub, tmp_path, opts, reporter, model_set):
    # The failure from the field: a "done" marker written for a file cut short (marker matching the short file).
    data = model_set[SHARD2]
    out = dest(tmp_path, SHARD2)
    out.parent.mkdir(parents=True)
    out.write_bytes(data[:150_000])
    _poison(out, 150_000, sha(data[:150_000]))
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(out, data)
    assert [r for _, _, r in hub.gets(SHARD2)] == ["bytes=150000-"]  # the good prefix was kept and completed
    assert any("re-verifying" in w for w in reporter.warnings)


def test_marker_claiming_full_size_on_short_file(hub, tmp_path, opts, reporter, model_set):
    data = model_set[SHARD2]
    out = dest(tmp_path, SHARD2)
    out.parent.mkdir(parents=True)
    out.write_bytes(data[:150_000])
    _poison(out, len(data), sha(data))
    with pytest.raises(StrataError):
        resolve_model(f"{REPO}:{SHARD2}", tmp_path / "models")  # never loaded as finished
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(out, data)


def test_short_prefix_with_wrong_bytes_is_redownloaded(hub, tmp_path, opts, reporter, model_set):
    data = model_set[SHARD2]
    out = dest(tmp_path, SHARD2)
    out.parent.mkdir(parents=True)
    out.write_bytes(b"\0" * 150_000)  # resumed, then the full hash fails, then a clean download
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(out, data)
    assert [r for _, _, r in hub.gets(SHARD2)] == ["bytes=150000-", None]


def test_same_size_corruption_needs_verify(hub, tmp_path, opts, reporter, model_set):
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    out = dest(tmp_path, SHARD2)
    good = out.read_bytes()
    out.write_bytes(good[:1000] + bytes([good[1000] ^ 1]) + good[1001:])  # bit rot after the fact
    opts.verify = True
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(out, model_set[SHARD2])
    assert len(hub.gets(SHARD2)) == 2 and len(hub.gets(SHARDS[0])) == 1  # only the rotten one came again


def test_file_without_marker_is_verified_not_refetched(hub, tmp_path, opts, reporter, model_set):
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    out = dest(tmp_path, SHARD2)
    marker_path(out).unlink()  # e.g. killed between the rename and the marker
    n = len(hub.gets())
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(out, model_set[SHARD2])
    assert len(hub.gets()) == n


def test_stale_marker_without_file_is_removed(hub, tmp_path, opts, reporter, model_set):
    out = dest(tmp_path, SHARD2)
    out.parent.mkdir(parents=True)
    _poison(out, len(model_set[SHARD2]), sha(model_set[SHARD2]))
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(out, model_set[SHARD2])


# --- interrupted runs ----------------------------------------------------------------------------------


class _InterruptAfter(Reporter):
    """Sets the cancel event (what Ctrl-C does) once `name` has received some bytes."""

    def __init__(self, name: str, cancel: threading.Event) -> None:
        super().__init__()
        self.name, self.cancel = name, cancel

    def task(self, description, total):
        rep = self

        class T:
            def update(self, completed, total=None):
                pass

            def advance(self, n):
                if rep.name in description:
                    rep.cancel.set()

        return T()


def test_interrupted_pull_resumes_without_refetching(hub, tmp_path, model_set):
    opts = PullOptions(jobs=1, retries=3, backoff=0.0, sleep=lambda s: None)
    rep = _InterruptAfter(SHARD2, opts.cancel)
    with pytest.raises(StrataError, match="interrupted"):
        _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, rep)
    first, second, third = (dest(tmp_path, n) for n in SHARDS)
    assert read_marker(first) is not None
    assert not second.exists() and not marker_path(second).exists()
    kept = second.with_name(second.name + ".part").stat().st_size
    assert 0 < kept < len(model_set[SHARD2])
    assert not third.exists() and hub.gets(SHARDS[2]) == []  # never started

    opts2 = PullOptions(jobs=3, retries=3, backoff=0.0, sleep=lambda s: None)
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts2, Reporter())
    for n in SHARDS:
        assert_exact(dest(tmp_path, n), model_set[n])
    assert len(hub.gets(SHARDS[0])) == 1  # the finished shard was not downloaded again
    assert hub.gets(SHARD2)[-1][2] == f"bytes={kept}-"


def test_failed_run_then_rerun(hub, tmp_path, opts, reporter, model_set):
    hub.fault("drop", match=SHARD2, times=None, at=100_000)
    with pytest.raises(StrataError):
        _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    hub.faults.clear()
    n1 = len(hub.gets(SHARDS[0]))
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, Reporter())
    for n in SHARDS:
        assert_exact(dest(tmp_path, n), model_set[n])
    assert len(hub.gets(SHARDS[0])) == n1
    assert hub.gets(SHARD2)[-1][2] == "bytes=100000-"


def test_hf_endpoint_env_is_honoured(hub, tmp_path, model_set, monkeypatch):
    # HF_ENDPOINT is read by huggingface_hub at import; strata takes its endpoint from there.
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "ENDPOINT", hub.url)
    out = pull(f"{REPO}:Q8_0", models_dir=tmp_path / "m", token=False, opts=PullOptions(backoff=0.0))
    assert_exact(out[0], model_set["Tiny-MoE-Q8_0.gguf"])


def test_pull_cli(hub, tmp_path, capsys, model_set):
    from strata.cli import main

    d = tmp_path / "cli"
    argv = ["pull", f"{REPO}:Q4_K_M", "--models-dir", str(d), "--endpoint", hub.url, "--token", "x"]
    assert main(argv) == 0
    out = capsys.readouterr().out.split()
    assert out == [str(d / REPO / n) for n in SHARDS]
    assert all(e[0] == "GET" for e in hub.log)
    hub.fault("status", match="Q8_0", times=None, at=403)
    assert main(["pull", f"{REPO}:Q8_0", "--models-dir", str(d), "--endpoint", hub.url, "--token", "x"]) == 1
    assert "HTTP 403" in capsys.readouterr().err


def test_pull_without_network_is_one_line(tmp_path):
    """No hub reachable (a closed port): one line naming the host and the variable that sets it, exit 1."""
    import socket
    import subprocess
    import sys

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    env = {k: v for k, v in __import__("os").environ.items() if k != "HF_ENDPOINT"}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{port}"
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    r = subprocess.run([sys.executable, "-m", "strata", "pull", "acme/Tiny-MoE-GGUF:Q4_K_M", "--models-dir",
                        str(tmp_path), "--quiet"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "HF_ENDPOINT" in lines[0]
    assert not any(tmp_path.rglob("*.gguf"))


def _rewrite_same_size(path) -> None:
    """Flip one byte in place (the size unchanged), as an editor or a stray tool would."""
    before = path.stat().st_mtime_ns
    data = path.read_bytes()
    time.sleep(0.02)  # past the file system's timestamp granularity, so the write shows in the mtime
    path.write_bytes(data[:1000] + bytes([data[1000] ^ 1]) + data[1001:])
    assert path.stat().st_mtime_ns != before


def test_changed_in_place_is_refetched_without_verify(hub, tmp_path, opts, reporter, model_set):
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    out = dest(tmp_path, SHARD2)
    _rewrite_same_size(out)
    with pytest.raises(StrataError, match="not completely downloaded or not verified"):
        resolve_model(f"{REPO}:Q4_K_M", tmp_path / "models")  # never loaded as verified either
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(out, model_set[SHARD2])
    assert len(hub.gets(SHARD2)) == 2 and len(hub.gets(SHARDS[0])) == 1
    assert any("modified since it was verified" in w for w in reporter.warnings)
    assert not any("already downloaded" in i and SHARD2 in i for i in reporter.infos)


def test_touched_file_is_rehashed_not_refetched(hub, tmp_path, opts, reporter, model_set):
    (out,) = _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    st = out.stat()
    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # e.g. copied with a new timestamp
    n = len(hub.gets())
    _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    assert len(hub.gets()) == n and f"{Q8}: verified" in reporter.infos
    assert read_marker(out).mtime_ns == out.stat().st_mtime_ns  # the cheap check holds again
    reporter.infos.clear()
    _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    assert reporter.infos == [f"{Q8}: already downloaded and verified"]


def test_marker_without_mtime_is_verified_once(hub, tmp_path, opts, reporter, model_set):
    # A marker from before mtimes were recorded: models load as before, a pull re-hashes once and upgrades it.
    (out,) = _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    m = json.loads(marker_path(out).read_text())
    del m["mtime_ns"]
    marker_path(out).write_text(json.dumps(m))
    assert resolve_model(f"{REPO}:{Q8}", tmp_path / "models") == [out]
    n = len(hub.gets())
    _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    assert len(hub.gets()) == n and f"{Q8}: verified" in reporter.infos
    assert read_marker(out).mtime_ns == out.stat().st_mtime_ns
    # ...and one whose file changed under it (same size) is fetched again
    _rewrite_same_size(out)
    m = json.loads(marker_path(out).read_text())
    del m["mtime_ns"]
    marker_path(out).write_text(json.dumps(m))
    _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    assert_exact(out, model_set[Q8]) and len(hub.gets()) == n + 1


def test_url_without_sha_changed_in_place_is_refetched(hub, tmp_path, opts, reporter, model_set):
    # No sha256 from the source, only a size: the marker's own sha256 is what tells the change.
    data = model_set[Q8]
    url = hub.add_plain("x/Tiny-MoE-Q8_0.gguf", data)
    out = tmp_path / "m.gguf"
    _pull(hub, tmp_path, url, opts, reporter, output=out, size=len(data))
    _rewrite_same_size(out)
    _pull(hub, tmp_path, url, opts, reporter, output=out, size=len(data))
    assert_exact(out, data)
    assert any("changed since it was downloaded" in w for w in reporter.warnings)


def test_offline_mode_uses_what_is_downloaded_and_fetches_nothing(hub, tmp_path, model_set):
    """HF_HUB_OFFLINE=1 (as huggingface_hub and llama.cpp read it): a model already pulled is its paths, exit 0,
    with no request made; one that is not is one error line naming the variable, and nothing is written."""
    from .test_pull_faults import _cli_pull

    models = tmp_path / "models"
    args = [f"{REPO}:Q4_K_M", "--models-dir", str(models), "--endpoint", hub.url]
    r = _cli_pull(args, {"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("strata: error: HF_HUB_OFFLINE is set"), r.stderr
    assert hub.log == [] and not models.exists()

    assert _cli_pull(args).returncode == 0
    n = len(hub.log)
    r = _cli_pull(args, {"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(dest(tmp_path, n)) for n in SHARDS]
    assert len(hub.log) == n  # not even the listing

    url = hub.add_plain("x/" + SHARDS[0].replace("Q4_K_M-00001-of-00003", "Q9"), model_set[SHARDS[0]])
    r = _cli_pull([url, "--models-dir", str(models)], {"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1 and "HF_HUB_OFFLINE is set" in r.stderr and len(hub.log) == n, r.stderr


def _wait_for(cond, what: str, limit: float = 60.0) -> None:
    """Poll until `cond()` holds (a state the test waits to reach, not a timing it asserts)."""
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def test_two_pulls_of_one_file_take_turns(hub, tmp_path, model_set):
    """A second `strata pull` of a file another is fetching waits for it (a lock beside the file), then finds it
    done: one download, one `.part`, never two writers renaming it under each other."""
    out = dest(tmp_path, Q8)
    part = out.with_name(out.name + ".part")
    hub.fault("stall", match=Q8, at=8000)
    results: dict[str, object] = {}

    def run(who: str, rep: Reporter) -> None:
        try:
            results[who] = _pull(hub, tmp_path, f"{REPO}:Q8_0", PullOptions(retries=3, backoff=0.0,
                                                                          sleep=lambda s: None), rep)
        except BaseException as e:  # noqa: BLE001 - the assertion below names it
            results[who] = e

    first, second = Reporter(), Reporter()
    a = threading.Thread(target=run, args=("first", first))
    a.start()
    _wait_for(lambda: part.exists() and part.stat().st_size == 8000, "the first pull's bytes on disk")
    b = threading.Thread(target=run, args=("second", second))
    b.start()
    _wait_for(lambda: any("waiting" in i for i in second.infos), "the second pull waiting")
    assert len(hub.gets(Q8)) == 1  # the first one's alone
    hub.release.set()
    a.join(60)
    b.join(60)
    assert results == {"first": [out], "second": [out]}
    assert_exact(out, model_set[Q8])
    assert [g[2] for g in hub.gets(Q8)] == [None, "bytes=8000-"]  # the first's download and its resume
    assert any("already downloaded" in i for i in second.infos)


def test_ctrl_c_on_a_stalled_transfer_stops_at_once_and_resumes(hub, tmp_path, model_set):
    """SIGINT while a transfer is blocked in a read (the server sent 8000 bytes, then nothing): one line, exit
    130, no traceback, no retry and no wait for the read timeout (the transfer's socket is shut down), the
    `.part` kept; the same command then resumes from it."""
    import signal
    import subprocess
    import sys

    out = dest(tmp_path, Q8)
    part = out.with_name(out.name + ".part")
    hub.fault("stall", match=Q8, at=8000)
    argv = [sys.executable, "-m", "strata", "pull", f"{REPO}:Q8_0", "--models-dir", str(tmp_path / "models"),
            "--endpoint", hub.url, "--quiet"]
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1"}
    p = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for(lambda: part.exists() and part.stat().st_size == 8000, "the first bytes on disk")
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "retry" not in err and "Timeout" not in err, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("strata:")]
    assert "interrupted" in line and "run the same command again" in line
    assert part.stat().st_size == 8000 and not out.exists() and not marker_path(out).exists()

    hub.release.set()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert_exact(out, model_set[Q8])
    assert hub.gets(Q8)[-1][2] == "bytes=8000-"


def test_an_unrecorded_file_with_nothing_to_check_it_by_is_not_taken_as_done(hub, tmp_path, opts, reporter):
    """A URL download with no sha256 and no --size whose file is already on disk, cut short, with no marker (another
    tool's, or a crash before the marker): it is resumed, and the server's length judges; it used to be marked
    done as it was. A downloaded file cut short later, its marker still there, is fetched again."""
    data = bytes(range(256)) * 400
    url = hub.add_plain("cfg/tokenizer.json", data)
    out = tmp_path / "models" / "tokenizer.json"
    out.parent.mkdir(parents=True)
    out.write_bytes(data[:40_000])
    (got,) = _pull(hub, tmp_path, url, opts, reporter)
    assert got == out and out.read_bytes() == data and read_marker(out).size == len(data)
    assert hub.gets("cfg/")[-1][2] == "bytes=40000-"

    out.write_bytes(data[:30_000])  # cut after its download
    _pull(hub, tmp_path, url, opts, reporter)
    assert out.read_bytes() == data and read_marker(out).size == len(data)
