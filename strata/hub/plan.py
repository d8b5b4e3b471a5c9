"""What `strata pull` fetches: the files a spec names, each with the size and sha256 its source vouches for
(the hub's API listing, a manifest, or the command line), and where each one goes."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlparse, urlsplit

import httpx

from strata import StrataError
from strata.hub import local
from strata.hub.http import first_line, is_transport_error


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
            f"{repo} is gated: accept its license on its page on the hub, then set HF_TOKEN to a token of that "
            "account (or pass --token, or run `hf auth login`)"
        ) from e
    except RepositoryNotFoundError as e:
        raise StrataError(f"{repo}: no such model repository at {endpoint} (a private one needs a token of an "
                          "account with access: set HF_TOKEN or pass --token)") from e
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


_SHA256 = re.compile(r"[0-9a-f]{64}")
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
    sha256 = [h.strip().lower() for h in (sha256 or [])]
    for h in sha256:
        if not _SHA256.fullmatch(h):
            raise StrataError(f"--sha256 {h!r} is not a sha256 (64 hex digits)")
    if size is not None and size < 1:
        raise StrataError(f"--size must be a positive number of bytes, got {size}")
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

    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else "not a text file"
        raise StrataError(f"--manifest {path}: {why}") from e
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    out: dict[str, tuple[int | None, str | None]] = {}
    if isinstance(data, dict):
        for name, v in data.items():
            size, sha = (v.get("size"), v.get("sha256")) if isinstance(v, dict) else (None, None)
            if not isinstance(v, dict) or (size is not None and (type(size) is not int or size < 1)) or (
                    sha is not None and not (isinstance(sha, str) and _SHA256.fullmatch(sha.lower()))):
                raise StrataError(f"--manifest {path}: the entry for {name!r} is not "
                                  '{"size": BYTES, "sha256": "64 hex digits"}')
            out[Path(name).name] = (size, sha.lower() if sha else None)
        return out
    for line in text.splitlines():
        parts = line.strip().split()
        if len(parts) >= 2 and re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
            out[Path(parts[-1].lstrip("*")).name] = (None, parts[0].lower())
    if not out:
        raise StrataError(f"{path}: no sha256 entries (expected `HEX  name` lines or JSON)")
    return out
