"""Every way a download has been seen to go wrong ends either with the source's exact bytes or with a clear
error and no `.done` marker (and no finished-looking file)."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from strata import StrataError
from strata.hub.plan import read_manifest
from strata.hub.pull import PullOptions, pull
from strata.hub.verify import marker_path, read_marker

from .conftest import REPO, sha

SHARD2 = "Tiny-MoE-Q4_K_M-00002-of-00003.gguf"
Q8 = "Tiny-MoE-Q8_0.gguf"


def _pull(hub, tmp_path, spec, opts, reporter, **kw):
    return pull(spec, models_dir=tmp_path / "models", endpoint=hub.url, token=False, opts=opts, reporter=reporter, **kw)


def dest(tmp_path, name, repo=REPO) -> Path:
    return tmp_path / "models" / repo / name


def assert_exact(path: Path, data: bytes) -> None:
    assert path.read_bytes() == data
    m = read_marker(path)
    assert m is not None and m.size == len(data) and m.sha256 == sha(data)
    assert not path.with_name(path.name + ".part").exists()


def assert_not_finished(path: Path) -> None:
    assert not marker_path(path).exists()
    assert not path.exists()  # only ever a `.part`, which nothing loads


# --- HEAD / Content-Length ----------------------------------------------------------------------------


def test_missing_content_length_uses_api_size(hub, tmp_path, opts, reporter, model_set):
    # HEAD and GET both lack Content-Length (read-until-close); the size comes from the API, not from HEAD.
    hub.fault("no_length", match=Q8, times=None)
    (out,) = _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    assert_exact(out, model_set[Q8])
    assert not [e for e in hub.log if e[0] == "HEAD"]  # sizes never come from a HEAD


def test_missing_content_length_short_body_is_resumed(hub, tmp_path, opts, reporter, model_set):
    # The 28.8 GB shard "complete" at 19.3 GB: a close-delimited body that stops early is not the file.
    hub.fault("no_length", match=SHARD2, times=1, at=100_000)
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(dest(tmp_path, SHARD2), model_set[SHARD2])
    assert [r for _, _, r in hub.gets(SHARD2)] == [None, "bytes=100000-"]


def test_missing_content_length_short_body_forever_fails(hub, tmp_path, opts, reporter):
    hub.fault("no_length", match=SHARD2, times=None, at=100_000)
    with pytest.raises(StrataError, match="download failed after 3 retries"):
        _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_not_finished(dest(tmp_path, SHARD2))
    assert read_marker(dest(tmp_path, "Tiny-MoE-Q4_K_M-00001-of-00003.gguf")) is not None  # the others finished


def test_url_without_length_or_hash_is_never_complete(hub, tmp_path, opts, reporter, model_set):
    url = hub.add_plain("x/Tiny-MoE-Q8_0.gguf", model_set[Q8])
    hub.fault("no_length", times=None, at=len(model_set[Q8]) - 1000)
    out = tmp_path / "m.gguf"
    with pytest.raises(StrataError, match="announced no size and no sha256 is known"):
        _pull(hub, tmp_path, url, opts, reporter, output=out)
    assert any("NO KNOWN SHA256" in w for w in reporter.warnings)  # said loudly, up front
    assert_not_finished(out)


def test_url_without_length_but_with_sha256(hub, tmp_path, opts, reporter, model_set):
    data = model_set[Q8]
    url = hub.add_plain("x/Tiny-MoE-Q8_0.gguf", data)
    hub.fault("no_length", times=1)
    out = tmp_path / "m.gguf"
    _pull(hub, tmp_path, url, opts, reporter, output=out, sha256=[sha(data)])
    assert_exact(out, data)
    # ...and a short body without a length fails the hash, twice, then gives up with nothing marked.
    out2 = tmp_path / "m2.gguf"
    hub.fault("no_length", times=None, at=len(data) - 1000)
    with pytest.raises(StrataError, match="sha256 .* != expected"):
        _pull(hub, tmp_path, url, opts, reporter, output=out2, sha256=[sha(data)])
    assert_not_finished(out2)


# --- 206 / Range ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["cr_before", "cr_after"])
def test_206_not_at_requested_offset_restarts(hub, tmp_path, opts, reporter, model_set, kind):
    hub.fault("drop", match=SHARD2, at=100_000)  # leaves a 100000-byte .part to resume
    hub.fault(kind, match=SHARD2, times=None, at=4096, ranged_only=True)  # every resume is answered wrongly
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(dest(tmp_path, SHARD2), model_set[SHARD2])
    ranges = [r for _, _, r in hub.gets(SHARD2)]
    assert ranges == [None, "bytes=100000-", None]  # the misplaced bytes were refused, the file restarted
    assert any("discarded, starting over" in w for w in reporter.warnings)


def test_200_ignoring_range_rewrites_from_zero(hub, tmp_path, opts, reporter, model_set):
    hub.fault("drop", match=SHARD2, at=100_000)
    hub.fault("ignore_range", match=SHARD2, times=None, ranged_only=True)
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(dest(tmp_path, SHARD2), model_set[SHARD2])
    assert [r for _, _, r in hub.gets(SHARD2)] == [None, "bytes=100000-"]
    assert any("ignored the resume range" in w for w in reporter.warnings)


def test_dropped_connection_resumes(hub, tmp_path, opts, reporter, model_set):
    hub.fault("drop", match=SHARD2, at=70_000)
    hub.fault("drop", match=SHARD2, at=150_000)
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(dest(tmp_path, SHARD2), model_set[SHARD2])
    assert [r for _, _, r in hub.gets(SHARD2)] == [None, "bytes=70000-", "bytes=150000-"]


def test_body_truncated_with_correct_headers_fails_cleanly(hub, tmp_path, opts, reporter):
    hub.fault("drop", match=SHARD2, times=None, at=200_000)  # full Content-Length, body never past 200000
    with pytest.raises(StrataError, match=f"{SHARD2}: download failed"):
        _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_not_finished(dest(tmp_path, SHARD2))


def test_truncated_file_with_matching_headers_is_refused(hub, tmp_path, opts, reporter, model_set):
    # A mirror serving a short copy, consistently: it disagrees with the API's size, so it is never accepted.
    hub.fault("truncate", match=SHARD2, times=None, at=200_000)
    with pytest.raises(StrataError, match="server announces 200000 bytes, 262400 expected"):
        _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_not_finished(dest(tmp_path, SHARD2))


def test_truncated_gguf_without_hash_fails_structure_check(hub, tmp_path, opts, reporter, model_set):
    # Without a known hash only structure can catch it: the last tensor's data runs past the end of the file.
    data = model_set[SHARD2]
    url = hub.add_plain(SHARD2.replace("00002", "00001").replace("of-00003", "of-00001"), data[:200_000])
    out = tmp_path / "one.gguf"
    msg = r"one\.gguf: tensor blk\.2\.ffn_down_exps\.weight ends at byte 262400 .*\(truncated\)"
    with pytest.raises(StrataError, match=msg):
        _pull(hub, tmp_path, url, opts, reporter, output=out)
    assert_not_finished(out)
    assert not out.with_name("one.gguf.part").exists()


# --- bytes --------------------------------------------------------------------------------------------


def test_flipped_byte_once_is_redownloaded(hub, tmp_path, opts, reporter, model_set):
    hub.fault("flip", match=SHARD2, at=123_457)
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(dest(tmp_path, SHARD2), model_set[SHARD2])
    assert any("downloading it again from the start" in w for w in reporter.warnings)


def test_flipped_byte_always_fails(hub, tmp_path, opts, reporter):
    hub.fault("flip", match=SHARD2, times=None, at=123_457)
    with pytest.raises(StrataError, match=f"{SHARD2}: sha256 .* != expected"):
        _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_not_finished(dest(tmp_path, SHARD2))
    assert not dest(tmp_path, SHARD2 + ".part").exists()  # wrong bytes are not kept to be resumed


def test_wrong_sha256_in_metadata(hub, tmp_path, opts, reporter):
    hub.repos[REPO].meta[SHARD2] = {"lfs": {"sha256": "ab" * 32}}
    with pytest.raises(StrataError, match="source serves different bytes than its metadata promises"):
        _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_not_finished(dest(tmp_path, SHARD2))


# --- disk space ---------------------------------------------------------------------------------------


def test_no_space_up_front(hub, tmp_path, opts, reporter, model_set):
    opts.disk_free = lambda path: 500_000  # less than the 3 shards' 787200 bytes
    with pytest.raises(StrataError, match="not enough disk space .* free"):
        _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert hub.gets() == []  # refused before a single byte was fetched


def test_space_check_counts_what_is_there(hub, tmp_path, opts, reporter, model_set):
    part = dest(tmp_path, SHARD2 + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(model_set[SHARD2][:200_000])
    need = 3 * 262_400 - 200_000
    opts.disk_free = lambda path: need
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    assert_exact(dest(tmp_path, SHARD2), model_set[SHARD2])
    opts.disk_free = lambda path: 0  # nothing left to fetch: no space needed
    _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)


class _FullDisk:
    """A file whose device fills up after `room` more bytes (ENOSPC from write, as the OS reports it)."""

    def __init__(self, f, room: list[int]):
        self.f, self.room = f, room

    def write(self, b) -> int:
        if len(b) > self.room[0]:
            self.f.write(bytes(b[: self.room[0]]))  # the device takes what fits, then fails
            self.room[0] = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room[0] -= len(b)
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_no_space_while_writing(hub, tmp_path, opts, reporter, model_set):
    room = [10_000]
    opts.open_file = lambda path, mode: _FullDisk(open(path, mode), room)
    opts.jobs = 1
    with pytest.raises(StrataError, match="no space left on the device while writing .*run the same command again"):
        _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    out = dest(tmp_path, Q8)
    assert_not_finished(out)
    kept = out.with_name(out.name + ".part").stat().st_size
    assert 0 < kept <= 10_000
    # Space freed: the same command resumes from the kept bytes.
    opts.open_file = open
    _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    assert_exact(out, model_set[Q8])
    assert hub.gets(Q8)[-1][2] == f"bytes={kept}-"


# --- retries ------------------------------------------------------------------------------------------


def test_retries_back_off_exponentially(hub, tmp_path, opts, reporter, model_set):
    delays = []
    opts.backoff, opts.sleep = 0.5, delays.append
    hub.fault("status", match=Q8, times=2, at=503)
    (out,) = _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    assert_exact(out, model_set[Q8])
    assert delays == [0.5, 1.0]


def test_a_rate_limit_is_waited_out_as_the_server_says(hub, tmp_path, opts, reporter, model_set):
    """429 (and 503) with Retry-After: the next try comes no sooner than the server asked (capped at
    RETRY_AFTER_MAX), not at the next step of the backoff, which a rate limit would refuse again."""
    from strata.hub.http import RETRY_AFTER_MAX

    delays = []
    opts.backoff, opts.sleep = 0.5, delays.append
    hub.fault("status", match=Q8, at=429, header="Retry-After: 7")
    hub.fault("status", match=Q8, at=503, header="Retry-After: 86400")
    hub.fault("status", match=Q8, at=503)
    (out,) = _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    assert_exact(out, model_set[Q8])
    assert delays == [7.0, RETRY_AFTER_MAX, 2.0]


def test_missing_file_is_fatal_not_retried(hub, tmp_path, opts, reporter, model_set):
    hub.fault("status", match=Q8, times=None, at=404)
    with pytest.raises(StrataError, match="HTTP 404"):
        _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    assert len(hub.gets(Q8)) == 1


def test_a_redirect_loop_is_one_error(hub, tmp_path, opts, reporter):
    hub.fault("redirect", match=Q8, times=None)
    with pytest.raises(StrataError, match=r"Tiny-MoE-Q8_0.gguf: too many redirects from http://127\.0\.0\.1:\d+/"):
        _pull(hub, tmp_path, f"{REPO}:{Q8}", opts, reporter)
    assert_not_finished(dest(tmp_path, Q8))


# --- manifests ----------------------------------------------------------------------------------------


def test_url_split_set_with_manifest(hub, tmp_path, opts, reporter, model_set):
    names = [n for n in model_set if "Q4_K_M" in n]
    for n in names:
        hub.add_plain(f"ms/acme/Tiny/resolve/master/{n}", model_set[n])
    man = tmp_path / "SHA256SUMS"
    man.write_text("".join(f"{sha(model_set[n])}  {n}\n" for n in names))
    url = f"{hub.url}/files/ms/acme/Tiny/resolve/master/{names[1]}"  # any shard names the whole set
    out = _pull(hub, tmp_path, url, opts, reporter, manifest=man)
    assert [p.name for p in out] == names
    for p in out:
        assert_exact(p, model_set[p.name])
        assert p.parent == tmp_path / "models" / "acme" / "Tiny"  # hub-shaped URL -> owner/repo layout
    assert not any("NO KNOWN SHA256" in w for w in reporter.warnings)
    assert read_manifest(man)[names[0]] == (None, sha(model_set[names[0]]))


def _cli_pull(args: list[str], env_extra: dict | None = None, fsize: int | None = None):
    """`python -m strata pull ...` in a child process (optionally under a file-size limit, as `ulimit -f` sets)."""
    import os
    import resource
    import subprocess
    import sys

    def limit():
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "strata", "pull", *args, "--quiet"], capture_output=True, text=True,
                          timeout=120, env=env, preexec_fn=limit)


def test_file_size_limit_is_one_line_and_the_partial_resumes(hub, tmp_path, model_set):
    """A write refused with EFBIG (a file-size limit, a file system's maximum) is one line, like a full disk: the
    `.part` kept, nothing marked done, and the same command resumes once the limit is gone."""
    args = [f"{REPO}:{Q8}", "--models-dir", str(tmp_path / "models"), "--endpoint", hub.url]
    r = _cli_pull(args, fsize=10_000)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("strata: error:")]
    assert len(lines) == 1 and "File too large" in lines[0] and "run the same command again" in lines[0], r.stderr
    out = dest(tmp_path, Q8)
    assert_not_finished(out)
    kept = out.with_name(out.name + ".part").stat().st_size
    assert kept == 10_000
    r = _cli_pull(args)
    assert r.returncode == 0, r.stderr
    assert_exact(out, model_set[Q8])
    assert hub.gets(Q8)[-1][2] == f"bytes={kept}-"


def test_an_unwritable_models_dir_is_one_line(hub, tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    r = _cli_pull([f"{REPO}:{Q8}", "--models-dir", str(tmp_path / "file" / "models"), "--endpoint", hub.url])
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("strata: error:")]
    assert len(lines) == 1 and "Not a directory" in lines[0], r.stderr


# --- a file that changes on the server between a partial download and its resume ----------------------


def _changed_under_a_partial(hub, tmp_path, opts, reporter, model_set) -> tuple[str, bytes, Path]:
    """A URL download (no sha256 known) cut off at 100,000 bytes; then the server's file changes, same size, a
    byte before the cut differing: a resume that stitched the kept prefix to the new file passes every size check."""
    old = model_set[SHARD2]
    url = hub.add_plain("latest/model.gguf", old)
    hub.fault("drop", match="latest/", at=100_000)
    opts.retries = 0
    with pytest.raises(StrataError):
        _pull(hub, tmp_path, url, opts, reporter)
    out = tmp_path / "models" / "model.gguf"
    assert out.with_name("model.gguf.part").stat().st_size == 100_000
    new = old[:50_000] + bytes([old[50_000] ^ 0xFF]) + old[50_001:]
    hub.plain["latest/model.gguf"] = new
    opts.retries = 3
    return url, new, out


def test_a_file_changed_on_the_server_is_not_stitched_to_the_partial(hub, tmp_path, opts, reporter, model_set):
    url, new, out = _changed_under_a_partial(hub, tmp_path, opts, reporter, model_set)
    _pull(hub, tmp_path, url, opts, reporter)
    assert_exact(out, new)
    _, _, rng = hub.gets("latest/")[-1]
    assert rng == "bytes=100000-" and hub.headers[-1]["if-range"] == f'"{sha(model_set[SHARD2])}"'
    assert any("changed on the server" in w for w in reporter.warnings)


def test_a_206_of_another_version_is_refused(hub, tmp_path, opts, reporter, model_set):
    """A server (or one CDN node) that ignores If-Range and answers 206 with the new file's ETag."""
    url, new, out = _changed_under_a_partial(hub, tmp_path, opts, reporter, model_set)
    hub.fault("no_if_range", match="latest/")
    _pull(hub, tmp_path, url, opts, reporter)
    assert_exact(out, new)
    assert [g[2] for g in hub.gets("latest/")][-2:] == ["bytes=100000-", None]  # refused, then from byte 0
    assert not out.with_name("model.gguf.part.etag").exists()


# --- access: gated repos, tokens, redirects -----------------------------------------------------------


def test_a_gated_file_without_a_token_says_to_set_hf_token(hub, tmp_path, opts, reporter):
    """The hub answers a gated repo's files 401 (no token) with X-Error-Code: GatedRepo: one line, naming
    HF_TOKEN and the license, said once for the whole split set."""
    hub.fault("gated", match="Q4_K_M", times=None, at=401)
    with pytest.raises(StrataError) as e:
        _pull(hub, tmp_path, f"{REPO}:Q4_K_M", opts, reporter)
    msg = str(e.value)
    assert "\n" not in msg and msg.count("HTTP 401") == 1 and "HF_TOKEN" in msg and "license" in msg, msg
    assert msg.startswith("3 of 3 file(s) failed: Tiny-MoE-Q4_K_M-00001-of-00003.gguf, "), msg
    assert not any((tmp_path / "models").rglob("*.done"))


def test_a_refused_token_says_to_accept_the_license(hub, tmp_path, opts, reporter):
    hub.fault("gated", match=Q8, times=None, at=403)
    with pytest.raises(StrataError, match=r"HTTP 403 .*accept its license.*HF_TOKEN") as e:
        pull(f"{REPO}:Q8_0", models_dir=tmp_path / "models", endpoint=hub.url, token="hf_test", opts=opts,
             reporter=reporter)
    assert "\n" not in str(e.value)
    assert hub.headers[-1]["authorization"] == "Bearer hf_test"


def test_a_hub_url_gets_the_token_and_its_cdn_does_not(hub, tmp_path, opts, reporter, model_set):
    """`strata pull https://<hub>/owner/repo/resolve/...` sends the hub's token (a gated repo needs it); the
    302 to the CDN's host does not carry it, nor does a URL on any other host."""
    hub.fault("redirect", match=Q8)
    url = f"{hub.url}/{REPO}/resolve/main/{Q8}"
    (out,) = pull(url, models_dir=tmp_path / "models", endpoint=hub.url, token="hf_test", opts=opts,
                  reporter=reporter)
    assert_exact(out, model_set[Q8])
    (to_hub, to_cdn) = hub.headers[-2:]
    assert to_hub["authorization"] == "Bearer hf_test" and to_hub["host"].startswith("127.0.0.1:")
    assert "authorization" not in to_cdn and to_cdn["host"].startswith("localhost:")
    other = url.replace("127.0.0.1", "localhost")
    pull(other, models_dir=tmp_path / "other", endpoint=hub.url, token="hf_test", opts=PullOptions(backoff=0.0),
         reporter=reporter)
    assert "authorization" not in hub.headers[-1]


@pytest.mark.parametrize("flags, says", [
    (["--sha256", "abc"], "--sha256 'abc' is not a sha256 (64 hex digits)"),
    (["--size", "-5"], "--size must be a positive number of bytes, got -5"),
    (["--size", "0"], "--size must be a positive number of bytes, got 0"),
    (["--manifest", "{tmp}/nope"], "--manifest {tmp}/nope: No such file or directory"),
    (["--manifest", "{tmp}"], "--manifest {tmp}: Is a directory"),
    (["--manifest", "{tmp}/binary"], "--manifest {tmp}/binary: not a text file"),
    (["--manifest", "{tmp}/shape.json"], "--manifest {tmp}/shape.json: the entry for 'm.gguf' is not"),
    (["--manifest", "{tmp}/size.json"], "--manifest {tmp}/size.json: the entry for 'm.gguf' is not"),
    (["--retries", "-1"], "--jobs must be >= 1 and --retries >= 0, got 4 and -1"),
    (["-j", "0"], "--jobs must be >= 1 and --retries >= 0, got 0 and 8"),
])
def test_bad_url_download_flags_are_one_line_before_any_byte(hub, tmp_path, capsys, model_set, flags, says):
    """A malformed --sha256/--size/--manifest is named before anything is fetched (a bad --sha256 used to cost two
    whole downloads, then blame the server; a bad manifest was a traceback)."""
    from strata.cli import main

    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00GGUF")
    (tmp_path / "shape.json").write_text('{"m.gguf": 5}')
    (tmp_path / "size.json").write_text('{"m.gguf": {"size": "big"}}')
    url = hub.add_plain("m.gguf", model_set[Q8])
    argv = ["pull", url, "--models-dir", str(tmp_path / "models"), "-q", *(f.format(tmp=tmp_path) for f in flags)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("strata: error: " + says.format(tmp=tmp_path)) and err.count("\n") == 1, err
    assert hub.gets() == []


def test_an_unreachable_host_fails_fast_with_its_name(tmp_path, reporter):
    """Nothing listening (a refused connection) or no such name: UNREACHABLE_TRIES tries, one short wait, then one
    line naming the host, where the backoff of `retries` tries used to wait ~3 minutes."""
    import socket

    from strata.hub.http import UNREACHABLE_TRIES

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for url in (f"http://127.0.0.1:{port}/x/m.gguf", "http://no-such-host.invalid/x/m.gguf"):
        delays = []
        opts = PullOptions(jobs=1, retries=8, backoff=1.0, sleep=delays.append)
        host = url.split("/")[2].split(":")[0]
        with pytest.raises(StrataError, match=f"cannot connect to {re.escape(host)}.*check the address"):
            pull(url, models_dir=tmp_path / "models", token=False, opts=opts, reporter=reporter,
                 output=tmp_path / "m.gguf", sha256=["0" * 64])
        assert delays == [1.0] * (UNREACHABLE_TRIES - 1), delays
        assert not (tmp_path / "m.gguf").exists()
