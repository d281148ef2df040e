"""The adapters a server knows and the device slots they run in (vLLM's --max-loras,
--max-cpu-loras): torch-free, over any table writer (tables.write's `put`).

    registered   name -> path: every adapter a request may name (--lora-modules, the load
                 endpoint); each is read and checked against the plan when registered, so a bad
                 one is refused before anything changes
    host cache   up to max_cpu_loras adapters kept read (LRU); one evicted is read again from its
                 path when a request needs it
    slots        1..max_loras, each holding one adapter (LRU among those no running request
                 holds); slot 0 is no adapter

A request takes its adapter's slot with acquire() when it is scheduled and gives it back with
release() when it finishes; acquire() returns None when every slot is held by running requests,
and the request waits. Each registration gets a fresh id (`lora_id`), which never names another
adapter: prefix caching keys blocks by it, so an adapter loaded again under the same name never
reads the blocks its predecessor computed.
"""
from collections import OrderedDict
from itertools import count
from pathlib import Path

from .adapter import Adapter
from .peft_dir import check_targets, load_peft, read_config
from .tables import AdapterError, AdapterNotLoaded, check, module_map, write


class LoraSlots:
    def __init__(self, plan: dict, put, max_cpu_loras: int | None = None, reader=load_peft):
        if "lora" not in plan:
            raise ValueError("this plan serves no LoRA adapters: build it with --enable-lora")
        self.plan, self.put, self.read = plan, put, reader
        self.max_loras = plan["lora"]["max_loras"]
        self.max_cpu_loras = max_cpu_loras or self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                             f"({self.max_loras})")
        self.modules = module_map(plan)
        self.paths: dict[str, str] = {}                           # name -> path
        self.ids: dict[str, int] = {}                             # name -> lora_id
        self.names_of: dict[int, str] = {}                        # lora_id -> name (while held)
        self.host: OrderedDict[int, Adapter] = OrderedDict()      # by lora_id, LRU
        self.slot_of: OrderedDict[int, int] = OrderedDict()       # lora_id -> slot, LRU first
        self.holders: dict[int, int] = {}                         # lora_id -> running requests
        self._next_id = count(1)
        self.loads = 0                                            # slot writes (metrics, tests)
        self.failed: list = []                                    # (seq, AdapterError): admit()
        for slot in range(self.max_loras + 1):    # zeros everywhere, whatever the loader filled
            write(plan, put, slot, None, clear=True)

    # -- registry ---------------------------------------------------------------------------
    def prepare(self, name: str, path) -> Adapter:
        """The adapter at path read and checked against the plan, nothing registered: reads only
        what never changes, so a server runs it off the engine's thread (a large adapter's read
        never holds up the steps)."""
        if not name or not isinstance(name, str):
            raise AdapterError(f"a LoRA adapter needs a name, got {name!r}")
        path = Path(path)
        check_targets(read_config(path, name), self.plan["lora"]["targets"], name, path)
        return self._read(name, str(path))

    def register(self, name: str, path, prepared: Adapter | None = None) -> int:
        """Read and check the adapter at path (or take it `prepared`); returns its lora_id. An
        error changes nothing."""
        self.check_free(name)
        adapter = prepared if prepared is not None else self.prepare(name, path)
        path = str(Path(path))
        lora_id = next(self._next_id)
        self.paths[name], self.ids[name], self.names_of[lora_id] = path, lora_id, name
        self._cache(lora_id, adapter)
        return lora_id

    def check_free(self, name: str):
        if name in self.paths:
            raise AdapterError(f"LoRA adapter '{name}' is already loaded (from {self.paths[name]}); "
                               f"unload it first")

    def unregister(self, name: str):
        """Forget the adapter; its slot is cleared now, or when its last running request ends."""
        if name not in self.paths:
            raise AdapterError(f"LoRA adapter '{name}' is not loaded")
        lora_id = self.ids.pop(name)
        del self.paths[name]
        self.host.pop(lora_id, None)
        if not self.holders.get(lora_id):
            self._forget(lora_id)

    def names(self) -> list[str]:
        return list(self.paths)

    # -- slots ------------------------------------------------------------------------------
    def acquire(self, name: str) -> int | None:
        """The slot holding adapter `name` for one more running request (loading it into a free or
        least recently used idle slot), or None when every slot is held."""
        if name not in self.paths:
            raise AdapterError(f"LoRA adapter '{name}' is not loaded")
        return self.acquire_id(self.ids[name])

    def acquire_id(self, lora_id: int) -> int | None:
        if lora_id in self.slot_of:
            self.slot_of.move_to_end(lora_id)
        else:
            name = self.names_of.get(lora_id)
            if name is None or self.ids.get(name) != lora_id:
                raise AdapterError(f"LoRA adapter #{lora_id} ({name}) was unloaded")
            slot = self._free_slot()
            if slot is None:
                return None
            adapter = self.host.get(lora_id) or self._read(name, self.paths[name])
            self._cache(lora_id, adapter)
            write(self.plan, self.put, slot, adapter)
            self.loads += 1
            self.slot_of[lora_id] = slot
        self.holders[lora_id] = self.holders.get(lora_id, 0) + 1
        return self.slot_of[lora_id]

    def release(self, lora_id: int):
        left = self.holders.get(lora_id, 0) - 1
        if left < 0:
            raise ValueError(f"LoRA adapter #{lora_id} released more often than acquired")
        self.holders[lora_id] = left
        name = self.names_of.get(lora_id)
        if left == 0 and self.ids.get(name) != lora_id:          # unloaded meanwhile
            self._forget(lora_id)

    # the block manager's gate (runtime/engine/block_manager.py): a sequence naming an adapter
    # (seq.lora = (name, lora_id)) is admitted with a slot (seq.lora_slot) or waits. One whose
    # adapter cannot take a slot (unloaded while it waited, or its directory no longer reads: the
    # host cache had dropped it) is not admitted and goes to `failed`: the engine ends its request
    # with that error (Engine._fail_lora_waiters) rather than dying of it.
    def admit(self, seq) -> bool:
        if seq.lora is None or seq.lora_slot:
            return True
        name, lora_id = seq.lora
        try:
            if lora_id not in self.slot_of and self.ids.get(name) != lora_id:
                raise AdapterNotLoaded(name, f"LoRA adapter '{name}' was unloaded while this request waited "
                                             "for a slot")
            slot = self.acquire_id(lora_id)
        except AdapterError as e:
            self.failed.append((seq, e))
            return False
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def drop(self, seq):
        if seq.lora_slot:
            seq.lora_slot = 0
            self.release(seq.lora[1])

    def _free_slot(self) -> int | None:
        used = set(self.slot_of.values())
        free = [s for s in range(1, self.max_loras + 1) if s not in used]
        if free:
            return free[0]
        for victim in self.slot_of:                # least recently used first
            if not self.holders.get(victim):
                self.holders.pop(victim, None)
                return self.slot_of.pop(victim)    # overwritten by the caller
        return None

    def _forget(self, lora_id: int):
        self.holders.pop(lora_id, None)
        self.names_of.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            write(self.plan, self.put, slot, None)

    # -- host cache -------------------------------------------------------------------------
    def _read(self, name: str, path: str) -> Adapter:
        adapter = self.read(path, name)
        check(self.plan, adapter, self.modules)
        return adapter

    def _cache(self, lora_id: int, adapter: Adapter):
        self.host[lora_id] = adapter
        self.host.move_to_end(lora_id)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
