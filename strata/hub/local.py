"""The models directory: where `strata pull` puts files and where `-m REPO:QUANT` finds them.

Layout: `<models_dir>/<owner>/<repo>/<file in repo>`, each finished file beside its `<file>.done` marker.
Choosing files from a name list is shared by `pull` (remote listing) and `resolve_model` (local listing), so
that both read `REPO:QUANT` the same way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from strata import StrataError
from strata.hub.verify import marker_valid

_SHARD = re.compile(r"^(?P<base>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$", re.IGNORECASE)
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def default_models_dir() -> Path:
    """$STRATA_MODELS_DIR, else <strata's cache>/models (strata.config.models_dir)."""
    from strata.config import models_dir

    return models_dir()


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`owner/repo[:FILE_OR_QUANT]` -> (repo, selector or None). StrataError when it is not of that shape."""
    repo, _, sel = spec.partition(":")
    if not _REPO.match(repo):
        raise StrataError(f"{spec!r} is neither a file, a URL, nor a Hugging Face repo id like owner/name[:Q4_K_M]")
    return repo, (sel or None)


def shard_info(name: str) -> tuple[str, int, int] | None:
    """`dir/X-00002-of-00005.gguf` -> ("dir/X", 2, 5); None when not a split GGUF file name."""
    m = _SHARD.match(name)
    if not m:
        return None
    return m.group("base"), int(m.group("idx")), int(m.group("n"))


def _model_key(name: str) -> str:
    """Files of one model share a key: the shard base for a split set, the name itself otherwise."""
    s = shard_info(name)
    return s[0] if s else name


def _order(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: (shard_info(n) or (n, 0, 0))[1])


def _quant_matches(name: str, quant: str) -> bool:
    # The tag must stand alone in the file name: Q4_K matches "x-Q4_K.gguf" but not "x-Q4_K_M.gguf".
    pat = rf"(?:^|[-_./]){re.escape(quant)}(?:[-./]|$)"
    return re.search(pat, name, re.IGNORECASE) is not None


def select_files(names: list[str], selector: str | None, what: str) -> list[str]:
    """The files of one model among `names` (paths in a repo), first shard first.

    `selector` is a file name (its whole split set when it is a shard), a quant tag (every .gguf whose name
    carries it, all shards of one set), or None (the only GGUF model there). StrataError when nothing or more
    than one model matches; `what` names the place for the message.
    """
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    if selector and selector in names:
        s = shard_info(selector)
        if not s:
            return [selector]
        chosen = [n for n in ggufs if _model_key(n) == s[0]]
    elif selector:
        chosen = [n for n in ggufs if _quant_matches(n, selector)]
        if not chosen:
            have = _available(ggufs) or "no GGUF files"
            raise StrataError(f"no file in {what} matches {selector!r}; available: {have}")
    else:
        chosen = ggufs
        if not chosen:
            raise StrataError(f"no GGUF files in {what}; name a file as REPO:FILE")
    # A multimodal projector rides along with its model only when it is all that matched.
    main = [n for n in chosen if not Path(n).name.lower().startswith("mmproj")]
    chosen = main or chosen
    keys = sorted({_model_key(n) for n in chosen})
    if len(keys) > 1:
        raise StrataError(
            f"{selector or 'the repo'} matches {len(keys)} models in {what}: {', '.join(keys)}; "
            "pick one as REPO:QUANT or REPO:FILE"
        )
    return _order(chosen)


def _available(ggufs: list[str]) -> str:
    keys = sorted({_model_key(n) for n in ggufs})
    return ", ".join(Path(k).name for k in keys[:20]) + (" ..." if len(keys) > 20 else "")


def check_shard_set(names: list[str], what: str) -> None:
    """StrataError unless a split set is complete (1..N of N, one N)."""
    infos = [shard_info(n) for n in names]
    if not any(infos):
        return
    if not all(infos):
        raise StrataError(f"{what}: split and unsplit files mixed: {names}")
    counts = {i[2] for i in infos if i}
    idx = sorted(i[1] for i in infos if i)
    n = max(counts)
    if len(counts) != 1 or idx != list(range(1, n + 1)):
        raise StrataError(f"{what}: incomplete split GGUF set (have parts {idx} of {n})")


def resolve_model(spec: str | os.PathLike, models_dir: str | os.PathLike | None = None) -> list[Path]:
    """The GGUF file(s) that `-m SPEC` means, first shard first.

    A path to an existing file passes through; a part of a split set brings the whole set, first part first,
    as the loader opens it. `owner/repo[:QUANT_OR_FILE]` is looked up under `models_dir`
    (default: `default_models_dir()`), and every chosen file must carry a valid `.done` marker, so that a
    partial or unverified download is never loaded. StrataError when nothing usable is found.
    """
    p = Path(spec).expanduser()
    if p.is_file():
        s = shard_info(p.name)
        if s:  # any part names its whole set, as the loader opens it (strata.gguf.reader.split_paths)
            parts = [p.with_name(f"{Path(s[0]).name}-{i:05d}-of-{s[2]:05d}.gguf") for i in range(1, s[2] + 1)]
            missing = [r.name for r in parts if not r.is_file()]
            if missing:
                raise StrataError(f"{p.name} is part {s[1]} of {s[2]}, but these parts are missing: "
                                  f"{', '.join(missing)}")
            return parts
        return [p]
    if p.is_dir():
        raise StrataError(_directory(p, str(spec)))
    spec = str(spec)
    if spec.startswith(("/", "./", "../", "~")):  # a path, not a repo id
        raise StrataError(f"no such file: {spec}")
    if is_url(spec):
        raise StrataError(f"{spec} is a URL: download it first with `strata pull {spec}`")
    if spec.endswith(".gguf") and ":" not in spec and not _REPO.match(spec):
        raise StrataError(f"no such file: {spec}")
    repo, selector = parse_spec(spec)
    root = Path(models_dir).expanduser() if models_dir else default_models_dir()
    repo_dir = root / repo
    if not repo_dir.is_dir():
        raise StrataError(f"{repo} is not in {root}; download it with `strata pull {spec}`")
    names = sorted(
        str(f.relative_to(repo_dir)) for f in repo_dir.rglob("*") if f.is_file() and f.suffix.lower() == ".gguf"
    )
    chosen = select_files(names, selector, f"{repo_dir}")
    check_shard_set(chosen, spec)
    files = [repo_dir / n for n in chosen]
    unfinished = [f.name for f in files if not marker_valid(f)]
    if unfinished:
        raise StrataError(
            f"{spec}: not completely downloaded or not verified ({', '.join(unfinished)}); run `strata pull {spec}`"
        )
    return files


def _directory(p: Path, spec: str) -> str:
    """What to pass instead of a directory: a GGUF in it, or the conversion of a transformers checkpoint."""
    ggufs = sorted(f.name for f in p.glob("*.gguf") if (shard_info(f.name) or ("", 1, 1))[1] == 1)  # (first parts)
    if ggufs:
        return (f"{spec} is a directory: name a .gguf file in it, e.g. -m {p / ggufs[0]}"
                + (f" ({len(ggufs)} models there)" if len(ggufs) > 1 else ""))
    if (p / "config.json").is_file():
        return (f"{spec} is a transformers checkpoint directory, and strata runs GGUF files: convert it with "
                f"`strata convert {spec} out.gguf`")
    return f"{spec} is a directory: name a .gguf file in it (or REPO[:QUANT])"
