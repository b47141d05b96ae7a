"""The device side's step types: what a step reads on the device (`StepInputs`, with its `SamplingTensors`) and a
step whose forward is launched (`LaunchedForward`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from nanovllm.layers.logprobs import TokenLogprobs
from nanovllm.runner.step_buffers import GROUP_TOKENS, ROWS, ROWS_PLUS_ONE, SEQS, TOKENS, UPDATES, buffer


@dataclass
class SamplingTensors:
    """Per-row sampling settings of one step, already on the device (what `nanovllm.layers.sampler` reads)."""

    temperatures: torch.Tensor = buffer(torch.float32, SEQS)  # [batch]; 0 = greedy
    top_k: torch.Tensor = buffer(torch.int64, SEQS)  # [batch]; >= vocab size = off
    top_p: torch.Tensor = buffer(torch.float32, SEQS)  # [batch]; 1 = off
    min_p: torch.Tensor = buffer(torch.float32, SEQS)  # [batch]; 0 = off
    seeds: torch.Tensor = buffer(torch.int64, SEQS)  # [batch]
    sample_positions: torch.Tensor = buffer(torch.int64, SEQS)  # [batch]: index of the output token being drawn
    all_greedy: bool
    any_filter: bool  # some row has top-k, top-p or min-p on (the torch path skips its sort without)


@dataclass
class StepInputs:
    """One step's device inputs, the only declaration of them: the step buffers' layout, a step's views of them,
    the decode graphs' inputs and what tensor-parallel ranks receive (tp_step.py) all follow these fields. Every
    rank executes the same ones. Tensors are views of the step buffers (`buffer` says their extent)."""

    input_ids: torch.Tensor = buffer(torch.int64, TOKENS, graph=True)
    positions: torch.Tensor = buffer(torch.int64, TOKENS, graph=True)
    # [KV groups, tokens] cache slot per token in each group's blocks (kv_groups.py); -1 = no write
    slot_mapping: torch.Tensor = buffer(torch.int64, GROUP_TOKENS, graph=True)
    query_start_loc: torch.Tensor = buffer(torch.int32, ROWS_PLUS_ONE)
    seq_lens: torch.Tensor = buffer(torch.int32, ROWS, graph=True)
    rows: torch.Tensor = buffer(torch.int64, ROWS, graph=True)  # each sequence's row of the block tables
    # Multi-LoRA (nanovllm.lora): the adapter slot of each token, -1 for the base model and graph padding; read
    # only when `lora_active` (some token of the step has an adapter; else the step runs the base model alone).
    lora_slots: torch.Tensor = buffer(torch.int32, TOKENS, graph=True)
    logits_indices: torch.Tensor = buffer(torch.int64, SEQS)  # the last new token of each sequence
    sampling: SamplingTensors
    logprob_rows: torch.Tensor = buffer(torch.int64, SEQS)  # batch indices of the sampled rows asking logprobs
    num_logprob_rows: int  # 0: no row asks, the logprob op is skipped
    num_top_logprobs: int  # the largest k those rows ask
    # int64 [2, n]: the step's token indices whose logits score a prompt token (prompt_logprobs), and that token;
    # None when no row asks. A small upload of its own, only in the steps that carry some.
    prompt_logprob_targets: torch.Tensor | None
    num_top_prompt_logprobs: int
    # Penalties (runner/logit_controls.py): the sampled rows holding a token-history slot, their slots and values.
    penalty_rows: torch.Tensor = buffer(torch.int64, SEQS)
    penalty_slots: torch.Tensor = buffer(torch.int64, SEQS)
    repetition_penalties: torch.Tensor = buffer(torch.float32, SEQS)
    presence_penalties: torch.Tensor = buffer(torch.float32, SEQS)
    frequency_penalties: torch.Tensor = buffer(torch.float32, SEQS)
    num_penalty_rows: int
    logit_controls: bool  # some row of the step has penalties or logit controls (False: none of them runs)
    lora_active: bool
    # [2, n] table entries new to the device (flat indices, then block ids), applied first. Last in the layout:
    # it is uploaded only as far as a step uses it.
    table_updates: torch.Tensor = buffer(torch.int32, UPDATES, graph=True)
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # in a step with longer queries too: its leading one-token sequences (AttentionMetadata)
    decode_num_splits: int  # of the decode kernel: over the whole batch of a decode step, else over num_decodes
    graph_size: int | None  # replay the decode graph of this batch size instead of running eagerly
    # int64 [tokens]: token types of pair inputs (BERT-style pooling models); None in a step without (a small
    # upload of its own)
    token_type_ids: torch.Tensor | None = None


@dataclass
class LaunchedForward:
    """A step whose forward is launched and whose sampling is not: its inputs, its logits (None on a
    tensor-parallel worker), its output slot (None on the CPU; Any: the runner's private type), upload number,
    and the prompt logprobs of rows that asked (computed with the forward)."""

    inputs: StepInputs
    logits: torch.Tensor | None
    slot: Any
    upload: int
    prompt_logprobs: TokenLogprobs | None = None
