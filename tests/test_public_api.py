"""The CLI uses nothing of the engine but its public surface: the names in `nanovllm.__all__` and the public
members of `LLM`, so the engine's parts (runner, block manager, scheduler) can change without breaking it."""
import ast
from pathlib import Path

import nanovllm
import nanovllm_cli
from nanovllm import LLM

CLI_DIR = Path(nanovllm_cli.__file__).parent
# Instance attributes of LLM that belong to its API (its methods and properties are found on the class).
PUBLIC_LLM_ATTRIBUTES = {"prompts", "tokenizer", "hf_config"}


def cli_modules() -> list[tuple[str, ast.Module]]:
    return [(path.name, ast.parse(path.read_text(), str(path))) for path in sorted(CLI_DIR.glob("*.py"))]


def engine_imports(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every import of `nanovllm` or a submodule, at any depth (functions included)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names
                      if alias.name.split(".")[0] == "nanovllm"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "nanovllm":
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return found


def private_imports(tree: ast.Module) -> list[str]:
    public = set(nanovllm.__all__)
    bad = []
    for line, module, names in engine_imports(tree):
        if module != "nanovllm":
            bad.append(f"line {line}: {module} (a submodule)")
        else:
            bad += [f"line {line}: nanovllm.{name}" for name in names if name not in public]
    return bad


def llm_attributes(tree: ast.Module) -> list[tuple[int, str]]:
    """Attributes read on `llm` or `self.llm`."""
    def is_llm(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id == "llm") or (
            isinstance(node, ast.Attribute) and node.attr == "llm" and isinstance(node.value, ast.Name)
            and node.value.id == "self")

    return [(node.lineno, node.attr) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_llm(node.value)]


def test_cli_imports_only_public_names():
    bad = {name: found for name, tree in cli_modules() if (found := private_imports(tree))}
    assert not bad, f"nanovllm_cli imports engine internals: {bad}"


def test_cli_reads_only_public_llm_members():
    public = {name for name in dir(LLM) if not name.startswith("_")} | PUBLIC_LLM_ATTRIBUTES
    bad = {name: [f"line {line}: llm.{attr}" for line, attr in attrs if attr not in public]
           for name, tree in cli_modules() if (attrs := llm_attributes(tree))}
    assert not any(bad.values()), f"nanovllm_cli reads LLM internals: {bad}"


def test_the_checks_catch_internals():
    """The walkers see imports inside functions and attribute reads through `self.llm`."""
    tree = ast.parse("import nanovllm.engine\nfrom nanovllm import LLM, Sequence\n"
                     "def f(self):\n    from nanovllm.engine.block_manager import BlockManager\n"
                     "    return self.llm._runner, llm._block_manager\n")
    assert private_imports(tree) == ["line 1: nanovllm.engine (a submodule)", "line 2: nanovllm.Sequence",
                                     "line 4: nanovllm.engine.block_manager (a submodule)"]
    assert sorted(attr for _, attr in llm_attributes(tree)) == ["_block_manager", "_runner"]


def test_public_names_exist_and_engine_info_is_complete():
    """Every name of `__all__` exists, and `LLM.info` / `LLM.report()` hold what the CLI reads."""
    assert all(hasattr(nanovllm, name) for name in nanovllm.__all__)
    with LLM("tiny-qwen3", load_format="dummy", max_model_len=128, max_num_seqs=6, num_kv_blocks=40,
             block_size=8) as llm:
        info = llm.info
        report = llm.report()
    assert (info.model, info.device, info.dtype, info.vocab_size) == ("tiny-qwen3", "cpu", "float32", 512)
    assert (info.block_size, info.num_kv_blocks, info.max_num_seqs, info.max_model_len) == (8, 40, 6, 128)
    assert info.decode_batch_sizes == (1, 2, 4, 6) and not info.cuda_graphs and info.tensor_parallel_size == 1
    assert info.kv_block_bytes == 8 * info.costs.kv_bytes_per_token
    assert report["kv_cache"]["num_kv_blocks"] == 40 and report["steps"]["steps"] == 0
    phases = info.startup_s
    assert {"resolve", "load_weights", "worst_step", "total"} <= set(phases)
    assert 0 <= phases["resolve"] + phases["load_weights"] + phases["worst_step"] <= phases["total"]
    assert info.pooling is None and nanovllm.pooling_spec("tiny-qwen3") is None  # a generator
    assert nanovllm.pooling_spec("tiny-qwen3", task="embed").task == "embed"  # what `run --task` reads up front


def test_the_cpu_default_batch_is_256():
    with LLM("tiny-qwen3", load_format="dummy", max_model_len=128, num_kv_blocks=40) as llm:
        assert llm.info.max_num_seqs == 256
