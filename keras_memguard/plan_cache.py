"""What the decider learned, kept across runs in a small JSON file.

One file per training set-up under `$KERAS_HOME/memguard/` (by default
`~/.keras/memguard/`), named by a hash of the set-up: the model's class and
weights (names, shapes, dtypes), the layers' dtype policies, the
optimizer's class, the input signature (dtypes and the dimensions that do
not vary), the devices, the memory limit, the micro-batching mode and the
TensorFlow and Keras versions. A second
`fit` of the same set-up reads it and plans its first batch from what the
first run measured. A file that cannot be read, or that describes another
set-up, is ignored with one warning and replaced at the next save: it is
never trusted blindly.

To clear the cache, delete the folder (`keras_memguard.plan_cache.cache_dir()`
names it).
"""

import hashlib
import json
import logging
import os
import tempfile

from keras_memguard import decider
from keras_memguard.probes.base import warn_at_user_code

logger = logging.getLogger("keras_memguard")

CACHE_FORMAT_VERSION = 2

# Folders a save could not write to, warned about once each.
_UNWRITABLE = set()


def cache_dir():
    """The folder plan files live in: `$KERAS_HOME/memguard`.

    `KERAS_HOME` defaults to `~/.keras`, as in Keras itself.

    Returns:
        The folder's path (it may not exist yet).

    Example:

    >>> cache_dir().endswith("memguard")
    True
    """
    home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras"
    )
    return os.path.join(home, "memguard")


def setup_key(fields):
    """A short, stable name for a set-up described by `fields`.

    Args:
        fields: A JSON-serializable dictionary describing the set-up.

    Returns:
        A hex string (the first 24 hex digits of its SHA-256).

    Example:

    >>> setup_key({"model": "x"}) == setup_key({"model": "x"})
    True
    """
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def path_for(key):
    """The plan file of set-up `key`."""
    return os.path.join(cache_dir(), f"plan-{key}.json")


def load(key, fields):
    """The decider state stored for `key`, or `None`.

    Args:
        key: From `setup_key(fields)`.
        fields: The set-up's description; a file whose own description
            differs is another set-up's (a hash collision, or an edited
            file) and is not used.

    Returns:
        A `keras_memguard.decider.DeciderState`, or `None` when there is no usable file (a
        corrupt or foreign file warns once).
    """
    path = path_for(key)
    try:
        with open(path) as f:
            payload = json.load(f)
    except (FileNotFoundError, NotADirectoryError):
        return None  # no file there (the save says why, where it cannot write)
    except (OSError, ValueError) as error:
        _warn_ignored(path, f"it cannot be read ({error})")
        return None
    try:
        if not isinstance(payload, dict):
            raise ValueError(f"expected a JSON object, got {type(payload).__name__}")
        if payload.get("version") != CACHE_FORMAT_VERSION:
            raise ValueError(f"unknown format version {payload.get('version')!r}")
        if payload.get("setup") != json.loads(json.dumps(fields, default=str)):
            raise ValueError("it describes another training set-up")
        state = decider.from_dict(payload.get("decider"))
    except ValueError as error:
        _warn_ignored(path, str(error))
        return None
    # What the earlier run learned, not what happened in it: this run's
    # recoveries count from zero, and its own readings recalibrate the
    # earlier run's.
    return decider.inherit(state._replace(oom_count=0, eval_oom_count=0))


def save(key, fields, state):
    """Writes `state` for `key` atomically; failures only log.

    Args:
        key: From `setup_key(fields)`.
        fields: The set-up's description, stored beside the state.
        state: A `keras_memguard.decider.DeciderState`.
    """
    folder = cache_dir()
    payload = {
        "version": CACHE_FORMAT_VERSION,
        "setup": fields,
        "decider": decider.to_dict(state),
    }
    try:
        os.makedirs(folder, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(handle, "w") as f:
            json.dump(payload, f, default=str)
        os.replace(tmp, path_for(key))
    except OSError as error:
        if folder in _UNWRITABLE:
            logger.info("plan cache: could not write %s (%s)", folder, error)
            return
        # Once a folder: a read-only home (a container's) would otherwise
        # leave every run planning from scratch with nothing said.
        _UNWRITABLE.add(folder)
        warn_at_user_code(
            f"keras_memguard cannot write its plan cache under {folder} "
            f"({error}), so each run plans from scratch. HINT: set KERAS_HOME "
            "to a writable folder, or pass MemoryGuard(plan_cache=False)."
        )


def _warn_ignored(path, why):
    warn_at_user_code(
        f"keras_memguard ignores the plan cache file {path}: {why}. The guard "
        "plans from scratch and rewrites the file. HINT: delete the file, or "
        "pass MemoryGuard(plan_cache=False) to turn the cache off."
    )
