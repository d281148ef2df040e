"""What the pass pipeline threads through: the graph, the weights table, and each pass's log."""
from dataclasses import dataclass, field

from .contract.errors import SpecError
from .ir import Graph
from .spec import Spec


@dataclass
class CompileState:
    spec: Spec
    env: dict
    graph: Graph
    weights: dict                    # weight name -> {"source": ..., "per_layer": bool}
    model: str                       # variant or directory name the plan is for
    backend: str = "triton"
    features: list = field(default_factory=list)   # extra backends, in order of preference
    log: list = field(default_factory=list)        # (pass, message)
    memory: dict | None = None       # set by plan_memory
    kernels: dict = field(default_factory=dict)    # phase -> node id -> (backend, template)
    merges: dict = field(default_factory=dict)     # phase -> producer node id -> consumer node id
                                                   # (merge_prologues: one launch in that phase)
    epilogues: dict = field(default_factory=dict)  # phase -> producer node id -> consumer node id
                                                   # (merge_epilogues: the consumer in its producer's launch)
    lora_sites: dict = field(default_factory=dict)  # phase -> linear id -> [lora_shrink id, expand id]
    lora_apart: set = field(default_factory=set)    # the phases whose sites keep the shrink's own launch
                                                    # (merge_lora: the site in the GEMV's launch)
    parallel: dict | None = None     # {"world", "rank", "tp", "ep"}: this plan is rank r's share
    row_logits: dict | None = None   # set by row_logits: the logits tail to re-run at other rows
    quant: object = None             # the checkpoint's quantization format (compiler/quant/formats)
    kv_cache: dict | None = None     # --kv-cache-dtype fp8: {"flag", "scales": {"k"|"v": {layer: s}}}
                                     # (passes/quantize_kv_cache.py); None: the model's dtype
    lora: dict | None = None         # --enable-lora: {"max_loras", "max_rank", "targets"} (passes/add_lora.py)
    lora_plan: dict | None = None    # set by add_lora: plan["lora"]
    capture: list | None = None      # a speculation head's layers: plan output aux_hidden
                                     # (passes/capture_hidden.py); None: no such output
    narrow_tokens: int = 1           # the narrow launches' widest step: above infc/config.py
                                     # NARROW_TOKENS (a speculative build's k + 1) a verify program
                                     # that wide (passes/select_kernels.py)

    def note(self, pass_name: str, msg: str):
        self.log.append((pass_name, msg))

    def error(self, msg: str, line: int | None) -> SpecError:
        return self.spec.err(msg, line)
