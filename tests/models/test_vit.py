"""Vision transformers: shapes, determinism, blocks, the ViT recipe's parameter groups, K-FAC's coverage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kaisoku.config import Config, OptimConfig
from kaisoku.errors import ConfigError
from kaisoku.memory.checkpointing import apply_recompute
from kaisoku.models.blocks import check_blocks_cover, ordered_blocks, run_blocks
from kaisoku.models.vit import build_vit, default_patch
from kaisoku.models.zoo import block_count, build_model
from kaisoku.optim.factory import build_optimizer, param_groups
from kaisoku.optim.kfac import KFAC
from kaisoku.presets import get_preset
from kaisoku.run_facts import check_config


def tiny(in_channels: int = 1, image_size: int = 16, seed: int = 0) -> nn.Module:
    """vit-tiny cut to 2 layers of width 32 (2 heads), head initialised so that gradients reach the body."""
    torch.manual_seed(seed)
    model = build_vit(
        "vit-tiny", num_classes=5, image_size=image_size, in_channels=in_channels, layers=2, width=32, heads=2
    )
    nn.init.normal_(model.heads.head.weight, std=0.02)
    return model


def test_named_shapes_and_patch_from_the_image_size() -> None:
    with torch.device("meta"):
        vit = build_model("vit-tiny", num_classes=10, in_channels=1, size=32)
        b16 = build_model("vit-b16", num_classes=7)
        big = build_model("vit-tiny", num_classes=10, size=96)
    assert (vit.hidden_dim, vit.patch_size, vit.image_size, vit.mlp_dim) == (192, 4, 32, 768)
    assert len(vit.encoder.layers) == 6 and vit.encoder.layers[0].num_heads == 3
    assert vit.conv_proj.in_channels == 1 and vit.encoder.pos_embedding.shape == (1, 65, 192)
    assert (b16.hidden_dim, b16.patch_size, b16.image_size, len(b16.encoder.layers)) == (768, 16, 224, 12)
    assert b16.conv_proj.in_channels == 3 and b16.heads.head.out_features == 7
    assert big.patch_size == 8 and [default_patch(s) for s in (32, 64, 128, 224)] == [4, 4, 8, 16]
    assert block_count("vit-tiny") == 8 and block_count("vit-b16") == 14


def test_grayscale_forward_blocks_and_determinism() -> None:
    model = tiny().eval()
    x = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    out = model(x)
    assert out.shape == (3, 5)
    blocks = ordered_blocks(model)
    assert len(blocks) == 4  # embedding, 2 encoder layers, norm + head
    check_blocks_cover(model, blocks)
    torch.testing.assert_close(run_blocks(blocks, x), out)
    # The class token and position embedding live in the first block, so the first stage sends one tensor.
    first = dict(blocks[0].named_parameters())
    assert {"class_token", "pos_embedding"} <= set(first)
    assert run_blocks(blocks[:1], x).shape == (3, 1 + 16, 32)
    again = tiny().eval()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert torch.equal(again(x), out)
    assert not torch.equal(tiny(seed=1).eval()(x), out)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"image_size": 30}, r"image size 30 px is not a multiple of its patch size 4 px"),
        ({"width": 30, "heads": 4}, r"width 30 is not divisible by its 4 attention heads"),
    ],
)
def test_bad_shapes_name_both_numbers(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_vit("vit-tiny", num_classes=2, **kwargs)
    with pytest.raises(ConfigError, match="unknown model 'vit-huge'.*vit-tiny, vit-b16"):
        build_model("vit-huge", num_classes=2)


def test_recipe_keeps_norms_biases_and_embeddings_out_of_weight_decay() -> None:
    model = tiny()
    groups = param_groups(model, weight_decay=0.05)
    decay = {name for name, _ in groups[0]["params"]}
    no_decay = {name for name, _ in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.05 and groups[1]["weight_decay"] == 0.0
    assert {"class_token", "encoder.pos_embedding", "encoder.ln.weight", "heads.head.bias"} <= no_decay
    assert "encoder.layers.encoder_layer_0.self_attention.in_proj_bias" in no_decay
    assert {"conv_proj.weight", "heads.head.weight"} <= decay
    assert "encoder.layers.encoder_layer_1.self_attention.in_proj_weight" in decay
    assert "encoder.layers.encoder_layer_1.mlp.0.weight" in decay
    assert decay.isdisjoint(no_decay) and len(decay) + len(no_decay) == len(list(model.parameters()))
    # The preset: AdamW, warmup + cosine, label smoothing, vit-tiny at 32 px; LAMB takes the same groups.
    preset = get_preset("vit-tiny-shapes")
    assert (preset.model.name, preset.data.image_size, preset.optim.name) == ("vit-tiny", 32, "adamw")
    assert (
        preset.sched.name == "cosine" and preset.sched.warmup_epochs > 0 and preset.train.label_smoothing > 0
    )
    lamb = build_optimizer(model, OptimConfig(name="lamb", lr=1e-3, weight_decay=0.05))
    assert [g["weight_decay"] for g in lamb.param_groups] == [0.05, 0.0]


def test_kfac_preconditions_the_linear_layers_and_names_the_attention_it_skips() -> None:
    model = tiny()
    kfac = KFAC(model, lr=0.1, damping=0.01, factor_update_steps=1, inv_update_steps=1)
    names = set(kfac.layers)
    assert {"conv_proj", "heads.head", "encoder.layers.encoder_layer_0.mlp.0"} <= names
    assert {"encoder.layers.encoder_layer_1.mlp.3"} <= names
    # nn.MultiheadAttention runs its projections inside one functional call: left out, out_proj included.
    assert not any("self_attention" in name for name in names)
    attention = [s for s in kfac.skipped_layers if "self_attention" in s]
    assert len(attention) == 2 and all("MultiheadAttention" in s for s in attention)
    x = torch.randn(8, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    y = torch.arange(8) % 5
    nn.functional.cross_entropy(model(x), y).backward()
    plain = model.encoder.layers[0].mlp[0].weight.grad.clone()
    kfac.step()
    assert all(kfac.layers[n].factors[0] is not None for n in names)
    assert not torch.allclose(model.encoder.layers[0].mlp[0].weight.grad, plain)


def test_recompute_on_vit_gives_the_same_gradients() -> None:
    x = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(3))
    y = torch.arange(4) % 5
    grads = []
    for mode in ("none", "full"):
        model = tiny()
        assert apply_recompute(model, mode) == ([] if mode == "none" else [0, 1, 2, 3])
        nn.functional.cross_entropy(model(x), y).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_pipeline_degree_above_the_vit_block_count_is_one_line() -> None:
    cfg = Config()
    cfg.model.name = "vit-tiny"
    cfg.data.image_size = 32
    cfg.data.global_batch = 64
    cfg.parallel.microbatches = 16
    cfg.parallel.dp = 1
    cfg.parallel.pp = 8
    check_config(cfg, 8)  # 8 blocks: one a stage
    cfg.data.image_size = 30
    with pytest.raises(ConfigError, match=r"image size 30 px is not a multiple of its patch size 4 px"):
        check_config(cfg, 8)  # before any rank starts
    cfg.data.image_size = 32
    cfg.parallel.pp = 16
    with pytest.raises(
        ConfigError,
        match=r"layout pp16 needs 16 pipeline stages .* the model has only 8 blocks; use at most 8",
    ):
        check_config(cfg, 16)


def test_a_volume_set_for_a_vit_is_one_line_naming_both(tmp_path) -> None:
    from kaisoku.data.cosmo import ensure_cosmo_dataset

    packed = ensure_cosmo_dataset(tmp_path, count=4, size=8)
    cfg = Config()
    cfg.model.name = "vit-tiny"
    cfg.data.path = str(packed)
    cfg.data.image_size = 32
    with pytest.raises(ConfigError, match=r"holds volumes .*regression.* model.name vit-tiny is a 2D image"):
        check_config(cfg, 2)


def test_the_vit_recipe_from_python() -> None:
    from kaisoku.optim.recipe import large_batch

    model = tiny()
    optimizer, scheduler, loss_fn = large_batch(
        model,
        base_lr=1e-3,
        batch=256,
        epochs=2,
        steps_per_epoch=10,
        optimizer="adamw",
        schedule="cosine",
        warmup_epochs=0.5,
        weight_decay=0.05,
        zero_init_residual=False,
    )
    assert isinstance(optimizer, torch.optim.AdamW) and loss_fn.label_smoothing == 0.1
    decay, no_decay = optimizer.param_groups
    assert "class_token" in no_decay["param_names"] and no_decay["weight_decay"] == 0.0
    assert "conv_proj.weight" in decay["param_names"] and decay["weight_decay"] == 0.05
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] < lrs[4] == pytest.approx(1e-3) and lrs[-1] < 0.05 * lrs[4]
