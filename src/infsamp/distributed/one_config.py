"""The processes of one launch run one configuration, compared before anything loads.

Each rank hashes its resolved configuration (the YAML file, the flags and the defaults, after
validation); the hashes are gathered, and when they differ the flat settings are gathered too, so
that the error names each differing key with every rank's value. Every rank raises the same
`ConfigError` (rank 0 prints it, every rank exits 2): a rank given another `learning_rate` would
otherwise train silently, and one given another `num_generations` would fail steps later inside a
collective.

Deliberately simple: every setting must agree, the per-process ones included (`model.device auto`
gives each rank its own GPU).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from infsamp.config import Config
from infsamp.config_io import flatten
from infsamp.options import ConfigError

MAX_SHOWN = 4


def check_one_config(ranks, cfg: Config) -> None:
    """ConfigError on every rank when the ranks' configurations differ."""
    digest = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
    if len(set(ranks.gather_json(digest.hexdigest()))) == 1:
        return
    settings = ranks.gather_json(flatten(json.loads(json.dumps(cfg.to_dict(), default=str))))
    differing = [key for key in settings[0] if any(s.get(key) != settings[0][key]
                                                   for s in settings[1:])]
    shown = "; ".join(f"{key}: " + ", ".join(f"rank {rank} {_show(s.get(key))}"
                                              for rank, s in enumerate(settings))
                      for key in differing[:MAX_SHOWN])
    more = f"; and {len(differing) - MAX_SHOWN} more" if len(differing) > MAX_SHOWN else ""
    ranks.watch.finished()  # every rank stops here: their exits are not failures
    err = ConfigError(f"the {ranks.world_size} processes of this launch were given different "
                      f"settings ({shown}{more}); give every process the same config file and "
                      "flags")
    err.agreed = True  # type: ignore[attr-defined]
    raise err


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else repr(value)
