"""`strata pull`: plan which files to fetch (`strata.hub.plan`: with the size and sha256 the source vouches for),
then fetch and verify each one so that a wrong file is never left looking finished.

Per file: a valid `.done` marker means done (nothing is fetched); a file without one is re-hashed and either
marked or demoted back to `.part`; then `http.fetch_to_part` transfers the bytes, the whole `.part` is hashed
from disk, a GGUF is checked structurally, and only then is it renamed into place and its marker written.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import httpx

from strata import StrataError
from strata.hub import local
from strata.hub.http import (Cancel, Interrupted, NullTask, OpenFile, Task, discard_part, etag_path,
                             fetch_to_part)
from strata.hub.plan import RemoteFile, hf_plan, read_manifest, url_plan
from strata.hub.verify import (
    check_gguf_file,
    hash_file,
    marker_mismatch,
    marker_valid,
    read_marker,
    remove_marker,
    write_marker,
)


class Reporter:
    """Progress bars and warnings; this one is silent and keeps the warnings (tests read them)."""

    def __init__(self) -> None:
        self.warnings: list[str] = []
        self.infos: list[str] = []
        self._lock = threading.Lock()

    def task(self, description: str, total: int | None) -> Task:
        return NullTask()

    def done(self, task: Task) -> None:
        pass

    def warn(self, msg: str) -> None:
        with self._lock:
            self.warnings.append(msg)

    def info(self, msg: str) -> None:
        with self._lock:
            self.infos.append(msg)


# --- fetching --------------------------------------------------------------------------------------------


def _free_space(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def _already_there(f: RemoteFile) -> int:
    """Bytes of `f` already on disk that the fetch will keep (before verification)."""
    for p in (f.dest, f.part):
        if p.exists():
            n = p.stat().st_size
            return n if f.size is None or n <= f.size else 0
    return 0


def check_disk_space(files: list[RemoteFile], where: Path, disk_free: Callable[[Path], int]) -> int:
    """Bytes still to download; StrataError when they do not fit in the free space at `where`."""
    need = sum(
        f.size - _already_there(f)
        for f in files
        if f.size is not None and not marker_valid(f.dest, f.size, f.sha256)
    )
    free = disk_free(where)
    if need > free:
        raise StrataError(
            f"not enough disk space in {where}: {_gb(need)} more needed (counting what is already there), "
            f"{_gb(free)} free; free {_gb(need - free)} or pick another --models-dir"
        )
    return need


def _gb(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n} B"


CANCEL_GRACE_S = 5.0  # after Ctrl-C, how long the transfers get to stop before the process leaves them


@dataclass
class PullOptions:
    jobs: int = 4
    retries: int = 5
    backoff: float = 1.0
    verify: bool = False  # re-hash files whose marker is valid
    hash_retries: int = 1  # full re-downloads after a hash mismatch before giving up
    headers: dict[str, str] | None = None
    disk_free: Callable[[Path], int] = _free_space
    open_file: OpenFile = open  # type: ignore[assignment]
    sleep: Callable[[float], None] | None = None  # default: wait on `cancel`, so Ctrl-C cuts a backoff short
    timeout: float = 60.0
    cancel: threading.Event = field(default_factory=Cancel)  # set: every transfer stops, keeping .part


def pull_files(
    files: list[RemoteFile],
    opts: PullOptions | None = None,
    reporter: Reporter | None = None,
    client: httpx.Client | None = None,
) -> list[Path]:
    """Fetch and verify every file (in parallel); returns their final paths. StrataError naming each failure."""
    opts = opts or PullOptions()
    rep = reporter or Reporter()
    if not files:
        return []
    unknown = [f.name for f in files if f.sha256 is None and f.git_sha1 is None]
    if unknown:
        rep.warn(
            "NO KNOWN SHA256 for " + ", ".join(unknown) + ": only size and GGUF structure can be checked; "
            "pass --sha256 (or --manifest) to verify the bytes"
        )
    where = files[0].dest.parent
    need = check_disk_space(files, where, opts.disk_free)
    if need:
        rep.info(f"{_gb(need)} to download into {where}")
    own = client is None
    if own:
        client = httpx.Client(
            follow_redirects=True, timeout=httpx.Timeout(opts.timeout, connect=30.0), headers={"User-Agent": "strata"}
        )
    errors: dict[str, str] = {}
    crashed: list[BaseException] = []
    pending = list(files)
    guard = threading.Lock()

    def work() -> None:
        while True:
            with guard:
                if not pending or opts.cancel.is_set():
                    return
                f = pending.pop(0)
            try:
                _pull_one(f, opts, rep, client)
            except StrataError as e:
                errors[f.name] = str(e)
            except OSError as e:  # the models directory itself: not creatable, not writable, ...
                errors[f.name] = f"{Path(f.name).name}: {e.strerror or e}: {e.filename or f.dest}"
            except BaseException as e:  # a bug: its traceback, from the main thread
                crashed.append(e)
                opts.cancel.set()

    # Daemon threads: after Ctrl-C the process leaves once the transfers have stopped (they do at their next
    # chunk, or at once when blocked in a read: Cancel shuts their sockets down), or after CANCEL_GRACE_S even
    # if one is stuck elsewhere (a connect, a hash); every state a file can be left in is resumable.
    workers = [threading.Thread(target=work, daemon=True, name=f"strata-pull-{i}")
               for i in range(max(1, min(opts.jobs, len(files))))]
    try:
        for t in workers:
            t.start()
        for t in workers:
            while t.is_alive():
                t.join(0.25)  # in slices, so that Ctrl-C reaches this thread
    except BaseException:
        opts.cancel.set()  # Ctrl-C: every transfer stops; .part files stay for a resume
        deadline = time.monotonic() + CANCEL_GRACE_S
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
        raise
    finally:
        if own and not any(t.is_alive() for t in workers):
            client.close()
    if crashed:
        raise crashed[0]
    if errors:
        raise StrataError(f"{len(errors)} of {len(files)} file(s) failed: {_summary(files, errors)}")
    return [f.dest for f in files]


def _summary(files: list[RemoteFile], errors: dict[str, str]) -> str:
    """The errors in file order; one reason shared by several files (a gated repo's 401) said once."""
    msgs = [errors[f.name] for f in files if f.name in errors]
    heads, tails = zip(*(m.split(": ", 1) if ": " in m else (m, "") for m in msgs))
    if len(msgs) > 1 and len(set(tails)) == 1 and tails[0]:
        return f"{', '.join(heads)}: {tails[0]}"
    return "; ".join(msgs)


def _is_hub_url(url: str, endpoint: str | None) -> bool:
    from huggingface_hub import constants

    return urlsplit(url).netloc == urlsplit(endpoint or constants.ENDPOINT).netloc


def _verified_against(f: RemoteFile, size_confirmed: bool = False) -> str:
    if f.sha256:
        return "sha256"
    if f.git_sha1:
        return "git-sha1"
    if f.size is not None:
        return "size"
    return "announced-size" if size_confirmed else "none"


def _digest_ok(f: RemoteFile, digest) -> str | None:
    """None when the digest matches what the source vouches for, else why not."""
    if f.size is not None and digest.size != f.size:
        return f"size {digest.size} != expected {f.size}"
    if f.sha256 and digest.sha256 != f.sha256:
        return f"sha256 {digest.sha256} != expected {f.sha256}"
    if f.git_sha1 and digest.git_sha1 != f.git_sha1:
        return f"git blob id {digest.git_sha1} != expected {f.git_sha1}"
    return None


def _hash(f: RemoteFile, path: Path, rep: Reporter):
    task = rep.task(f"hash {Path(f.name).name}", path.stat().st_size)
    try:
        return hash_file(path, task, git_sha1=f.git_sha1 is not None)
    finally:
        rep.done(task)


def _pull_one(f: RemoteFile, opts: PullOptions, rep: Reporter, client: httpx.Client) -> Path:
    f.dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(f, opts, rep):
        return _pull_locked(f, opts, rep, client)


@contextmanager
def _exclusive(f: RemoteFile, opts: PullOptions, rep: Reporter):
    """Hold `<file>.lock` (flock) while the file is checked, fetched and marked: a second `strata pull` of the
    same file, in this process or another, waits for the first and then finds it done, where both writing one
    `.part` and renaming it under each other left a file that was neither's download. The lock file stays (a
    waiter may hold it open: removing it would let a third pull lock a new one)."""
    fd = os.open(f.dest.with_name(f.dest.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    rep.info(f"{Path(f.name).name}: another strata pull is fetching it; waiting for it to finish")
                    told = True
                if opts.cancel.wait(0.2):
                    raise Interrupted(f"{Path(f.name).name}: interrupted while waiting for another strata pull")
        yield
    finally:
        os.close(fd)  # releases the lock


def _pull_locked(f: RemoteFile, opts: PullOptions, rep: Reporter, client: httpx.Client) -> Path:
    short = Path(f.name).name
    if f.dest.exists():
        if marker_valid(f.dest, f.size, f.sha256, allow_legacy=False) and not opts.verify:
            rep.info(f"{short}: already downloaded and verified")
            return f.dest
        m = read_marker(f.dest)
        if m is not None and not opts.verify:
            rep.warn(f"{short}: {marker_mismatch(m, f.dest)}; re-verifying")
        remove_marker(f.dest)  # from here on the file is unproven until hashed
        digest = _hash(f, f.dest, rep)
        why = _digest_ok(f, digest)
        unchecked = f.sha256 is None and f.git_sha1 is None  # nothing from the source to hash it against
        if why is None and unchecked and m is not None and (m.size, m.sha256.lower()) != (digest.size, digest.sha256):
            # changed in place, or cut: with no hash from the source, the marker's is the only record of the fetch
            why = f"changed since it was downloaded (sha256 {digest.sha256[:16]}..., marker {m.sha256[:16]}...)"
        blind = unchecked and f.size is None and m is None  # no size, no hash, no record: a file of any length
        if why is None and blind:
            why = "on disk with no record of its download, and the source gives no size or sha256 to check it by"
        if why is None and _structure_ok(f, f.dest, rep):
            write_marker(f.dest, digest, f.source, _verified_against(f))
            rep.info(f"{short}: verified")
            return f.dest
        if (f.size is not None and digest.size < f.size) or blind:  # (blind: the server's length then judges)
            rep.warn(f"{short}: {why or 'bad structure'}; resuming it as a partial download")
            discard_part(f.part)
            os.replace(f.dest, f.part)  # a short file is likely a good prefix; the full hash will judge
        else:
            rep.warn(f"{short}: {why or 'bad structure'}; downloading it again")
            f.dest.unlink()
    elif read_marker(f.dest) is not None:
        remove_marker(f.dest)

    for attempt in range(opts.hash_retries + 1):
        task = rep.task(f"get  {short}", f.size)
        try:
            t = fetch_to_part(
                client,
                f.url,
                f.part,
                expected_size=f.size,
                headers=opts.headers,
                retries=opts.retries,
                backoff=opts.backoff,
                task=task,
                warn=rep.warn,
                open_file=opts.open_file,
                sleep=opts.sleep or opts.cancel.wait,
                cancelled=opts.cancel.is_set,
                watch=opts.cancel.watching if isinstance(opts.cancel, Cancel) else None,
            )
        finally:
            rep.done(task)
        if not t.size_confirmed and f.sha256 is None and f.git_sha1 is None:
            raise StrataError(
                f"{short}: the server announced no size and no sha256 is known, so a complete file cannot be told "
                f"from a truncated one; kept as {f.part.name} (pass --sha256 or --size)"
            )
        digest = _hash(f, f.part, rep)
        why = _digest_ok(f, digest)
        if why is None:
            break
        discard_part(f.part)
        if attempt < opts.hash_retries:
            rep.warn(f"{short}: {why}; downloading it again from the start")
            continue
        raise StrataError(
            f"{short}: {why} after {attempt + 1} download(s); "
            "the source serves different bytes than its metadata promises"
        )
    _check_structure(f, f.part)
    os.replace(f.part, f.dest)
    etag_path(f.part).unlink(missing_ok=True)
    write_marker(f.dest, digest, f.source, _verified_against(f, t.size_confirmed))
    rep.info(f"{short}: done ({_gb(digest.size)}, sha256 {digest.sha256[:16]}...)")
    return f.dest


def _structure_ok(f: RemoteFile, path: Path, rep: Reporter) -> bool:
    try:
        _check_structure(f, path)
        return True
    except StrataError as e:
        rep.warn(str(e))
        return False


def _check_structure(f: RemoteFile, path: Path) -> None:
    if not f.name.lower().endswith(".gguf"):
        return
    try:
        check_gguf_file(path, name=f.dest.name)
    except StrataError as e:
        if path.name.endswith(".part"):
            discard_part(path)
            raise StrataError(f"{e} (downloaded bytes discarded)") from e
        raise


def pull(
    spec: str,
    *,
    models_dir: Path | None = None,
    revision: str = "main",
    endpoint: str | None = None,
    token: str | bool | None = None,
    sha256: list[str] | None = None,
    size: int | None = None,
    output: Path | None = None,
    manifest: Path | None = None,
    opts: PullOptions | None = None,
    reporter: Reporter | None = None,
) -> list[Path]:
    """`strata pull SPEC`: a URL, or `owner/repo[:FILE_OR_QUANT]` from the hub. Returns the files, first shard first."""
    from strata.config import hub_offline

    root = Path(models_dir) if models_dir else local.default_models_dir()
    opts = opts or PullOptions()
    if hub_offline():
        return _offline(spec, root, sha256=sha256, size=size, output=output, reporter=reporter or Reporter())
    if local.is_url(spec):
        files = url_plan(
            spec,
            root,
            sha256=sha256,
            size=size,
            output=output,
            manifest=read_manifest(manifest) if manifest else None,
        )
        if opts.headers is None and _is_hub_url(spec, endpoint):
            # the hub's own file URL (a gated or private repo's needs the token); never another host's
            from huggingface_hub.utils import build_hf_headers

            opts.headers = build_hf_headers(token=token)
    else:
        if sha256 or size is not None or output is not None:
            raise StrataError(
                "--sha256, --size and -o apply to URL downloads; the hub's metadata gives sizes and hashes"
            )
        repo, selector = local.parse_spec(spec)
        files = hf_plan(repo, selector, root, revision=revision, endpoint=endpoint, token=token)
        if opts.headers is None:
            from huggingface_hub.utils import build_hf_headers

            opts.headers = build_hf_headers(token=token)
    return pull_files(files, opts, reporter)


def _offline(spec: str, root: Path, *, sha256, size, output, reporter: Reporter) -> list[Path]:
    """HF_HUB_OFFLINE: the files of `spec` as already downloaded and verified, or one error; nothing is fetched."""
    try:
        if local.is_url(spec):
            files = url_plan(spec, root, sha256=sha256, size=size, output=output)
            missing = [f.dest.name for f in files if not marker_valid(f.dest, f.size, f.sha256)]
            if missing:
                raise StrataError(f"{', '.join(missing)}: not completely downloaded to {files[0].dest.parent}")
            paths = [f.dest for f in files]
        else:
            paths = local.resolve_model(spec, root)
    except StrataError as e:
        raise StrataError(f"HF_HUB_OFFLINE is set, so nothing is downloaded: {e}") from e
    for p in paths:
        reporter.info(f"{p.name}: already downloaded (offline: not checked against the source)")
    return paths
