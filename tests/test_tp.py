"""Tensor parallelism on the CPU (gloo): sharded layers against unsharded math, TP=N greedy outputs equal to TP=1
on both step loops, the step packing, the workers' life cycle and failures, and impossible splits."""
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
import torch.nn.functional as F
from helpers import GraphSizes, process_alive
from reference import hf_greedy, load_hf_model
from test_engine_hf import ARCH_PROMPTS, CHATS, MAX_NEW, TINY_PROMPTS

from nanovllm import LLM, SamplingParams
from nanovllm.distributed import before_tp_group_destroyed, destroy_tp_group, init_tp_group, min_over_ranks
from nanovllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from nanovllm.loaders import resolve_model
from nanovllm.runner.inputs import StepInputs
from nanovllm.runner.tp_step import pack, unpack
from nanovllm.runner.tp_workers import TPWorkerError, check_tp_split

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# A 32-token budget chunks the long prompts; the shared 48-token prefix of TINY_PROMPTS hits the prefix cache.
TINY_ENGINE = {"max_model_len": 256, "num_kv_blocks": 128, "max_num_batched_tokens": 32}


# ---- sharded layers against unsharded math, in real gloo groups ------------------------------------------------

def _check_layers(rank: int, world: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    init_tp_group(rank, world, store, torch.device("cpu"))
    try:
        torch.manual_seed(0)  # every rank draws the same full tensors
        x = torch.randn(5, 12)

        def gathered(local: torch.Tensor) -> torch.Tensor:
            shards = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(shards, local)
            return torch.cat(shards, dim=-1)

        w, b = torch.randn(12, 12), torch.randn(12)
        column = ColumnParallelLinear(12, 12, bias=True)
        column.weight_loader(column.weight, w)
        column.weight_loader(column.bias, b)
        torch.testing.assert_close(gathered(column(x)), F.linear(x, w, b))

        w, b = torch.randn(8, 12), torch.randn(8)
        row = RowParallelLinear(12, 8, bias=True)
        row.weight_loader(row.weight, w)
        row.weight_loader(row.bias, b)
        shard = 12 // world
        torch.testing.assert_close(row(x[:, rank * shard:(rank + 1) * shard]), F.linear(x, w, b))

        head_dim, heads, kv_heads = 2, 12, 6
        full = {"q": torch.randn(heads * head_dim, 12), "k": torch.randn(kv_heads * head_dim, 12),
                "v": torch.randn(kv_heads * head_dim, 12)}
        bias = {part: torch.randn(len(t)) for part, t in full.items()}
        qkv = QKVParallelLinear(12, head_dim, heads, kv_heads, bias=True)
        for part, weight in full.items():
            qkv.weight_loader(qkv.weight, weight, part)
            qkv.weight_loader(qkv.bias, bias[part], part)
        local = qkv(x).split([heads * head_dim // world, kv_heads * head_dim // world, kv_heads * head_dim // world],
                             dim=-1)
        for part, out in zip(full, local):
            torch.testing.assert_close(gathered(out), F.linear(x, full[part], bias[part]))

        gate, up = torch.randn(18, 12), torch.randn(18, 12)
        merged = MergedColumnParallelLinear(12, [18, 18])
        merged.weight_loader(merged.weight, gate, 0)
        merged.weight_loader(merged.weight, up, 1)
        local_gate, local_up = merged(x).chunk(2, dim=-1)
        torch.testing.assert_close(gathered(local_gate), x @ gate.T)
        torch.testing.assert_close(gathered(local_up), x @ up.T)

        vocab, table = 11, torch.randn(11, 12)  # 11 rows split unevenly: the last shard is padded
        embedding = VocabParallelEmbedding(vocab, 12)
        embedding.weight_loader(embedding.weight, table)
        ids = torch.tensor([0, 3, 4, 5, 7, 10, 10, 1])
        torch.testing.assert_close(embedding(ids), F.embedding(ids, table))

        head = ParallelLMHead(vocab, 12)
        head.weight_loader(head.weight, table)
        logits = head(x)
        if rank == 0:
            torch.testing.assert_close(logits, x @ table.T)
        else:
            assert logits is None

        assert min_over_ranks(10 + rank) == 10  # the KV-cache budget every rank can hold
    finally:
        destroy_tp_group()


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_layers_match_unsharded_math(world):
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    torch.multiprocessing.spawn(_check_layers, args=(world, store.port), nprocs=world)


# ---- whole engine: TP=N greedy outputs equal TP=1 -------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_tp1(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), **TINY_ENGINE)
    return [o.token_ids for o in llm.generate(TINY_PROMPTS, GREEDY)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_tp2_equals_tp1_tiny_qwen3(async_scheduling, tiny_model_dirs, tiny_tp1, monkeypatch):
    """Also: the steps start no thread (a thread started and joined around each step cost up to 0.1 s a step)."""
    with LLM(str(tiny_model_dirs["qwen3"]), tensor_parallel_size=2, async_scheduling=async_scheduling,
             **TINY_ENGINE) as llm:
        started = []
        start = threading.Thread.start
        monkeypatch.setattr(threading.Thread, "start", lambda thread: (started.append(thread.name), start(thread)))
        first = llm.generate(TINY_PROMPTS, GREEDY)
        second = llm.generate(TINY_PROMPTS, GREEDY)  # served largely from the prefix cache
        monkeypatch.undo()
        pids = llm._workers.pids
    assert started == []
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == tiny_tp1
    assert second[2].num_cached_tokens == 64
    assert not any(process_alive(pid) for pid in pids) and not dist.is_initialized()


@pytest.mark.parametrize("arch", ["phi3-longrope", "gemma2"])
def test_tp2_architectures_match_hf(arch, arch_model_dirs):
    """Phi-3's stacked q|k|v and gate|up tensors cut into parts, then each part split across the ranks; Gemma 2's
    windows and soft-caps on each rank's heads."""
    directory = arch_model_dirs[arch]
    reference = hf_greedy(load_hf_model(directory, attn_implementation="eager"), ARCH_PROMPTS, MAX_NEW)
    with LLM(str(directory), tensor_parallel_size=2, max_model_len=128, num_kv_blocks=64,
             max_num_batched_tokens=16) as llm:
        outputs = llm.generate(ARCH_PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outputs] == reference


def test_tp2_dummy_weights_equal_tp1():
    """Each rank draws the full random tensors and keeps its shard: TP=2 runs the same model as TP=1."""
    prompts = [[1, 2, 3, 4, 5] * 7, [30, 31, 32], list(range(100, 170))]
    engine = {"max_model_len": 256, "cpu_kv_cache_bytes": 1 << 22}  # the KV budget is agreed over the ranks
    single = LLM("tiny-qwen3", **engine)
    reference = single.generate(prompts, GREEDY)
    with LLM("tiny-qwen3", tensor_parallel_size=2, **engine) as llm:
        outputs = llm.generate(prompts, GREEDY)
        assert llm._runner.num_kv_blocks == 2 * single._runner.num_kv_blocks  # each rank holds half the KV heads
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]


def test_tp3_equals_tp1_smollm():
    """SmolLM2-135M: 9 heads and 3 KV heads split three ways; its 49152-token vocabulary too."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    single = LLM(None, max_model_len=512, num_kv_blocks=32)
    reference = [o.token_ids for o in single.chat(CHATS[:2], params)]
    with LLM(None, max_model_len=512, num_kv_blocks=32, tensor_parallel_size=3) as llm:
        assert [o.token_ids for o in llm.chat(CHATS[:2], params)] == reference
        # A TP=1 engine built before keeps its unsharded layers while a TP group is alive in the process.
        assert [o.token_ids for o in single.chat(CHATS[:1], params)] == reference[:1]


def test_releases_run_before_an_orderly_group_teardown_only():
    """CUDA graphs holding collectives register a release: it must run while the group still exists (NCCL's
    teardown would otherwise wait on their collectives), and not on an abort, whose peers may be stuck."""
    calls = []
    for abort in (False, True):
        init_tp_group(0, 1, dist.HashStore(), torch.device("cpu"))
        before_tp_group_destroyed(lambda abort=abort: calls.append((abort, dist.is_initialized())))
        destroy_tp_group(abort=abort)
    assert calls == [(False, True)] and not dist.is_initialized()
    init_tp_group(0, 1, dist.HashStore(), torch.device("cpu"))
    destroy_tp_group()  # the aborted group's release was dropped with it
    assert calls == [(False, True)]


# ---- the step's trip to the workers ----------------------------------------------------------------------------

def test_step_packing_round_trip():
    """A padded decode step, with seeded sampling: every field arrives with its dtype, shape and value."""
    rank0 = LLM("tiny-qwen3", max_model_len=256, num_kv_blocks=32)
    for prompt in ([1, 2, 3, 4, 5] * 5, [7, 8], [9] * 20):
        rank0.add_request(prompt, SamplingParams(temperature=0.7, top_k=5, max_tokens=4, seed=1))
    rank0.step()  # the prefills
    rank0._runner.graphs = GraphSizes()
    batch = rank0._scheduler.schedule()
    assert batch.num_tokens == len(batch)  # a pure decode step
    sent = rank0._runner.prepare(batch)
    assert sent.graph_size == 4 and len(sent.input_ids) == 4 and sent.table_updates.shape == (2, 4)

    header, payload = pack(sent)
    received = unpack(StepInputs, header, payload.clone())
    for sent_part, received_part in ((sent, received), (sent.sampling, received.sampling)):
        for name, value in vars(sent_part).items():
            got = getattr(received_part, name)
            assert type(got) is type(value)
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and torch.equal(got, value), name
            elif name != "sampling":
                assert got == value, name


def test_graph_steps_carry_one_table_entry_per_row_or_run_eagerly():
    """A decode graph applies a fixed number of table updates (its batch size, padded with sink writes); a step
    that brings more (a sequence readmitted with its whole table) runs eagerly with all of them."""
    llm = LLM("tiny-qwen3", max_model_len=256, num_kv_blocks=32)
    llm.add_request(list(range(3, 73)), SamplingParams(temperature=0, max_tokens=4))  # 70 tokens: 5 blocks
    llm.step()
    runner, seq = llm._runner, llm._scheduler.running[0]
    runner.graphs = GraphSizes()
    batch = llm._scheduler.schedule()
    inputs = runner.prepare(batch)
    assert inputs.graph_size == 4 and inputs.table_updates.tolist() == [[runner.tables.sink_index] * 4, [0] * 4]
    seq.epoch += 1  # as if preempted and readmitted: its row is refilled and its 5 blocks sent again
    batch.table_changed.append(seq)
    inputs = runner.prepare(batch)
    row = runner.persistent.rows.row_of[seq.seq_id] * runner.persistent.rows.width
    assert inputs.graph_size is None
    assert inputs.table_updates.tolist() == [list(range(row, row + 5)), seq.block_table]


# ---- failures and life cycle -----------------------------------------------------------------------------------

def test_killed_worker_ends_the_job_with_a_clear_error_and_no_orphans():
    llm = LLM("tiny-qwen3", tensor_parallel_size=2, max_model_len=2048, num_kv_blocks=160)
    pids = llm._workers.pids
    killed = []  # when the kill was sent: the timer thread may run late on a busy machine

    def kill():
        killed.append(time.monotonic())
        os.kill(pids[0], signal.SIGKILL)

    killer = threading.Timer(1.0, kill)
    killer.start()
    with pytest.raises(TPWorkerError, match=r"rank 1 \(pid \d+\) died: killed by SIGKILL"):
        llm.generate([[1, 2, 3]] * 4, SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    noticed = time.monotonic()
    killer.join()
    assert noticed - killed[0] < 5.0
    assert not any(process_alive(pid) for pid in pids) and not dist.is_initialized()
    with pytest.raises(TPWorkerError, match="the tensor-parallel engine is stopped"):
        llm.generate([[1, 2, 3]], GREEDY)
    llm.exit()  # nothing left to stop


_FAULTY_WORKER = """
from nanovllm.runner.model_runner import ModelRunner

execute, calls = ModelRunner.execute, []


def faulty_execute(self, inputs):
    calls.append(1)
    if len(calls) == 3:
        raise RuntimeError("injected fault in the third step")
    return execute(self, inputs)


ModelRunner.execute = faulty_execute
"""


def test_worker_exception_reaches_the_caller_with_its_traceback(tmp_path, monkeypatch):
    # Every interpreter started from here on imports it: the workers (the test process has started already).
    (tmp_path / "sitecustomize.py").write_text(_FAULTY_WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    llm = LLM("tiny-qwen3", tensor_parallel_size=2, **TINY_ENGINE)
    pids = llm._workers.pids
    with pytest.raises(TPWorkerError, match=r"(?s)rank 1 \(pid \d+\) raised:\nTraceback.*"
                                            r"RuntimeError: injected fault in the third step"):
        llm.generate([[1, 2, 3]], GREEDY)
    assert not any(process_alive(pid) for pid in pids) and not dist.is_initialized()


_WORKER_FAILING_IN_BUILD = """
from nanovllm.runner import model_runner


def failing_load(*args, **kwargs):
    raise RuntimeError("injected fault in the weights' loading")


model_runner.load_weights = failing_load
"""


def test_worker_failing_while_the_model_is_built_ends_the_start_with_its_traceback(tmp_path, monkeypatch):
    """A worker that fails inside the build while rank 0 waits in a collective for it (the KV cache's size, agreed
    by every rank) ends LLM() at once with the worker's traceback (on NCCL the guard's watchdog aborts that
    collective, which would otherwise wait for its timeout)."""
    (tmp_path / "sitecustomize.py").write_text(_WORKER_FAILING_IN_BUILD)  # the workers import it, not this process
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    started = time.monotonic()
    with pytest.raises(TPWorkerError, match=r"(?s)rank 1 \(pid \d+\) raised:\nTraceback.*"
                                            r"RuntimeError: injected fault in the weights' loading"):
        LLM("tiny-qwen3", tensor_parallel_size=2, max_model_len=256, max_num_batched_tokens=32)
    assert time.monotonic() - started < 60 and not dist.is_initialized()


_LIFE_CYCLE_SCRIPT = """
import signal
import sys
from nanovllm import LLM, SamplingParams

if __name__ == "__main__":
    # Ctrl-C as a script started from a shell has it: a child inherits its parent's ignored signals, and what
    # the test process inherited or set earlier in the suite must not decide this test.
    print("inherited SIGINT handler:", signal.getsignal(signal.SIGINT), file=sys.stderr)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM("tiny-qwen3", tensor_parallel_size=2, max_model_len=2048, num_kv_blocks=160)
    print(*llm._workers.pids, flush=True)
    if sys.argv[1] != "return":
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
"""


@pytest.mark.parametrize("ending", ["return", "ctrl-c", "kill-rank0"])
def test_every_ending_of_rank0_stops_the_workers(ending, tmp_path):
    """Returning without exit() (atexit), Ctrl-C mid-generation, even SIGKILL of rank 0: no worker outlives it."""
    script = tmp_path / "job.py"
    script.write_text(_LIFE_CYCLE_SCRIPT)
    job = subprocess.Popen([sys.executable, str(script), ending], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        pids = [int(p) for p in job.stdout.readline().split()]
        assert pids, job.stderr.read()
        if ending != "return":
            time.sleep(1.0)  # generating
            job.send_signal(signal.SIGINT if ending == "ctrl-c" else signal.SIGKILL)
        returncode = job.wait(timeout=120)  # a hang, not a slow exit on a busy machine
    finally:
        job.kill()
    stderr = job.stderr.read()
    # Python ends on an uncaught KeyboardInterrupt by re-raising SIGINT at itself.
    expected = {"return": 0, "ctrl-c": -signal.SIGINT, "kill-rank0": -signal.SIGKILL}[ending]
    assert returncode == expected, stderr
    if ending == "ctrl-c":
        assert "KeyboardInterrupt" in stderr
    deadline = time.monotonic() + 60.0  # a worker reads EOF at once; its exit may take a while on a busy machine
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(pid) for pid in pids)


# ---- impossible splits -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("world, message", [
    (3, r"num_attention_heads=4, num_key_value_heads=2, intermediate_size=256; sizes that split it: 1, 2$"),
    (4, r"num_key_value_heads=2; sizes that split it: 1, 2$"),
])
def test_impossible_split_is_a_value_error(world, message):
    with pytest.raises(ValueError, match=message):
        LLM("tiny-qwen3", tensor_parallel_size=world)


def test_more_ranks_than_cuda_devices_is_a_value_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 CUDA devices"):
        check_tp_split(resolve_model("tiny-qwen3").hf_config, 2, torch.device("cuda"))
