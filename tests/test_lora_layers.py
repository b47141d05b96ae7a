"""Adapters on nanovllm's layers (core/lora/layers.py) against PEFT, fp32 on the CPU.

Tiny random Llama (with biases), Qwen3 and Phi-3 models (Phi-3: the family whose checkpoints, and adapters, name the packed
qkv_proj and gate_up_proj) get PEFT adapters with random, non-zero A and B, saved by PEFT. One projection's
output is compared with PEFT's layers under each adapter; whole forwards of a batch mixing rows of two adapters
and of the base model (one prefill of every prompt, then decode steps of one token per row) with each row's
PEFT-merged model (`merge_and_unload`), through the torch reference and through the Triton kernels (in the
interpreter). Tensor parallelism: each rank's shard of the adapter, through the layers' own split, adds up to
the single-rank result."""
import os

import pytest
import torch
from conftest import ARCH_CONFIGS, TINY_SHAPE, save_random_hf_model
from reference import load_hf_model

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("peft")

from nanovllm.attention import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend
from nanovllm.loaders import load_safetensors_weights
from nanovllm.lora import LoRALayers, load_adapter
from nanovllm.models.registry import model_class_for

MAX_RANK = 16
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# family -> (model preset or config, its two adapters' LoRA configs)
FAMILIES = {
    # biases on every projection: a column-parallel layer's is stacked with the adapters' A on the dense path
    "llama": (dict(TINY_SHAPE, model_type="llama", attention_bias=True, mlp_bias=True), [
        dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP, rank_pattern={"down_proj": 4}),
        dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "gate_proj"]),
    ]),
    "qwen3": ("tiny-qwen3", [
        dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP, alpha_pattern={"o_proj": 4}),
        dict(r=16, lora_alpha=32, target_modules=["k_proj", "up_proj", "down_proj"]),
    ]),
    "phi3": (ARCH_CONFIGS["phi3-longrope"], [
        dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        dict(r=16, lora_alpha=16, use_rslora=True, target_modules=["qkv_proj", "down_proj"]),
    ]),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """family -> (model folder, [adapter folders])."""
    from peft import LoraConfig, get_peft_model

    dirs = {}
    for family, (preset, configs) in FAMILIES.items():
        root = tmp_path_factory.mktemp(f"lora-{family}")
        model_dir = save_random_hf_model(preset, root / "model")
        adapters = []
        for i, config in enumerate(configs):
            torch.manual_seed(100 + i)
            peft_model = get_peft_model(load_hf_model(model_dir), LoraConfig(init_lora_weights=False, **config))
            peft_model.save_pretrained(root / f"adapter{i}")
            adapters.append(root / f"adapter{i}")
        dirs[family] = (model_dir, adapters)
    return dirs


def our_model(model_dir, update: str, max_loras: int = 3):
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(model_dir))
    model = model_class_for(hf_config)(hf_config).eval()
    load_safetensors_weights(model, model_dir)
    return model, LoRALayers(model, max_loras, MAX_RANK, torch.float32, update=update)


class PagedBatch:
    """Sequences in one paged KV cache (torch attention backend), stepped together: every row's new tokens in
    one forward, each token with its row's adapter slot."""

    def __init__(self, model, lora: LoRALayers, slots: list[int], max_len: int, block_size: int = 16):
        self.model, self.lora, self.slots, self.block_size = model, lora, slots, block_size
        blocks_per_row = -(-max_len // block_size)
        num_blocks = blocks_per_row * len(slots)
        for layer in model.attention_layers():
            layer.k_cache = torch.zeros(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.v_cache = torch.zeros_like(layer.k_cache)
            layer.backend = TorchAttentionBackend()
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32)
        self.tables = order.view(len(slots), blocks_per_row)  # rows' blocks interleaved in the cache
        self.lens = [0] * len(slots)

    @torch.inference_mode()
    def step(self, new_tokens: list[list[int]]) -> list[torch.Tensor]:
        """Logits of each row's new tokens."""
        positions = torch.cat([torch.arange(n, n + len(t)) for n, t in zip(self.lens, new_tokens)])
        rows = torch.cat([torch.full((len(t),), i) for i, t in enumerate(new_tokens)])
        slot_mapping = (self.tables[rows, positions // self.block_size].long() * self.block_size
                        + positions % self.block_size)
        counts = [len(t) for t in new_tokens]
        self.lens = [n + c for n, c in zip(self.lens, counts)]
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=torch.tensor([0, *torch.tensor(counts).cumsum(0)], dtype=torch.int32),
            seq_lens=torch.tensor(self.lens, dtype=torch.int32), block_tables=self.tables, max_query_len=max(counts),
            max_seq_len=max(self.lens))
        self.lora.set_step(torch.tensor(self.slots, dtype=torch.int32)[rows])
        hidden = self.model(torch.tensor([t for ts in new_tokens for t in ts]), positions, meta)
        return list(self.model.compute_logits(hidden).split(counts))


@torch.inference_mode()
def merged_logits(model_dir, adapter_dir, tokens: list[int]) -> torch.Tensor:
    """HF's model with the adapter merged into its weights by PEFT (None: the base model)."""
    from peft import PeftModel

    model = load_hf_model(model_dir, attn_implementation="eager")
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return model(input_ids=torch.tensor([tokens])).logits[0]


PROMPTS = [list(range(100, 140)), list(range(30, 47)), list(range(200, 223)), [5, 6, 7]]
# Row i runs adapter ROW_ADAPTERS[i] (None: the base model); adapter j sits in slot SLOT_OF[j].
ROW_ADAPTERS = [0, None, 1, 0]
SLOT_OF = [2, 0]
DECODED = [[11, 12], [13, 14], [15, 16], [17, 18]]  # two decode steps


@pytest.fixture(scope="module")
def merged_references(family_dirs):
    """family -> per row: (the PEFT-merged model's logits of its prompt and decoded tokens, the base model's)."""
    references = {}
    for family, (model_dir, adapter_dirs) in family_dirs.items():
        rows = []
        for row, adapter in enumerate(ROW_ADAPTERS):
            tokens = PROMPTS[row] + DECODED[row]
            base = merged_logits(model_dir, None, tokens)
            rows.append((base if adapter is None else merged_logits(model_dir, adapter_dirs[adapter], tokens), base))
        references[family] = rows
    return references


@pytest.mark.parametrize("family, path", [
    ("llama", "torch"), ("qwen3", "torch"), ("phi3", "torch"), ("qwen3", "triton"), ("llama", "dense"),
    ("qwen3", "dense"), ("phi3", "dense"),
    pytest.param("llama", "triton", marks=pytest.mark.slow), pytest.param("phi3", "triton", marks=pytest.mark.slow)])
def test_mixed_batch_logits_match_peft_merged(family, path, family_dirs, merged_references):
    model_dir, adapter_dirs = family_dirs[family]
    model, lora = our_model(model_dir, path)
    for adapter, slot in zip(adapter_dirs, SLOT_OF):
        lora.load(slot, load_adapter(adapter, MAX_RANK))
    slots = [-1 if a is None else SLOT_OF[a] for a in ROW_ADAPTERS]
    if path == "dense":  # every A under its plain base weight: the base product makes the first update product
        for layer in lora.layers.values():
            assert layer.weight_and_a is not None
            assert layer.base.weight.untyped_storage().data_ptr() == layer.lora_a.untyped_storage().data_ptr()
    batch = PagedBatch(model, lora, slots, max_len=64)
    logits = batch.step(PROMPTS)
    for step in range(2):
        for row, new in enumerate(batch.step([d[step : step + 1] for d in DECODED])):
            logits[row] = torch.cat([logits[row], new])
    for row, (expected, base) in enumerate(merged_references[family]):
        torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
        if ROW_ADAPTERS[row] is not None:  # the adapter matters: the test would see it missing or misapplied
            assert (expected - base).abs().max() > 0.05


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_packed_projection_matches_peft_layers(family, family_dirs):
    """Layer 0's q|k|v (as q, k, v under Qwen3; as one qkv_proj under Phi-3) and layer 1's down projection on
    tokens of both adapters and of the base model, against PEFT's own LoRA layers."""
    from peft import PeftModel

    model_dir, adapter_dirs = family_dirs[family]
    _, lora = our_model(model_dir, "torch")
    peft_model = PeftModel.from_pretrained(load_hf_model(model_dir), str(adapter_dirs[0]), adapter_name="a0")
    peft_model.load_adapter(str(adapter_dirs[1]), adapter_name="a1")
    for adapter, slot in zip(adapter_dirs, SLOT_OF):
        lora.load(slot, load_adapter(adapter, MAX_RANK))
    token_adapters = [1, None, 0, 0, 1, None, 1]
    lora.set_step(torch.tensor([-1 if a is None else SLOT_OF[a] for a in token_adapters], dtype=torch.int32))
    hf_layers = peft_model.base_model.model.model.layers
    attention = hf_layers[0].self_attn
    hf_qkv = [attention.qkv_proj] if family == "phi3" else [attention.q_proj, attention.k_proj, attention.v_proj]
    cases = [("model.layers.0.self_attn.qkv_proj", hf_qkv, 128), ("model.layers.1.mlp.down_proj",
                                                                    [hf_layers[1].mlp.down_proj], None)]
    with torch.inference_mode():
        for name, hf_modules, _ in cases:
            layer = lora.layers[name]
            x = torch.randn(len(token_adapters), layer.base.weight.shape[1], generator=torch.Generator().manual_seed(1))
            ours = layer(x)
            for row, adapter in enumerate(token_adapters):
                if adapter is None:
                    with peft_model.disable_adapter():
                        expected = torch.cat([m(x[row : row + 1]) for m in hf_modules], dim=-1)
                else:
                    peft_model.set_adapter(f"a{adapter}")
                    expected = torch.cat([m(x[row : row + 1]) for m in hf_modules], dim=-1)
                torch.testing.assert_close(ours[row : row + 1], expected, rtol=1e-5, atol=1e-5)


def test_reloading_a_slot_leaves_nothing_of_the_previous_adapter(family_dirs):
    """Adapter 1 (rank 16, some modules) then adapter 0 (rank 8, others) into one slot: the same slot contents
    as adapter 0 written into a fresh pool."""
    model_dir, adapter_dirs = family_dirs["llama"]
    _, reused = our_model(model_dir, "torch")
    reused.load(1, load_adapter(adapter_dirs[1], MAX_RANK))
    reused.load(1, load_adapter(adapter_dirs[0], MAX_RANK))
    _, fresh = our_model(model_dir, "torch")
    fresh.load(1, load_adapter(adapter_dirs[0], MAX_RANK))
    for name, layer in reused.layers.items():
        for buffer in ("lora_a", "lora_b", "ranks"):
            assert torch.equal(getattr(layer, buffer), getattr(fresh.layers[name], buffer)), (name, buffer)


def test_adapter_of_another_base_model_is_refused(family_dirs, tmp_path):
    """Where the model's layers cannot take the adapter's matrices: other sizes, or fewer layers."""
    import json

    from conftest import PRESETS

    adapter = family_dirs["qwen3"][1][0]  # all projections of 2 layers, hidden 128, intermediate 256
    preset = json.loads((PRESETS / "tiny-llama.json").read_text())
    _, lora = our_model(save_random_hf_model({**preset, "intermediate_size": 192}, tmp_path / "wider"), "torch")
    with pytest.raises(ValueError, match=r"layer model.layers.0.mlp.gate_up_proj: lora_A \(8, 128\) and lora_B "
                                         r"\(256, 8\) do not fit .*expected \(8, 128\) and \(192, 8\).*another base"):
        lora.load(0, load_adapter(adapter, MAX_RANK))
    _, lora = our_model(save_random_hf_model({**preset, "num_hidden_layers": 1}, tmp_path / "shallow"), "torch")
    with pytest.raises(ValueError, match=r"adapts model.layers.1.\S+, which this model has no linear layer for: "
                                         r".*another base model"):
        lora.load(0, load_adapter(adapter, MAX_RANK))


@pytest.mark.parametrize("update", ["torch", "dense"])
def test_tensor_parallel_shards_add_up_to_one_rank(update, monkeypatch):
    """q|k|v, gate|up and down of tensor-parallel size 2, each rank's layer built and loaded as that rank (its
    heads and rows of B, its columns of A for the row-parallel down): the ranks' q, k, v and gate, up columns
    side by side, and their partial down products summed, equal the single rank's layers. On the dense path each
    rank's A is stacked under its own shard of the weight (the down's partial first product summed with it)."""
    from nanovllm import distributed
    from nanovllm.kernels.lora_dense import off_slot_mask
    from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from nanovllm.loaders.weights import load_whole
    from nanovllm.lora.adapter import LoRAModule
    from nanovllm.lora.layers import LoRALinear, StepSlots

    hidden, heads, kv_heads, head_dim, inter, tokens = 32, 4, 2, 8, 48, 7
    gen = torch.Generator().manual_seed(0)
    full = {"qkv": torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=gen),
            "gate_up": torch.randn(2 * inter, hidden, generator=gen), "down": torch.randn(hidden, inter, generator=gen)}

    def module(rank, out, inp):
        return LoRAModule(torch.randn(rank, inp, generator=gen), torch.randn(out, rank, generator=gen), 0.5 + rank / 8)

    adapters = {"qkv": {"q": module(4, heads * head_dim, hidden), "k": module(8, kv_heads * head_dim, hidden),
                        "v": module(2, kv_heads * head_dim, hidden)},
                "gate_up": {0: module(8, inter, hidden), 1: module(3, inter, hidden)},
                "down": {None: module(5, hidden, inter)}}
    x, x_inter = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, inter, generator=gen)
    step = StepSlots()
    step.token_slots = torch.tensor([1, -1, 1, 0, 1, -1, 1], dtype=torch.int32)
    step.off_slot = off_slot_mask(step.token_slots, torch.arange(2, dtype=torch.int32))

    def layers():
        built = {"qkv": QKVParallelLinear(hidden, head_dim, heads, kv_heads),
                 "gate_up": MergedColumnParallelLinear(hidden, [inter] * 2), "down": RowParallelLinear(inter, hidden)}
        out = {}
        for name, layer in built.items():
            load_whole(layer.weight, layer.weight_loader, full[name])
            out[name] = LoRALinear(layer, 2, MAX_RANK, torch.float32, step, update)
            assert (out[name].weight_and_a is not None) == (update == "dense")
            out[name].write_slot(1, adapters[name], name)
        return out

    def outputs(built, x_down):
        down = built["down"]
        return {"qkv": built["qkv"](x), "gate_up": built["gate_up"](x),
                "down": down.product_and_update(x_down, None)}  # before the all-reduce

    with torch.inference_mode():
        single = layers()
        one = outputs(single, x_inter)
        assert (one["qkv"] - single["qkv"].base(x)).abs().max() > 0.1  # the adapter is applied
        shards = []
        for rank in range(2):
            monkeypatch.setattr(distributed, "_group", distributed._Group(rank, 2, torch.device("cpu")))
            shards.append(outputs(layers(), x_inter[:, rank * inter // 2 : (rank + 1) * inter // 2]))
    q, kv = heads * head_dim // 2, kv_heads * head_dim // 2
    qkv = [s["qkv"].split([q, kv, kv], dim=-1) for s in shards]
    torch.testing.assert_close(torch.cat([p[i] for i in range(3) for p in qkv], dim=-1), one["qkv"])
    gate_up = [s["gate_up"].split(inter // 2, dim=-1) for s in shards]
    torch.testing.assert_close(torch.cat([p[i] for i in range(2) for p in gate_up], dim=-1), one["gate_up"])
    torch.testing.assert_close(shards[0]["down"] + shards[1]["down"], one["down"], rtol=1e-5, atol=1e-4)
