"""Multi-LoRA through the whole engine (LLM.generate), fp32 on the CPU, against HF transformers + PEFT.

Tiny random Llama, Qwen3 and Phi-3 models (Phi-3: the family whose checkpoints, and adapters, name the packed
qkv_proj and gate_up_proj) get three PEFT adapters each (random, non-zero A and B, saved by PEFT). One batch
mixes rows of the three adapters and of the base model, with two adapter slots, so rows wait for a slot and
adapters are evicted and written again; each row's greedy tokens must be those of HF's model with that row's
adapter merged by PEFT, on the sync and the async loop, and under tensor parallelism (gloo) those of one rank.
The prefix cache is keyed by adapter: rows of one prompt under different adapters never share KV blocks."""
import pytest
import torch
from conftest import ARCH_CONFIGS, save_random_hf_model
from helpers import GraphSizes, make_seq
from reference import hf_greedy, load_hf_model

from nanovllm import LLM, LoRARequest, SamplingParams, save_random_lora_adapter
from nanovllm.engine.block_manager import BlockManager
from nanovllm.lora.manager import LoRAManager

pytest.importorskip("peft")

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# family -> (model preset or config, its three adapters' LoRA configs)
FAMILIES = {
    "llama": ("tiny-llama", [
        dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP, rank_pattern={"down_proj": 4}),
        dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "gate_proj"]),
        dict(r=4, lora_alpha=8, target_modules=["o_proj", "up_proj", "down_proj"]),
    ]),
    "qwen3": ("tiny-qwen3", [
        dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP, alpha_pattern={"o_proj": 4}),
        dict(r=16, lora_alpha=32, target_modules=["k_proj", "up_proj", "down_proj"]),
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj"]),
    ]),
    "phi3": (ARCH_CONFIGS["phi3-longrope"], [
        dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        dict(r=16, lora_alpha=16, use_rslora=True, target_modules=["qkv_proj", "down_proj"]),
        dict(r=4, lora_alpha=8, target_modules=["gate_up_proj"]),
    ]),
}
SHARED = list(range(300, 340))  # a prefix of two and a half 16-token blocks
# (prompt, adapter index or None for the base model); the shared prompt runs under every adapter and the base.
ROWS = [
    (SHARED + [7, 8, 9], 0), ([30, 31, 32], None), (list(range(100, 150)), 1), (SHARED + [7, 8, 9], 2),
    ([9], 0), (SHARED + [7, 8, 9], None), (SHARED + [7, 8, 9], 1), (list(range(60, 80)), 2),
]
ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128, num_kv_blocks=64,
              max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (model folder, [LoRARequest per adapter], per row its HF + PEFT greedy tokens, per row the base
    model's greedy tokens)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    found = {}
    for family, (preset, configs) in FAMILIES.items():
        root = tmp_path_factory.mktemp(f"lora-engine-{family}")
        model_dir = save_random_hf_model(preset, root / "model")
        requests = []
        for i, config in enumerate(configs):
            torch.manual_seed(200 + i)
            get_peft_model(load_hf_model(model_dir), LoraConfig(init_lora_weights=False, **config)).save_pretrained(
                root / f"adapter{i}")
            requests.append(LoRARequest(f"{family}-{i}", i + 1, str(root / f"adapter{i}")))
        prompts = [prompt for prompt, _ in ROWS]
        hf = load_hf_model(model_dir, attn_implementation="eager")
        base = hf_greedy(hf, prompts, MAX_NEW)
        expected = list(base)
        for i, request in enumerate(requests):
            merged = PeftModel.from_pretrained(load_hf_model(model_dir, attn_implementation="eager"),
                                               request.lora_path).merge_and_unload()
            rows = [row for row, (_, adapter) in enumerate(ROWS) if adapter == i]
            for row, tokens in zip(rows, hf_greedy(merged, [prompts[row] for row in rows], MAX_NEW)):
                expected[row] = tokens
        found[family] = (model_dir, requests, expected, base)
    return found


def row_requests(requests):
    return [None if adapter is None else requests[adapter] for _, adapter in ROWS]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_adapters_match_peft(family, async_scheduling, families):
    model_dir, requests, expected, base = families[family]
    with LLM(str(model_dir), async_scheduling=async_scheduling, **ENGINE) as llm:
        outputs = llm.generate([prompt for prompt, _ in ROWS], GREEDY, lora_request=row_requests(requests))
        pool = llm._lora.pool
        assert pool.num_evictions > 0  # three adapters in two slots: rows waited, slots were written again
    assert [o.error for o in outputs] == [None] * len(ROWS)
    assert [o.token_ids for o in outputs] == expected
    for adapter in range(len(requests)):  # each adapter changes its rows' tokens: a missing one would show
        assert any(expected[row] != base[row] for row, (_, a) in enumerate(ROWS) if a == adapter)


def test_tensor_parallel_equals_one_rank(families):
    model_dir, requests, expected, _ = families["qwen3"]
    with LLM(str(model_dir), tensor_parallel_size=2, **ENGINE) as llm:
        outputs = llm.generate([prompt for prompt, _ in ROWS], GREEDY, lora_request=row_requests(requests))
    assert [o.token_ids for o in outputs] == expected


def test_prefix_cache_is_keyed_by_adapter(families):
    """One prompt under adapter 0, then under adapter 1, the base model and adapter 0 again: only the last
    finds cached blocks, and every output is its adapter's."""
    model_dir, requests, expected, _ = families["llama"]
    prompt = SHARED + [7, 8, 9]
    row_of = {adapter: row for row, (p, adapter) in enumerate(ROWS) if p == prompt}
    cached = []
    with LLM(str(model_dir), **ENGINE) as llm:
        for adapter in (0, 1, None, 0):
            [out] = llm.generate([prompt], GREEDY, lora_request=None if adapter is None else requests[adapter])
            assert out.token_ids == expected[row_of[adapter]]
            cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 0, 32]  # two full blocks of the 43-token prompt


def test_block_hashes_start_from_the_adapter():
    """The block manager on its own: a computed prompt's blocks serve the same prompt under the same adapter
    only."""
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    tokens = list(range(40))
    manager = BlockManager(num_blocks=16, block_size=16)
    first = make_seq(tokens)
    first.lora_request = a
    assert manager.admit(first, 64)
    first.num_computed_tokens = len(tokens)
    manager.commit_computed_blocks(first)
    for lora, hits in ((a, 2), (b, 0), (None, 0)):
        seq = make_seq(tokens)
        seq.lora_request = lora
        assert len(manager.match_prefix(seq)) == hits
    base = make_seq(tokens)
    assert manager.admit(base, 64) and base.num_computed_tokens == 0
    base.num_computed_tokens = len(tokens)
    manager.commit_computed_blocks(base)
    seq = make_seq(tokens)
    assert len(manager.match_prefix(seq)) == 2
    seq.lora_request = b
    assert manager.match_prefix(seq) == []


def test_request_errors_are_per_row(families, tmp_path):
    model_dir, requests, expected, _ = families["qwen3"]
    prompts = [prompt for prompt, _ in ROWS[:3]]
    (tmp_path / "empty").mkdir()
    bad = [LoRARequest("missing", 7, str(tmp_path / "empty")), None,
           LoRARequest("clash", requests[1].lora_int_id, requests[0].lora_path)]
    with LLM(str(model_dir), **ENGINE) as llm:
        llm.generate(prompts[2:], GREEDY, lora_request=requests[1])  # id 2 now names adapter 1
        outputs = llm.generate(prompts, GREEDY, lora_request=bad)
    assert "LoRA adapter 'missing'" in outputs[0].error and "adapter_config.json" in outputs[0].error
    assert outputs[1].error is None and outputs[1].token_ids == expected[1]
    assert "lora_int_id 2 names adapter 'qwen3-1'" in outputs[2].error
    with LLM(str(model_dir), max_model_len=128, num_kv_blocks=32) as llm:
        [out] = llm.generate(prompts[:1], GREEDY, lora_request=requests[0])
    assert "enable_lora=True" in out.error


def test_fp8_weights_with_lora_are_refused():
    with pytest.raises(ValueError, match="enable_lora with FP8 weights"):
        LLM("tiny-qwen3", load_format="dummy", quantization="fp8", enable_lora=True, max_model_len=64,
            num_kv_blocks=16)


def test_manager_hands_slot_writes_to_the_next_step_and_forgets_them_after_a_failure():
    """One slot, two adapters: rows of the resident adapter share its slot and its one write; the other
    adapter's row waits until the last of them is released; after a failed step every adapter is written
    again before use."""
    manager = LoRAManager(1, 16, check=lambda adapter: None)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    rows = [make_seq([1]), make_seq([2]), make_seq([3])]
    for seq, lora in zip(rows, (a, a, b)):
        seq.lora_request = lora
    first, second, other = rows
    manager.admit(first)
    manager.admit(second)
    assert (first.lora_slot, second.lora_slot) == (0, 0) and manager.take_loads() == [(0, a)]
    assert not manager.can_admit(other)
    manager.release(first)
    assert not manager.can_admit(other) and first.lora_slot == -1
    manager.release(second)
    assert manager.can_admit(other)
    manager.admit(other)
    assert manager.take_loads() == [(0, b)] and manager.take_loads() == []
    manager.abort([other])
    assert other.lora_slot == -1 and manager.can_admit(first)
    manager.admit(first)
    assert manager.take_loads() == [(0, a)]


def test_decode_graph_step_carries_each_rows_slot_and_padding(tmp_path):
    """A decode step padded to a graph size: the adapter row's slot, -1 for the base row and the padding; a step
    of base rows only runs without LoRA."""
    with LLM("tiny-qwen3", load_format="dummy", enable_lora=True, max_lora_rank=8, max_model_len=128,
             num_kv_blocks=32) as llm:
        adapter = LoRARequest("a", 1, save_random_lora_adapter(llm.hf_config, tmp_path / "a", 8))
        llm.add_request(None, GREEDY, prompt_token_ids=[5, 6, 7], lora_request=adapter)
        llm.add_request(None, GREEDY, prompt_token_ids=[8, 9])
        llm.step()  # both prefills
        runner = llm._runner
        runner.graphs = GraphSizes()
        inputs = runner.prepare(llm._scheduler.schedule())
        assert inputs.graph_size == 4 and inputs.lora_active and inputs.lora_slots.tolist() == [0, -1, -1, -1]
    with LLM("tiny-qwen3", load_format="dummy", enable_lora=True, max_model_len=128, num_kv_blocks=32) as llm:
        llm.add_request(None, GREEDY, prompt_token_ids=[8, 9])
        assert not llm._runner.prepare(llm._scheduler.schedule()).lora_active
