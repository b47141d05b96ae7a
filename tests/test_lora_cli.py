"""LoRA adapters in `nanovllm run`: rows naming `--lora-modules` adapters (plain `lora` field, OpenAI body.model),
their errors, admission grouped by adapter, and a job whose rows name three adapters and the base model, each
record equal to its row run alone through `LLM.generate` with that adapter (tests/test_lora_engine.py checks
that against PEFT)."""
import json
from pathlib import Path

import pytest
import torch
from reference import load_hf_model
from test_cli_run import invoke, read_records, write_jsonl

from nanovllm import LLM, LoRARequest, SamplingParams
from nanovllm_cli.admission import admission_groups
from nanovllm_cli.lora_modules import LoRAModules
from nanovllm_cli.rows import RowError, RowParser, RowRequest

pytest.importorskip("peft")

DEFAULTS = {"max_tokens": 6, "temperature": 0.0}
MODULES = LoRAModules.parse(["tone=/adapters/tone", "sql=org/sql-lora"]).with_base_names("base-model", "base")


def parse(row, lora=MODULES):
    return RowParser(DEFAULTS, 0, "line", lora=lora).parse(3, row)


def test_rows_name_their_adapter():
    assert MODULES.requests == {"tone": LoRARequest("tone", 1, "/adapters/tone"),
                                "sql": LoRARequest("sql", 2, "org/sql-lora")}
    assert parse({"prompt": "x", "lora": "sql"}).lora_request == MODULES.requests["sql"]
    assert parse({"prompt": "x"}).lora_request is None and parse({"prompt": "x", "lora": None}).lora_request is None
    chat = {"custom_id": "c", "body": {"messages": [{"role": "user", "content": "hi"}]}}
    for model, expected in (("tone", MODULES.requests["tone"]), ("base", None), ("base-model", None), (None, None)):
        body = {**chat["body"], **({"model": model} if model else {})}
        assert parse({**chat, "body": body}).lora_request == expected
    # without --lora-modules an OpenAI line's model is not looked at
    assert parse({**chat, "body": {**chat["body"], "model": "gpt-4o"}}, lora=None).lora_request is None


@pytest.mark.parametrize("row, lora, problem", [
    ({"prompt": "x", "lora": "chat"}, MODULES, "'lora' names 'chat', which is not one of the job's --lora-modules "
                                               "(tone, sql)"),
    ({"prompt": "x", "lora": 1}, MODULES, "'lora' must be the name of a --lora-modules adapter, not int"),
    ({"prompt": "x", "lora": "tone"}, None, "it has no --lora-modules"),
    ({"custom_id": "c", "body": {"prompt": "x", "model": "gpt-4o"}, "url": "/v1/completions"}, MODULES,
     "body.model 'gpt-4o' is neither the base model ('base' or 'base-model') nor one of the job's --lora-modules"),
])
def test_a_row_naming_no_adapter_of_the_job_is_an_error(row, lora, problem):
    error = parse(row, lora)
    assert isinstance(error, RowError) and problem in error.problem


@pytest.mark.parametrize("specs, message", [
    (["tone"], "give each adapter as NAME=PATH"), (["=/a"], "NAME=PATH"),
    (["a=/x", "a=/y"], "names 'a' twice")])
def test_bad_lora_modules_are_refused(specs, message):
    with pytest.raises(ValueError, match=message):
        LoRAModules.parse(specs)
    with pytest.raises(ValueError, match="'tone' is also the base model's name"):
        MODULES.with_base_names("tone")


def test_admission_groups_rows_by_adapter():
    """Rows sharing a prefix form one group per adapter: a group's followers wait for its leader's blocks, which
    only rows of the same adapter can use."""
    prompt = list(range(40))
    rows = [RowRequest(str(i), "", "token_ids", prompt, SamplingParams(), token_ids=prompt + [i], lora_request=lora)
            for i, lora in enumerate([MODULES.requests["sql"], None, MODULES.requests["tone"], None,
                                      MODULES.requests["sql"]])]
    groups = admission_groups(rows, True, 16)
    assert [[r.id for r in g.requests] for g in groups] == [["1", "3"], ["2"], ["0", "4"]]


@pytest.fixture(scope="module")
def adapters(text_model, tmp_path_factory):
    """Three PEFT adapters of the tiny text model: name -> folder."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("cli-adapters")
    configs = {"tone": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
               "sql": dict(r=4, lora_alpha=8, target_modules=["o_proj", "gate_proj", "up_proj"]),
               "chat": dict(r=16, lora_alpha=16, use_rslora=True, target_modules=["k_proj", "q_proj", "up_proj"])}
    found = {}
    for i, (name, config) in enumerate(configs.items()):
        torch.manual_seed(300 + i)
        get_peft_model(load_hf_model(text_model), LoraConfig(init_lora_weights=False, **config)).save_pretrained(
            root / name)
        found[name] = str(root / name)
    return found


PROMPTS = ["The capital of France is", "Once upon a time", "SELECT * FROM", "Roses are red,"]
ROWS = [{"id": f"{lora or 'base'}-{i}", "prompt": prompt, **({"lora": lora} if lora else {})}
        for i, prompt in enumerate(PROMPTS) for lora in ("tone", "sql", "chat", None)]


def test_run_rows_of_three_adapters_and_the_base_model(text_model, adapters, tmp_path):
    """Two adapter slots for three adapters: rows wait for slots; every record is its row alone."""
    path = write_jsonl(tmp_path / "in.jsonl", ROWS)
    modules = [arg for name, folder in adapters.items() for arg in ("--lora-modules", f"{name}={folder}")]
    result = invoke("run", path, "-o", tmp_path / "out.jsonl", "--model", text_model, "--max-model-len", 128,
                    "--max-tokens", 6, "--max-loras", 2, "--include-token-ids", "-q", *modules)
    assert result.exit_code == 0, result.stderr
    records = read_records(tmp_path / "out.jsonl")
    assert set(records) == {row["id"] for row in ROWS}
    requests = {name: LoRARequest(name, i + 1, folder) for i, (name, folder) in enumerate(adapters.items())}
    with LLM(text_model, max_model_len=128, enable_lora=True) as llm:
        for row in ROWS:
            [alone] = llm.generate(row["prompt"], SamplingParams(temperature=0, max_tokens=6),
                                   lora_request=requests.get(row.get("lora")))
            assert records[row["id"]]["token_ids"] == alone.token_ids, row["id"]
    for lora in adapters:  # each adapter changes some row's output
        assert any(records[f"{lora}-{i}"]["token_ids"] != records[f"base-{i}"]["token_ids"] for i in range(4))


def test_openai_lines_name_adapters_by_model(text_model, adapters, tmp_path):
    lines = [{"custom_id": f"{model}-{i}", "url": "/v1/completions", "body": {"prompt": prompt, "model": model}}
             for i, prompt in enumerate(PROMPTS[:2]) for model in ("tone", text_model, "unknown")]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    result = invoke("run", path, "-o", tmp_path / "out.jsonl", "--model", text_model, "--max-model-len", 128,
                    "--max-tokens", 6, "--temperature", 0, "--include-token-ids", "-q",
                    "--lora-modules", f"tone={adapters['tone']}")
    assert result.exit_code == 1, result.stderr  # the unknown model's rows
    records = read_records(tmp_path / "out.jsonl", "custom_id")
    for i in range(2):
        tone, base = records[f"tone-{i}"]["response"]["body"], records[f"{text_model}-{i}"]["response"]["body"]
        assert (tone["model"], base["model"]) == ("tone", Path(text_model).name)  # the adapter's, the engine's
        assert "is neither the base model" in records[f"unknown-{i}"]["error"]["message"]
    assert any(records[f"tone-{i}"]["nanovllm"]["choices"][0]["token_ids"]  # greedy: the adapter made them differ
               != records[f"{text_model}-{i}"]["nanovllm"]["choices"][0]["token_ids"] for i in range(2))


@pytest.mark.parametrize("family", ["tiny-qwen3", "phi3"])
def test_random_adapters_are_peft_adapters_of_the_model(family, tmp_path):
    """What `bench --lora` runs: PEFT loads it onto the model, and the engine's rows under it match PEFT."""
    from conftest import ARCH_CONFIGS, save_random_hf_model
    from peft import PeftModel
    from reference import hf_greedy

    from nanovllm import save_random_lora_adapter

    model_dir = save_random_hf_model(ARCH_CONFIGS["phi3-longrope"] if family == "phi3" else family, tmp_path / "m")
    prompts = [list(range(10, 30)), [5, 6, 7]]
    with LLM(str(model_dir), enable_lora=True, max_lora_rank=8, max_model_len=64, num_kv_blocks=16) as llm:
        adapter = save_random_lora_adapter(llm.hf_config, tmp_path / "adapter", rank=8, seed=1, dtype=torch.float32)
        num_layers = llm.hf_config.num_hidden_layers
        ours = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            lora_request=LoRARequest("random", 1, adapter))
    peft = PeftModel.from_pretrained(load_hf_model(model_dir, attn_implementation="eager"), adapter)
    modules = peft.peft_config["default"].target_modules
    assert modules == ({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if family == "phi3" else
                       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    assert len(peft.targeted_module_names) == len(modules) * num_layers
    assert [o.token_ids for o in ours] == hf_greedy(peft.merge_and_unload(), prompts, 5)


def test_bench_lora_against_the_base_model_on_cpu():
    args = ["bench", "--model", "tiny-qwen3", "--load-format", "dummy", "--max-model-len", "256", "--num-seqs", "6",
            "--input-len-range", "5", "40", "--output-len-range", "3", "12", "--lora", "3", "--lora-rank", "8",
            "--max-loras", "2", "--max-num-seqs", "4", "--json"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["lora"] == {"adapters": 3, "rank": 8, "max_loras": 2}
    pair = report["modes"]["sync"]
    assert pair["lora"]["requests"] == pair["base"]["requests"] == 6 and pair["lora"]["rows_failed"] == 0
    assert pair["lora"]["output_tokens"] == pair["base"]["output_tokens"]
    assert pair["lora_over_base"] == pair["lora"]["output_tok_s"] / pair["base"]["output_tok_s"]
    bad = invoke(*args[:-1], "--data-parallel-size", "2")
    assert bad.exit_code == 2 and "--lora N needs" in bad.output
