"""bad_words as vLLM reads them: each word's token sequences, and which ids a row must not take.

A word is tokenized as it stands (left-stripped) and with one leading space, as it would appear
mid-text; the spaced form is kept when it starts with another token. vLLM also asks it to be as
long as the plain form, and so lets the word through mid-text wherever the space makes one token
of several (Qwen's " exaggerated" is one token, "exaggerated" three: vLLM issues 23886, 32557);
here it is banned. A sequence's last token is banned when the tokens before it were just generated
(the output's tail; a one-token word is banned always).
"""


def token_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode_text(word.lstrip())
        if not plain:
            continue
        out.append(plain)
        spaced = tokenizer.encode_text(" " + word.lstrip())
        if spaced and spaced[0] != plain[0]:
            out.append(spaced)
    return out


def banned_now(sequences: list[list[int]], output_ids) -> tuple:
    """The ids banned for the next token after output_ids (a list or its tail)."""
    banned = set()
    n = len(output_ids)
    for seq in sequences:
        k = len(seq) - 1
        if k > n:
            continue
        if k == 0 or list(output_ids[n - k:]) == seq[:k]:
            banned.add(seq[-1])
    return tuple(sorted(banned))
