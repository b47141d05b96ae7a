"""Multi-LoRA on a CUDA device (`pytest -m gpu`): the Triton kernels, the LoRA decode graphs, the async loop and
eager steps, in float32 against HF transformers + PEFT on the same device, on random models with three PEFT
adapters in two slots (rows wait, slots are written again). The tiny model's q|k|v takes the grouped kernels and
its other projections the dense products (kernels/lora_dense.py chooses by the pool's size next to the layer);
every projection of the wide one (hidden 1024) takes the dense products. Then a base-model-only batch on the
same engine, whose decode steps replay the graphs without LoRA."""
import json

import pytest
import torch
from conftest import PRESETS, save_random_hf_model
from reference import hf_greedy, load_hf_model

from nanovllm import LLM, LoRARequest, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("peft")

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
ADAPTERS = [
    dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"], rank_pattern={"down_proj": 4}),
    dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "gate_proj"]),
    dict(r=4, lora_alpha=8, target_modules=["o_proj", "up_proj", "down_proj"]),
]
PROMPTS = [list(range(300, 340)) + [7, 8, 9], [30, 31, 32], list(range(100, 170)), list(range(300, 340)) + [7, 8, 9],
           [9], list(range(60, 80)), list(range(300, 340)), list(range(5, 50))]
ROW_ADAPTERS = [0, None, 1, 2, 0, 2, 1, None]
WIDE = {**json.loads((PRESETS / "tiny-qwen3.json").read_text()), "hidden_size": 1024, "intermediate_size": 2048,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}


@pytest.fixture(scope="module", params=["tiny-qwen3", "wide-qwen3"])
def case(request, tmp_path_factory):
    """(model folder, LoRARequests, per row its HF + PEFT fp32 greedy tokens on the device)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    root = tmp_path_factory.mktemp(f"gpu-lora-{request.param}")
    model_dir = save_random_hf_model(WIDE if request.param == "wide-qwen3" else "tiny-qwen3", root / "model")
    requests = []
    for i, config in enumerate(ADAPTERS):
        torch.manual_seed(400 + i)
        get_peft_model(load_hf_model(model_dir), LoraConfig(init_lora_weights=False, **config)).save_pretrained(
            root / f"adapter{i}")
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(root / f"adapter{i}")))
    expected = hf_greedy(load_hf_model(model_dir, device="cuda"), PROMPTS, MAX_NEW)
    for i, request in enumerate(requests):
        merged = PeftModel.from_pretrained(load_hf_model(model_dir), request.lora_path).merge_and_unload().to("cuda")
        rows = [row for row, adapter in enumerate(ROW_ADAPTERS) if adapter == i]
        for row, tokens in zip(rows, hf_greedy(merged, [PROMPTS[row] for row in rows], MAX_NEW)):
            expected[row] = tokens
    return model_dir, requests, expected


@pytest.mark.parametrize("variant", [{}, {"async_scheduling": True}, {"enforce_eager": True}],
                         ids=["graphs", "graphs-async", "eager"])
def test_mixed_adapters_match_peft_fp32(case, variant):
    model_dir, requests, expected = case
    with LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=2, max_model_len=256,
             max_num_batched_tokens=64, gpu_memory_utilization=0.3, **variant) as llm:
        runner = llm._runner
        assert runner.lora.updates == ({"triton", "dense"} if "tiny" in str(model_dir) else {"dense"})
        assert (runner.lora_graphs is not None) == ("enforce_eager" not in variant)
        outputs = llm.generate(PROMPTS, GREEDY, lora_request=[None if a is None else requests[a]
                                                              for a in ROW_ADAPTERS])
        assert [o.token_ids for o in outputs] == expected
        base_rows = [row for row, adapter in enumerate(ROW_ADAPTERS) if adapter is None]
        base = llm.generate([PROMPTS[row] for row in base_rows], GREEDY)  # no adapter in any step
        assert [o.token_ids for o in base] == [expected[row] for row in base_rows]


@pytest.mark.parametrize("tokens", [1, 5, 64, 200])
def test_stacked_layers_with_biases_in_bf16_match_the_torch_path(tokens):
    """The dense path's one product over the weight with every A stacked under it, in bf16, the column-parallel
    layers with biases (the skinny kernel up to 64 rows, cuBLAS above), against the torch path on copies of the
    same layers and adapters; the strided outputs then through SiLU-and-mul and RMSNorm as a decoder layer runs
    them."""
    from nanovllm.kernels.fused_ops import rms_norm, silu_and_mul
    from nanovllm.kernels.lora_dense import off_slot_mask
    from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from nanovllm.lora.adapter import LoRAModule
    from nanovllm.lora.layers import LoRALinear, StepSlots

    hidden, heads, kv_heads, head_dim, inter, slots, rank = 256, 4, 2, 64, 512, 4, 16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=0.05):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    built = {"qkv": lambda: QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True, fused=True),
             "gate_up": lambda: MergedColumnParallelLinear(hidden, [inter] * 2, bias=True, fused=True),
             "down": lambda: RowParallelLinear(inter, hidden, fused=True)}  # its bias would be added after
    step = StepSlots()
    step.token_slots = (torch.arange(tokens, device="cuda", dtype=torch.int32) % (slots + 1)) - 1
    step.off_slot = off_slot_mask(step.token_slots, torch.arange(slots, device="cuda", dtype=torch.int32))
    x = {"qkv": randn(tokens, hidden, scale=1.0), "gate_up": randn(tokens, hidden, scale=1.0),
         "down": randn(tokens, inter, scale=1.0)}
    outputs = {}
    with torch.device("cuda"), torch.inference_mode():
        for name, make in built.items():
            layers = {update: make().to(torch.bfloat16) for update in ("dense", "torch")}
            weight, bias = randn(*layers["dense"].weight.shape), randn(layers["dense"].weight.shape[0])
            modules = {None: LoRAModule(randn(rank, weight.shape[1]), randn(weight.shape[0], rank), 2.0)}
            for update, layer in layers.items():
                layer.weight.copy_(weight)
                if layer.bias is not None:
                    layer.bias.copy_(bias)
                wrapped = LoRALinear(layer, slots, rank, torch.bfloat16, step, update)
                for slot in range(slots):
                    wrapped.write_slot(slot, modules if slot % 2 else {}, name)
                outputs[name, update] = wrapped(x[name])
            assert outputs[name, "dense"].stride(0) > outputs[name, "dense"].shape[1]  # a view of the stacked rows
            expected = outputs[name, "torch"].float()
            assert (outputs[name, "dense"].float() - expected).abs().max() <= 0.02 * expected.abs().max()
        for update in ("dense", "torch"):
            outputs["act", update] = silu_and_mul(outputs["gate_up", update]).float()
            outputs["norm", update] = rms_norm(outputs["down", update], torch.ones(hidden, device="cuda",
                                               dtype=torch.bfloat16), 1e-6).float()
    for name in ("act", "norm"):
        expected = outputs[name, "torch"]
        assert (outputs[name, "dense"] - expected).abs().max() <= 0.02 * expected.abs().max()
