"""The runtime: runs a built plan, model-agnostic and torch-free. It imports the plan contract
(compiler/contract/) and the op vocabulary (compiler/ops/), nothing else of the compiler.

How a request flows:

    server/ or LLM(...)
      -> engine/async_engine.py   AsyncEngine: the one door in and out (a step loop thread)
      -> engine/engine.py         Engine: admits requests, steps, stops, detokenizes
           engine/scheduler.py      which sequences run this step (continuous batching, chunked
           engine/block_manager.py  prefill, preemption) over paged KV with prefix caching
           engine/state_snapshots.py  slot-cache state kept with cached blocks (hybrid models)
           engine/sequence.py, engine/step.py  a sequence; one step's metadata (StepMeta)
           engine/sampling.py       sampling parameters; the numpy sampler
      -> engine/runner.py         the seam to a backend: execute / launch + collect one step
           reference/             the numpy executor of the plan (CPU backend and test oracle)
           cuda/                  the GPU runner: driver, kernels, CUDA Graphs, sampler, NCCL
           distributed/           one process per rank: rank 0 broadcasts each step
                                  (step_channel.py frames, rank_workers.py processes)
    weights/                      a checkpoint -> the plan's weights (load.py, recipes.py), or
                                  random ones (dummy.py)
    tokenization/                 the tokenizer, incremental detokenizer, fast long-prompt encoding
"""
