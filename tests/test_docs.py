"""Every code name in README.md and docs/*.md is real.

(a) every backticked repo path (`runtime/core.py`, `docs/export.md`, `tools/demo_models/target`, ...)
    exists, relative to the repo root;
(b) every dotted Python name that starts with a specrt top-level module or package (`contract.`,
    `trees.`, `engines.`, `runtime.`, `export.`, `tools.`, `specrt.`), in inline code or in a fenced
    block, resolves: the longest importable module prefix is imported and the rest is getattr-ed;
    `from specrt.X import a, b` lines in fenced blocks import;
(c) every relative markdown link points at a file or folder that exists.

The matchers are deliberately conservative: a name that only looks like specrt's (preceded by a
`.`, `/` or `-`, a file name such as `runtime.py`, a path with placeholders) is not checked.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

TOP = ("contract", "trees", "engines", "runtime", "export", "tools")
# (a): paths start with a top-level entry of the repo
PATH_HEADS = ("runtime/", "export/", "engines/", "tools/", "tests/", "docs/", "contract.py", "trees.py",
              "__init__.py", "pyproject.toml", "README.md")
# (b): file names are not Python names
FILE_EXTS = {"py", "md", "json", "jsonl", "onnx", "txt", "h", "hpp", "toml", "png", "plan", "so",
             "safetensors", "pt", "bin", "data", "yaml", "yml", "sh", "cache", "csv"}
NAME = re.compile(r"(?<![\w./\-:])(?:specrt|" + "|".join(TOP) + r")(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
FROM_IMPORT = re.compile(r"^\s*from\s+(specrt(?:\.\w+)*)\s+import\s+\(?([\w\s,]+)\)?\s*(?:#.*)?$")
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.S | re.M)
INLINE = re.compile(r"(?<!`)`((?:[^`\n]|\n(?![ \t]*\n))+)`(?!`)")  # may wrap onto the next line
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")


def _split(text: str) -> tuple[str, list[str]]:
    """(the prose with fenced blocks blanked, the fenced blocks)."""
    blocks = [m.group(0) for m in FENCE.finditer(text)]
    return FENCE.sub("", text), blocks


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def repo_paths(text: str) -> set[str]:
    """Backticked tokens that name a path in the repo."""
    prose, _ = _split(text)
    found = set()
    for span in INLINE.findall(prose):
        for token in span.split():
            token = token.strip(",;()[]'\"")
            token = token.split(":", 1)[0]  # `runtime/sampling.py: penalize`, `tests/x.py::test`
            if not token.startswith(PATH_HEADS) or any(c in token for c in "<>*{}$|~"):
                continue
            if "/" not in token and "." not in token:
                continue
            found.add(token.rstrip("."))
    return found


def python_names(text: str) -> set[str]:
    """Dotted specrt names in inline code and fenced blocks, and the names of `from specrt... import` lines."""
    prose, blocks = _split(text)
    found = set()
    for chunk in [*INLINE.findall(prose), *blocks]:
        for m in NAME.finditer(chunk):
            name = m.group(0)
            last = re.split(r"[.:]", name)[-1]
            if last in FILE_EXTS:  # `runtime.py`: a file name
                continue
            found.add(name)
    for chunk in [*INLINE.findall(prose), *blocks]:
        for line in chunk.splitlines():
            m = FROM_IMPORT.match(line)
            if m:
                for part in m.group(2).split(","):
                    part = part.strip().split(" as ")[0].strip()
                    if part:
                        found.add(f"{m.group(1)}.{part}")
    return found


def links(path: Path, text: str) -> set[str]:
    prose, _ = _split(text)
    found = set()
    for m in LINK.finditer(prose):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http:, https:, mailto:, an anchor on this page
        found.add(target.split("#", 1)[0])
    return found


class Unverifiable(Exception):
    """The module exists but needs a dependency that is not installed here."""


def resolve(name: str) -> None:
    """Import the longest importable module prefix of ``name`` and getattr the rest; raise if it does not resolve."""
    name = name.replace(":", ".")
    parts = name.split(".")
    if parts[0] != "specrt":
        parts = ["specrt", *parts]
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, AttributeError, ValueError):  # a parent is not a package
            spec = None
        if spec is None:
            continue
        try:
            obj = importlib.import_module(module)
        except ImportError as e:
            if e.name and not e.name.startswith("specrt"):
                raise Unverifiable(f"{module} needs {e.name}") from e
            raise
        for attr in parts[i:]:
            obj = getattr(obj, attr)  # AttributeError: the name is not there
        return
    raise ModuleNotFoundError(name)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_repo_paths_exist(doc):
    missing = sorted(p for p in repo_paths(doc.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{_doc_id(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_python_names_resolve(doc):
    bad, skipped = [], []
    for name in sorted(python_names(doc.read_text())):
        try:
            resolve(name)
        except Unverifiable as e:
            skipped.append(f"{name} ({e})")
        except (ImportError, AttributeError) as e:
            bad.append(f"{name} ({type(e).__name__}: {e})")
    assert not bad, f"{_doc_id(doc)} names Python objects that do not exist:\n  " + "\n  ".join(bad)
    if skipped:
        pytest.skip("not importable here: " + "; ".join(skipped))


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_relative_links_exist(doc):
    text = doc.read_text()
    missing = sorted(t for t in links(doc, text) if t and not (doc.parent / t).exists())
    assert not missing, f"{_doc_id(doc)} links to files that do not exist: {missing}"


def test_matchers():
    """What the matchers take and what they leave alone."""
    text = ("See `runtime/core.py`, `python tools/gpu_check.py --smoke`, `runtime/sampling.py: penalize`, "
            "`torch/<role>/`, `docs/x.md`.\n"
            "`contract.MASK_MIN`, `specrt.load(dir)`, `runtime.py`, `specrt.h`, `python -m specrt.tools.bench.cpp`, `docs/runtime.md`, `rt.runtime.x`, "
            "`python -m specrt.tools.bench.faults ENGINE_DIR`, `specrt.runtime.serve.ray_serve:app_builder`\n"
            "[a](docs/a.md#x) [b](https://example.com) [c](#anchor) ![d](img/d.png)\n"
            "`python -m\nspecrt.tools.bench.scale`, `from specrt.runtime.device import load_device_runtime`\n"
            "  ```python\n  from specrt.runtime.core import CoreConfig, DecodeCore\nx = trees.compile_tree\n"
            "`docs/in_fence.md` [e](in_fence.md)\n  ```\n")
    assert repo_paths(text) == {"runtime/core.py", "tools/gpu_check.py", "runtime/sampling.py", "docs/x.md",
                               "docs/runtime.md"}
    assert python_names(text) == {
        "contract.MASK_MIN", "specrt.load", "specrt.tools.bench.faults", "specrt.runtime.serve.ray_serve:app_builder",
        "specrt.runtime.core", "specrt.runtime.core.CoreConfig", "specrt.runtime.core.DecodeCore", "trees.compile_tree",
        "specrt.tools.bench.scale", "specrt.tools.bench.cpp", "specrt.runtime.device", "specrt.runtime.device.load_device_runtime"}
    assert links(Path("README.md"), text) == {"docs/a.md", "img/d.png"}
    resolve("contract.MASK_MIN")
    resolve("specrt.EngineError")
    with pytest.raises(AttributeError):
        resolve("contract.KV_IN_PLACE")
    with pytest.raises(AttributeError):
        resolve("runtime.tree.Tree")
