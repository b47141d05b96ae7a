"""Pooling models (decoder embedders and classifiers, BERT / XLM-RoBERTa encoders and cross-encoders) against
sentence-transformers and HF transformers, fp32 on the CPU, on tiny random-weight checkpoints: each checkpoint is
read by nanovllm.pooling's task detection, loaded by our loader, run over a flat batch (decoders through the torch
attention backend over a paged cache, also in chunks) and pooled; embeddings must reach cosine >= 0.9999 and
probabilities agree within 1e-4."""
from pathlib import Path

import pytest
import torch
from conftest import save_random_hf_model
from transformers import AutoConfig, BertTokenizer

from nanovllm.attention import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend
from nanovllm.loaders import load_safetensors_weights
from nanovllm.models.registry import model_class_for
from nanovllm.pooling import PoolingState, activate, check_dimensions, embedding_output, pool_sequences, resolve_task

WORDS = [f"w{i}" for i in range(90)]
TEXTS = ["w1 w2 w3 w4 w5", "w7", "w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21 w22", "w5 w4 w3 w2 w1 w0 w9 w8"]
PAIRS = [("w1 w2 w3", "w4 w5 w6 w7"), ("w8", "w9 w10"), ("w11 w12 w13 w14 w15 w16", "w1"), ("w3 w3", "w3 w3 w3")]
DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=128, pad_token_id=0,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
               max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
XLMR = dict(ENCODER, type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2)


def bert_tokenizer() -> BertTokenizer:
    return BertTokenizer(vocab={w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])})


def xlmr_tokenizer() -> BertTokenizer:
    """XLM-RoBERTa's special-token ids (<s> 0, <pad> 1, </s> 2) over a word vocabulary, without token types."""
    specials = dict(cls_token="<s>", pad_token="<pad>", sep_token="</s>", unk_token="<unk>", mask_token="<mask>")
    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>", *WORDS])}
    return BertTokenizer(vocab=vocab, model_input_names=["input_ids", "attention_mask"], **specials)


def save_checkpoint(config: dict, directory: Path, auto_class: str, tokenizer) -> Path:
    save_random_hf_model(config, directory, auto_class=auto_class)
    tokenizer.save_pretrained(directory)
    return directory


def save_sentence_transformer(directory: Path, pooling_mode: str, normalize: bool) -> Path:
    """A sentence-transformers bi-encoder built from modules around the HF base model saved in `directory`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(directory))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)]
    SentenceTransformer(modules=modules + [Normalize()] * normalize).save(str(directory))
    return directory


def load_ours(directory: Path, **task):
    """Our model for the checkpoint (its class and pooling as task detection decides) with its pooling spec."""
    hf_config = AutoConfig.from_pretrained(str(directory))
    spec = resolve_task(hf_config, directory, **task)
    model = model_class_for(hf_config, spec.model_kind)(hf_config).eval()
    load_safetensors_weights(model, directory)
    return model, spec


def metadata(lengths: list[int]) -> AttentionMetadata:
    """The layout of whole sequences in a flat batch, with no KV cache (the encoders read only the layout)."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), query_start_loc=cu,
                             seq_lens=torch.tensor(lengths, dtype=torch.int32),
                             block_tables=torch.empty(len(lengths), 0, dtype=torch.int32),
                             max_query_len=max(lengths), max_seq_len=max(lengths))


@torch.inference_mode()
def encoder_pooled(model, spec, sequences: list[list[int]], token_types: list[list[int]] | None = None):
    """Whole sequences in one flat batch through an encoder, pooled by the spec's method."""
    lengths = [len(s) for s in sequences]
    hidden = model(torch.tensor(sum(sequences, [])), torch.cat([torch.arange(n) for n in lengths]), metadata(lengths),
                   None if token_types is None else torch.tensor(sum(token_types, [])))
    lengths_t = torch.tensor(lengths)
    return pool_sequences(hidden, torch.cumsum(lengths_t, 0) - lengths_t, lengths_t, spec.pooling)


@torch.inference_mode()
def decoder_pooled(model, spec, sequences: list[list[int]], chunk: int) -> torch.Tensor:
    """Sequences through a decoder over a paged KV cache (torch backend), all rows in each step, `chunk` tokens of
    each per step, pooled chunk by chunk (PoolingState)."""
    block_size = 16
    tables = []
    for s in sequences:
        first = sum(len(t) for t in tables)
        tables.append(list(range(first, first + -(-len(s) // block_size))))
    num_blocks = sum(len(t) for t in tables)
    for layer in model.attention_layers():
        layer.k_cache = torch.zeros(num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.v_cache = torch.zeros_like(layer.k_cache)
        layer.backend = TorchAttentionBackend()
    state = PoolingState(spec.pooling, len(sequences), model.config.hidden_size)
    done = [0] * len(sequences)
    while any(d < len(s) for d, s in zip(done, sequences)):
        rows = [i for i, s in enumerate(sequences) if done[i] < len(s)]
        parts = [sequences[i][done[i]:done[i] + chunk] for i in rows]
        positions = torch.cat([torch.arange(done[i], done[i] + len(p)) for i, p in zip(rows, parts)])
        lengths = torch.tensor([len(p) for p in parts])
        row_tables = [torch.tensor(tables[i]) for i in rows]
        slots = torch.cat([t[torch.arange(done[i], done[i] + len(p)) // block_size] * block_size
                           + torch.arange(done[i], done[i] + len(p)) % block_size
                           for i, p, t in zip(rows, parts, row_tables)])
        width = max(len(t) for t in row_tables)
        block_tables = torch.stack([torch.nn.functional.pad(t, (0, width - len(t)), value=-1) for t in row_tables])
        seq_lens = torch.tensor([done[i] + len(p) for i, p in zip(rows, parts)], dtype=torch.int32)
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.nn.functional.pad(
            lengths.cumsum(0), (1, 0)).int(), seq_lens=seq_lens, block_tables=block_tables.int(),
            max_query_len=int(lengths.max()), max_seq_len=int(seq_lens.max()))
        hidden = model(torch.tensor(sum(parts, [])), positions, meta)
        state.update(torch.tensor(rows), hidden, torch.cumsum(lengths, 0) - lengths, lengths,
                     torch.tensor([done[i] == 0 for i in rows]))
        for i, p in zip(rows, parts):
            done[i] += len(p)
    return state.result(torch.arange(len(sequences)))


def assert_cosine(ours: torch.Tensor, reference: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(ours.float(), torch.as_tensor(reference).float(), dim=-1)
    assert cosine.min() >= 0.9999, cosine


def token_ids(tokenizer, texts) -> list[list[int]]:
    return [tokenizer(t).input_ids for t in texts]


# ---- decoder embedders ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type, pooling_mode", [("qwen3", "lasttoken"), ("llama", "lasttoken"),
                                                      ("qwen3", "mean")])
def test_decoder_embedder_matches_sentence_transformers(tmp_path, model_type, pooling_mode):
    from sentence_transformers import SentenceTransformer

    directory = save_checkpoint(dict(DECODER, model_type=model_type), tmp_path, "AutoModel", bert_tokenizer())
    save_sentence_transformer(directory, pooling_mode, normalize=True)
    model, spec = load_ours(directory)
    assert (spec.task, spec.pooling.value, spec.normalize) == ("embed", "last" if pooling_mode == "lasttoken"
                                                              else "mean", True)
    reference = SentenceTransformer(str(directory)).encode(TEXTS, convert_to_tensor=True)
    sequences = token_ids(bert_tokenizer(), TEXTS)
    for chunk in (64, 5, 1):  # whole, chunked over steps, one token a step
        assert_cosine(embedding_output(decoder_pooled(model, spec, sequences, chunk), spec.normalize), reference)


def test_causal_lm_checkpoint_embeds_with_its_decoder(tmp_path):
    """A decoder saved as a causal LM (`model.` names and an LM head, as Qwen3-Embedding-style checkpoints may
    be) embeds under runner="pooling": the normalized last-token state of HF's base model."""
    from transformers import AutoModel

    directory = save_random_hf_model(dict(DECODER, model_type="qwen3"), tmp_path)
    model, spec = load_ours(directory, runner="pooling")
    assert (spec.task, spec.pooling.value, spec.normalize) == ("embed", "last", True)
    sequences = [list(range(10, 30)), [5, 6, 7], list(range(40, 51))]
    hf = AutoModel.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = torch.stack([torch.nn.functional.normalize(hf(input_ids=torch.tensor([s])).last_hidden_state[0, -1],
                                                               dim=-1) for s in sequences])
    assert_cosine(embedding_output(decoder_pooled(model, spec, sequences, 7), spec.normalize), reference)


def test_matryoshka_dimensions_match_sentence_transformers_truncation(tmp_path):
    from sentence_transformers import SentenceTransformer

    directory = save_checkpoint(dict(DECODER, model_type="qwen3", is_matryoshka=True), tmp_path, "AutoModel",
                                bert_tokenizer())
    save_sentence_transformer(directory, "lasttoken", normalize=True)
    model, spec = load_ours(directory)
    check_dimensions(16, model.config, spec.output_size)
    reference = SentenceTransformer(str(directory), truncate_dim=16).encode(TEXTS, convert_to_tensor=True,
                                                                            normalize_embeddings=True)
    ours = embedding_output(decoder_pooled(model, spec, token_ids(bert_tokenizer(), TEXTS), 64), spec.normalize, 16)
    assert ours.shape == (len(TEXTS), 16)
    assert_cosine(ours, reference)
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(TEXTS)))


# ---- decoder classifiers and reward models -----------------------------------------------------------------------

def hf_pipeline_probabilities(directory: Path, texts: list[str], tokenizer) -> tuple[torch.Tensor, list[str]]:
    """HF's text-classification pipeline: every label's probability (its own softmax / sigmoid choice), by label
    id, and the label names it reports."""
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(directory), tokenizer=tokenizer, top_k=None,
                        dtype=torch.float32)
    rows = classify(texts)
    labels = [entry["label"] for entry in rows[0]]
    order = sorted(labels, key=lambda name: classify.model.config.label2id[name])
    return torch.tensor([[{e["label"]: e["score"] for e in row}[name] for name in order] for row in rows]), order


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_decoder_classifier_matches_hf_pipeline(tmp_path, model_type):
    id2label = {0: "negative", 1: "neutral", 2: "positive"}
    config = dict(DECODER, model_type=model_type, num_labels=3, id2label=id2label,
                  label2id={v: k for k, v in id2label.items()})
    directory = save_checkpoint(config, tmp_path, "AutoModelForSequenceClassification", bert_tokenizer())
    model, spec = load_ours(directory)
    assert (spec.task, spec.pooling.value, spec.labels, spec.activation("classify")) == (
        "classify", "last", ("negative", "neutral", "positive"), "softmax")
    reference, labels = hf_pipeline_probabilities(directory, TEXTS, bert_tokenizer())
    assert tuple(labels) == spec.labels
    for chunk in (64, 3):
        pooled = decoder_pooled(model, spec, token_ids(bert_tokenizer(), TEXTS), chunk)
        torch.testing.assert_close(activate(model.compute_logits(pooled), spec.activation("classify")), reference,
                                   rtol=0, atol=1e-4)


def test_reward_model_matches_hf_score(tmp_path):
    from transformers import AutoModelForSequenceClassification

    directory = save_checkpoint(dict(DECODER, model_type="llama", num_labels=1), tmp_path,
                                "AutoModelForSequenceClassification", bert_tokenizer())
    model, spec = load_ours(directory)
    assert (spec.task, spec.activation("reward")) == ("reward", "none")
    sequences = token_ids(bert_tokenizer(), TEXTS)
    hf = AutoModelForSequenceClassification.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = torch.cat([hf(input_ids=torch.tensor([s])).logits for s in sequences])
    pooled = decoder_pooled(model, spec, sequences, 4)
    torch.testing.assert_close(activate(model.compute_logits(pooled), "none"), reference, rtol=0, atol=1e-4)


# ---- BERT and XLM-RoBERTa ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, pooling_mode, normalize", [("bert", "cls", True), ("bert", "mean", False),
                                                             ("xlm-roberta", "cls", False),
                                                             ("xlm-roberta", "mean", True)])
def test_encoder_embedder_matches_sentence_transformers(tmp_path, family, pooling_mode, normalize):
    from sentence_transformers import SentenceTransformer

    tokenizer = bert_tokenizer() if family == "bert" else xlmr_tokenizer()
    config = dict(ENCODER if family == "bert" else XLMR, model_type=family)
    directory = save_checkpoint(config, tmp_path, "AutoModel", tokenizer)
    save_sentence_transformer(directory, pooling_mode, normalize)
    model, spec = load_ours(directory)
    assert (spec.task, spec.pooling.value, spec.normalize) == ("embed", pooling_mode, normalize)
    reference = SentenceTransformer(str(directory)).encode(TEXTS, convert_to_tensor=True)
    ours = embedding_output(encoder_pooled(model, spec, token_ids(tokenizer, TEXTS)), spec.normalize)
    assert_cosine(ours, reference)
    if not normalize:  # the raw pooled vector, not only its direction
        torch.testing.assert_close(ours, reference.float(), rtol=1e-4, atol=1e-4)


def test_xlm_roberta_positions_skip_pad_tokens_as_hf(tmp_path):
    """A pad id inside a sequence keeps position padding_idx and is not counted (HF's rule)."""
    from transformers import AutoModel

    directory = save_random_hf_model(dict(XLMR, model_type="xlm-roberta"), tmp_path, auto_class="AutoModel")
    model, spec = load_ours(directory)
    sequences = [[0, 7, 1, 1, 9, 2], [0, 5, 2], [0, 1, 8, 8, 2]]
    hf = AutoModel.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = torch.stack([hf(input_ids=torch.tensor([s])).last_hidden_state[0, 0] for s in sequences])
    torch.testing.assert_close(encoder_pooled(model, spec, sequences), reference, rtol=1e-4, atol=1e-4)


def test_bert_cross_encoder_matches_sentence_transformers(tmp_path):
    from sentence_transformers import CrossEncoder

    tokenizer = bert_tokenizer()
    directory = save_checkpoint(dict(ENCODER, model_type="bert", num_labels=1), tmp_path / "hf",
                                "AutoModelForSequenceClassification", tokenizer)
    cross_encoder = CrossEncoder(str(directory))
    cross_encoder.save(str(tmp_path / "st"))  # a CrossEncoder config: model_type and its activation_fn
    model, spec = load_ours(tmp_path / "st")
    assert (spec.task, spec.pooling.value, spec.activation("score")) == ("score", "cls", "sigmoid")
    encoded = [tokenizer(a, b) for a, b in PAIRS]
    pooled = encoder_pooled(model, spec, [e.input_ids for e in encoded], [e.token_type_ids for e in encoded])
    scores = activate(model.compute_logits(pooled), spec.activation("score"))[:, 0]
    torch.testing.assert_close(scores, cross_encoder.predict(PAIRS, convert_to_tensor=True).float(), rtol=0,
                               atol=1e-4)


def test_xlm_roberta_classifier_matches_hf_pipeline(tmp_path):
    tokenizer = xlmr_tokenizer()
    config = dict(XLMR, model_type="xlm-roberta", num_labels=2, id2label={0: "no", 1: "yes"},
                  label2id={"no": 0, "yes": 1})
    directory = save_checkpoint(config, tmp_path, "AutoModelForSequenceClassification", tokenizer)
    model, spec = load_ours(directory)
    assert (spec.task, spec.labels, spec.activation("classify")) == ("classify", ("no", "yes"), "softmax")
    reference, labels = hf_pipeline_probabilities(directory, TEXTS, tokenizer)
    assert tuple(labels) == spec.labels
    pooled = encoder_pooled(model, spec, token_ids(tokenizer, TEXTS))
    torch.testing.assert_close(activate(model.compute_logits(pooled), "softmax"), reference, rtol=0, atol=1e-4)


# ---- tensor parallelism -----------------------------------------------------------------------------------------

def _tp_classifier_logits(rank: int, world: int, port: int, cases: list) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from nanovllm.distributed import destroy_tp_group, init_tp_group

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    init_tp_group(rank, world, store, torch.device("cpu"))
    try:
        for directory, sequences, expected in cases:
            model, spec = load_ours(directory)
            pooled = decoder_pooled(model, spec, sequences, 4) if model.attention_layers() \
                else encoder_pooled(model, spec, sequences)
            torch.testing.assert_close(model.compute_logits(pooled), expected, rtol=1e-5, atol=1e-5)
    finally:
        destroy_tp_group()


@pytest.mark.slow
def test_tp2_classifiers_equal_tp1(tmp_path):
    """A BERT and a Qwen3 classifier across 2 gloo ranks (q|k|v parts with biases, row-parallel biases, the
    vocabulary split; the replicated head on each rank) give the unsharded logits."""
    from datetime import timedelta

    import torch.distributed as dist
    import torch.multiprocessing

    sequences = token_ids(bert_tokenizer(), TEXTS)
    cases = []
    for family, config in (("bert", ENCODER), ("qwen3", DECODER)):
        directory = save_checkpoint(dict(config, model_type=family, num_labels=3), tmp_path / family,
                                    "AutoModelForSequenceClassification", bert_tokenizer())
        model, spec = load_ours(directory)
        pooled = decoder_pooled(model, spec, sequences, 4) if family == "qwen3" \
            else encoder_pooled(model, spec, sequences)
        cases.append((directory, sequences, model.compute_logits(pooled)))
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    torch.multiprocessing.spawn(_tp_classifier_logits, args=(2, store.port, cases), nprocs=2)
