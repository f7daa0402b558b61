"""Programs that tests run in processes of their own.

Each module here has a `main()` and takes its arguments from `sys.argv` or
the environment. They import one another as `programs.<name>`, so the process
needs the `tests` folder on `sys.path`: `source` and `command` arrange that.
Run one by hand with `cd tests && python -m programs.<name> ARGS`.
"""

import pathlib
import sys

DIRECTORY = pathlib.Path(__file__).resolve().parent
TESTS_DIRECTORY = DIRECTORY.parent


def path(name):
    """The file of program `name`."""
    return DIRECTORY / f"{name}.py"


def source(name, *args):
    """Python source that runs program `name` as `__main__` with `args`.

    For `keras_memguard.testing.run_with_memory_cap`, which takes source
    text, and for `python -c`.
    """
    if not path(name).is_file():
        raise ValueError(f"No test program {name!r} in {DIRECTORY}.")
    return (
        "import runpy, sys\n"
        f"sys.path.insert(0, {str(TESTS_DIRECTORY)!r})\n"
        f"sys.argv[1:] = {[str(arg) for arg in args]!r}\n"
        f"runpy.run_module('programs.{name}', run_name='__main__', alter_sys=True)\n"
    )


def command(name, *args):
    """The command line that runs program `name` with `args`."""
    return [sys.executable, "-c", source(name, *args)]
