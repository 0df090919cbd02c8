"""Local path or Hugging Face hub id: decided at once, before anything waits on the network.

`looks_like_path(name)` is the one rule for `model.name_or_path` and `data.dataset`: a name that
starts with `/`, `.` or `~`, has more or fewer than one `/` part separator, or whose first part is a
local folder (`models/qwen3-tin` beside a `models/` folder) is a path; a missing one is an error.
Anything else (`org/name`, `gpt2`) may be a hub id. `hub_unavailable()` says why the hub cannot be
used right now: `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is set, or the endpoint does not answer
a TCP connect within `PROBE_TIMEOUT_S`, instead of waiting out the hub client's retries (~50 s).
`cached_hub_snapshot(repo_id)` finds a model already in the hub cache, so offline runs still work.

Deliberately simple: one TCP probe per process (cached); proxies are not consulted.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0
_TRUE = ("1", "true", "yes", "on")


def looks_like_path(name: str) -> bool:
    """True when `name` can only mean a local file or folder (never a hub id)."""
    if name.startswith(("/", ".", "~")) or "\\" in name or name.endswith("/"):
        return True
    if name.endswith((".jsonl", ".json", ".txt", ".yaml", ".parquet", ".csv", ".safetensors",
                      ".gguf")):
        return True
    parts = name.split("/")
    return len(parts) > 2 or (len(parts) == 2 and Path(parts[0]).is_dir())


def hub_offline() -> bool:
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in names)


@functools.lru_cache(maxsize=1)
def _endpoint_answers() -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    address = (url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80))
    try:
        with socket.create_connection(address, timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def hub_unavailable() -> str | None:
    """None when the hub can be asked now; otherwise the reason, for the error line."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    if not _endpoint_answers():
        host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
        return f"{host} cannot be reached (no network?)"
    return None


def cached_hub_snapshot(repo_id: str, marker: str = "config.json") -> Path | None:
    """The folder of `repo_id`'s newest cached snapshot that holds `marker`, or None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, marker)
    except Exception:  # noqa: BLE001 - an invalid repo id is simply not cached
        return None
    return Path(found).parent if isinstance(found, str) else None
