"""runtime/engine/gc_freeze.py: startup objects leave the collector's walks, unless INFC_GC_FREEZE=0.
Each check runs in a fresh interpreter: freezing is process-wide and would hold the test
session's own objects."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = """
import gc
from infc.runtime.engine.gc_freeze import freeze_startup
kept = [[i] for i in range(20000)]             # startup objects that live on
cycle = []; cycle.append(cycle); del cycle     # startup garbage: collected, not frozen
before = len(gc.get_objects())
done = freeze_startup()
print(done, gc.get_freeze_count(), len(gc.get_objects()), before)
"""


def _probe(**env):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, **env}, timeout=60)
    assert out.returncode == 0, out.stderr
    done, frozen, after, before = out.stdout.split()
    return done == "True", int(frozen), int(after), int(before)


def test_freeze_moves_the_live_startup_objects_out_of_the_walks():
    done, frozen, after, before = _probe()
    assert done
    assert frozen >= 20000                 # the kept lists are in the permanent generation
    assert after < 1000 < before           # and no longer among the objects collections walk


def test_infc_gc_freeze_0_leaves_the_collector_alone():
    done, frozen, after, before = _probe(INFC_GC_FREEZE="0")
    assert not done and frozen == 0
    assert after >= 20000
