"""Where specs are found: the user's spec directories, then the built-in specs/.

    search_path(spec_dirs)  -> [--spec-dir dirs..., $INFC_SPEC_PATH dirs..., <repo>/specs]

User directories come first, like PATH: a spec there that claims an architecture (or a variant
name) the built-in specs also have takes precedence, so a user can fix or extend a family
without editing the repository. The first match wins; `infc inspect` prints which spec file a
model came from. A directory that does not exist is an error (a typo would otherwise silently
fall back to the built-in spec), naming where it was given.
"""
from pathlib import Path

from infc import envs
from .contract.errors import SpecError

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
ENV = "INFC_SPEC_PATH"

HOW_TO_POINT = (f"pass a spec file with --spec FILE, or put it in a directory named by --spec-dir DIR "
                f"or {ENV}=DIR[:DIR...]")


def _checked(d: str, where: str) -> Path:
    p = Path(d).expanduser()
    if not p.is_dir():
        raise SpecError(f"{where}: spec directory '{d}' "
                        f"{'is not a directory' if p.exists() else 'does not exist'}", None)
    return p


def search_path(spec_dirs=None) -> list[Path]:
    """The directories searched for *.yaml specs, in order (duplicates dropped)."""
    dirs = [_checked(str(d), "--spec-dir") for d in (spec_dirs or [])]
    dirs += [_checked(d, ENV) for d in envs.value(ENV) if d.strip()]
    dirs.append(SPECS_DIR)
    out, seen = [], set()
    for d in dirs:
        key = d.resolve()
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def spec_files(spec_dirs=None) -> list[Path]:
    """Every spec file on the search path, directory by directory, sorted within each."""
    return [f for d in search_path(spec_dirs) for f in sorted(d.glob("*.yaml"))]


def describe(spec_dirs=None) -> str:
    """'specs/, /my/specs' for messages."""
    return ", ".join(str(d) for d in search_path(spec_dirs))


def add_spec_dir_arg(p) -> None:
    """The `--spec-dir DIR` flag (repeatable) of build, inspect, generate and serve."""
    p.add_argument("--spec-dir", action="append", metavar="DIR",
                   help=f"a directory of spec files searched before specs/ (repeatable; "
                        f"also ${ENV}, colon-separated)")
