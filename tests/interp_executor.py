"""Runs a built plan entirely through its generated Triton kernels under TRITON_INTERPRET=1,
following the plan's launches, bindings and grids: the GPU runtime's job, on torch CPU tensors.
Used by tests to check whole models against the numpy reference executor."""
import numpy as np
import torch

from infc.compiler.codegen.render import Kernel
from infc.compiler.contract import caches
from infc.compiler.contract.bind import Resolver, grid, scratch_sizes
from infc.compiler.contract.program import program_name, unrolled
from infc.runtime.engine.step import Chunk, build_step
from infc.runtime.lora.groups import lora_groups, num_slots
from infc.runtime.weights.load import at
from infc.runtime.weights.quant_pack import to_storage

from kernels.harness import TORCH, interpreter_constexprs, load


PACKED = ("u4", "e2m1", "u8")


def _nan_storage(shape, dtype):
    # poison: a kernel that reads a slot no launch wrote shows NaN in the logits
    return torch.full(shape, float("nan"), dtype=TORCH[dtype])


class InterpExecutor:
    def __init__(self, plan: dict, weights: dict, page_size: int = 16, num_pages: int = 64):
        self.plan, self.page_size = plan, page_size
        self.kernels = {kid: Kernel(kid, k["backend"], k["template"], _source(plan, k), k)
                        for kid, k in plan["kernels"].items()}
        def dev(a, name):            # the plan's dtype (bf16, or f32 where the spec says so)
            dtype = plan["weights"].get(name, {}).get("dtype", "bf16")
            if dtype in PACKED:      # quantized codes as the device stores them (u4 / e2m1: two a byte)
                return torch.from_numpy(to_storage(a, dtype))
            return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(TORCH[dtype])
        self.weights = {n: ([dev(x, n) for x in w] if isinstance(w, list) else dev(w, n))
                        for n, w in weights.items()}
        decl = caches.of_plan(plan)
        # a state slot per seq_id (plans with slot caches), as the engine hands them out
        num_slots = num_pages if caches.has_slots(decl) else 0
        self.caches = caches.HostCaches(decl, page_size, num_pages, num_slots, factory=_nan_storage)
        self.free_pages = list(range(num_pages))
        self.pages: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}
        self.free_slots = list(range(num_slots))
        self.scratch = {}
        self._load()

    def _load(self):
        """The plan's load program once, through its kernels (as runtime/cuda/runner.py before its
        first step): its launches write the derived weights in place. Grids at one row."""
        dims = {"T": 1, "B": 1}
        resolver = Resolver(tensor=lambda name, layer: at(self.plan, self.weights, name, layer),
                            scratch=lambda k, name: torch.zeros(scratch_sizes(k.meta, dims)[name] // 4 + 1,
                                                                dtype=torch.int32),
                            dim=dims.__getitem__)
        self.loaded = []                     # the load program's launched templates (tests)
        for launch, layer in unrolled(self.plan["programs"].get("load", [])):
            k = self.kernels[launch["kernel_id"]]
            g = grid(k.meta, dims)
            assert g[0] * g[1] * g[2], f"the load program's {launch['op']} has an empty grid"
            self.loaded.append((launch["op"], launch["kernel"]))
            args = resolver.values(k.meta, launch["inputs"], launch["outputs"], layer, k)
            getattr(load(k), k.meta["entry"])[g](*args, **interpreter_constexprs(k.meta))

    def ensure_pages(self, seq_id: int, tokens: int, shared: list[int] | None = None):
        pages = self.pages.setdefault(seq_id, list(shared or []))
        while len(pages) * self.page_size < tokens:
            pages.append(self.free_pages.pop(len(self.free_pages) // 2))   # not in order: paging is real

    def step(self, chunks: list[Chunk], lora=None) -> np.ndarray:
        """lora: each chunk's adapter slot (a LoRA plan's; None: slot 0 on every row)."""
        for c in chunks:
            self.ensure_pages(c.seq_id, c.start + len(c.tokens))
            if self.free_slots and c.seq_id not in self.slots:
                self.slots[c.seq_id] = self.free_slots.pop(len(self.free_slots) // 2)
        meta = build_step(chunks, self.pages.__getitem__, self.page_size,
                          slot_of=self.slots.__getitem__ if self.slots else None)
        if "lora_slots" in self.plan["step_metadata"]:
            meta.lora_slots = np.repeat(np.asarray(lora if lora is not None else [0] * meta.B, np.int32),
                                        [len(c.tokens) for c in chunks])
        dims = {"T": meta.T, "B": meta.B}
        a = self.plan["arena"]
        arena = torch.full(((a["bytes_per_token"] * meta.T + a["bytes_per_seq"] * meta.B + a["bytes"]) // 2,),
                           float("nan"), dtype=torch.bfloat16).view(torch.uint8)
        views = {}
        for name, b in self.plan["buffers"].items():
            off = b["offset"]
            start = off["T"] * meta.T + off["B"] * meta.B + off["bytes"]
            shape = [dims.get(d, d) for d in b["shape"]]
            n = int(np.prod(shape)) * torch.tensor([], dtype=TORCH[b["dtype"]]).element_size()
            views[name] = arena[start:start + n].view(TORCH[b["dtype"]]).view(shape)
        views["tokens"].copy_(torch.from_numpy(meta.tokens))
        arrays = {k: getattr(meta, k) for k in self.plan["step_metadata"] if hasattr(meta, k)}
        if "lora_segs" in self.plan["step_metadata"]:       # the runner's grouping (runtime/lora/groups.py)
            arrays["lora_rows"], arrays["lora_segs"] = lora_groups(meta.lora_slots, num_slots(self.plan))
        md = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
        md["max_pages"] = meta.max_pages

        def tensor(name, layer):
            return views[name] if name in views else at(self.plan, self.weights, name, layer)

        def scratch(k, name):
            size = scratch_sizes(k.meta, dims)[name]
            buf = self.scratch.get((k.id, name))
            if buf is None or buf.numel() * 4 < size:
                buf = torch.zeros(size // 4 + 1, dtype=torch.int32)
                self.scratch[(k.id, name)] = buf
            return buf

        resolver = Resolver(tensor=tensor, cache=self.caches.get, meta=md.__getitem__, scratch=scratch,
                            scale=lambda n, layer: caches.scale(self.caches.caches[n], layer),
                            dim=dims.__getitem__, meta_names=self.plan["step_metadata"])
        self.program = program_name(self.plan, meta.phase, meta.T)     # what this step ran (tests)
        self.templates = []                                            # its launches' templates
        for launch, layer in unrolled(self.plan["programs"][self.program]):
            k = self.kernels[launch["kernel_id"]]
            g = grid(k.meta, dims)
            if g[0] * g[1] * g[2] == 0:      # skipped, as the runner skips it (an expert_upcast below its rows)
                continue
            self.templates.append((launch["op"], launch["kernel"]))
            args = resolver.values(k.meta, launch["inputs"], launch["outputs"], layer, k)
            consts = interpreter_constexprs(k.meta)
            getattr(load(k), k.meta["entry"])[g](*args, **consts)
        self.views = views                  # the step's buffers: its other outputs (tests)
        return views[self.plan["outputs"]["logits"]].float().numpy().copy()


def _source(plan, k):
    from pathlib import Path
    return (Path(plan["_dir"]) / k["source"]).read_text()
