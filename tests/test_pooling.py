"""Pooling math, outputs and task detection (nanovllm.pooling) against plain torch references and the rules of
vLLM and sentence-transformers; the models themselves are compared with HF in test_pooling_models.py."""
import json

import pytest
import torch
from transformers import AutoConfig

from nanovllm.pooling import (
    PoolingMethod,
    PoolingState,
    activate,
    check_dimensions,
    classifier_activation,
    embedding_output,
    labels_of,
    pool_sequences,
    read_sentence_transformers_config,
    resolve_task,
)

LENGTHS = [5, 1, 12, 7]


def reference_pool(sequence: torch.Tensor, method: str) -> torch.Tensor:
    return {"last": sequence[-1], "cls": sequence[0], "mean": sequence.mean(0)}[method]


def flat_batch(lengths, hidden=8, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    sequences = [torch.randn(n, hidden, dtype=dtype) for n in lengths]
    return sequences


@pytest.mark.parametrize("method", list(PoolingMethod))
def test_pool_sequences_matches_per_sequence_reference(method):
    sequences = flat_batch(LENGTHS)
    # Sequences in the flat batch out of order, with tokens of other rows between them.
    filler = torch.randn(3, 8)
    hidden = torch.cat([filler, sequences[2], sequences[0], filler, sequences[3], sequences[1]])
    starts = torch.tensor([3 + 12, 3 + 12 + 5 + 3 + 7, 3, 3 + 12 + 5 + 3])
    pooled = pool_sequences(hidden, starts, torch.tensor(LENGTHS), method)
    expected = torch.stack([reference_pool(s, method.value) for s in sequences])
    torch.testing.assert_close(pooled, expected)


@pytest.mark.parametrize("method", list(PoolingMethod))
@pytest.mark.parametrize("chunk", [1, 3, 5, 100])
def test_pooling_state_over_chunks_equals_whole_sequences(method, chunk):
    """Sequences fed in chunks of `chunk` tokens, several rows per step, rows finishing at different steps (and a
    row reused for a second sequence), pool as the whole sequences do; bf16 hidden states accumulate in fp32."""
    sequences = flat_batch(LENGTHS + [4], dtype=torch.bfloat16)
    row_of = [2, 0, 5, 1, 2]  # the last sequence takes row 2 after the first one finished
    state = PoolingState(method, max_rows=6, hidden_size=8)
    done, results = [0] * len(sequences), {}
    active = [0, 1, 2, 3]
    while active:
        parts = [(i, sequences[i][done[i]:done[i] + chunk]) for i in active]
        hidden = torch.cat([p for _, p in parts])
        lengths = torch.tensor([len(p) for _, p in parts])
        starts = torch.cumsum(lengths, 0) - lengths
        state.update(torch.tensor([row_of[i] for i, _ in parts]), hidden, starts, lengths,
                     torch.tensor([done[i] == 0 for i, _ in parts]), num_tokens=len(hidden))
        for i, part in parts:
            done[i] += len(part)
            if done[i] == len(sequences[i]):
                results[i] = state.result(torch.tensor([row_of[i]]))[0]
        active = [i for i in active if done[i] < len(sequences[i])]
        if 0 not in active and 4 not in results and 4 not in active:
            active.append(4)
    for i, sequence in enumerate(sequences):
        torch.testing.assert_close(results[i], reference_pool(sequence.float(), method.value))


def test_embedding_output_truncates_then_normalizes():
    pooled = torch.tensor([[3.0, 4.0, 12.0], [1.0, 0.0, 5.0]])
    torch.testing.assert_close(embedding_output(pooled, normalize=True, dimensions=2),
                               torch.tensor([[0.6, 0.8], [1.0, 0.0]]))
    torch.testing.assert_close(embedding_output(pooled, normalize=True), pooled / pooled.norm(dim=1, keepdim=True))
    assert torch.equal(embedding_output(pooled, normalize=False, dimensions=1), pooled[:, :1])


def test_dimensions_follow_vllms_matryoshka_rules():
    config = AutoConfig.for_model("qwen3", hidden_size=64)
    check_dimensions(None, config, 64)
    with pytest.raises(ValueError, match="does not declare Matryoshka"):
        check_dimensions(32, config, 64)
    config.is_matryoshka = True
    check_dimensions(32, config, 64)
    for bad, why in ((65, "exceeds the model's embedding size 64"), (0, "positive integer"),
                     (True, "positive integer")):
        with pytest.raises(ValueError, match=why):
            check_dimensions(bad, config, 64)
    config.matryoshka_dimensions = [16, 32]
    check_dimensions(16, config, 64)
    with pytest.raises(ValueError, match=r"allows only \[16, 32\]"):
        check_dimensions(24, config, 64)


def test_classifier_activation_and_labels_from_the_config():
    config = AutoConfig.for_model("qwen3", num_labels=3, id2label={0: "neg", 1: "neutral", 2: "pos"})
    assert classifier_activation(config) == "softmax" and labels_of(config) == ("neg", "neutral", "pos")
    config.problem_type = "multi_label_classification"
    assert classifier_activation(config) == "sigmoid"
    one = AutoConfig.for_model("llama", num_labels=1)
    assert classifier_activation(one) == "sigmoid" and labels_of(one) == ("LABEL_0",)
    logits = torch.tensor([[1.0, -2.0, 0.5]])
    torch.testing.assert_close(activate(logits, "softmax"), torch.softmax(logits, -1))
    torch.testing.assert_close(activate(logits, "sigmoid"), torch.sigmoid(logits))
    assert torch.equal(activate(logits, "none"), logits)
    with pytest.raises(ValueError, match="expected one of softmax, sigmoid, none"):
        activate(logits, "tanh")


# ---- sentence-transformers configs ----------------------------------------------------------------------------

TRANSFORMER = {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.base.modules.transformer.Transformer"}
POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


def write_st(directory, modules, pooling=None, settings=None, inputs=None):
    (directory / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (directory / "1_Pooling").mkdir(exist_ok=True)
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if settings is not None:
        (directory / "config_sentence_transformers.json").write_text(json.dumps(settings))
    if inputs is not None:
        (directory / "sentence_bert_config.json").write_text(json.dumps(inputs))
    return directory


@pytest.mark.parametrize("pooling, expected", [
    ({"pooling_mode": "mean"}, PoolingMethod.MEAN),
    ({"pooling_mode": ["lasttoken"]}, PoolingMethod.LAST),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, PoolingMethod.CLS),  # legacy keys
    ({"pooling_mode_lasttoken": True}, PoolingMethod.LAST),
    ({"word_embedding_dimension": 8}, PoolingMethod.MEAN),  # legacy, no mode set: sentence-transformers' default
])
def test_sentence_transformers_pooling_modes(tmp_path, pooling, expected):
    write_st(tmp_path, [TRANSFORMER, POOLING, NORMALIZE], pooling, inputs={"max_seq_length": 128, "do_lower_case": True})
    st = read_sentence_transformers_config(tmp_path, AutoConfig.for_model("bert"))
    assert (st.pooling, st.normalize, st.cross_encoder, st.max_seq_length, st.lowercase) == (expected, True, False,
                                                                                             128, True)


@pytest.mark.parametrize("modules, pooling, message", [
    ([TRANSFORMER, POOLING], {"pooling_mode": "max"}, "pooling mode 'max' .* not supported"),
    ([TRANSFORMER, POOLING], {"pooling_mode": ["cls", "mean"]}, r"pooling mode \['cls', 'mean'\]"),
    ([TRANSFORMER, POOLING], {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "pooling mode"),
    ([TRANSFORMER, POOLING], {"pooling_mode": "mean", "include_prompt": False}, "include_prompt false"),
    ([TRANSFORMER, POOLING, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
     {"pooling_mode": "mean"}, "module 'sentence_transformers.models.Dense' .* only Transformer, Pooling, Normalize"),
    ([dict(TRANSFORMER, path="0_Transformer"), POOLING], {"pooling_mode": "mean"}, "in '0_Transformer'"),
    ([TRANSFORMER], None, "has no Pooling module"),
])
def test_unsupported_sentence_transformers_configs_are_named(tmp_path, modules, pooling, message):
    write_st(tmp_path, modules, pooling)
    with pytest.raises(ValueError, match=message):
        read_sentence_transformers_config(tmp_path, AutoConfig.for_model("bert"))


def test_cross_encoder_configs(tmp_path):
    assert read_sentence_transformers_config(tmp_path, AutoConfig.for_model("bert")) is None
    legacy = AutoConfig.for_model("bert", sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    st = read_sentence_transformers_config(tmp_path, legacy)
    assert st.cross_encoder and st.activation == "none"
    write_st(tmp_path, [TRANSFORMER], settings={"model_type": "CrossEncoder",
                                                "activation_fn": "torch.nn.modules.activation.Sigmoid"})
    st = read_sentence_transformers_config(tmp_path, AutoConfig.for_model("bert"))
    assert st.cross_encoder and st.activation == "sigmoid" and st.pooling is None
    write_st(tmp_path, [TRANSFORMER], settings={"model_type": "CrossEncoder", "activation_fn": "torch.nn.Tanh"})
    with pytest.raises(ValueError, match="activation_fn 'torch.nn.Tanh' is not supported"):
        read_sentence_transformers_config(tmp_path, AutoConfig.for_model("bert"))


# ---- task detection -------------------------------------------------------------------------------------------

def config_of(architecture: str, model_type: str, **fields):
    return AutoConfig.for_model(model_type, architectures=[architecture], hidden_size=64, **fields)


@pytest.mark.parametrize("architecture, model_type, num_labels, task, tasks, pooling, activation", [
    ("Qwen3ForSequenceClassification", "qwen3", 3, "classify", ("classify", "reward"), "last", "softmax"),
    ("LlamaForSequenceClassification", "llama", 1, "reward", ("classify", "reward", "score"), "last", "none"),
    ("BertForSequenceClassification", "bert", 1, "score", ("classify", "reward", "score"), "cls", "sigmoid"),
    ("XLMRobertaForSequenceClassification", "xlm-roberta", 2, "classify", ("classify", "reward"), "cls", "softmax"),
])
def test_classifier_tasks(architecture, model_type, num_labels, task, tasks, pooling, activation):
    spec = resolve_task(config_of(architecture, model_type, num_labels=num_labels), None)
    assert (spec.task, spec.tasks, spec.pooling.value, spec.model_kind, spec.output_size) == (task, tasks, pooling,
                                                                                             "classify", num_labels)
    assert spec.activation(task) == activation and spec.activation("reward") == "none"
    assert len(spec.labels) == num_labels


def test_a_sentence_transformers_cross_encoder_scores(tmp_path):
    write_st(tmp_path, [TRANSFORMER], settings={"model_type": "CrossEncoder",
                                                "activation_fn": "torch.nn.modules.linear.Identity"})
    spec = resolve_task(config_of("Qwen3ForSequenceClassification", "qwen3", num_labels=1), tmp_path)
    assert spec.task == "score" and spec.activation("score") == "none" and spec.activation("classify") == "sigmoid"


@pytest.mark.parametrize("architecture, model_type, pooling", [
    ("BertModel", "bert", "cls"), ("XLMRobertaModel", "xlm-roberta", "cls"), ("Qwen3Model", "qwen3", "last"),
    ("MistralModel", "mistral", "last"), ("Gemma3TextModel", "gemma3_text", "last"),
])
def test_base_models_embed(architecture, model_type, pooling):
    spec = resolve_task(config_of(architecture, model_type), None)
    assert (spec.task, spec.tasks, spec.pooling.value, spec.normalize, spec.output_size, spec.model_kind) == (
        "embed", ("embed", "score"), pooling, True, 64, "embed")


def test_causal_lm_generates_unless_asked_or_a_sentence_transformer(tmp_path):
    config = config_of("Qwen3ForCausalLM", "qwen3")
    assert resolve_task(config, tmp_path) is None
    assert resolve_task(config, tmp_path, runner="pooling").task == "embed"
    assert resolve_task(config, tmp_path, task="score").task == "score"
    write_st(tmp_path, [TRANSFORMER, POOLING], {"pooling_mode": "mean"})
    spec = resolve_task(config, tmp_path)
    assert (spec.task, spec.pooling, spec.normalize) == ("embed", PoolingMethod.MEAN, False)
    assert resolve_task(config, tmp_path, runner="generate") is None


@pytest.mark.parametrize("architecture, model_type, kwargs, message", [
    ("BertModel", "bert", dict(task="classify"), r"task='classify' needs a sequence-classification checkpoint"),
    ("Qwen3ForCausalLM", "qwen3", dict(task="reward"),
     r"task='reward' needs a sequence-classification .* a causal LM, which pools as an embedder serving embed, score"),
    ("Qwen3ForSequenceClassification", "qwen3", dict(task="embed"), r"task='embed' needs an embedding checkpoint"),
    ("Qwen3ForSequenceClassification", "qwen3", dict(task="score"), r"classifier of 2 labels serving classify, reward"),
    ("BertModel", "bert", dict(runner="generate", task="embed"), "needs runner='pooling'"),
    ("BertModel", "bert", dict(runner="encode"), "runner='encode': expected one of 'auto', 'generate', 'pooling'"),
    ("BertModel", "bert", dict(task="rerank"), "task='rerank': expected one of"),
    ("GPT2Model", "gpt2", {}, "GPT2Model is not supported"),
])
def test_task_errors_name_the_fix(architecture, model_type, kwargs, message):
    config = config_of(architecture, model_type, num_labels=2) if "Classification" in architecture \
        else config_of(architecture, model_type)
    with pytest.raises(ValueError, match=message):
        resolve_task(config, None, **kwargs)


def test_generation_of_a_pooling_architecture_is_refused_with_the_task_to_use():
    from nanovllm.models.registry import model_class_for

    with pytest.raises(ValueError, match="BertModel is a pooling model, not a generate model: run it with task embed"):
        model_class_for(config_of("BertModel", "bert"))
    with pytest.raises(ValueError, match="run it with task classify, score or reward"):
        model_class_for(config_of("Qwen2ForSequenceClassification", "qwen2"), "embed")


def test_pooling_models_cost_their_matmuls_not_their_tables():
    """bench's roofline FLOPs (models/costs.py) of models without an LM head, counted by hand: a BERT encoder
    (its word, position and token-type tables are gathered from) and a Qwen3 embedder."""
    from nanovllm.models.costs import weight_costs
    from nanovllm.models.registry import model_class_for

    h, inter, layers = 64, 128, 2
    bert = AutoConfig.for_model("bert", architectures=["BertModel"], hidden_size=h, intermediate_size=inter,
                                num_hidden_layers=layers, num_attention_heads=4)
    costs = weight_costs(model_class_for(bert, "embed")(bert))
    assert costs.flops_per_token() == 2 * layers * (4 * h * h + 2 * h * inter)
    # + biases (q|k|v, o, intermediate, output) and the two LayerNorms' weight and bias, in fp32
    assert costs.shared_bytes == 4 * (layers * (4 * h * h + 2 * h * inter + 3 * h + h + inter + h + 4 * h) + 2 * h)
    qwen3 = AutoConfig.for_model("qwen3", architectures=["Qwen3Model"], hidden_size=h, intermediate_size=inter,
                                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 vocab_size=512)
    costs = weight_costs(model_class_for(qwen3, "embed")(qwen3))
    assert costs.flops_per_token() == 2 * layers * (h * (64 + 2 * 32) + 64 * h + 3 * h * inter)
