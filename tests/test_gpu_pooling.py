"""Pooling through the engine on a CUDA device (`pytest -m gpu`, run by scripts/gpu_check.sh's pooling stage):
embeddings and scores of tiny random-weight checkpoints against sentence-transformers on the CPU, in fp32
(cosine >= 0.9999, scores within 1e-4) and in bf16 (cosine >= 0.999), whole and chunked, sync and async."""
import pytest
import torch
from test_pooling_models import DECODER, ENCODER, PAIRS, TEXTS, bert_tokenizer, save_checkpoint, save_sentence_transformer

from nanovllm import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LONG_TEXTS = TEXTS + [" ".join(f"w{i % 90}" for i in range(7, 57))]


def cosine(ours: list[list[float]], reference: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(ours), reference.float().cpu(), dim=-1).min())


@pytest.mark.parametrize("family, config, pooling", [("qwen3", DECODER, "lasttoken"), ("qwen3", DECODER, "mean"),
                                                     ("bert", ENCODER, "cls")])
def test_embeddings_on_cuda_match_sentence_transformers(tmp_path, family, config, pooling):
    from sentence_transformers import SentenceTransformer

    directory = save_checkpoint(dict(config, model_type=family), tmp_path, "AutoModel", bert_tokenizer())
    save_sentence_transformer(directory, pooling, normalize=True)
    reference = SentenceTransformer(str(directory), device="cpu").encode(LONG_TEXTS, convert_to_tensor=True)
    for dtype, bound in (("float32", 0.9999), ("bfloat16", 0.999)):
        for engine in ({}, {"max_num_batched_tokens": 16, "max_num_seqs": 3, "async_scheduling": True}):
            if family == "bert" and engine:
                continue  # an encoder computes rows whole
            with LLM(str(directory), dtype=dtype, **engine) as llm:
                ours = [o.outputs.embedding for o in llm.embed(LONG_TEXTS)]
            assert cosine(ours, reference) >= bound, (dtype, engine)


def test_cross_encoder_scores_on_cuda_match_sentence_transformers(tmp_path):
    from sentence_transformers import CrossEncoder

    hf = save_checkpoint(dict(ENCODER, model_type="bert", num_labels=1), tmp_path / "hf",
                         "AutoModelForSequenceClassification", bert_tokenizer())
    CrossEncoder(str(hf)).save(str(tmp_path / "ce"))
    reference = CrossEncoder(str(tmp_path / "ce"), device="cpu").predict(PAIRS, convert_to_tensor=True).float().cpu()
    with LLM(str(tmp_path / "ce"), dtype="float32") as llm:
        scores = [o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS])]
    torch.testing.assert_close(torch.tensor(scores), reference, rtol=0, atol=1e-4)
