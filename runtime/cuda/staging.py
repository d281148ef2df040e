"""Page-locked staging for a step's uploads, two steps deep.

A copy from pageable host memory is not truly asynchronous: the driver may stage it through its
own buffer and wait on the stream, which would make the host wait for the step still running on
the GPU. The engine overlaps the next step's host work with the current step's GPU work
(engine.Engine, overlap), so every host array a step uploads (token ids, positions, block tables,
sampling parameters) is first copied into page-locked memory, and the copy from there runs in
stream order.

Two buffers, alternating by step: step N + 2 writes the buffer step N read from. An event
recorded after each step's uploads guards the reuse: a runner that issues steps without waiting
for them (chunks of a long prompt that sample nothing, a rank worker) waits there for step N's
copies before it overwrites their source; the overlapped engine has collected step N by then.
"""
import numpy as np


class Staging:
    def __init__(self, ctx, nbytes: int):
        self.nbytes = nbytes
        self.buffers = [ctx.pinned(nbytes), ctx.pinned(nbytes)]
        self.copied = [ctx.event(), ctx.event()]      # after the uploads from each buffer
        self.recorded = [False, False]
        self.step = 0
        self.used = 0

    def begin(self):
        """A new step: switch to the other buffer, empty, once the copies from it have run."""
        self.step += 1
        self.used = 0
        i = self.step % 2
        if self.recorded[i]:
            self.copied[i].wait()

    def done(self):
        """The step's uploads (so far) are issued: mark the point its buffer is free again."""
        i = self.step % 2
        self.copied[i].record()
        self.recorded[i] = True

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
