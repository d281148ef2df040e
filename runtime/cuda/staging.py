"""Page-locked staging for a step's uploads, two steps deep.

A copy from pageable host memory is not truly asynchronous: the driver may stage it through its
own buffer and wait on the stream, which would make the host wait for the step still running on
the GPU. The engine overlaps the next step's host work with the current step's GPU work
(engine.Engine, overlap), so every host array a step uploads (token ids, positions, block tables,
sampling parameters) is first copied into page-locked memory, and the copy from there runs in
stream order.

Two buffers, alternating by step: step N + 2 writes the buffer step N read from, and the engine
collects step N (its last event, after its uploads) before it prepares step N + 2.
"""
import numpy as np


class Staging:
    def __init__(self, ctx, nbytes: int):
        self.nbytes = nbytes
        self.buffers = [ctx.pinned(nbytes), ctx.pinned(nbytes)]
        self.step = 0
        self.used = 0

    def begin(self):
        """A new step: switch to the other buffer, empty."""
        self.step += 1
        self.used = 0

    def put(self, a: np.ndarray) -> np.ndarray:
        """a copied into this step's buffer (64-byte aligned); the page-locked copy to upload."""
        a = np.ascontiguousarray(a)
        at = -(-self.used // 64) * 64
        if at + a.nbytes > self.nbytes:
            raise ValueError(f"a step's uploads need more than the {self.nbytes} bytes of staging "
                             f"memory sized for max_num_batched_tokens and max_num_seqs")
        out = self.buffers[self.step % 2][at:at + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        self.used = at + a.nbytes
        return out
