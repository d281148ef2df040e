"""One home for every default and environment variable (infc/config.py, infc/envs.py):

- no KV page size default is a literal outside infc/config.py (a `page_size=16` / `block_size=16`
  default or keyword, a `.get("page_size", 16)`, or a --block-size / --page-size flag with its
  own default);
- no INFC_* variable is read from os.environ outside infc/envs.py, and every INFC_* name the
  product's code mentions is registered there;
- docs/configuration.md lists the registry as `infc env --markdown` prints it;
- the configs built by `infc serve`'s flags, `LLM(...)` and flat settings agree.
Tests (tests/, tests/gpu/) may read the environment directly; they are not scanned.
"""
import ast
import re
from pathlib import Path

import pytest

from infc import envs
from infc.config import DEFAULT_PAGE_SIZE, EngineConfig

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("infc", "compiler", "runtime", "server", "bench", "tools")
HOMES = {"infc/config.py", "infc/envs.py"}
PAGE_NAMES = {"page_size", "block_size"}
PAGE_FLAGS = {"--block-size", "--page-size"}
DOC = REPO / "docs" / "configuration.md"
BEGIN, END = "<!-- infc env --markdown: begin -->", "<!-- infc env --markdown: end -->"


def _literal(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


def _infc_name(node) -> str | None:
    """The INFC_ variable a string expression names ('INFC_X', or f'INFC_{...}')."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("INFC_"):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant) \
            and str(node.values[0].value).startswith("INFC_"):
        return node.values[0].value + "..."
    return None


def _is_environ(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" or \
        isinstance(node, ast.Name) and node.id == "environ"


def scan(source: str, where: str) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            pos = a.posonlyargs + a.args
            pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + \
                [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
            bad += [f"{where}:{d.lineno}: default {k.arg}={d.value}" for k, d in pairs
                    if k.arg in PAGE_NAMES and _literal(d)]
        elif isinstance(node, ast.Call):
            bad += [f"{where}:{node.lineno}: keyword {k.arg}={k.value.value}" for k in node.keywords
                    if k.arg in PAGE_NAMES and _literal(k.value)]
            if isinstance(node.func, ast.Attribute) and node.func.attr == "get" and len(node.args) == 2 \
                    and isinstance(node.args[0], ast.Constant) and node.args[0].value in PAGE_NAMES \
                    and _literal(node.args[1]):        # config.get("page_size", 16)
                bad += [f"{where}:{node.lineno}: default {node.args[0].value}={node.args[1].value}"]
            if node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in PAGE_FLAGS:
                bad += [f"{where}:{node.lineno}: flag {node.args[0].value} has its own default"
                        for k in node.keywords if k.arg == "default"]
            f = node.func       # os.environ.get("INFC_X"), os.getenv("INFC_X"), environ.pop(...)
            reads_env = isinstance(f, ast.Attribute) and (
                _is_environ(f.value) or f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os")
            if reads_env and node.args and _infc_name(node.args[0]):
                bad += [f"{where}:{node.lineno}: reads {_infc_name(node.args[0])} from the environment"]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and _infc_name(node.slice):
            bad += [f"{where}:{node.lineno}: reads {_infc_name(node.slice)} from the environment"]
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators) \
                and _infc_name(node.left):
            bad += [f"{where}:{node.lineno}: reads {_infc_name(node.left)} from the environment"]
    return bad


def _product_files():
    for folder in PRODUCT:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel not in HOMES and not rel.startswith("bench/results"):
                yield rel, path.read_text()


def test_no_literal_default_and_no_environment_read_outside_the_homes():
    bad = [b for rel, src in _product_files() for b in scan(src, rel)]
    assert not bad, "defaults and INFC_ reads belong to infc/config.py and infc/envs.py:\n" + "\n".join(bad)


def test_every_infc_variable_the_code_names_is_registered():
    named = {(rel, m) for rel, src in _product_files() for m in re.findall(r"\bINFC_[A-Z0-9_]+\b", src)}
    unknown = sorted(f"{rel}: {m}" for rel, m in named if m not in envs.REGISTRY)
    assert not unknown, "INFC_ variables missing from infc/envs.py:\n" + "\n".join(unknown)


@pytest.mark.parametrize("planted,expect", [
    ("def f(num_pages, page_size=16):\n    pass\n", "default page_size=16"),
    ("def f(*, block_size: int = 64):\n    pass\n", "default block_size=64"),
    ("x = g(plan, page_size=16)\n", "keyword page_size=16"),
    ("x = config.get('page_size', 16)\n", "default page_size=16"),
    ("p.add_argument('--block-size', type=int, default=16)\n", "flag --block-size has its own default"),
    ("import os\nx = os.environ.get('INFC_OVERLAP', '1')\n", "reads INFC_OVERLAP from the environment"),
    ("import os\nx = os.getenv('INFC_PDL')\n", "reads INFC_PDL from the environment"),
    ("import os\nx = os.environ['INFC_P2P']\n", "reads INFC_P2P from the environment"),
    ("import os\nx = 'INFC_DEBUG' in os.environ\n", "reads INFC_DEBUG from the environment"),
    ("import os\nx = os.environ.get(f'INFC_{name}')\n", "reads INFC_... from the environment"),
])
def test_a_planted_violation_is_found(planted, expect):
    found = scan(planted, "planted.py")
    assert found and found[0].endswith(expect), found
    assert not scan("def f(page_size=DEFAULT_PAGE_SIZE):\n    return envs.value('INFC_PDL')\n", "ok.py")


def test_the_docs_list_the_registry():
    text = DOC.read_text()
    assert BEGIN in text and END in text, f"{DOC}: the generated markers are missing"
    listed = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert listed == envs.markdown(), ("docs/configuration.md is stale: replace the table between its "
                                       "markers with `infc env --markdown`")


def test_infc_env_prints_every_variable(capsys):
    from infc.cli import main
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in envs.REGISTRY)


def test_values_are_typed_and_defaulted(monkeypatch):
    monkeypatch.delenv("INFC_OVERLAP", raising=False)
    assert envs.value("INFC_OVERLAP") is True
    monkeypatch.setenv("INFC_OVERLAP", "0")
    assert envs.value("INFC_OVERLAP") is False
    monkeypatch.setenv("INFC_EP_GATHER", "1")
    assert envs.value("INFC_EP_GATHER") is True
    monkeypatch.setenv("INFC_P2P_BYTES", "4096")
    assert envs.value("INFC_P2P_BYTES") == 4096
    monkeypatch.setenv("INFC_P2P_BYTES", "lots")
    with pytest.raises(ValueError, match="INFC_P2P_BYTES='lots': not an integer"):
        envs.value("INFC_P2P_BYTES")
    with pytest.raises(KeyError, match="INFC_NOPE is not a registered"):
        envs.value("INFC_NOPE")


def test_one_config_from_flags_llm_and_settings():
    from infc.server.args import engine_config
    from infc.cli import parser
    args = parser().parse_args(["serve", "--model-path", "m", "--device", "cpu", "--block-size", "32",
                                "--max-num-seqs", "8"])
    flags = engine_config(args)
    flat = EngineConfig.from_settings(device="cpu", block_size=32, max_num_seqs=8, overlap=None)
    assert flags.cache.page_size == flat.cache.page_size == 32            # vLLM's alias, one name
    assert flags.scheduler.max_num_seqs == flat.scheduler.max_num_seqs == 8
    never = lambda: pytest.fail("the cpu device needs no GPU table")  # noqa: E731
    done = EngineConfig.from_settings(device="cpu").resolved(lambda: "cpu", never)
    assert done.cache.page_size == DEFAULT_PAGE_SIZE
    assert done.resolved(lambda: "cpu", never) == done                  # idempotent
    gpu = EngineConfig.from_settings(device="cuda").resolved(lambda: "cuda", lambda: 64)
    assert gpu.cache.page_size == 64                                      # the GPU's tuning table
    with pytest.raises(TypeError, match="unknown engine setting 'max_num_seq'"):
        EngineConfig.from_settings(max_num_seq=3)
    with pytest.raises(ValueError, match="--block-size must be >= 1"):
        EngineConfig.from_settings(device="cpu", block_size=-1).resolved(lambda: "cpu", never)
