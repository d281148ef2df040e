"""The layers of infc, read from every module's imports (module-level and inside functions):

    compiler/contract/   the plan contract: what the compiler writes and the runtime reads
    compiler/            imports no runtime, benchmark, server or application module
    runtime/             imports the contract, the op vocabulary (compiler/ops) and the shared
                         settings (infc.envs, infc.config, infc.records) only
    server/              imports no benchmark and no CLI
    infc.envs, infc.config, infc.records   shared settings: import no other layer

and no import cycle anywhere in infc. A cycle counts function-level (lazy) imports too: a lazy
import only hides a cycle from the interpreter, not from a reader, who must still know both
modules to understand either.
"""
import ast
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parent.parent
# folder -> the package it installs as (pyproject.toml package-dir)
PACKAGES = {"infc": "infc", "compiler": "infc.compiler", "runtime": "infc.runtime",
            "server": "infc.server", "bench": "infc.bench"}
NOT_INSTALLED = ("bench/experiments", "bench/results")
SHARED = ("infc.envs", "infc.config", "infc.records")

# importer prefix -> the prefixes it may import (the longest matching importer prefix applies)
ALLOWED = {
    "infc.compiler.contract": ("infc.compiler.contract", "infc.envs"),
    "infc.runtime": ("infc.runtime", "infc.compiler.contract", "infc.compiler.ops", *SHARED),
    "infc.envs": ("infc.envs",),
    "infc.config": ("infc.config", "infc.envs"),
    "infc.records": ("infc.records", "infc.envs"),
}
# importer prefix -> the prefixes it may not import
FORBIDDEN = {
    "infc.compiler": ("infc.runtime", "infc.bench", "infc.server", "infc.backend", "infc.cli",
                      "infc.llm", "infc.records"),
    "infc.server": ("infc.bench", "infc.cli", "infc.llm"),
}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def modules(root: Path = REPO) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package's __init__)."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.as_posix().startswith(NOT_INSTALLED):
                continue
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join([package, *(parts[:-1] if is_pkg else parts)])] = (path, is_pkg)
    return out


def imports(name: str, path: Path, is_pkg: bool, known) -> list[tuple[str, int]]:
    """(imported infc module, line) for every import statement in the file, at any depth."""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                module = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:     # `from pkg import submodule` imports the submodule
                sub = f"{module}.{a.name}"
                found.append((sub if sub in known else module, node.lineno))
    out = []
    for target, line in found:
        while target and target not in known:    # an attribute of a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.append((target, line))
    return out


def graph(root: Path = REPO) -> tuple[nx.DiGraph, dict]:
    known = modules(root)
    g = nx.DiGraph()
    lines = {}
    for name, (path, is_pkg) in known.items():
        g.add_node(name)
        for target, line in imports(name, path, is_pkg, known):
            g.add_edge(name, target)
            lines.setdefault((name, target), (path.relative_to(root).as_posix(), line))
    return g, lines


def _rule(name: str, table: dict):
    keys = [k for k in table if _under(name, k)]
    return table[max(keys, key=len)] if keys else None


def violations(root: Path = REPO) -> list[str]:
    g, lines = graph(root)
    bad = []
    for a, b in sorted(g.edges):
        allowed, forbidden = _rule(a, ALLOWED), _rule(a, FORBIDDEN)
        if (allowed is not None and not any(_under(b, p) for p in allowed)) or \
                (forbidden is not None and any(_under(b, p) for p in forbidden)):
            where, line = lines[(a, b)]
            bad.append(f"{where}:{line}: {a} imports {b}")
    return bad


def cycles(root: Path = REPO) -> list[list[str]]:
    g, _ = graph(root)
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_the_walk_sees_the_tree():
    g, _ = graph()
    # a lazy import (inside a function) is an edge like any other
    assert g.has_edge("infc.runtime.distributed.rank_runners", "infc.compiler.ops")
    assert g.has_edge("infc.compiler.plan", "infc.compiler.contract.schema")
    assert len(g) > 120


def test_no_layer_imports_past_its_own():
    bad = violations()
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles()
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def _copy(tmp_path: Path) -> Path:
    for folder in PACKAGES:
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO)
            if not rel.as_posix().startswith(NOT_INSTALLED):
                (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / rel).write_text(path.read_text())
    return tmp_path


@pytest.mark.parametrize("file,line,expect", [
    ("compiler/plan.py", "    from infc.runtime.engine import engine\n", "infc.compiler.plan imports infc.runtime.engine.engine"),
    ("runtime/engine/step.py", "from infc.compiler.build import build\n", "infc.runtime.engine.step imports infc.compiler.build"),
    ("runtime/cuda/tune_run.py", "from infc.bench import common\n", "infc.runtime.cuda.tune_run imports infc.bench.common"),
    ("compiler/contract/caches.py", "from ..plan import dumps\n", "infc.compiler.contract.caches imports infc.compiler.plan"),
])
def test_a_planted_forbidden_import_is_named(tmp_path, file, line, expect):
    root = _copy(tmp_path)
    path = root / file
    src = path.read_text()
    if line.startswith(" "):
        src += "\n\ndef _planted():\n" + line
    else:
        src = line + src
    path.write_text(src)
    assert any(v.endswith(expect) for v in violations(root)), violations(root)


def test_a_planted_lazy_cycle_is_found(tmp_path):
    root = _copy(tmp_path)
    path = root / "compiler" / "parallel.py"
    path.write_text(path.read_text() + "\n\ndef _planted():\n    from .build import build\n")
    assert ["infc.compiler.build", "infc.compiler.parallel"] in cycles(root)


def test_every_package_is_installed():
    """pyproject.toml lists packages one by one: a new subpackage missing there is missing from
    the wheel, though the editable install finds it."""
    import tomllib
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, (_, is_pkg) in modules().items() if is_pkg}
    assert packages <= listed, f"not in pyproject.toml's packages: {sorted(packages - listed)}"
