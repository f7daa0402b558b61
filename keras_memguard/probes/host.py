"""The process's resident memory (RSS), read from `/proc/self/statm`.

Host memory is where an input pipeline keeps what it holds: a dataset
`.cache()`d in memory, numpy arrays copied every epoch, prefetch buffers
on a GPU machine. Linux gives the resident pages of the process in the
second field of `/proc/self/statm`; times the page size, that is the RSS.
The file is opened once and read with `os.pread` at offset 0, so a reading
is one system call and no Python file object, and no new dependency.

Where there is no `/proc` (macOS, Windows), the value is `None` and one
INFO line on the `keras_memguard` logger says so; nothing raises.
"""

import logging
import os
import threading
import weakref

logger = logging.getLogger("keras_memguard")

STATM_PATH = "/proc/self/statm"

# statm is seven decimal page counts; 128 bytes hold any of them.
_READ_BYTES = 128

# Probes with an open file, reopened in a forked child: the inherited
# descriptor still reads the parent's `/proc/<pid>/statm`.
_open_probes = weakref.WeakSet()
_fork_hook_lock = threading.Lock()
_fork_hook_registered = False


def _forget_files_in_child():
    for probe in list(_open_probes):
        probe.forget_file()


def _register_fork_hook():
    global _fork_hook_registered
    with _fork_hook_lock:
        if not _fork_hook_registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_forget_files_in_child)
        _fork_hook_registered = True


class HostMemoryProbe:
    """Reads the resident memory (RSS) of this process.

    The file is opened on the first reading and kept open; each later
    reading is one `os.pread`. Where it cannot be opened or read (no
    `/proc`), `rss_bytes()` returns `None` from then on, after one INFO
    line on the `keras_memguard` logger.

    Args:
        path: The `statm` file to read. Defaults to `"/proc/self/statm"`.

    Example:

    ```python
    probe = HostMemoryProbe()
    rss = probe.rss_bytes()  # an int, or None without /proc
    ```
    """

    def __init__(self, path=STATM_PATH):
        self.path = path
        self._fd = None
        self._page_size = None
        # None: not tried yet; False: unavailable for good.
        self._available = None
        self._lock = threading.Lock()

    @property
    def available(self):
        """Whether the RSS can be read here (opens the file on first use)."""
        if self._available is None:
            self._open()
        return self._available

    def rss_bytes(self):
        """Returns the resident memory of this process in bytes, or `None`.

        Returns:
            An int (resident pages times the page size), or `None` where
            `/proc/self/statm` cannot be read.
        """
        fd = self._fd
        if fd is None:
            if self._available is False or not self._open():
                return None
            fd = self._fd
        try:
            return int(os.pread(fd, _READ_BYTES, 0).split(None, 2)[1]) * self._page_size
        except (OSError, ValueError, IndexError) as error:
            self._give_up(f"reading {self.path} failed: {error}")
            return None

    def close(self):
        """Closes the file; a later reading opens it again."""
        with self._lock:
            fd, self._fd = self._fd, None
            if self._available:
                self._available = None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def _open(self):
        with self._lock:
            if self._fd is not None:
                return True
            if self._available is False:
                return False
            try:
                page_size = os.sysconf("SC_PAGE_SIZE")
                fd = os.open(self.path, os.O_RDONLY)
            except (AttributeError, ValueError, OSError) as error:
                # AttributeError: no os.sysconf (Windows).
                why = f"{self.path} cannot be read on this platform ({error})"
            else:
                self._fd, self._page_size = fd, page_size
                self._available = True
                _open_probes.add(self)
                _register_fork_hook()
                return True
        self._give_up(why)
        return False

    def _give_up(self, why):
        with self._lock:
            already = self._available is False
            self._available = False
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        if not already:
            logger.info("host memory (RSS) is not logged: %s", why)

    def forget_file(self):
        """Drops the open file without reading it; the next reading opens it afresh.

        For a forked child (the module's fork hook calls it there): the
        inherited descriptor still reads the parent's `/proc/<pid>/statm`,
        and the inherited lock may be held by a thread that does not exist
        in the child, so both are replaced.
        """
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        if self._available:
            self._available = None
        self._lock = threading.Lock()

    def __del__(self, _close=os.close):
        # `os.close` bound at definition: at interpreter shutdown the
        # module's globals may already be gone when this runs.
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                _close(fd)
            except OSError:
                pass


_shared = None


def shared_probe():
    """Returns the process-wide `HostMemoryProbe` (one open file for all).

    Returns:
        A `HostMemoryProbe` of `/proc/self/statm`, made on first use.
    """
    global _shared
    if _shared is None:
        _shared = HostMemoryProbe()
    return _shared


def rss_bytes():
    """The resident memory of this process in bytes, or `None` without `/proc`.

    Returns:
        An int, or `None`.
    """
    return shared_probe().rss_bytes()
