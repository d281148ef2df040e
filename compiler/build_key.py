"""The key of a served artifact: what a rebuild would read, by size and modification time.

`infc serve` builds or reuses .cache/artifacts/<name> at every start (build(reuse_bins=True)).
Rebuilding the plan to find it unchanged costs the compiler's imports, every pass, rendering and
hashing every kernel (0.2-0.3 s on the GPU host, more on a small CPU). This key stands in for that
rebuild: the build's arguments, every INFC_* variable's value (infc/envs.py), and (path, size, mtime_ns) of every file
the compiler reads: its own sources and the runtime's it imports (infc/, compiler/, runtime/),
the templates and tuning tables, the specs (specs/ and every spec directory given or in
$INFC_SPEC_PATH), and the model directory's files (config.json, the checkpoint whose headers are
checked, the quantization and tokenizer files). Any change to any of them, even a touch, misses
the key and rebuilds as before; a hit also requires the plan.json that build wrote (its size and
mtime, so a plan rewritten there by anything else is rebuilt) and a cubin for each of its kernels.
"""
import hashlib
import json
import os
from pathlib import Path

KEY_FILE = "build_key.json"
REPO = Path(__file__).resolve().parent.parent
SOURCES = ("infc", "compiler", "runtime", "codegen_templates", "specs")


def _stats(root: Path, out: list):
    """(path, size, mtime_ns) of every file under root (root itself if a file), sorted."""
    root = Path(root)
    if root.is_file():
        st = root.stat()
        out.append((str(root), st.st_size, st.st_mtime_ns))
        return
    rows = []
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                st = os.stat(p)
            except OSError:
                continue
            rows.append((p, st.st_size, st.st_mtime_ns))
    out.extend(sorted(rows))


def build_key(args: dict, model_dir, spec_path, spec_dirs) -> str:
    """args: the build's own arguments (JSON-able); the files are found from the rest."""
    files: list = []
    for d in SOURCES:
        _stats(REPO / d, files)
    from infc import envs
    from .spec_paths import ENV
    extra = [*(spec_dirs or []), *(d for d in envs.value(ENV) if d.strip())]
    for d in [spec_path, model_dir, *extra]:
        if d and Path(d).exists():
            _stats(Path(d).resolve(), files)
    env = [(name, repr(envs.value(name))) for name in sorted(envs.REGISTRY)]
    blob = json.dumps({"args": args, "env": env, "files": files}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _plan_stamp(out: Path) -> list:
    st = (Path(out) / "plan.json").stat()
    return [st.st_size, st.st_mtime_ns]


def matches(out: Path, key: str) -> bool:
    """The artifact at out was built under this key, its plan.json is the one that build wrote
    (another writer, `infc build --out` or a GPU session's prepare, changes its stamp), and it
    still has a cubin for each of the plan's kernels."""
    try:
        rec = json.loads((out / KEY_FILE).read_text())
        if rec.get("key") != key or rec.get("plan") != _plan_stamp(out):
            return False
        plan = json.loads((out / "plan.json").read_text())
    except (OSError, ValueError):
        return False
    kernels = plan.get("kernels") or {}
    return all((out / "bin" / f"{kid}.cubin").is_file() for kid in kernels)


def record(out: Path, key: str):
    tmp = out / (KEY_FILE + ".tmp")
    tmp.write_text(json.dumps({"key": key, "plan": _plan_stamp(out)}))
    tmp.replace(out / KEY_FILE)


def forget(out: Path):
    """Before the artifact is rewritten: a build that stops half-way leaves no key behind."""
    try:
        (out / KEY_FILE).unlink()
    except FileNotFoundError:
        pass
