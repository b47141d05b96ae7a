"""Pooling through the engine (LLM.embed / classify / score / reward, add_request + step) against
sentence-transformers and HF transformers, fp32 on the CPU, on tiny random-weight checkpoints of each kind:
decoder embedders, classifiers, reward models and cross-encoders, BERT and XLM-RoBERTa encoders. Embeddings must
reach cosine >= 0.9999, probabilities and scores agree within 1e-4; long inputs chunked over steps (a small token
budget, both step loops) give what whole ones give; TP=2 over gloo gives what TP=1 gives."""
import pytest
import torch
from test_pooling_models import (
    DECODER,
    ENCODER,
    PAIRS,
    TEXTS,
    XLMR,
    assert_cosine,
    bert_tokenizer,
    hf_pipeline_probabilities,
    save_checkpoint,
    save_sentence_transformer,
    xlmr_tokenizer,
)

from nanovllm import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams
from nanovllm.pooling.kv_budget import pooling_kv_blocks

LONG_TEXTS = TEXTS + [" ".join(f"w{i % 90}" for i in range(7, 57))]  # 52 tokens: chunked under a 16-token budget
WHOLE = {"num_kv_blocks": 64}
CHUNKED = {**WHOLE, "max_num_batched_tokens": 16, "max_num_seqs": 3}  # decoders: inputs chunked over steps
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every kind of pooling checkpoint, saved once for the module."""
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp("pooling-checkpoints")
    dirs = {}
    dirs["qwen3-last"] = save_checkpoint(dict(DECODER, model_type="qwen3", is_matryoshka=True), root / "qwen3-last",
                                         "AutoModel", bert_tokenizer())
    save_sentence_transformer(dirs["qwen3-last"], "lasttoken", normalize=True)
    dirs["llama-mean"] = save_checkpoint(dict(DECODER, model_type="llama"), root / "llama-mean", "AutoModel",
                                         bert_tokenizer())
    save_sentence_transformer(dirs["llama-mean"], "mean", normalize=False)
    dirs["qwen3-classifier"] = save_checkpoint(
        dict(DECODER, model_type="qwen3", num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()}),
        root / "qwen3-classifier", "AutoModelForSequenceClassification", bert_tokenizer())
    dirs["llama-reward"] = save_checkpoint(dict(DECODER, model_type="llama", num_labels=1), root / "llama-reward",
                                           "AutoModelForSequenceClassification", bert_tokenizer())
    for family, config in (("qwen3", DECODER), ("bert", ENCODER)):
        hf = save_checkpoint(dict(config, model_type=family, num_labels=1), root / f"{family}-ce-hf",
                             "AutoModelForSequenceClassification", bert_tokenizer())
        CrossEncoder(str(hf)).save(str(root / f"{family}-cross-encoder"))  # its CrossEncoder config
        dirs[f"{family}-cross-encoder"] = root / f"{family}-cross-encoder"
    dirs["bert-cls"] = save_checkpoint(dict(ENCODER, model_type="bert"), root / "bert-cls", "AutoModel",
                                       bert_tokenizer())
    save_sentence_transformer(dirs["bert-cls"], "cls", normalize=True)
    dirs["xlmr-mean"] = save_checkpoint(dict(XLMR, model_type="xlm-roberta"), root / "xlmr-mean", "AutoModel",
                                        xlmr_tokenizer())
    save_sentence_transformer(dirs["xlmr-mean"], "mean", normalize=False)
    dirs["xlmr-classifier"] = save_checkpoint(
        dict(XLMR, model_type="xlm-roberta", num_labels=2, id2label={0: "no", 1: "yes"}, label2id={"no": 0, "yes": 1}),
        root / "xlmr-classifier", "AutoModelForSequenceClassification", xlmr_tokenizer())
    return dirs


def embeddings(outputs) -> torch.Tensor:
    assert all(isinstance(o, EmbeddingRequestOutput) and o.error is None for o in outputs)
    return torch.tensor([o.outputs.embedding for o in outputs])


# ---- embedders ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3-last", "llama-mean", "bert-cls", "xlmr-mean"])
def test_embed_matches_sentence_transformers(checkpoints, name):
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(checkpoints[name])).encode(LONG_TEXTS, convert_to_tensor=True).float()
    with LLM(str(checkpoints[name]), **WHOLE) as llm:
        assert llm.pooling.task == "embed"
        ours = embeddings(llm.embed(LONG_TEXTS))
        assert ours.shape == reference.shape
        assert_cosine(ours, reference)
        if name in ("llama-mean", "xlmr-mean"):  # not normalized: the vector itself, not only its direction
            torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
        assert llm.get_metrics()["kv_cache_usage"] == 0  # no KV kept after a row


@pytest.mark.parametrize("name", ["qwen3-last", "llama-mean"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chunked_inputs_pool_as_whole_ones(checkpoints, name, async_scheduling):
    """A 16-token budget chunks the long input over four steps and puts several rows' chunks in one step; the
    pooled vectors equal those of whole inputs (mean sums chunk by chunk, last takes the last chunk's)."""
    with LLM(str(checkpoints[name]), **WHOLE) as llm:
        whole = embeddings(llm.embed(LONG_TEXTS))
    with LLM(str(checkpoints[name]), **CHUNKED, async_scheduling=async_scheduling) as llm:
        chunked = embeddings(llm.embed(LONG_TEXTS))
        assert llm.get_stats()["steps"] >= 6
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_matryoshka_dimensions_and_normalize_per_request(checkpoints):
    from sentence_transformers import SentenceTransformer

    directory = str(checkpoints["qwen3-last"])
    reference = SentenceTransformer(directory, truncate_dim=16).encode(TEXTS, convert_to_tensor=True,
                                                                      normalize_embeddings=True).float()
    with LLM(directory, **WHOLE) as llm:
        params = [PoolingParams(dimensions=16), PoolingParams(), PoolingParams(dimensions=16, normalize=False),
                  PoolingParams(dimensions=16)]
        outputs = llm.embed(TEXTS, params)
        assert [o.outputs.hidden_size for o in outputs] == [16, 64, 16, 16]
        assert_cosine(embeddings([outputs[0], outputs[3]]), reference[[0, 3]])
        assert abs(torch.tensor(outputs[1].outputs.embedding).norm() - 1) < 1e-5
        raw = torch.tensor(outputs[2].outputs.embedding)
        assert_cosine(raw[None], reference[2:3])
        assert abs(raw.norm() - 1) > 1e-3  # not normalized
        with pytest.raises(ValueError, match="matryoshka_dimensions|exceeds"):
            llm.add_request("w1", PoolingParams(dimensions=65))
    with LLM(str(checkpoints["llama-mean"]), **WHOLE) as llm:
        error = llm.embed("w1 w2", PoolingParams(dimensions=8))[0].error
        assert "does not declare Matryoshka" in error


def test_embedder_scores_by_cosine_as_sentence_transformers(checkpoints):
    from sentence_transformers import SentenceTransformer

    directory = str(checkpoints["bert-cls"])
    model = SentenceTransformer(directory)
    query, documents = TEXTS[0], TEXTS[1:]
    reference = model.similarity(model.encode([query]), model.encode(documents))[0]
    with LLM(directory, **WHOLE) as llm:
        one_to_n = [o.outputs.score for o in llm.score(query, documents)]
        n_to_n = [o.outputs.score for o in llm.score([query] * 3, documents)]
        request_id = llm.add_score_request(query, documents)
        (grouped,) = [o for o in llm.step() if o.request_id == request_id]
    torch.testing.assert_close(torch.tensor(one_to_n), reference, rtol=0, atol=1e-4)
    assert n_to_n == one_to_n
    assert [s.score for s in grouped.outputs] == pytest.approx(one_to_n, abs=1e-6)


# ---- classifiers, reward models, cross-encoders ------------------------------------------------------------------

@pytest.mark.parametrize("name, tokenizer, engine", [("qwen3-classifier", bert_tokenizer, CHUNKED),
                                                     ("xlmr-classifier", xlmr_tokenizer, WHOLE)])
def test_classify_matches_hf_pipeline(checkpoints, name, tokenizer, engine):
    reference, labels = hf_pipeline_probabilities(checkpoints[name], LONG_TEXTS, tokenizer())
    with LLM(str(checkpoints[name]), **engine) as llm:
        outputs = llm.classify(LONG_TEXTS)
        raw = llm.classify(LONG_TEXTS[0], PoolingParams(activation=False))[0].outputs.probs
    probs = torch.tensor([o.outputs.probs for o in outputs])
    torch.testing.assert_close(probs, reference, rtol=0, atol=1e-4)
    assert [o.outputs.label for o in outputs] == [labels[i] for i in reference.argmax(-1).tolist()]
    torch.testing.assert_close(torch.tensor(raw).softmax(-1), reference[0], rtol=0, atol=1e-4)


def test_reward_is_the_raw_score_of_hf(checkpoints):
    from transformers import AutoModelForSequenceClassification

    directory = checkpoints["llama-reward"]
    hf = AutoModelForSequenceClassification.from_pretrained(str(directory), dtype=torch.float32).eval()
    tokenizer = bert_tokenizer()
    with torch.inference_mode():
        reference = torch.cat([hf(input_ids=torch.tensor([tokenizer(t).input_ids])).logits for t in LONG_TEXTS])
    with LLM(str(directory), **CHUNKED) as llm:
        assert llm.pooling.task == "reward"
        outputs = llm.reward(LONG_TEXTS)
    torch.testing.assert_close(torch.stack([o.outputs.data for o in outputs]), reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["bert-cross-encoder", "qwen3-cross-encoder"])
def test_cross_encoder_scores_match_sentence_transformers(checkpoints, name):
    """Pairs tokenized together (with token types for BERT), the pair's logit through the CrossEncoder's
    activation."""
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(checkpoints[name])).predict(PAIRS, convert_to_tensor=True).float()
    with LLM(str(checkpoints[name]), **WHOLE) as llm:
        assert llm.pooling.task == "score"
        outputs = llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS])
        one_to_n = llm.score(PAIRS[0][0], [b for _, b in PAIRS])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in outputs]), reference, rtol=0, atol=1e-4)
    expected = CrossEncoder(str(checkpoints[name])).predict([(PAIRS[0][0], b) for _, b in PAIRS])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in one_to_n]), torch.tensor(expected).float(),
                               rtol=0, atol=1e-4)


# ---- the engine's handling of pooling rows ------------------------------------------------------------------------

def test_last_token_rows_hit_the_prefix_cache_and_mean_rows_do_not(checkpoints):
    texts = [" ".join(f"w{i}" for i in range(1, 40)), " ".join(f"w{i}" for i in range(1, 41))]  # shared 39 words
    for name, hits in (("qwen3-last", True), ("llama-mean", False)):
        with LLM(str(checkpoints[name]), **WHOLE, block_size=16) as llm:
            first = llm.embed(texts[0])[0]
            second = llm.embed(texts[1])[0]
            again = llm.embed(texts[0])[0]
        assert first.num_cached_tokens == 0
        assert (second.num_cached_tokens, again.num_cached_tokens) == ((32, 32) if hits else (0, 0))
        torch.testing.assert_close(torch.tensor(again.outputs.embedding), torch.tensor(first.outputs.embedding),
                                   rtol=1e-5, atol=1e-5)


def test_request_level_api_and_refusals(checkpoints):
    with LLM(str(checkpoints["qwen3-classifier"]), **WHOLE) as llm:
        ids = [llm.add_request(t, PoolingParams(), request_id=f"r{i}") for i, t in enumerate(TEXTS)]
        llm.add_request(None, prompt_token_ids=[5, 6, 7], request_id="tokens")
        finished = {}
        while llm.has_unfinished_requests():
            finished.update((o.request_id, o) for o in llm.step())
        assert sorted(finished) == sorted(ids + ["tokens"])
        assert finished["tokens"].num_prompt_tokens == 3 and finished["tokens"].prompt_token_ids == [5, 6, 7]
        assert llm.report()["tokens"]["generated"] == 0
        with pytest.raises(ValueError, match="serves classify, reward"):
            llm.add_request("w1", PoolingParams(task="embed"))
        with pytest.raises(ValueError, match="pass PoolingParams"):
            llm.add_request("w1", SamplingParams())
        with pytest.raises(ValueError, match="use LLM.embed / classify / score / reward"):
            llm.generate("w1")
        with pytest.raises(ValueError, match="max_model_len is 128"):
            llm.add_request(None, prompt_token_ids=[5] * 129)
        assert llm.classify([[5] * 129])[0].error.startswith("prompt 0: input has 129 tokens")
    with LLM("tiny-qwen3", load_format="dummy", max_model_len=64, num_kv_blocks=16) as generator:
        with pytest.raises(ValueError, match="generates: PoolingParams need a pooling model"):
            generator.add_request("w1", PoolingParams())


def test_pooling_engines_keep_only_the_kv_their_prefills_need(checkpoints):
    """A decoder's cache is capped at two steps of prefills in flight; an encoder has none. Both rest on rows
    never needing more than admitted: a full batch of max-length rows runs."""
    with LLM(str(checkpoints["qwen3-last"]), max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4,
             block_size=16) as llm:
        assert llm.info.num_kv_blocks == pooling_kv_blocks(64, 64, 4, 16) < (1 << 30) // llm.info.kv_block_bytes
        outputs = llm.embed([[7] * 64] * 12 + [[8] * 10] * 5)
        assert all(o.error is None for o in outputs)
    with LLM(str(checkpoints["bert-cls"]), max_num_batched_tokens=64, max_num_seqs=3) as llm:
        assert llm.info.num_kv_blocks == 0 and llm.info.pooling.encoder
        assert all(o.error is None for o in llm.embed([[2, 7, 3]] * 10 + [[2] + [9] * 62 + [3]] * 3))
        assert "computes an input whole in one step; raise max_num_batched_tokens" in llm.embed([[9] * 65])[0].error \
            or "max_model_len is 64" in llm.embed([[9] * 65])[0].error
    with LLM(str(checkpoints["bert-cls"]), max_num_batched_tokens=32) as llm:
        assert "computes an input whole in one step; raise max_num_batched_tokens" in llm.embed([[9] * 40])[0].error


def test_causal_lm_embeds_under_the_pooling_runner():
    """A generator's preset becomes a last-token embedder with task="embed" (runner "pooling" alike)."""
    with LLM("tiny-qwen3", load_format="dummy", task="embed", max_model_len=64) as llm:
        assert (llm.pooling.task, llm.pooling.pooling.value) == ("embed", "last")
        (output,) = llm.embed([[3, 4, 5]])
        assert output.outputs.hidden_size == llm.hf_config.hidden_size
        assert abs(torch.tensor(output.outputs.embedding).norm() - 1) < 1e-5


# ---- tensor parallelism ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name, method", [("qwen3-last", "embed"), ("bert-cross-encoder", "score"),
                                          ("xlmr-classifier", "classify")])
def test_tp2_equals_tp1(checkpoints, name, method):
    def run(**engine):
        with LLM(str(checkpoints[name]), **(WHOLE if name.startswith(("bert", "xlmr")) else CHUNKED), **engine) as llm:
            if method == "score":
                return torch.tensor([o.outputs.score for o in llm.score([a for a, _ in PAIRS],
                                                                        [b for _, b in PAIRS])])
            outputs = getattr(llm, method)(LONG_TEXTS)
            return torch.tensor([o.outputs.embedding if method == "embed" else o.outputs.probs for o in outputs])

    torch.testing.assert_close(run(tensor_parallel_size=2), run(), rtol=1e-5, atol=1e-5)


def test_sentence_transformers_lowercase_and_max_seq_length_apply(tmp_path):
    """A checkpoint whose sentence-transformers config lower-cases inputs and cuts them to max_seq_length (over a
    tokenizer that does neither): the engine tokenizes as sentence-transformers does."""
    from sentence_transformers import SentenceTransformer
    from test_pooling_models import WORDS
    from transformers import BertTokenizer

    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                                                   *WORDS])}, do_lower_case=False)
    directory = save_checkpoint(dict(ENCODER, model_type="bert"), tmp_path, "AutoModel", tokenizer)
    save_sentence_transformer(directory, "mean", normalize=False)
    model = SentenceTransformer(str(directory))
    model.max_seq_length, model[0].do_lower_case = 6, True
    model.save(str(directory))
    texts = ["W1 W2 W3 W4 W5 W6 W7 W8", "w9 W10", "W11 w12 W13 W14 W15"]
    reference = SentenceTransformer(str(directory)).encode(texts, convert_to_tensor=True).float()
    with LLM(str(directory)) as llm:
        outputs = llm.embed(texts)
    assert [o.num_prompt_tokens for o in outputs] == [6, 4, 6]
    torch.testing.assert_close(embeddings(outputs), reference, rtol=1e-4, atol=1e-4)
