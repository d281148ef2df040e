"""Data-parallel steps over rank processes on the CPU (runtime/distributed/rank_workers.py execute_ranks):
each rank runs its own padded step and samples its own rows; the workers' samples come back in
their ACK frames (runtime/distributed/step_channel.py DP_STEP / encode_samples, no pickle), checked against
the in-process simulated ranks (runtime/reference/ranks.py step_paged_ranks) on the same steps."""
import time

import numpy as np
import pytest

from infc.runtime.distributed import step_channel as ch
from infc.runtime.engine.runner import RowSampling, Sample, sample_row
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.engine.step import Chunk, build_step, pad_ranks
from test_rank_workers import write_plans as write_rank_plans

FACTORY = "infc.runtime.distributed.rank_runners:reference_rank_runner"
NUM_PAGES, PAGE_SIZE = 32, 16


def _meta(rng, B: int):
    chunks = [Chunk(10 + b, [int(t) for t in rng.integers(0, 320, n)], 0)
              for b, n in enumerate(rng.integers(1, 9, B))]
    return build_step(chunks, lambda s: [s], PAGE_SIZE)


def _same_meta(a, b):
    for f in a.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f
        else:
            assert x == y, f


# -- the frames -------------------------------------------------------------------------------
def test_dp_step_frames_carry_the_rows_sampling_with_logprobs(rng):
    meta = _meta(rng, 4)
    rows = [RowSampling(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=3),
                        (1 << 70) + 3, 4, (2, 9)),
            None, RowSampling(SamplingParams(temperature=0.0), 1, 0), None]
    kind, items = ch.decode(ch.encode_dp_step(meta, 17, rows))
    assert kind == ch.DP_STEP
    k, back, sampling = ch.dp_step_of(kind, items)
    assert k == 17 and ch.meta_of(kind, items)[0] == 17
    _same_meta(meta, back)
    assert [s is None for s in sampling] == [False, True, False, True]
    a, b = sampling[0], sampling[2]
    assert (a.seed, a.step, a.banned) == ((1 << 70) + 3, 4, (2, 9))
    assert (a.params.temperature, a.params.top_k, a.params.top_p, a.params.min_p, a.params.logprobs) \
        == (0.7, 5, 0.9, 0.05, 3)
    assert (b.seed, b.step, b.banned, b.params.temperature, b.params.logprobs) == (1, 0, (), 0.0, None)
    # an idle rank's rows, all pad: nothing samples
    k, back, sampling = ch.dp_step_of(*ch.decode(ch.encode_dp_step(meta, 3, [None] * 4)))
    assert sampling == [None] * 4
    with pytest.raises(ch.ChannelError, match="3 sampling rows for a step of 4"):
        ch.encode_dp_step(meta, 0, rows[:3])
    with pytest.raises(ch.ChannelError, match="disagree in length"):
        ch.dp_step_of(kind, [(n, v[:0] if n == "logprobs" else v) for n, v in items])
    with pytest.raises(ch.ChannelError, match="sampling fields"):
        ch.dp_step_of(kind, items[:-1])
    with pytest.raises(ch.ChannelError, match="samples rows"):
        ch.dp_step_of(kind, [(n, v + 9 if n == "row" else v) for n, v in items])
    with pytest.raises(ch.ChannelError, match="expected a data-parallel step"):
        ch.dp_step_of(*ch.decode(ch.encode_launch(meta, 0, rows, [])))
    with pytest.raises(ch.ChannelError, match="expected a launch frame"):
        ch.launch_of(kind, items)


def test_samples_round_trip_in_an_ack():
    samples = [Sample(5), None, Sample(319, -0.25, [(319, -0.25), (7, -1.5), (0, -np.inf)]),
               Sample(0, -3.0, []), None, Sample(2 ** 31 - 1, -1e-9, None)]
    kind, items = ch.decode(ch.encode_samples(12, samples))
    assert kind == ch.ACK and dict(items)["token"].dtype == np.int32
    step, back = ch.samples_of(kind, items)
    assert step == 12 and back == samples          # float64 logprobs: the same values exactly
    assert ch.samples_of(*ch.decode(ch.encode_samples(0, [])))[1] == []
    assert ch.samples_of(*ch.decode(ch.encode_samples(1, [None, None])))[1] == [None, None]
    with pytest.raises(ch.ChannelError, match="token id -1"):
        ch.encode_samples(0, [Sample(-1)])
    with pytest.raises(ch.ChannelError, match="ack of a data-parallel step"):
        ch.samples_of(ch.ACK, [("step", 3)])               # a plain ack: no samples
    with pytest.raises(ch.ChannelError, match="disagree in length"):
        ch.samples_of(kind, [(n, v[:-1] if n == "top_token" else v) for n, v in items])
    with pytest.raises(ch.ChannelError, match="top list lengths"):
        ch.samples_of(kind, [(n, np.where(v == -1, 0, v) if n == "top_n" else v) for n, v in items])


# -- rank processes ---------------------------------------------------------------------------
def write_plans(d, tmp_path) -> tuple[list, list[str]]:
    """The DP=2 rank plans of d, written for the rank processes."""
    return write_rank_plans(d, tmp_path, data_parallel_size=2, enable_expert_parallel=True)


def processes(d, paths, factory=FACTORY, **kw):
    from infc.runtime.distributed.rank_workers import MultiProcessRunner
    return MultiProcessRunner(factory, {"plans": paths, "model_dir": str(d), "num_pages": NUM_PAGES},
                              world=len(paths), step_timeout=kw.pop("step_timeout", 60),
                              startup_timeout=120, **kw)


class Ranks:
    """Each rank's own pages (a free list and seq_id -> pages) and the steps built over them."""

    def __init__(self, world: int):
        self.free = [list(range(NUM_PAGES)) for _ in range(world)]
        self.pages = [{} for _ in range(world)]

    def metas(self, per_rank: list[list[Chunk]]):
        metas = []
        for r, chunks in enumerate(per_rank):
            for c in chunks:
                own = self.pages[r].setdefault(c.seq_id, [])
                while len(own) * PAGE_SIZE < c.start + len(c.tokens):
                    own.append(self.free[r].pop())
            metas.append(build_step(chunks, self.pages[r].__getitem__, PAGE_SIZE))
        # pad rows write page NUM_PAGES, the rank runners' spare page
        return pad_ranks(metas, page=NUM_PAGES, page_size=PAGE_SIZE)


def greedy(logprobs=None):
    return RowSampling(SamplingParams(temperature=0.0, logprobs=logprobs), seed=1, step=0)


def test_each_rank_samples_its_own_sequences(tiny_model, tmp_path, rng):
    """Rank 0 and rank 1 prefill prompts of different lengths, decode, then rank 1 runs two
    sequences (one decoding, one prefilling) while rank 0 decodes one, then rank 0 idles: each
    rank's greedy tokens (and one row's logprobs) are those of the in-process simulated ranks."""
    from infc.runtime.reference.ranks import RankExecutor
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    d, _ = tiny_model("qwen3_moe")
    plans, paths = write_plans(d, tmp_path)
    sim = RankExecutor(plans, [load_weights(p, Checkpoint(d)) for p in plans])
    sim.allocate_pages(NUM_PAGES + 1, PAGE_SIZE)
    ranks = Ranks(2)
    a = [int(t) for t in rng.integers(0, 320, 9)]
    b = [int(t) for t in rng.integers(0, 320, 4)]
    c = [int(t) for t in rng.integers(0, 320, 3)]
    runner = processes(d, paths)
    try:
        assert runner.dp_world == 2 and runner.num_pages == NUM_PAGES
        last = {}                                     # (rank, seq) -> (its next token, its length)

        def step(per_rank, logprobs_on=None):
            metas = ranks.metas(per_rank)
            sampling = []
            for r, (m, chunks) in enumerate(zip(metas, per_rank)):
                rows = [greedy(3 if (r, ch_.seq_id) == logprobs_on else None) for ch_ in chunks]
                sampling.append(rows + [None] * (m.B - len(chunks)))       # pad rows: no samples
            got = runner.execute_ranks(metas, sampling)
            want = sim.step_paged_ranks(metas)
            assert [len(g) for g in got] == [m.B for m in metas]
            for r, chunks in enumerate(per_rank):
                assert got[r][len(chunks):] == [None] * (metas[r].B - len(chunks))
                for i, chunk in enumerate(chunks):
                    s = got[r][i]
                    assert s.token == int(np.argmax(want[r][i])), (r, chunk.seq_id)
                    if (r, chunk.seq_id) == logprobs_on:
                        w = sample_row(want[r][i], sampling[r][i])
                        assert s.token == w.token and len(s.top) == 3
                        assert abs(s.logprob - w.logprob) <= 1e-5
                        assert [t for t, _ in s.top] == [t for t, _ in w.top]
                        np.testing.assert_allclose([lp for _, lp in s.top], [lp for _, lp in w.top],
                                                   atol=1e-5)
                    else:
                        assert s.logprob is None and s.top is None
                    last[r, chunk.seq_id] = (s.token, chunk.start + len(chunk.tokens))
            return metas

        def decode(r, seq):
            tok, n = last[r, seq]
            return Chunk(seq, [tok], n)

        metas = step([[Chunk(0, a, 0)], [Chunk(1, b, 0)]], logprobs_on=(1, 1))    # prefill 9 | 4
        assert [(m.T, m.phase) for m in metas] == [(9, "prefill")] * 2
        for _ in range(2):
            metas = step([[decode(0, 0)], [decode(1, 1)]])
            assert [(m.T, m.phase) for m in metas] == [(1, "decode")] * 2
        metas = step([[decode(0, 0)], [decode(1, 1), Chunk(2, c, 0)]], logprobs_on=(0, 0))
        assert [(m.T, m.B) for m in metas] == [(4, 2), (4, 2)] and metas[0].phase == "mixed"
        metas = step([[], [decode(1, 1), decode(1, 2)]])                           # rank 0 idle
        assert [(m.T, m.B) for m in metas] == [(2, 2), (2, 2)]
        runner.free_on(1, 2)
        runner.free_on(0, 0)
        metas = step([[], [decode(1, 1)]])
        assert [(m.T, m.B) for m in metas] == [(1, 1), (1, 1)]
    finally:
        runner.close()
    assert all(p.exitcode == 0 for p in runner.procs.values())


# -- rank runners without a model (tests/rank_factories.py): frees and the acks bookkeeping ------
def test_free_on_reaches_one_rank_and_steps_of_both_kinds_interleave():
    from infc.runtime.distributed.rank_workers import MultiProcessRunner
    runner = MultiProcessRunner("rank_factories:counting_factory", {}, world=3,
                                step_timeout=30, startup_timeout=120)
    try:
        assert runner.dp_world == 3
        one = build_step([Chunk(0, [1], 0)], lambda s: [0], 16)
        two = build_step([Chunk(0, [1], 0), Chunk(1, [2], 0)], lambda s: [0, 1], 16)
        row = RowSampling(SamplingParams(temperature=0.0), 1, 0)

        def dp_step():
            return runner.execute_ranks([two, two, two], [[row, None], [None, row], [row, row]])

        assert dp_step() == [[Sample(0, -0.0, []), None], [None, Sample(101, -0.5, [(1, -0.5)])],
                             [Sample(200, -1.0, [(2, -0.5)] * 2), Sample(201, -1.0, [(2, -0.5)] * 2)]]
        runner.free_on(2, 7)
        runner.free_on(0, 8)
        # a shared step (acknowledged lazily), then data-parallel steps: the acks stay in order
        assert runner.execute(one, [row]) == [Sample(10, -0.0, [])]
        got = dp_step()
        assert [s.token for s in got[0] + got[2] if s] == [10, 210, 211] and got[1][1].token == 101
        runner.free(9)                                                        # every rank
        assert runner.execute(one, [row]) == [Sample(20, -0.0, [])]
        assert runner.execute(one, [row]) == [Sample(20, -0.0, [])]
        got = dp_step()
        assert [got[0][0].token, got[1][1].token, got[2][0].token] == [20, 111, 220]
        with pytest.raises(ValueError, match="same T"):
            runner.execute_ranks([one, two, two], [[row], [row, row], [row, row]])
        with pytest.raises(ValueError, match="rank 1: 1 sampling rows for a step of 2"):
            runner.execute_ranks([two] * 3, [[row, row], [row], [row, row]])
        with pytest.raises(ValueError, match="for 3 ranks"):
            runner.execute_ranks([two] * 2, [[row, row]] * 2)
        with pytest.raises(ValueError, match="rank 3 of 3"):
            runner.free_on(3, 1)
        own = runner.runner.plan
        runner.runner.plan = {"parallel": {"world": 3, "rank": 0, "tp": 3}}
        assert runner.dp_world == 1
        with pytest.raises(ValueError, match="use execute"):
            dp_step()
        runner.runner.plan = own
        assert runner.error is None and dp_step()[1][1].token == 111       # still up
    finally:
        runner.close()
    assert all(p.exitcode == 0 for p in runner.procs.values())


# -- failures (tests/rank_factories.py raising_factory: rank 1 raises in its second DP step) ---
def test_a_worker_that_raises_in_a_data_parallel_step_is_a_rank_error(tiny_model, tmp_path, rng):
    from infc.runtime.distributed.rank_workers import RankError
    d, _ = tiny_model("qwen3_moe")
    _, paths = write_plans(d, tmp_path)
    runner = processes(d, paths, factory="rank_factories:raising_factory", step_timeout=30)
    ranks = Ranks(2)
    try:
        metas = ranks.metas([[Chunk(0, [1, 2, 3], 0)], [Chunk(0, [4, 5], 0)]])
        got = runner.execute_ranks(metas, [[greedy()], [greedy(), None]])
        assert got[0][0] is not None and got[1][0] is not None and got[1][1] is None
        metas = ranks.metas([[Chunk(0, [got[0][0].token], 3)], [Chunk(0, [got[1][0].token], 2)]])
        t = time.monotonic()
        said = r"rank 1 \(pid \d+\) failed: RuntimeError: rank 1 lost its experts"
        with pytest.raises(RankError, match=said):
            runner.execute_ranks(metas, [[greedy()], [greedy()]])
        assert time.monotonic() - t < 10
        with pytest.raises(RankError, match="the ranks are down"):
            runner.execute_ranks(metas, [[greedy()], [greedy()]])
        with pytest.raises(RankError, match="the ranks are down"):
            runner.free_on(1, 0)
    finally:
        runner.close()


# -- overlapped data-parallel steps (launch_ranks / collect_ranks) -----------------------------
def test_dp_launch_and_collect_frames_round_trip(rng):
    meta = _meta(rng, 4)
    rows = [RowSampling(SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1, logprobs=2),
                        (1 << 65) + 1, 6, (4,)),
            None, greedy(), None]
    feed = [(int(meta.last_rows[0]), 2), (int(meta.last_rows[2]), 0)]
    kind, items = ch.decode(ch.encode_dp_launch(meta, 23, rows, feed))
    assert kind == ch.DP_LAUNCH and ch.KIND_NAMES[kind] == "data-parallel launch"
    k, back, sampling, got_feed = ch.dp_launch_of(kind, items)
    assert k == 23 and got_feed == feed and ch.meta_of(kind, items)[0] == 23
    _same_meta(meta, back)
    assert [s is None for s in sampling] == [False, True, False, True]
    a = sampling[0]
    assert (a.seed, a.step, a.banned) == ((1 << 65) + 1, 6, (4,))
    assert (a.params.temperature, a.params.top_k, a.params.top_p, a.params.min_p, a.params.logprobs) \
        == (0.5, 3, 0.8, 0.1, 2)                  # logprobs too: the rank samples for the engine
    assert sampling[2].params.logprobs is None
    k, back, sampling, got_feed = ch.dp_launch_of(*ch.decode(ch.encode_dp_launch(meta, 0, [None] * 4, [])))
    assert sampling == [None] * 4 and got_feed == []                        # an idle rank's step
    with pytest.raises(ch.ChannelError, match="3 sampling rows for a step of 4"):
        ch.encode_dp_launch(meta, 0, rows[:3], feed)
    with pytest.raises(ch.ChannelError, match="feeds"):
        ch.dp_launch_of(*ch.decode(ch.encode_dp_launch(meta, 0, rows, [(meta.T, 0)])))
    with pytest.raises(ch.ChannelError, match="sampling fields"):
        ch.dp_launch_of(kind, items[:-1])
    with pytest.raises(ch.ChannelError, match="expected a data-parallel launch"):
        ch.dp_launch_of(*ch.decode(ch.encode_dp_step(meta, 0, rows)))
    with pytest.raises(ch.ChannelError, match="expected a data-parallel step"):
        ch.dp_step_of(kind, items)
    # DP_COLLECT: the step index alone
    kind, items = ch.decode(ch.encode_dp_collect(41))
    assert kind == ch.DP_COLLECT and ch.dp_collect_of(kind, items) == 41
    with pytest.raises(ch.ChannelError, match="data-parallel collect"):
        ch.dp_collect_of(ch.ACK, items)
    with pytest.raises(ch.ChannelError, match="data-parallel collect"):
        ch.dp_collect_of(kind, [("step", "41")])
    # the workers' answers: a bare ACK (nothing collected) or a step's samples
    assert ch.dp_reply_of(*ch.decode(ch.encode(ch.ACK, [("step", 7)]))) == (7, None)
    samples = [Sample(3, -0.5, [(3, -0.5)]), None]
    assert ch.dp_reply_of(*ch.decode(ch.encode_samples(6, samples))) == (6, samples)
    with pytest.raises(ch.ChannelError, match="ack of a data-parallel step"):
        ch.dp_reply_of(ch.ACK, [("step", 7), ("num_pages", 3)])


def drive(runner, ranks, schedule, overlapped: bool, base: int, frees=None) -> tuple[dict, list]:
    """Run `schedule` as an engine would: each entry is a step, every rank's items (a new
    sequence: (name, prompt); a decoding one: its name; every chunk samples its next token), or
    None: collect the step in flight alone. Overlapped: step k + 1 is launched before step k is
    collected, a sequence whose last token is in flight is fed it (`feed`, a 0 in its row);
    else execute_ranks with the real tokens. frees: {schedule index: names} freed (free_on)
    right after that step is launched. -> ({name: its sampled tokens}, the launched handles)."""
    seqs, out, handles, in_flight = {}, {}, [], None

    def take(step, metas, names, samples):
        assert [len(s) for s in samples] == [m.B for m in metas]
        for r, rank_names in enumerate(names):
            for b, name in enumerate(rank_names):
                s = seqs[name]
                s["toks"].append(samples[r][b].token)
                out[name].append(samples[r][b].token)
                if s["pending"] == (step, b):
                    s["pending"] = None
            assert samples[r][len(rank_names):] == [None] * (len(samples[r]) - len(rank_names))

    for i, plan in enumerate(schedule):
        launched = None
        if plan is not None:
            per_rank, feeds, names = [], [], []
            for r, items in enumerate(plan):
                chunks, feed, rank_names, at = [], [], [], 0
                for it in items:
                    if isinstance(it, tuple):
                        name, prompt = it
                        seqs[name] = {"rank": r, "id": base + len(seqs), "toks": list(prompt), "n": 0,
                                      "pending": None}
                        out[name] = []
                    else:
                        name = it
                    s = seqs[name]
                    tokens = s["toks"][s["n"]:]
                    if s["pending"] is not None:          # its token is still in flight
                        assert overlapped and not tokens and s["pending"][0] == handles[-1].step
                        feed.append((at, s["pending"][1]))
                        tokens = [0]
                    chunks.append(Chunk(s["id"], tokens, s["n"]))
                    s["n"] += len(tokens)
                    rank_names.append(name)
                    at += len(tokens)
                per_rank.append(chunks)
                feeds.append(feed)
                names.append(rank_names)
            metas = ranks.metas(per_rank)
            sampling = [[greedy()] * len(c) + [None] * (m.B - len(c)) for c, m in zip(per_rank, metas)]
            if overlapped:
                h = runner.launch_ranks(metas, sampling, feeds)
                handles.append(h)
                launched = (h, metas, names)
                for r, rank_names in enumerate(names):
                    for b, name in enumerate(rank_names):
                        seqs[name]["pending"] = (h.step, b)
            else:
                assert not any(feeds)
                take(None, metas, names, runner.execute_ranks(metas, sampling))
            for name in (frees or {}).get(i, ()):
                runner.free_on(seqs[name]["rank"], seqs[name]["id"])
        if overlapped and in_flight is not None:
            h, metas, names = in_flight
            take(h.step, metas, names, runner.collect_ranks(h))
        in_flight = launched
    assert in_flight is None
    return out, handles


def test_overlapped_data_parallel_steps_give_the_synchronous_tokens(tiny_model, tmp_path, rng, monkeypatch):
    """Steps launched one ahead of their collect (launch_ranks / collect_ranks over DP_LAUNCH and
    DP_COLLECT frames), sequences decoding with their tokens fed from the step before on their
    own rank, an idle rank, a sequence freed while steps are in flight, a step collected alone,
    then a launch after that: every rank's greedy tokens are those of the same steps run
    synchronously by execute_ranks with the real tokens."""
    monkeypatch.setenv("INFC_RANK_OVERLAP", "1")
    d, _ = tiny_model("qwen3_moe")
    _, paths = write_plans(d, tmp_path)
    a, b, c, e = ([int(t) for t in rng.integers(0, 320, n)] for n in (9, 4, 3, 6))
    schedule = [
        [[("A", a)], [("B", b)]],             # 0: prefills
        [["A"], ["B"]],                       # 1: decodes, fed from step 0 (launched before its collect)
        [["A"], ["B", ("C", c)]],             # 2: rank 1 decodes B and prefills C
        [[], ["B", "C"]],                     # 3: rank 0 idles
        [[("D", e)], ["B"]],                  # 4: rank 0 prefills D; C is freed (after this launch)
        None,                                 # step 4 collected alone: DP_COLLECT
        [["D"], ["B"]],                       # 5: launched with nothing in flight, the real tokens
        [["D"], []],                          # 6: rank 1 idles
        None,
    ]
    collected_alone = []
    encode_dp_collect = ch.encode_dp_collect
    monkeypatch.setattr(ch, "encode_dp_collect",
                        lambda k: collected_alone.append(k) or encode_dp_collect(k))
    runner = processes(d, paths)
    ranks = Ranks(2)
    try:
        assert runner.can_overlap and runner.dp_world == 2
        got, handles = drive(runner, ranks, schedule, True, 0, frees={4: ["C"]})
        assert [h.step for h in handles] == list(range(7)) and all(h.collected for h in handles)
        assert collected_alone == [4, 6]
        assert not runner._dp_flight and not runner._dp_owed and runner._dp_pending is None
        want, _ = drive(runner, ranks, schedule, False, 100)          # execute_ranks after launches
        assert {k: len(v) for k, v in got.items()} == {"A": 3, "B": 6, "C": 2, "D": 3}
        assert got == want
        # overlapped again after synchronous steps; closed with that step in flight
        more, _ = drive(runner, ranks, [[[("E", b)], [("F", a)]], [["E"], ["F"]], None], True, 200)
        assert more == {"E": want["B"][:2], "F": want["A"][:2]}   # the same prompts, the same tokens
        h = runner.launch_ranks(*_one_step(ranks))
        assert not h.collected
    finally:
        runner.close()
    assert h.collected and not runner._dp_flight                       # close collected it
    assert all(p.exitcode == 0 for p in runner.procs.values())


def _one_step(ranks):
    metas = ranks.metas([[Chunk(300, [5, 6], 0)], [Chunk(301, [7], 0)]])
    return metas, [[greedy()] + [None] * (m.B - 1) for m in metas], [[], []]


def test_overlapped_data_parallel_steps_are_collected_in_order_and_not_interleaved(monkeypatch):
    """launch_ranks / collect_ranks' bookkeeping over three ranks: two steps in flight at most,
    collected in launch order and once; any other step while one is in flight is refused with
    the ranks still up; frees go through meanwhile; close() collects what is in flight."""
    from infc.runtime.distributed.rank_workers import MultiProcessRunner
    monkeypatch.setenv("INFC_RANK_OVERLAP", "1")
    runner = MultiProcessRunner("rank_factories:counting_launch_factory", {}, world=3,
                                step_timeout=30, startup_timeout=120)
    try:
        assert runner.can_overlap and runner.dp_world == 3
        one = build_step([Chunk(0, [1], 0)], lambda s: [0], 16)
        two = build_step([Chunk(0, [1], 0), Chunk(1, [2], 0)], lambda s: [0, 1], 16)
        row = RowSampling(SamplingParams(temperature=0.0), 1, 0)
        rows = [[row, None], [None, row], [row, row]]

        def launch():
            return runner.launch_ranks([two, two, two], rows, [[], [], []])

        h0, h1 = launch(), launch()
        with pytest.raises(RuntimeError, match=r"steps \[0, 1\] are launched and uncollected: "
                                               r"collect_ranks step 0 before launching another"):
            launch()
        in_flight = "data-parallel step 0 was launched by launch_ranks and is not collected"
        with pytest.raises(RuntimeError, match=in_flight):
            runner.execute_ranks([two] * 3, rows)
        with pytest.raises(RuntimeError, match=in_flight):
            runner.execute(one, [row])
        with pytest.raises(RuntimeError, match=in_flight):
            runner.launch(one, [row])
        with pytest.raises(RuntimeError, match="launch order: step 0 before step 1"):
            runner.collect_ranks(h1)
        with pytest.raises(ValueError, match="a handle this runner's launch_ranks returned"):
            runner.collect_ranks(object())
        runner.free_on(2, 7)                                  # no answer owed: between the others'
        assert runner.collect_ranks(h0) == [
            [Sample(0, -0.0, []), None], [None, Sample(101, -0.5, [(1, -0.5)])],
            [Sample(200, -1.0, [(2, -0.5)] * 2), Sample(201, -1.0, [(2, -0.5)] * 2)]]
        with pytest.raises(RuntimeError, match="step 0 was collected already"):
            runner.collect_ranks(h0)
        assert runner.collect_ranks(h1)[2][0].token == 200    # computed at its launch: before the free
        assert runner.collect_ranks(launch())[2][0].token == 210      # alone: DP_COLLECT
        assert runner.error is None and not runner._dp_owed
        # the other kinds of steps again, then overlapped steps after a lazily acknowledged one
        assert runner.execute_ranks([two] * 3, rows)[2][1].token == 211
        assert runner.execute(one, [row]) == [Sample(0, -0.0, [])]
        with pytest.raises(ValueError, match="2 feeds for 3 ranks"):
            runner.launch_ranks([two] * 3, rows, [[], []])
        with pytest.raises(ValueError, match="rank 1: 1 sampling rows for a step of 2"):
            runner.launch_ranks([two] * 3, [[row, row], [row], [row, row]], [[]] * 3)
        h3 = launch()
        assert runner.collect_ranks(h3)[1][1].token == 101
        h4, h5 = launch(), launch()
    finally:
        runner.close()
    assert h4.collected and h5.collected                      # close collected them
    assert all(p.exitcode == 0 for p in runner.procs.values())


@pytest.mark.parametrize("where", ["launch", "collect"])
def test_a_worker_that_raises_in_an_overlapped_data_parallel_step_is_a_rank_error(
        where, tiny_model, tmp_path, monkeypatch):
    """Rank 1 raises launching step 1 (rank 0's launch_ranks fails: its collectives lose rank 1)
    or collecting step 0 while it launches step 1 (rank 0's collect_ranks of step 0 reads the
    error instead of the samples): a RankError naming rank 1 and its error, and the ranks down."""
    from infc.runtime.distributed.rank_workers import RankError
    monkeypatch.setenv("INFC_RANK_OVERLAP", "1")
    d, _ = tiny_model("qwen3_moe")
    _, paths = write_plans(d, tmp_path)
    runner = processes(d, paths, factory=f"rank_factories:raising_{where}_factory", step_timeout=30)
    ranks = Ranks(2)
    try:
        metas = ranks.metas([[Chunk(0, [1, 2, 3], 0)], [Chunk(0, [4, 5], 0)]])
        h0 = runner.launch_ranks(metas, [[greedy()], [greedy(), None]], [[], []])
        metas = ranks.metas([[Chunk(0, [0], 3)], [Chunk(0, [0], 2)]])
        step1 = (metas, [[greedy()], [greedy()]], [[(0, 0)], [(0, 0)]])
        said = rf"rank 1 \(pid \d+\) failed: RuntimeError: rank 1 lost its experts in {where}"
        t = time.monotonic()
        if where == "launch":
            with pytest.raises(RankError, match=said):
                runner.launch_ranks(*step1)
        else:
            h1 = runner.launch_ranks(*step1)
            with pytest.raises(RankError, match=said):
                runner.collect_ranks(h0)
            with pytest.raises(RankError, match="the ranks are down"):
                runner.collect_ranks(h1)
        assert time.monotonic() - t < 10
        with pytest.raises(RankError, match="the ranks are down"):
            runner.collect_ranks(h0)
        with pytest.raises(RankError, match="the ranks are down"):
            runner.launch_ranks(*step1)
        with pytest.raises(RankError, match="the ranks are down"):
            runner.execute_ranks(*step1[:2])
    finally:
        runner.close()
    assert runner.procs[1].exitcode == 1


def test_a_worker_killed_between_launch_and_collect_is_a_rank_error(monkeypatch):
    """A worker that dies while a launched data-parallel step waits to be collected: the
    watchdog (or the collect, whichever sees it first) takes the ranks down, and collect_ranks
    raises a RankError naming the rank."""
    from infc.runtime.distributed.rank_workers import MultiProcessRunner, RankError
    monkeypatch.setenv("INFC_RANK_OVERLAP", "1")
    runner = MultiProcessRunner("rank_factories:counting_launch_factory", {}, world=2,
                                step_timeout=30, startup_timeout=120)
    try:
        two = build_step([Chunk(0, [1], 0), Chunk(1, [2], 0)], lambda s: [0, 1], 16)
        row = RowSampling(SamplingParams(temperature=0.0), 1, 0)
        h0 = runner.launch_ranks([two, two], [[row, row], [row, None]], [[], []])
        h1 = runner.launch_ranks([two, two], [[row, row], [row, None]], [[(0, 0)], [(0, 0)]])
        assert runner.collect_ranks(h0)[1] == [Sample(100, -0.5, [(1, -0.5)]), None]
        runner.procs[1].kill()
        t = time.monotonic()
        with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\)"):
            runner.collect_ranks(h1)
        assert time.monotonic() - t < 10
    finally:
        runner.close()


def test_the_engine_overlaps_data_parallel_steps_over_rank_processes(tiny_model, rng, monkeypatch):
    """The engine over two CPU rank processes of a data-parallel plan (load_backend, as `infc
    serve --data-parallel-size 2 --enable-expert-parallel` starts them), overlapped steps forced
    on (INFC_RANK_OVERLAP=1): the tokens of synchronous steps, greedy and seeded."""
    from families import engine_tokens
    from infc.backend import load_backend
    from infc.runtime.engine.sampling import SamplingParams
    d, _ = tiny_model("qwen3_moe")
    prompts = [[int(t) for t in rng.integers(0, 320, n)] for n in (6, 13, 2, 9)]
    params = [SamplingParams(max_tokens=5, ignore_eos=True,
                             **({"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}))
              for i in range(len(prompts))]
    monkeypatch.setenv("INFC_RANK_OVERLAP", "1")
    got = {}
    for overlap in (False, True):
        b = load_backend(d, device="cpu", asynchronous=False, log=None, max_model_len=256,
                         num_gpu_blocks_override=64, data_parallel_size=2, enable_expert_parallel=True)
        try:
            assert b.engine.dp == 2
            got[overlap] = engine_tokens(b.engine.runner, prompts, params, max_model_len=256,
                                         max_num_batched_tokens=8, overlap=overlap)
        finally:
            b.engine.runner.close()
    assert got[True] == got[False] and all(len(v) == 5 for v in got[True].values())
