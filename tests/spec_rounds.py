"""A speculation head's CUDA runner against its CPU runner, round by round (tests/test_spec_eagle3_cuda.py,
tests/test_spec_mtp_cuda.py): two proposers over the same sequences and target rows."""
import numpy as np


def same_drafts_each_round(props, seqs, seen, aux, cpu, gpu, H: int, rounds: int, graph, k: int = 2,
                           logits_tol: float = 3e-2):
    """props: the (CPU, CUDA) proposers; seqs: each one's copy of the sequences; seen: each one's
    logged head-step logits; aux: each sequence's target rows. The prompts' rows observed, then
    `rounds` times: k drafts each, the same from both, every head step's logits and the last hidden
    rows within bf16; one draft accepted and a bonus token. The chained steps replay the CUDA
    head's graph (`graph`, the fake's), and every page comes back."""
    for prop, ss in zip(props, seqs):
        for s in ss:
            s.token_ids.append(7)
        prop.observe([(s.seq_id, 0, len(s.token_ids) - 1) for s in ss],
                     np.concatenate([aux[s.seq_id][:len(s.token_ids) - 1] for s in ss]))
    replays = graph.replays
    for rnd in range(rounds):
        drafts = [prop.propose([(s, k) for s in ss]) for prop, ss in zip(props, seqs)]
        assert len(seen[0]) == len(seen[1]) == k
        for a, b in zip(*seen):                       # the same steps' logits, within bf16
            assert a.shape == b.shape and np.abs(a - b).max() <= logits_tol * np.abs(a).max(), rnd
        seen[0].clear(), seen[1].clear()
        assert drafts[0] == drafts[1] and len(drafts[0]) == 2 and all(len(x) == k for x in drafts[0].values())
        want, got = cpu.outputs()["hidden_out"], gpu.outputs()["hidden_out"]
        assert got.shape == want.shape == (2, H)
        assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max(), rnd
        for prop, ss in zip(props, seqs):          # one draft accepted, then a bonus token
            for s in ss:
                p, dr = len(s.token_ids) - 1, drafts[0][s.seq_id]
                prop.observe([(s.seq_id, p, 1)] + [(s.seq_id, p + 1 + j, 1) for j in range(k)],
                             aux[s.seq_id][p:p + k + 1])
                s.token_ids += [dr[0], 11]
                prop.settle(s, 1)
    assert graph.replays - replays == rounds * (k - 1)      # the chained steps replay the head's graph
    for prop, ss in zip(props, seqs):
        for s in ss:
            prop.release(s)
        assert prop.held_pages() == 0
