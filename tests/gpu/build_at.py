"""Run HERE (no GPU): build an artifact with the compiler of an earlier commit, for an A/B against
HEAD's build of the same model directory (tests/gpu/run.sh ab-latency).

    python tests/gpu/build_at.py COMMIT MODEL_DIR NAME     # -> .cache/artifacts/NAME and NAME-h100

The commit is checked out as a git worktree under /tmp, and its packages are imported from there:
the editable install maps infc.compiler etc. to this checkout, so a plain sys.path entry would
mix the two. NAME holds the H200 table's plan (both tables' cubins), NAME-h100 the H100 table's.
Neither has a built_from.json: tests/gpu/rerender.py would re-render them with HEAD's compiler,
so the device command picks NAME or NAME-h100 by the card that came.
"""
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def package_root(tree: Path) -> Path:
    """A directory whose infc package is `tree`'s, laid out as that commit's pyproject package-dir
    maps it (infc.compiler -> compiler/, ...)."""
    dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = Path(f"/tmp/infc-pkg-{tree.name}")
    pkg = root / "infc"
    pkg.mkdir(parents=True, exist_ok=True)
    for f in (tree / dirs["infc"]).iterdir():
        if not (pkg / f.name).exists():
            (pkg / f.name).symlink_to(f)
    for name, src in dirs.items():
        link = root / Path(*name.split("."))
        if name != "infc" and not link.exists():
            link.symlink_to(tree / src)
    return root


def main(commit: str, model_dir: str, name: str):
    # the worktree is named by the commit's hash, not by what was typed: a ref such as HEAD names
    # another commit tomorrow, and a worktree left under its name would be reused (built stale)
    commit = subprocess.run(["git", "rev-parse", "--short=12", f"{commit}^{{commit}}"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.strip()
    tree = Path(f"/tmp/infc-at-{commit}")
    if not tree.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True)
    model_dir = str(Path(model_dir).resolve())
    code = (f"import sys, shutil; sys.path.insert(0, {str(package_root(tree))!r})\n"
            "from infc.compiler.build import build\n"
            f"for out, gpus in (({name!r}, ('h100', 'h200')), ({name + '-h100'!r}, ('h100',))):\n"
            f"    out = {str(REPO / '.cache' / 'artifacts')!r} + '/' + out\n"
            "    shutil.rmtree(out, ignore_errors=True)\n"
            "    for g in gpus:\n"
            f"        build(out=out, gpu=g, log=None, model_dir={model_dir!r})\n"
            "    print('[build_at]', out)\n")
    # run from the worktree, in a fresh interpreter (the build's process pool imports infc again)
    subprocess.run([sys.executable, "-c", code], cwd=tree, check=True)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
