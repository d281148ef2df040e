"""KV tiers beyond the device's pages: a host pool and a disk directory holding prefix blocks
that left the KV cache (docs/architecture.md, "KV tiers"; issue 44).

A block is one page of every paged cache and layer (compiler/contract/caches.py: a host block),
named by the same prefix hash as in the block manager. A hashed page whose last reference goes
(a finished, aborted or preempted sequence) is offered to the host pool; the copy is issued at
the next flush (before the next step is launched, and after each step), so a page evicted and
reused in between still holds the block when it is read. The host pool is an LRU of rows of one
slab (pinned on the GPU) within --kv-offloading-size; a row it evicts is written to the disk
directory when one is set (an LRU within its own size). Admission looks past the device's hits
into the pool, then the disk: each block found there gets a fresh page, and the engine's flush
before the step copies it in (a disk block is read, checked and promoted to the pool at
admission, so a corrupt file is a miss before anything counts on it).

    host_pool.py   the rows: which hash each holds, the LRU, rows pinned by a pending restore
    disk_store.py  one file per block: header (layout, hash, length), checksum, LRU by bytes
    tiers.py       KVTiers: the block manager's hooks, flushes, hit and byte counters
    host_copies.py the CPU runner's copies (numpy pages <-> slab rows); the GPU's are
                   runtime/cuda/kv_copies.py
"""
