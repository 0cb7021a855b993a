"""Tests of lowprec_demo.book.models: parameter counts, shapes, initialisation, causality."""

import math

import pytest
import torch

from lowprec_demo.book.models import GPT, GPT_CONFIGS, MLP, GPTConfig, LeNet5, gpt_config


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def quick_model() -> GPT:
    return GPT(gpt_config("nanogpt-quick"), generator=seeded(0)).eval()


@pytest.fixture(scope="module")
def gpt2_model() -> GPT:
    # the one full-size build of the file (~5 s on 2 CPU cores, ~0.5 GB)
    return GPT(gpt_config("gpt2"), generator=seeded(0)).eval()


# ---- configurations ---------------------------------------------------------------------------


def test_named_configs():
    gpt2 = gpt_config("gpt2")
    assert (gpt2.n_layer, gpt2.n_head, gpt2.n_embd, gpt2.block_size) == (12, 12, 768, 1024)
    assert gpt2.vocab_size == 50304 and gpt2.vocab_size % 64 == 0 and gpt2.vocab_size >= 50257
    char = gpt_config("shakespeare-char")
    assert (char.n_layer, char.n_head, char.n_embd) == (6, 6, 384)
    assert (char.block_size, char.vocab_size) == (256, 65)
    assert char.dropout == 0.0
    assert set(GPT_CONFIGS) == {"gpt2", "shakespeare-char", "nanogpt-quick"}


def test_gpt_config_overrides_return_a_copy():
    config = gpt_config("shakespeare-char", vocab_size=96, dropout=0.1)
    assert (config.vocab_size, config.dropout, config.n_layer) == (96, 0.1, 6)
    assert GPT_CONFIGS["shakespeare-char"].vocab_size == 65
    config.n_layer = 1
    assert gpt_config("shakespeare-char").n_layer == 6


def test_gpt_config_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as info:
        gpt_config("gpt5")
    for name in GPT_CONFIGS:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="n_embd"):
        gpt_config("gpt2", n_embed=10)


def test_gpt_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=3, n_embd=16)
    with pytest.raises(ValueError, match="vocab_size"):
        GPTConfig(block_size=8, vocab_size=0, n_layer=1, n_head=2, n_embd=16)


# ---- GPT-2 124M -------------------------------------------------------------------------------


def test_gpt2_parameter_counts_on_meta_device():
    # Counted by hand: V*C + T*C (embeddings) + 12 * 7,087,872 (blocks) + 2*C (ln_f), with
    # C=768, T=1024 and the tied lm_head counted once. 124,439,808 is GPT-2 small's published
    # size; padding the vocabulary to 50304 adds 47 * 768 = 36,096.
    with torch.device("meta"):
        padded = GPT(gpt_config("gpt2"), generator=seeded(0))
        original = GPT(gpt_config("gpt2", vocab_size=50257))
    assert padded.num_params() == 124_475_904
    assert original.num_params() == 124_439_808
    assert padded.num_params() - original.num_params() == 47 * 768
    # nanoGPT's "non-embedding" count leaves out the position embedding
    assert padded.num_params(non_embedding=True) == 124_475_904 - 1024 * 768


def test_gpt2_forward_at_short_context(gpt2_model):
    assert gpt2_model.num_params() == 124_475_904
    g = seeded(1)
    x = torch.randint(0, 50257, (2, 8), generator=g)
    y = torch.randint(0, 50257, (2, 8), generator=g)
    with torch.no_grad():
        logits, loss = gpt2_model(x, y)
    assert logits.shape == (2, 8, 50304)
    assert abs(loss.item() - math.log(50304)) < 0.3


# ---- GPT structure ----------------------------------------------------------------------------


def test_parameter_names_follow_nanogpt(quick_model):
    names = {name for name, _ in quick_model.named_parameters()}
    for name in [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.h.0.ln_1.weight",
        "transformer.h.0.ln_1.bias",
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.0.attn.c_attn.bias",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.ln_2.weight",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.0.mlp.c_proj.weight",
        "transformer.h.3.mlp.c_proj.bias",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    ]:
        assert name in names, name
    # lm_head is tied to the token embedding, so it is not a separate parameter
    assert quick_model.lm_head.weight is quick_model.transformer.wte.weight
    assert "lm_head.weight" not in names


def test_forward_shapes_and_loss(quick_model):
    config = quick_model.config
    x = torch.randint(0, config.vocab_size, (3, config.block_size), generator=seeded(2))
    with torch.no_grad():
        logits, loss = quick_model(x)
    assert logits.shape == (3, config.block_size, config.vocab_size)
    assert loss is None
    with torch.no_grad():
        logits, loss = quick_model(x[:, :10], x[:, 1:11])
    assert logits.shape == (3, 10, config.vocab_size)
    assert loss.shape == () and torch.isfinite(loss)


def test_context_longer_than_block_size_is_rejected(quick_model):
    x = torch.zeros(1, quick_model.config.block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="block_size"):
        quick_model(x)


@pytest.mark.parametrize("name", ["nanogpt-quick", "shakespeare-char"])
def test_loss_at_init_is_log_vocab(name):
    # With N(0, 0.02) weights the logits are nearly equal, so the loss is about ln(vocab_size).
    config = gpt_config(name)
    model = GPT(config, generator=seeded(3)).eval()
    g = seeded(4)
    x = torch.randint(0, config.vocab_size, (4, 32), generator=g)
    y = torch.randint(0, config.vocab_size, (4, 32), generator=g)
    with torch.no_grad():
        _, loss = model(x, y)
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.25


def test_same_generator_seed_gives_identical_weights():
    config = gpt_config("nanogpt-quick")
    a = GPT(config, generator=seeded(7)).state_dict()
    torch.manual_seed(123)  # the global RNG must not matter
    b = GPT(config, generator=seeded(7)).state_dict()
    c = GPT(config, generator=seeded(8)).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["transformer.wte.weight"], c["transformer.wte.weight"])


def test_gpt2_style_initialisation(quick_model):
    n_layer = quick_model.config.n_layer
    params = dict(quick_model.named_parameters())
    assert torch.equal(params["transformer.h.0.ln_1.weight"], torch.ones(128))
    assert torch.equal(params["transformer.h.0.ln_1.bias"], torch.zeros(128))
    assert torch.equal(params["transformer.h.0.attn.c_attn.bias"], torch.zeros(3 * 128))
    # sample standard deviations of 16k-65k draws are within a few percent of the target
    c_attn = params["transformer.h.0.attn.c_attn.weight"]
    assert c_attn.std().item() == pytest.approx(0.02, rel=0.05)
    assert params["transformer.wte.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / math.sqrt(2 * n_layer)
    for name in ("transformer.h.0.attn.c_proj.weight", "transformer.h.1.mlp.c_proj.weight"):
        assert params[name].std().item() == pytest.approx(residual, rel=0.05)


def test_attention_is_causal(quick_model):
    config = quick_model.config
    x = torch.randint(0, config.vocab_size, (2, 20), generator=seeded(5))
    changed = x.clone()
    changed[:, 12] = (changed[:, 12] + 1) % config.vocab_size
    with torch.no_grad():
        before, _ = quick_model(x)
        after, _ = quick_model(changed)
    torch.testing.assert_close(before[:, :12], after[:, :12], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, 12:], after[:, 12:])


def test_gpt_trains_on_a_repeated_batch():
    config = gpt_config("nanogpt-quick", n_layer=1)
    model = GPT(config, generator=seeded(0))
    x = torch.randint(0, config.vocab_size, (4, 16), generator=seeded(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        _, loss = model(x[:, :-1], x[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


# ---- MLP and LeNet-5 --------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh"])
def test_mlp_shapes_and_seeding(activation):
    a = MLP([784, 32, 16, 10], activation, generator=seeded(0))
    b = MLP([784, 32, 16, 10], activation, generator=seeded(0))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    images = torch.rand(5, 1, 28, 28, generator=seeded(1))
    out = a(images)
    assert out.shape == (5, 10)
    torch.testing.assert_close(out, a(images.flatten(1)))
    assert sum(p.numel() for p in a.parameters()) == 784 * 32 + 32 + 32 * 16 + 16 + 16 * 10 + 10
    # PyTorch's default: every weight and bias lies in [-1/sqrt(fan_in), 1/sqrt(fan_in)]
    first = a.layers[0]
    assert first.weight.abs().max() <= 1 / math.sqrt(784)
    assert first.bias.abs().max() <= 1 / math.sqrt(784)


def test_mlp_rejects_bad_arguments():
    with pytest.raises(ValueError, match="relu"):
        MLP([4, 2], activation="sigmoid")
    with pytest.raises(ValueError, match="sizes"):
        MLP([4])


def test_lenet5_shapes_parameters_and_seeding():
    a = LeNet5(generator=seeded(0))
    b = LeNet5(generator=seeded(0))
    c = LeNet5(generator=seeded(1))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.conv1.weight, c.conv1.weight)
    # conv1 156 + conv2 2,416 + fc1 48,120 + fc2 10,164 + fc3 850
    assert sum(p.numel() for p in a.parameters()) == 61_706
    assert a(torch.rand(8, 1, 28, 28)).shape == (8, 10)
    assert LeNet5(num_classes=3, generator=seeded(0))(torch.rand(2, 1, 28, 28)).shape == (2, 3)
