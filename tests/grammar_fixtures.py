"""Shared by the structured-output tests: a small byte-level BPE tokenizer (trained in
milliseconds, ~300 ids, so every token of a mask can be checked) and a runner whose logits come
from its context, for the engine's grammar paths without a model."""
import zlib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from infc.runtime.engine.runner import sample_rows
from infc.runtime.tokenization.tokenizer import Tokenizer
from test_scheduler import FakeRunner

EOS = 0
CORPUS = ['{"name": "John", "age": 25, "tags": ["a", "b"]}', "yes no maybe true false null",
          "hello world 123-4567 [1, 2, 3] </think>"]


def small_tokenizer(directory: Path) -> Tokenizer:
    """A runtime Tokenizer over a byte-level BPE of ~300 ids trained here; id 0 is <eos>."""
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tk.save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


class LogitsRunner(FakeRunner):
    """FakeRunner's paged KV, with logits (a function of each row's context) sampled by the numpy
    sampler: so bitmasks, seeds and the deferred sampling run as on a model."""

    def forward(self, meta):
        ctxs = self.contexts(meta)
        self.steps.append((meta.phase, np.diff(meta.seq_starts).tolist()))
        return np.stack([np.random.default_rng(zlib.crc32(np.asarray(c, np.int64).tobytes()))
                         .standard_normal(self.vocab_size).astype(np.float32) for c in ctxs])

    def execute(self, meta, sampling):
        return sample_rows(self.forward(meta), sampling)
