"""The Python code blocks of the README and of `docs/`, as tests see them.

Every ```python block is run by `tests/test_docs_examples.py` (and, for
blocks marked with a backend, by that backend's own test process). A block
is steered by an HTML comment on the line before its fence, which a reader
of the rendered page does not see:

- `<!-- docs-test: excerpt -->`: a fragment that is not run (few of these);
- `<!-- docs-test: slow -->`: runs in a process of its own, as a slow test;
- `<!-- docs-test: cap=600 -->`: runs in a process of its own under a real
  600 MiB allocator cap (`keras_memguard.testing.run_with_memory_cap`),
  as a slow test: the out-of-memory errors the page speaks of happen;
- `<!-- docs-test: gpu -->`: as `cap=...`, with the process acting as a GPU
  (the step compiled with XLA as on a GPU);
- `<!-- docs-test: continues -->`: runs after the page's previous block,
  in the same program (the page builds one example step by step): the
  blocks of such a chain run once, as one test, and any option of one of
  them (`slow`, `cap=...`) applies to the whole chain;
- `<!-- docs-test: backend=jax -->` (or `torch`): runs only in that
  backend's test process.

Options combine with commas: `<!-- docs-test: cap=600, timeout=300 -->`.
"""

import pathlib
import re
from typing import NamedTuple, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(\s*)```+\s*python\b.*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_KNOWN = {"excerpt", "slow", "cap", "gpu", "continues", "backend", "timeout"}


class Block(NamedTuple):
    """One Python code block and how it is run."""

    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str  # with the blocks it continues, in order
    excerpt: bool
    slow: bool
    cap_mib: Optional[int]
    as_gpu: bool
    backend: str
    timeout: int
    covers: int = 1  # the page's blocks this one runs (a chain: several)

    @property
    def name(self):
        return f"{self.path}:{self.line}"


def markdown_files():
    """The README and every page of the documentation site, sorted."""
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _options(text, where):
    options = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in _KNOWN:
            raise ValueError(f"{where}: unknown docs-test option {key!r}")
        options[key] = value.strip() or True
    return options


def blocks_of(path):
    """The Python blocks of one Markdown file, in order."""
    relative = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    found = []
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        start = index
        indent = len(fence.group(1))
        body = []
        index += 1
        while index < len(lines) and not lines[index].strip().startswith("```"):
            body.append(lines[index][indent:])
            index += 1
        index += 1
        marker = _MARKER.match(lines[start - 1]) if start else None
        where = f"{relative}:{start + 1}"
        options = _options(marker.group(1), where) if marker else {}
        code = "\n".join(body) + "\n"
        cap = options.get("cap")
        block = Block(
            path=relative,
            line=start + 1,
            code=code,
            excerpt=bool(options.get("excerpt")),
            slow=bool(options.get("slow") or cap or options.get("gpu")),
            cap_mib=int(cap) if cap else None,
            as_gpu=bool(options.get("gpu")),
            backend=options.get("backend", "tensorflow"),
            timeout=int(options.get("timeout", 600)),
        )
        if options.get("continues"):
            chained = [b for b in found if not b.excerpt]
            if not chained:
                raise ValueError(f"{where}: `continues` with no block before it")
            previous = chained[-1]
            found.remove(previous)
            block = previous._replace(
                code=previous.code + "\n" + code,
                slow=previous.slow or block.slow,
                cap_mib=block.cap_mib or previous.cap_mib,
                as_gpu=previous.as_gpu or block.as_gpu,
                timeout=max(previous.timeout, block.timeout) if "timeout" in options else previous.timeout,
                covers=previous.covers + 1,
            )
        found.append(block)
    return found


def all_blocks():
    """Every Python block of the README and the documentation site."""
    return [block for path in markdown_files() for block in blocks_of(path)]


def counts(blocks) -> Tuple[int, int]:
    """`(run, excerpts)`: the Markdown blocks `blocks` run, and the excerpts."""
    excerpts = sum(block.excerpt for block in blocks)
    return sum(block.covers for block in blocks if not block.excerpt), excerpts


def blocks_for(backend):
    """The blocks to run on Keras backend `backend` (excerpts left out)."""
    return [b for b in all_blocks() if b.backend == backend and not b.excerpt]


def run_in_process(block, folder, monkeypatch):
    """Runs `block` here, as a script in `folder` would, then clears Keras.

    `KERAS_HOME` points into `folder`, so a plan cache the block writes
    stays there.
    """
    import gc

    import keras

    monkeypatch.chdir(folder)
    monkeypatch.setenv("KERAS_HOME", str(folder / "keras_home"))
    namespace = {"__name__": "__main__", "__file__": block.path}
    try:
        exec(compile(block.code, block.name, "exec"), namespace)
    finally:
        namespace.clear()
        keras.backend.clear_session()
        gc.collect()
