"""`strata pull`: plan which files to fetch (with the size and sha256 the source vouches for), then fetch and
verify each one so that a wrong file is never left looking finished.

Per file: a valid `.done` marker means done (nothing is fetched); a file without one is re-hashed and either
marked or demoted back to `.part`; then `http.fetch_to_part` transfers the bytes, the whole `.part` is hashed
from disk, a GGUF is checked structurally, and only then is it renamed into place and its marker written.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from urllib.parse import quote, urlsplit, unquote, urlparse

import httpx

from strata import StrataError
from strata.hub import local
from strata.hub.http import NullTask, OpenFile, Task, fetch_to_part, first_line, is_transport_error
from strata.hub.verify import (
    check_gguf_file,
    hash_file,
    marker_mismatch,
    marker_valid,
    read_marker,
    remove_marker,
    write_marker,
)


@dataclass
class RemoteFile:
    """One file to fetch and what its source vouches for (None: not known)."""

    name: str  # path inside the repo (or the URL's file name)
    url: str
    dest: Path
    size: int | None
    sha256: str | None
    source: str  # recorded in the marker: "hf:owner/repo@commit:path" or the URL
    git_sha1: str | None = None  # hub blob id of a non-LFS file

    @property
    def part(self) -> Path:
        return self.dest.with_name(self.dest.name + ".part")


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


# --- planning --------------------------------------------------------------------------------------------


def hf_plan(
    repo: str,
    selector: str | None,
    models_dir: Path,
    *,
    revision: str = "main",
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> list[RemoteFile]:
    """Files of `repo` chosen by `selector`, with sizes and sha256s from the hub's API (LFS metadata)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except GatedRepoError as e:
        raise StrataError(
            f"{repo} is gated: accept its terms on the hub's page, then log in (hf auth login) or pass --token"
        ) from e
    except RepositoryNotFoundError as e:
        raise StrataError(f"{repo}: no such model repository at {endpoint} (or it is private/gated)") from e
    except RevisionNotFoundError as e:
        raise StrataError(f"{repo}: no revision {revision!r}") from e
    except (HfHubHTTPError, httpx.HTTPError, OSError) as e:
        raise StrataError(f"{repo}: could not list files at {endpoint}: {first_line(e)}") from e
    except Exception as e:
        # huggingface_hub's own HTTP stack (httpx, or its vendored httpx2) raises transport errors of classes
        # this module cannot name; any other failure of the listing call is as much the network's
        if not is_transport_error(e):
            raise
        host = urlsplit(endpoint).netloc or endpoint
        raise StrataError(
            f"could not reach {host} to list {repo} ({type(e).__name__}: {first_line(e)}); check the network, "
            "or point HF_ENDPOINT (or --endpoint) at a mirror"
        ) from e
    siblings = {s.rfilename: s for s in info.siblings or []}
    names = select_files_for(list(siblings), selector, repo)
    commit = info.sha or revision  # pin every shard to the one commit the listing came from
    files = []
    for name in names:
        s = siblings[name]
        size = s.lfs.size if s.lfs else s.size
        sha = s.lfs.sha256 if s.lfs else None
        files.append(
            RemoteFile(
                name=name,
                url=f"{endpoint}/{repo}/resolve/{commit}/{quote(name)}",
                dest=models_dir / repo / name,
                size=size,
                sha256=sha.lower() if sha else None,
                source=f"hf:{repo}@{commit}:{name}",
                git_sha1=None if s.lfs else s.blob_id,
            )
        )
    return files


def select_files_for(names: list[str], selector: str | None, repo: str) -> list[str]:
    chosen = local.select_files(names, selector, repo)
    local.check_shard_set(chosen, repo)
    return chosen


_SHARD_NO = re.compile(r"-\d{5}-of-(\d{5})\.gguf$", re.IGNORECASE)
_HUB_LIKE = re.compile(r"/(?:models/)?(?P<owner>[^/]+)/(?P<repo>[^/]+)/resolve/[^/]+/(?P<file>.+)$")


def url_plan(
    url: str,
    models_dir: Path,
    *,
    sha256: list[str] | None = None,
    size: int | None = None,
    output: Path | None = None,
    manifest: dict[str, tuple[int | None, str | None]] | None = None,
) -> list[RemoteFile]:
    """The file at `url` (and its sibling shards when it is part of a split GGUF set).

    Destination: `output` (a file, or a directory to put it in); else `<models_dir>/<owner>/<repo>/<file>`
    for hub-shaped URLs (`.../owner/repo/resolve/rev/file`, as ModelScope and HF mirrors use), so that
    `-m owner/repo:QUANT` finds it; else `<models_dir>/<file name>`.
    """
    parsed = urlparse(url)
    path = unquote(parsed.path)
    fname = Path(path).name
    if not fname:
        raise StrataError(f"{url}: the URL names no file")
    shard = local.shard_info(fname)
    names = [fname]
    if shard:
        base = Path(shard[0]).name
        names = [f"{base}-{i:05d}-of-{shard[2]:05d}.gguf" for i in range(1, shard[2] + 1)]
    m = _HUB_LIKE.search(path)
    if output is not None:
        as_dir = len(names) > 1 or output.is_dir() or str(output).endswith(("/", os.sep))
        dests = [output / n for n in names] if as_dir else [output]
    elif m:
        sub = Path(m.group("file")).parent
        dests = [models_dir / m.group("owner") / m.group("repo") / sub / n for n in names]
    else:
        dests = [models_dir / n for n in names]
    sha256 = [h.lower() for h in (sha256 or [])]
    if sha256 and len(sha256) != len(names):
        raise StrataError(f"{len(sha256)} --sha256 value(s) for {len(names)} file(s): give one per shard, in order")
    if size is not None and len(names) > 1:
        raise StrataError("--size applies to a single file, not to a split set")
    files = []
    for i, n in enumerate(names):
        u = url
        if len(names) > 1:  # same URL, this shard's number (the path's own encoding kept)
            u = parsed._replace(path=_SHARD_NO.sub(f"-{i + 1:05d}-of-\\1.gguf", parsed.path)).geturl()
        fsize, fsha = (manifest or {}).get(n, (None, None))
        files.append(
            RemoteFile(
                name=n,
                url=u,
                dest=dests[i],
                size=size if size is not None else fsize,
                sha256=sha256[i] if sha256 else fsha,
                source=u,
            )
        )
    return files


def read_manifest(path: Path) -> dict[str, tuple[int | None, str | None]]:
    """`sha256sum`-style lines (`HEX  name`) or JSON {name: {"size": N, "sha256": HEX}} -> {name: (size, sha)}."""
    import json

    text = path.read_text()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    out: dict[str, tuple[int | None, str | None]] = {}
    if isinstance(data, dict):
        for name, v in data.items():
            out[Path(name).name] = (v.get("size"), (v.get("sha256") or "").lower() or None)
        return out
    for line in text.splitlines():
        parts = line.strip().split()
        if len(parts) >= 2 and re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
            out[Path(parts[-1].lstrip("*")).name] = (None, parts[0].lower())
    if not out:
        raise StrataError(f"{path}: no sha256 entries (expected `HEX  name` lines or JSON)")
    return out


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
    cancel: threading.Event = field(default_factory=threading.Event)  # set: every transfer stops, keeping .part


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
    pool = ThreadPoolExecutor(max_workers=max(1, opts.jobs), thread_name_prefix="strata-pull")
    try:
        futs = {pool.submit(_pull_one, f, opts, rep, client): f for f in files}
        for fut, f in futs.items():
            try:
                fut.result()
            except StrataError as e:
                errors[f.name] = str(e)
            except OSError as e:  # the models directory itself: not creatable, not writable, ...
                errors[f.name] = f"{Path(f.name).name}: {e.strerror or e}: {e.filename or f.dest}"
    except BaseException:
        opts.cancel.set()  # Ctrl-C: stop every transfer at its next chunk; .part files stay for a resume
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if own:
            client.close()
    if errors:
        lines = "; ".join(errors.values())
        raise StrataError(f"{len(errors)} of {len(files)} file(s) failed: {lines}")
    return [f.dest for f in files]


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
    short = Path(f.name).name
    f.dest.parent.mkdir(parents=True, exist_ok=True)
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
        if why is None and f.sha256 is None and f.git_sha1 is None and m is not None and m.size == digest.size \
                and m.sha256.lower() != digest.sha256:
            # changed in place: with no hash from the source, the marker's is the only record of what was fetched
            why = f"changed since it was downloaded (sha256 {digest.sha256[:16]}..., marker {m.sha256[:16]}...)"
        if why is None and _structure_ok(f, f.dest, rep):
            write_marker(f.dest, digest, f.source, _verified_against(f))
            rep.info(f"{short}: verified")
            return f.dest
        if f.size is not None and digest.size < f.size:
            rep.warn(f"{short}: {why or 'bad structure'}; resuming it as a partial download")
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
        f.part.unlink(missing_ok=True)
        if attempt < opts.hash_retries:
            rep.warn(f"{short}: {why}; downloading it again from the start")
            continue
        raise StrataError(
            f"{short}: {why} after {attempt + 1} download(s); "
            "the source serves different bytes than its metadata promises"
        )
    _check_structure(f, f.part)
    os.replace(f.part, f.dest)
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
            path.unlink(missing_ok=True)
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
    root = Path(models_dir) if models_dir else local.default_models_dir()
    opts = opts or PullOptions()
    if local.is_url(spec):
        files = url_plan(
            spec,
            root,
            sha256=sha256,
            size=size,
            output=output,
            manifest=read_manifest(manifest) if manifest else None,
        )
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
