"""Exact, fast tokenization of long prompts: split at proven pre-token boundaries, encode the
pieces in parallel (the `tokenizers` library's `encode_batch_fast`: Rust threads), concatenate,
and remember the ids of each piece so that a prompt repeating an earlier prompt's text (a chat
history that grows) encodes only what is new.

    FastEncoder(tk).encode(text) == tk.encode(text, add_special_tokens=False).ids

for every text, or the fast path is off for that tokenizer (`.enabled` False, `.reason` says why)
and `encode` is that plain call.

Why a cut is exact. `Tokenizer.encode` is: (1) extract added tokens (Aho-Corasick, leftmost
longest, on the raw text; lstrip/rstrip/single_word look at the characters around a match),
(2) normalize each remaining piece, (3) pre-tokenize (split into words), (4) run the model on each
word independently, (5) post-process (with add_special_tokens=False no post-processor changes
ids). So encode(a + b) == encode(a) + encode(b) when the cut between a and b is a boundary of
each stage and no stage behaves differently on a and b alone. We cut only *before an ASCII space
that follows a printable ASCII character* ("x y" -> "x" | " y") and only where:

  added tokens  no added token occurs overlapping [p-1, q] (p the cut, q the first non-space at or
                after p): then every match, with its lstrip/rstrip extension and single_word
                check, lies on one side and sees the same characters there. A token matched on
                normalized text (normalized=True) together with a normalizer is not supported
                (the fast path stays off).
  normalizer    None, NFC/NFD/NFKC/NFKD, Lowercase, or a Sequence of these. All are
                per-character or Unicode normalization forms, and the position before an ASCII
                character is a normalization boundary (ASCII has combining class 0 and is never
                the second character of a canonical composition), so normalize(a + b) ==
                normalize(a) + normalize(b), and the characters at the cut stay (printable
                ASCII, space).
  pre-tokenizer its stages, in order, must be: zero or more *cut-safe* stages that keep the
                characters (Digits), then one *boundary* stage, then anything from the supported
                list. Boundary stages, and why (left char c printable ASCII, right char ' '):
                - a regex Split (behavior Isolated, not inverted) or ByteLevel(use_regex=True)
                  whose regex is one of KNOWN_REGEXES (GPT-2, Qwen2, Llama-3/cl100k, o200k). In
                  each, a space can only be the *first* character of a match or part of a
                  whitespace-only alternative, so no match holds "c " and p is a match
                  boundary; the regexes have no look-behind, and their only look-ahead, (?!\\S),
                  follows a whitespace run, which on the left of p ends before c: matching on a
                  alone and on b alone reproduces the matches of a + b. ByteLevel's
                  add_prefix_space prepends a space only to pieces not starting with one: b
                  starts with one, a starts like a + b.
                - Metaspace(split=True): replaces ' ' with its replacement and splits before
                  each replacement (MergedWithNext), so p is a boundary; its prepend (always, or
                  first) applies only to a piece not starting with the replacement: b starts with
                  it, a starts like a + b.
                - WhitespaceSplit, Whitespace, BertPreTokenizer: split at (and drop) whitespace.
  model         BPE without dropout, Unigram, WordPiece, WordLevel: each word on its own.
  truncation, padding: none (checked at every call).

Anything else (SentencePiece-style Prepend/Replace normalizers, Metaspace(split=False), no
pre-tokenizer, unknown regexes, Precompiled normalizers, ...) keeps the plain call. At load the
fast path also encodes adversarial probe texts (cut at every candidate, added tokens beside and
across cuts, multi-byte text, whitespace and digit runs) both ways; any difference turns it off
with a warning.

Pieces: from the start, the next cut is the first valid one at least `chunk_chars` characters
after the previous cut, so the cuts depend only on the text before them (plus a few characters
after): a prompt that extends an earlier one has the same first pieces, found in the piece cache
(keyed by the piece's text: the ids of a piece are a function of its text alone). Texts shorter
than `min_chars` take the plain call.

A piece the cache lacks may still begin with one it holds: the last piece of an earlier prompt
that this one extends (a warm prefix hit's new words, a chat's next turn) is the start of this
prompt's piece at the same place. Where the cached piece ends at a valid cut of this text, only
the rest is encoded: ids(piece) = ids(cached head) + encode(rest), by the same rule as any cut.
Cached pieces are found as heads by their first HEAD_CHARS characters.
"""
from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections import OrderedDict

from infc import envs

log = logging.getLogger("infc.tokenizer")

CHUNK_CHARS = 1024          # a piece: ~150-250 tokens of prose (a 1k-token prompt ~7 pieces, 32k ~230)
MIN_CHARS = 2048            # below this one plain call (too little work to split)
CACHE_CHARS = 4 << 20       # piece cache budget, characters of piece text (~1M tokens, ~40 MB with their ids)
HEAD_CHARS = 64             # a cached piece this long or longer can be found as a longer piece's head

# Pre-tokenizer regexes whose splits are proven above (as tokenizer.json spells them).
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
KNOWN_REGEXES = {
    GPT2_REGEX: "gpt2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "llama3",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+": "o200k",
}
NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
MODELS = {"BPE", "Unigram", "WordPiece", "WordLevel"}
POST_PROCESSORS = {"ByteLevel", "TemplateProcessing", "RobertaProcessing", "BertProcessing"}
# A cut goes before the space of "c " where c is printable ASCII (not a space).
CANDIDATE = re.compile(r"[!-~] ")
NON_SPACE = re.compile(r"\S")       # Python's \s is a superset of Rust's char::is_whitespace


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_ok(n: dict | None) -> str | None:
    """None when normalize(a + b) == normalize(a) + normalize(b) before an ASCII char, else why not."""
    if n is None:
        return None
    if n["type"] == "Sequence":
        for sub in n["normalizers"]:
            why = _normalizer_ok(sub)
            if why:
                return why
        return None
    return None if n["type"] in NORMALIZERS else f"normalizer {n['type']}"


def _pre_tokenizer_rule(p: dict | None) -> tuple[str | None, str | None]:
    """(rule name, None) when a cut before ' ' after printable ASCII is a pre-token boundary,
    else (None, why not)."""
    if p is None:
        return None, "no pre-tokenizer (the model sees the whole text as one word)"
    stages = p["pretokenizers"] if p["type"] == "Sequence" else [p]
    rule = None
    for s in stages:
        t = s["type"]
        if rule is not None:                         # the boundary exists: pieces are identical
            if t in ("ByteLevel", "Digits", "Metaspace", "Split", "WhitespaceSplit", "Whitespace",
                     "BertPreTokenizer", "Punctuation"):
                continue
            return None, f"pre-tokenizer stage {t}"
        if t == "Digits":                            # cut-safe: splits only at digit transitions
            continue
        if t == "ByteLevel":
            if not s.get("use_regex", True):
                return None, "ByteLevel(use_regex=False) before any splitting stage"
            rule = "ByteLevel/" + KNOWN_REGEXES[GPT2_REGEX]
        elif t == "Split":
            pat = s.get("pattern", {})
            regex = pat.get("Regex")
            if regex not in KNOWN_REGEXES or s.get("behavior") != "Isolated" or s.get("invert"):
                return None, f"Split {json.dumps(pat)[:80]} ({s.get('behavior')}, invert={s.get('invert')}) " \
                             "is not a known regex split"
            rule = "Split/" + KNOWN_REGEXES[regex]
        elif t == "Metaspace":
            if not s.get("split", True):
                return None, "Metaspace(split=False): no word boundaries"
            rule = "Metaspace"
        elif t in ("WhitespaceSplit", "Whitespace", "BertPreTokenizer"):
            rule = t
        else:
            return None, f"pre-tokenizer stage {t}"
    if rule is None:
        return None, "the pre-tokenizer never splits at spaces"
    return rule, None


def derive_rule(tk) -> tuple[str | None, str | None]:
    """(rule, None) where cutting before ' ' after printable ASCII (away from added tokens) is
    exact for this tokenizer, else (None, why not)."""
    n = _state(tk.normalizer)
    why = _normalizer_ok(n)
    if why:
        return None, why
    model = type(tk.model).__name__
    if model not in MODELS:
        return None, f"model {model}"
    if model == "BPE" and tk.model.dropout not in (None, 0.0):
        return None, "BPE dropout"
    pp = _state(tk.post_processor)
    kinds = [pp] if pp is None or pp["type"] != "Sequence" else pp["processors"]
    for k in kinds:
        if k is not None and k["type"] not in POST_PROCESSORS:
            return None, f"post-processor {k['type']}"
    if n is not None and any(t.normalized for t in tk.get_added_tokens_decoder().values()):
        return None, "added tokens matched after normalization (normalized=True) with a normalizer"
    return _pre_tokenizer_rule(_state(tk.pre_tokenizer))


class FastEncoder:
    """encode(text) == tk.encode(text, add_special_tokens=False).ids, faster on long texts."""

    def __init__(self, tk, *, chunk_chars: int = CHUNK_CHARS, min_chars: int = MIN_CHARS,
                 cache_chars: int = CACHE_CHARS, probe: bool | str = True):
        """probe: True runs the load-time probe, False trusts the rule; a string is an earlier
        probe's outcome for this tokenizer (runtime/tokenization/facts.py): "ok", or why the fast
        path is off. self.probed: this load's outcome, or None where no probe ran."""
        self.tk = tk
        self.chunk_chars, self.min_chars, self.cache_chars = chunk_chars, min_chars, cache_chars
        self._batch = getattr(tk, "encode_batch_fast", None) or tk.encode_batch
        self._cache: OrderedDict[str, tuple] = OrderedDict()     # piece text -> its ids
        self._heads: dict[str, set[int]] = {}    # a cached piece's first HEAD_CHARS -> their lengths
        self._cached_chars = 0
        self._lock = threading.Lock()
        self.stats = {"fast": 0, "plain": 0, "pieces": 0, "piece_hits": 0, "head_hits": 0, "head_chars": 0}
        contents = sorted({t.content for t in tk.get_added_tokens_decoder().values() if t.content})
        self._by_first: dict[str, list[str]] = {}
        for c in contents:
            self._by_first.setdefault(c[0], []).append(c)
        self._max_added = max((len(c) for c in contents), default=0)
        self._first = re.compile("[" + "".join(re.escape(c) for c in sorted(self._by_first)) + "]") \
            if contents else None
        if not envs.value("INFC_FAST_TOKENIZE"):
            self.rule, self.reason = None, "INFC_FAST_TOKENIZE=0"
        else:
            try:
                self.rule, self.reason = derive_rule(tk)
            except Exception as e:  # noqa: BLE001 - a component this module cannot read: plain calls
                self.rule, self.reason = None, f"cannot read the tokenizer's configuration ({e!r})"
        self.probed = None
        if self.rule is not None and isinstance(probe, str):
            if probe != "ok":
                self.rule, self.reason = None, f"{probe} (an earlier load's probe)"
        elif self.rule is not None and probe:
            try:
                bad = self._probe()
            except Exception as e:  # noqa: BLE001 - a probe the library rejects: plain calls
                bad = f"(the probe raised {e!r})"
            self.probed = "ok"
            if bad is not None:
                log.warning("fast tokenization off: the split encoding differs from the plain one on a "
                            "probe text (%r...); using the plain call", bad[:60])
                self.rule, self.reason = None, f"probe mismatch on {bad[:60]!r}"
                self.probed = self.reason
        if self.rule is None:
            log.info("fast tokenization off: %s", self.reason)
        else:
            log.info("fast tokenization on: cuts before ' ' after printable ASCII (%s)", self.rule)

    @property
    def enabled(self) -> bool:
        return self.rule is not None

    def plain(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    # -- cuts -------------------------------------------------------------------------------
    def _near_added_token(self, text: str, p: int) -> bool:
        """Whether some added token occurs overlapping [p-1, q] (q: the first non-space at or
        after p): the characters its match, lstrip/rstrip and single_word checks could see."""
        if self._first is None:
            return False
        m = NON_SPACE.search(text, p)
        q = m.start() if m else len(text)
        lo, hi = max(0, p - self._max_added), min(len(text), q + 1)
        pos = lo
        while True:
            m = self._first.search(text, pos, hi)
            if m is None:
                return False
            s = m.start()
            for c in self._by_first[text[s]]:
                if s + len(c) > p - 1 and text.startswith(c, s):
                    return True
            pos = s + 1

    def cuts(self, text: str, chunk: int | None = None) -> list[int]:
        """Cut positions (0 < p < len(text)), each the first valid one >= chunk after the last."""
        chunk = chunk or self.chunk_chars
        out, last, n = [], 0, len(text)
        while last + chunk < n:
            pos = last + chunk - 1                  # the candidate's first char, p - 1, >= this
            for _ in range(4096):                   # rejected candidates (added tokens) per cut
                m = CANDIDATE.search(text, pos)
                if m is None:
                    return out
                p = m.start() + 1
                if not self._near_added_token(text, p):
                    break
                pos = p
            else:
                return out
            out.append(p)
            last = p
        return out

    # -- encoding ---------------------------------------------------------------------------
    def encode_pieces(self, pieces: list[str], text: str | None = None, starts: list[int] | None = None) -> list[int]:
        """Concatenated ids of pieces cut at valid cuts, from the cache where it has them; with the
        text they were cut from and their starts in it, a missing piece's cached head too."""
        cache, lock = self._cache, self._lock
        got: list[tuple | None] = [None] * len(pieces)
        with lock:
            for i, s in enumerate(pieces):
                a = cache.get(s)
                if a is not None:
                    cache.move_to_end(s)
                    got[i] = a
        miss = [i for i, a in enumerate(got) if a is None]
        if miss:
            heads = [self._head(pieces[i], text, starts[i]) if text is not None else (0, ()) for i in miss]
            encs = self._batch([pieces[i][n:] for i, (n, _) in zip(miss, heads)], add_special_tokens=False)
            with lock:
                for i, (n, head), e in zip(miss, heads, encs):
                    a = got[i] = head + tuple(e.ids)
                    if n:
                        self.stats["head_hits"] += 1
                        self.stats["head_chars"] += n
                    s = pieces[i]
                    if self.cache_chars and s not in cache:
                        cache[s] = a
                        self._cached_chars += len(s)
                        if len(s) >= HEAD_CHARS:
                            self._heads.setdefault(s[:HEAD_CHARS], set()).add(len(s))
                while self._cached_chars > self.cache_chars and cache:
                    s, _ = cache.popitem(last=False)
                    self._cached_chars -= len(s)
                    if len(s) >= HEAD_CHARS:
                        lengths = self._heads[s[:HEAD_CHARS]]
                        lengths.discard(len(s))
                        if not lengths:
                            del self._heads[s[:HEAD_CHARS]]
        self.stats["pieces"] += len(pieces)
        self.stats["piece_hits"] += len(pieces) - len(miss)
        ids: list[int] = []
        for a in got:
            ids.extend(a)
        return ids

    def _head(self, s: str, text: str, start: int) -> tuple[int, tuple]:
        """(n, ids): the longest cached piece that s (at text[start:]) begins with and that ends
        at a valid cut of text (printable ASCII, then a space; no added token near), and its ids;
        (0, ()) where none does."""
        with self._lock:
            lengths = sorted(self._heads.get(s[:HEAD_CHARS], ()), reverse=True)
        for n in lengths:
            if n >= len(s) or s[n] != " " or not "!" <= s[n - 1] <= "~":
                continue
            with self._lock:
                a = self._cache.get(s[:n])
                if a is not None:
                    self._cache.move_to_end(s[:n])
            if a is not None and not self._near_added_token(text, start + n):
                return n, a
        return 0, ()

    def encode(self, text: str) -> list[int]:
        if (self.rule is None or len(text) < self.min_chars or self.tk.truncation is not None
                or self.tk.padding is not None):
            self.stats["plain"] += 1
            return self.plain(text)
        cuts = self.cuts(text)
        if not cuts:
            self.stats["plain"] += 1
            return self.plain(text)
        self.stats["fast"] += 1
        bounds = [0, *cuts, len(text)]
        return self.encode_pieces([text[a:b] for a, b in zip(bounds, bounds[1:])], text, bounds)

    def clear_cache(self):
        with self._lock:
            self._cache.clear()
            self._heads.clear()
            self._cached_chars = 0

    # -- the load-time check ----------------------------------------------------------------
    def probe_texts(self, seed: int = 0) -> list[str]:
        """Adversarial texts: every kind of character around spaces, added tokens beside and
        across cut candidates, whitespace and digit runs, text without any candidate."""
        rng = random.Random(seed)
        added = sorted({t.content for t in self.tk.get_added_tokens_decoder().values() if t.content})
        if len(added) > 48:
            added = added[:24] + rng.sample(added[24:], 24)
        pools = ["abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789",
                 "  ", " \t\n\r\u00a0\u3000\u2003\x0b\x0c\x1c\x85", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
                 "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年", "あいうえおアイウエオ漢字",
                 "😀👍🎉🚀❤️🇫🇷", "éèêàçüößñåøİıſﬁ", "e\u0301a\u0308\u0327o\u0302", "абвгдежзийклмн",
                 "١٢٣४५६①②½Ⅻ", "'s 't 're 've 'm 'll 'd 'S", "\u200b\u200d\ufeff▁Ġ"]
        texts = []
        for _ in range(24):
            parts = []
            for _ in range(rng.randint(20, 120)):
                r = rng.random()
                if added and r < 0.12:
                    tok = rng.choice(added)
                    k = rng.randint(0, len(tok))
                    parts.append(rng.choice([tok, " " + tok, tok + " ", " " + tok + " ", tok + tok,
                                             tok[:k] + " " + tok[k:], tok[:k], "x" + tok + "y "]))
                elif r < 0.5:
                    parts.append(rng.choice([" ", "", "  ", "\n", " \n "]) +
                                 "".join(rng.choice(pools[0]) for _ in range(rng.randint(1, 9))))
                else:
                    pool = rng.choice(pools)
                    parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
            texts.append("".join(parts))
        words = "The quick brown fox, 12345 jumps; over the lazy dog's back. " * 8
        texts += [words, words.replace(" ", "  "), words.replace(" ", "\n"), "x" * 300 + " " * 300 + "y",
                  "中文没有空格" * 50, "1 " * 200 + "2", "a" + " " * 500, " " * 64 + "a b"]
        for tok in added[:8]:
            texts.append(f"a {tok} b{tok} c {tok}d e{tok}f {tok}{tok}  g  {tok}\n{tok} ")
        return texts

    def _probe(self) -> str | None:
        """The first probe text whose cut-everywhere encoding differs from the plain one."""
        for text in self.probe_texts():
            want = self.plain(text)
            for chunk in (1, 7):
                cuts = self.cuts(text, chunk)
                bounds = [0, *cuts, len(text)]
                pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
                got = [t for e in self._batch(pieces, add_special_tokens=False) for t in e.ids]
                if got != want:
                    return text
        return None
