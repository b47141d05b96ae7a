"""Penalties and logit controls against HF transformers' logits processors (and OpenAI's formula by hand); the
penalties, which touch only each row's seen tokens, against the formula over the whole vocabulary."""
import os

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from nanovllm import SamplingParams
from nanovllm.layers import logit_controls
from nanovllm.layers.logit_controls import (
    TokenHistory,
    allowed_bitmask,
    apply_allowed_tokens,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    batch_index_of,
    pack_bad_words,
)
from nanovllm.runner.logit_controls import LogitControls, _EntryPool

VOCAB = 64
PROMPTS = [[3, 4, 5, 3], [10, 11], [7, 7, 8]]
OUTPUTS = [[4, 9, 9, 20], [], [1, 2, 7, 2, 2]]
IDENTITY = torch.arange(3)  # batch_index of a step whose batch rows are the persistent rows 0, 1, 2
KERNEL_PATHS = pytest.mark.parametrize("on_kernels", [False, True], ids=["torch", "kernel"])


@pytest.fixture
def kernels(monkeypatch):
    """`kernels(on)`: the ops take their CUDA paths (on) or their torch paths; the kernels run on the tests' CPU
    tensors in Triton's interpreter."""
    def use(on: bool) -> None:
        if on:
            pytest.importorskip("triton")
            if os.environ.get("TRITON_INTERPRET") != "1":
                pytest.skip("the kernels run on CPU tensors in Triton's interpreter")
        monkeypatch.setattr(logit_controls, "_use_kernel", lambda tensor: on)
    return use


def random_logits(rows=3, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def filled_history(window=4):
    """Slots 2, 0, 5 hold rows 0, 1, 2; their outputs are recorded one step at a time as the engine would."""
    history = TokenHistory.allocate(num_slots=6, vocab_size=VOCAB, window=window, device=torch.device("cpu"))
    slots = [2, 0, 5]
    for slot, prompt in zip(slots, PROMPTS):
        history.reset(slot, prompt)
    for step in range(max(map(len, OUTPUTS))):
        live = [i for i, out in enumerate(OUTPUTS) if step < len(out)]
        history.record(torch.tensor([slots[i] for i in live]), torch.tensor([OUTPUTS[i][step] for i in live]),
                       torch.arange(len(live)))
    return history, torch.tensor(slots)


@KERNEL_PATHS
def test_repetition_penalty_equals_hf(kernels, on_kernels):
    kernels(on_kernels)
    history, slots = filled_history()
    penalties = [1.3, 0.7, 2.0]
    logits = random_logits()
    ours = logits.clone()
    apply_penalties(ours, torch.arange(3), slots, history, torch.tensor(penalties), torch.zeros(3), torch.zeros(3))
    for row, penalty in enumerate(penalties):
        seen = torch.tensor([PROMPTS[row] + OUTPUTS[row]])
        hf = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits[row:row + 1].clone())
        torch.testing.assert_close(ours[row:row + 1], hf, rtol=0, atol=0)


def test_presence_and_frequency_follow_openai_formula():
    history, slots = filled_history()
    presence, frequency = [0.5, -0.3, 1.5], [0.25, 0.4, -0.5]
    logits = random_logits(seed=1)
    ours = logits.clone()
    apply_penalties(ours, torch.arange(3), slots, history, torch.ones(3), torch.tensor(presence),
                    torch.tensor(frequency))
    for row in range(3):
        for token in range(VOCAB):
            count = OUTPUTS[row].count(token)  # the prompt does not count
            want = logits[row, token].item() - frequency[row] * count - presence[row] * (count > 0)
            assert abs(ours[row, token].item() - want) < 1e-5, (row, token)


def test_penalties_only_touch_the_rows_given():
    history, slots = filled_history()
    logits = random_logits(seed=2)
    ours = logits.clone()
    apply_penalties(ours, torch.tensor([1]), slots[1:2], history, torch.tensor([1.5]), torch.tensor([1.0]),
                    torch.tensor([1.0]))
    assert torch.equal(ours[0], logits[0]) and torch.equal(ours[2], logits[2])
    assert not torch.equal(ours[1], logits[1])


@KERNEL_PATHS
def test_min_tokens_equal_hf_min_new_tokens(kernels, on_kernels):
    kernels(on_kernels)
    eos = [2, 5]
    min_tokens = [3, 1, 4]
    output_lens = torch.tensor([len(out) for out in OUTPUTS])
    logits = random_logits(seed=3)
    ours = logits.clone()
    rows = torch.tensor([row for row in range(3) for _ in eos])
    apply_min_tokens(ours, IDENTITY, rows, torch.tensor(eos * 3), torch.tensor(min_tokens).repeat_interleave(len(eos)),
                     output_lens)
    for row in range(3):
        ids = torch.tensor([PROMPTS[row] + OUTPUTS[row]])
        processor = MinNewTokensLengthLogitsProcessor(len(PROMPTS[row]), min_tokens[row], eos)
        torch.testing.assert_close(ours[row:row + 1], processor(ids, logits[row:row + 1].clone()), rtol=0, atol=0)


@KERNEL_PATHS
def test_bad_words_equal_hf_over_the_output(kernels, on_kernels):
    """vLLM matches bad words against the output only: HF's processor is given the output as its input ids."""
    kernels(on_kernels)
    window = 4
    history, slots = filled_history(window)
    bad_words = [[[9, 20, 33], [9, 9, 20, 6], [40]], [[1, 2]], [[2, 7, 2, 2, 50], [2, 8], [2, 13], [62]]]
    logits = random_logits(seed=4)
    ours = logits.clone()
    packed = [pack_bad_words(words, window) for words in bad_words]
    rows = torch.cat([torch.full((len(words),), row) for row, words in enumerate(bad_words)])
    apply_bad_words(ours, IDENTITY, rows, slots[rows], torch.cat([p[0] for p in packed]), torch.cat([p[1] for p in packed]),
                    history)
    for row, words in enumerate(bad_words):
        processor = NoBadWordsLogitsProcessor(words, eos_token_id=None)
        hf = processor(torch.tensor(OUTPUTS[row], dtype=torch.int64).view(1, -1), logits[row:row + 1].clone())
        torch.testing.assert_close(ours[row:row + 1], hf, rtol=0, atol=0)
    assert ours[0, 33] == float("-inf") and ours[0, 6] == float("-inf") and ours[2, 50] == float("-inf")


def test_bad_words_longer_than_the_window_are_rejected_by_name():
    with pytest.raises(ValueError, match="bad_words"):
        pack_bad_words([[1, 2, 3, 4, 5, 6]], window=4)
    with pytest.raises(ValueError, match="bad_words"):
        pack_bad_words([[]], window=4)


@KERNEL_PATHS
def test_logit_bias_equals_hf_sequence_bias(kernels, on_kernels):
    kernels(on_kernels)
    biases = [{4: 2.5, 9: -100.0}, {}, {0: 1.0, 63: -3.0, 7: 0.5}]
    logits = random_logits(seed=5)
    ours = logits.clone()
    entries = [(row, token, value) for row, bias in enumerate(biases) for token, value in bias.items()]
    rows, tokens, values = (torch.tensor(column) for column in zip(*entries))
    apply_logit_bias(ours, IDENTITY, rows, tokens, values)
    for row, bias in enumerate(biases):
        if not bias:
            assert torch.equal(ours[row], logits[row])
            continue
        processor = SequenceBiasLogitsProcessor({(token,): value for token, value in bias.items()})
        hf = processor(torch.tensor([[1, 2]]), logits[row:row + 1].clone())
        torch.testing.assert_close(ours[row:row + 1], hf, rtol=0, atol=0)


@KERNEL_PATHS
def test_allowed_token_ids_mask_everything_else(kernels, on_kernels):
    kernels(on_kernels)
    logits = random_logits(seed=6)
    ours = logits.clone()
    allowed = {0: [5, 6, 60], 2: [1]}
    apply_allowed_tokens(ours, IDENTITY, *allowed_tables(allowed, 3, VOCAB))
    for row in range(3):
        for token in range(VOCAB):
            want = logits[row, token] if row not in allowed or token in allowed[row] else float("-inf")
            assert ours[row, token] == want


def test_controls_reject_half_precision_logits():
    with pytest.raises(TypeError, match="float32"):
        apply_logit_bias(random_logits().half(), IDENTITY, torch.tensor([0]), torch.tensor([1]), torch.tensor([1.0]))


def seen_lists(history, slots):
    return [sorted(history.seen_tokens[slot, :history.num_seen[slot]].tolist()) for slot in slots.tolist()]


@KERNEL_PATHS
def test_history_reset_with_output_equals_recording_it(kernels, on_kernels):
    kernels(on_kernels)
    history, slots = filled_history()
    resumed = TokenHistory.allocate(num_slots=6, vocab_size=VOCAB, window=4, device=torch.device("cpu"))
    for slot, prompt, output in zip(slots.tolist(), PROMPTS, OUTPUTS):
        resumed.reset(slot, prompt, output)
    for name in ("output_counts", "prompt_mask", "num_seen", "recent", "output_lens"):
        assert torch.equal(getattr(resumed, name), getattr(history, name)), name
    assert seen_lists(resumed, slots) == seen_lists(history, slots) == [
        sorted(set(prompt + output)) for prompt, output in zip(PROMPTS, OUTPUTS)]


def dense_penalties(logits, rows, slots, history, repetition, presence, frequency):
    """The penalty formula over the whole vocabulary (torch, as the engine applied it before the seen lists)."""
    counts = history.output_counts[slots]
    in_output = counts > 0
    seen = in_output | history.prompt_mask[slots]
    values = logits[rows]
    penalty = repetition.unsqueeze(1)
    values = torch.where(seen, torch.where(values > 0, values / penalty, values * penalty), values)
    values -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * in_output
    logits[rows] = values


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_penalties_on_the_seen_tokens_equal_the_formula_over_the_vocabulary(path):
    """Random histories (prompt-only, output-only and shared tokens, a token seen everywhere) and penalties
    (below and above 1, negative presence), banned tokens among the seen ones; rows out of order, a row without
    penalties. The seen-token paths (the torch one, the kernel in Triton's interpreter) equal the dense formula
    bit for bit."""
    generator = torch.Generator().manual_seed(7)
    vocab, window = 300, 4
    history = TokenHistory.allocate(num_slots=5, vocab_size=vocab, window=window, device=torch.device("cpu"))
    for slot in range(5):
        prompt = torch.randint(0, vocab, (int(torch.randint(0, 60, (1,), generator=generator)),), generator=generator)
        history.reset(slot, prompt.tolist() + [17])
        for _ in range(int(torch.randint(0, 40, (1,), generator=generator))):
            history.record(torch.tensor([slot]), torch.randint(0, vocab, (1,), generator=generator),
                           torch.tensor([0]))
    history.record(torch.arange(5), torch.full((5,), 17), torch.arange(5))
    rows, slots = torch.tensor([4, 0, 2, 3]), torch.tensor([1, 3, 0, 4])
    repetition, presence = torch.tensor([1.3, 0.7, 2.0, 1.0]), torch.tensor([0.5, -0.3, 1.5, 0.0])
    frequency = torch.tensor([0.25, 0.4, -0.5, 0.7])
    logits = torch.randn(5, vocab, generator=generator) * 3
    logits[:, ::13] = float("-inf")
    expected = logits.clone()
    dense_penalties(expected, rows, slots, history, repetition, presence, frequency)
    ours = logits.clone()
    if path == "torch":
        apply_penalties(ours, rows, slots, history, repetition, presence, frequency)
    else:
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
            pytest.skip("needs Triton's interpreter or a GPU")
        from nanovllm.kernels.penalties import apply_history_penalties
        apply_history_penalties(ours, rows, slots, repetition, presence, frequency, history.seen_tokens,
                                history.num_seen, history.output_counts, block=16)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert torch.equal(ours[1], logits[1])


@KERNEL_PATHS
def test_batch_index_of_inverts_the_row_list(kernels, on_kernels):
    kernels(on_kernels)
    assert batch_index_of(torch.tensor([4, 0, 2]), 6).tolist() == [1, -1, 2, -1, 0, -1]
    assert batch_index_of(torch.tensor([4, 0, 7, 2]), 9).tolist() == [1, -1, 3, -1, 0, -1, -1, 2, -1]


def history_tables(history):
    return {name: getattr(history, name).clone() for name in (
        "output_counts", "prompt_mask", "seen_tokens", "num_seen", "recent", "output_lens")}


def test_the_record_kernel_leaves_the_torch_paths_history(kernels):
    """Steps recording into a few slots (rows in another order than their slots, a slot skipping a step): a token
    of the prompt, output tokens repeated, more steps than the window holds. Every table equals the torch path's
    after every step, bit for bit (past the seen lists' ends too)."""
    vocab, window = 64, 3
    histories = {}
    for on_kernels in (False, True):
        history = TokenHistory.allocate(num_slots=4, vocab_size=vocab, window=window, device=torch.device("cpu"))
        history.reset(1, [5, 6, 5], [7])
        history.reset(3, [40])
        histories[on_kernels] = history
    steps = [([1, 3], [5, 41]), ([3, 1], [41, 7]), ([1, 3, 0], [9, 40, 9]), ([0, 1], [9, 9]), ([1, 3], [5, 63]),
             ([3], [63]), ([1, 3, 0], [12, 2, 9])]
    for slots, tokens in steps:
        sampled = torch.tensor(tokens[::-1] + [0])  # the batch lists the rows in reverse, then a row without a slot
        rows = torch.arange(len(slots) - 1, -1, -1)
        for on_kernels, history in histories.items():
            kernels(on_kernels)
            history.record(torch.tensor(slots), sampled, rows)
        ours, reference = history_tables(histories[True]), history_tables(histories[False])
        for name in ours:
            assert torch.equal(ours[name], reference[name]), (slots, name)
    assert seen_lists(histories[True], torch.tensor([0, 1, 3])) == [[9], [5, 6, 7, 9, 12], [2, 40, 41, 63]]
    assert histories[True].recent[1].tolist() == [9, 5, 12] and histories[True].output_lens.tolist() == [3, 7, 0, 6]


def allowed_tables(allowed, num_rows, vocab):
    """(allowed_rows, bitmask) of `allowed` {persistent row: its allowed token ids}."""
    rows = torch.tensor([row in allowed for row in range(num_rows)])
    bitmask = torch.from_numpy(np.stack([allowed_bitmask(allowed.get(row, []), vocab) for row in range(num_rows)]))
    return rows, bitmask


def sparse_controls_step(vocab=300, window=4):
    """A step whose batch holds persistent rows 5, 2, 6, 0 (of 7), with entries of every sparse control, some of
    them on rows 1, 3 and 4, which are not in it; bad words repeat a (row, token) with different verdicts."""
    generator = torch.Generator().manual_seed(11)
    history = TokenHistory.allocate(num_slots=3, vocab_size=vocab, window=window, device=torch.device("cpu"))
    for slot, output in enumerate([[8, 9, 10], [1, 2], [3]]):
        history.reset(slot, [100 + slot], output)
    logits = torch.randn(4, vocab, generator=generator) * 3
    logits[:, ::17] = float("-inf")
    batch_rows = torch.tensor([5, 2, 6, 0])
    words = [[9, 10, 50], [7, 10, 50], [50], [2, 60], [1, 60], [3, 61], [62]]
    prefixes, banned = pack_bad_words(words, window)
    controls = dict(
        allowed=allowed_tables({3: [4, 5], 2: [7, 8, 200], 0: [9]}, 7, vocab),
        bad_words=(torch.tensor([5, 5, 2, 6, 6, 1, 4]), torch.tensor([0, 0, 1, 1, 1, 2, 2]), prefixes, banned),
        min_tokens=(torch.tensor([5, 5, 2, 3, 0]), torch.tensor([20, 21, 20, 20, 22]), torch.tensor([3, 3, 1, 9, 9])),
        bias=(torch.tensor([5, 5, 6, 1, 0]), torch.tensor([30, 31, 30, 30, 7]),
              torch.tensor([2.5, -100.0, 0.75, 1.0, -3.0])))
    return logits, batch_rows, controls, history


def apply_sparse_controls(logits, batch_rows, controls, history, output_lens):
    index = batch_index_of(batch_rows, 7)
    apply_allowed_tokens(logits, index, *controls["allowed"])
    apply_bad_words(logits, index, *controls["bad_words"], history)
    apply_min_tokens(logits, index, *controls["min_tokens"], output_lens)
    apply_logit_bias(logits, index, *controls["bias"])


def test_sparse_control_kernels_equal_the_torch_paths(kernels):
    """allowed tokens, bad words (a banned token of a row listed by a word that matches and one that does not),
    min_tokens and logit_bias, each with entries of rows outside the step, through their kernels: the torch
    path's logits bit for bit, and the expected ones."""
    logits, batch_rows, controls, history = sparse_controls_step()
    output_lens = torch.tensor([2, 0, 5, 3])
    results = {}
    for on_kernels in (False, True):
        kernels(on_kernels)
        results[on_kernels] = logits.clone()
        apply_sparse_controls(results[on_kernels], batch_rows, controls, history, output_lens)
    torch.testing.assert_close(results[True], results[False], rtol=0, atol=0)
    ours = results[True]
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in ours]
    assert finite[3] == [9] and ours[3, 9] == logits[3, 9]  # row 0 allows 9 alone
    assert finite[1] == [7, 8, 200] and torch.equal(ours[1, finite[1]], logits[1, finite[1]])
    changed = [(row != raw).nonzero().flatten().tolist() for row, raw in zip(ours, logits)]
    assert changed[0] == [20, 21, 30, 31, 50] and torch.isneginf(ours[0, [20, 21, 50]]).all()  # 2 < min_tokens 3
    assert ours[0, 30] == logits[0, 30] + 2.5 and ours[0, 31] == logits[0, 31] - 100.0
    assert changed[2] == [30, 60] and ours[2, 60] == float("-inf") and ours[2, 30] == logits[2, 30] + 0.75


def controlled_steps(vocab=96, device="cpu"):
    """The runner's controls over a few steps as the runner drives them (stage, apply, a greedy draw, record): rows
    with every control, steps that leave rows out or list them in another order, a row joining midway (the slot
    pool grows) and one leaving. Returns each step's scores and the final history tables (on the CPU)."""
    controls = LogitControls(6, vocab, device, eos_token_ids=[2], initial_slots=2)
    controls.fill(0, SamplingParams(repetition_penalty=1.3, logit_bias={5: 3.0, 7: -2.0}), [1, 2, 3, 4], 3, [])
    controls.fill(2, SamplingParams(presence_penalty=0.5, frequency_penalty=0.4, min_tokens=3, stop_token_ids=[9]),
                  [10, 11, 12], 2, [[12, 13], [50]])
    controls.fill(3, SamplingParams(allowed_token_ids=[4, 5, 6, 40], logit_bias={40: 1.5}), [1], 1, [])
    generator = torch.Generator().manual_seed(3)
    scores = []
    for step, batch in enumerate([[0, 2, 3, 5], [5, 3, 0], [2, 5], [4, 0, 2, 3, 5], [3, 4, 2], [4, 2, 0]]):
        if step == 2:
            controls.fill(4, SamplingParams(repetition_penalty=0.8, min_tokens=2), [7, 8, 9], 3, [[20], [9, 21]])
        if step == 4:
            controls.clear(0)
        host = {name: np.zeros(len(batch), dtype=dtype) for name, dtype in (
            ("penalty_rows", np.int64), ("penalty_slots", np.int64), ("repetition_penalties", np.float32),
            ("presence_penalties", np.float32), ("frequency_penalties", np.float32))}
        count = controls.stage(host, np.array(batch), [True] * len(batch))
        penalty = tuple(torch.from_numpy(host[name][:count]).to(device) for name in host) if count else None
        logits = (torch.randn(len(batch), vocab, generator=generator) * 3).to(device, torch.bfloat16)
        step_scores = controls.apply(logits, torch.tensor(batch, device=device),
                                     torch.full((len(batch),), step, device=device), penalty)
        sampled = step_scores.argmax(dim=-1)
        if penalty is not None:
            controls.record(sampled, penalty[0], penalty[1])
        scores.append(step_scores.cpu())
    return scores, {name: table.cpu() for name, table in history_tables(controls.history).items()}


def test_the_runners_controls_step_through_the_kernels_as_through_torch(kernels):
    """`LogitControls` on the kernels: every step's scores and the final histories are the torch path's."""
    kernels(False)
    reference_scores, reference_history = controlled_steps()
    kernels(True)
    scores, history = controlled_steps()
    for step, (ours, reference) in enumerate(zip(scores, reference_scores)):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0, msg=f"step {step}")
    for name in history:
        assert torch.equal(history[name], reference_history[name]), name
    assert torch.isfinite(scores[0][2]).nonzero().flatten().tolist() == [4, 5, 6, 40]  # row 3 allows them


@pytest.mark.gpu
def test_gpu_runners_controls_on_the_compiled_kernels_equal_the_cpu_torch_path():
    """The same steps on CUDA (the compiled kernels: thread order inside a program, which the interpreter cannot
    show) and on the CPU (the torch path): scores and histories bit for bit."""
    reference_scores, reference_history = controlled_steps()
    scores, history = controlled_steps(device="cuda")
    for step, (ours, reference) in enumerate(zip(scores, reference_scores)):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0, msg=f"step {step}")
    for name in history:
        assert torch.equal(history[name], reference_history[name]), name


def test_entry_pool_holds_each_live_rows_entries_through_joins_leaves_and_rebuilds():
    """Rows joining and leaving in random order (some with no entries, some rejoining): after every change the
    entries that do not point at the dead row are exactly the live rows' ones, the entries in use fit the pool,
    and the pool is never larger than twice the most entries ever live at once (it rebuilds at twice the live
    ones)."""
    generator = np.random.default_rng(5)
    pool = _EntryPool(torch.device("cpu"), 99, (torch.int64, torch.float32))
    expected: dict[int, set] = {}
    peak = 0
    for _ in range(300):
        row = int(generator.integers(0, 12))
        pool.remove(row)
        expected.pop(row, None)
        if generator.random() < 0.6:  # the row joins (again), else it only left
            count = int(generator.integers(0, 6))
            tokens = generator.choice(1000, count, replace=False).astype(np.int64)
            values = generator.standard_normal(count).astype(np.float32)
            pool.add(row, (tokens, values))
            expected[row] = {(row, int(t), float(v)) for t, v in zip(tokens, values)}
        entries = pool.tensors()
        held = set() if entries is None else {
            (int(r), int(t), float(v)) for r, t, v in zip(*entries) if int(r) != 99}
        assert held == set().union(*expected.values())
        peak = max(peak, len(held))
        if pool.columns:
            assert pool.end <= len(pool.columns[0]) <= 2 * peak
