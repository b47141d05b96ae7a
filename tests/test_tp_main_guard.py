"""A tensor-parallel script without `if __name__ == "__main__":` fails at once with a message saying so, instead of
"rank 1 died: exit code 1"."""
import subprocess
import sys

SCRIPT = """
from nanovllm import LLM
llm = LLM("tiny-qwen3", load_format="dummy", tensor_parallel_size=2, max_model_len=64, num_kv_blocks=8)
print(llm.generate([[1, 2]])[0].token_ids)
"""


def run(path):
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)


def test_script_without_main_guard_gets_a_clear_message(tmp_path):
    path = tmp_path / "tp_script.py"
    path.write_text(SCRIPT)
    result = run(path)
    assert result.returncode == 1
    assert f"needs the script {path} to create its LLM under `if __name__ == \"__main__\":`" in result.stderr
    assert "died" not in result.stderr and "bootstrapping" not in result.stderr


def test_script_with_main_guard_runs(tmp_path):
    path = tmp_path / "tp_script.py"
    path.write_text("if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in SCRIPT.strip().splitlines()))
    result = run(path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("[")
