"""Config tree: overrides, TOML, validation, help text."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kaisoku import config as c
from kaisoku.errors import ConfigError
from kaisoku.presets import PRESETS, get_preset
from kaisoku.run_facts import check_config


def test_every_field_has_help_text() -> None:
    missing = [key for key, _, _, doc in c.iter_fields() if not doc]
    assert missing == []


def test_override_converts_to_field_type() -> None:
    cfg = c.Config()
    c.apply_override(cfg, "optim.lr", "0.25")
    c.apply_override(cfg, "train.grad-accum", "4")
    c.apply_override(cfg, "optim.nesterov", "true")
    c.apply_override(cfg, "sched.step_milestones", "0.3,0.6")
    assert cfg.optim.lr == 0.25
    assert cfg.train.grad_accum == 4
    assert cfg.optim.nesterov is True
    assert cfg.sched.step_milestones == [0.3, 0.6]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("optim.lrr", "1", "unknown config key 'optim.lrr': optim has name, lr"),
        ("nosuch.lr", "1", "the config has run_dir, model"),
        ("optim.name", "adam", "choose one of: sgd, lars, lamb, adamw"),
        ("optim.kfac.factor-dtype", "float16", "choose one of: float32, bfloat16"),
        ("train.epochs", "many", "train.epochs: 'many' is not a float"),
        ("train.grad_accum", "1.5", "is not an int"),
        ("optim.nesterov", "maybe", "use true or false"),
        ("optim", "1", "is a section"),
    ],
)
def test_bad_override_names_key_and_choices(key: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        c.apply_override(c.Config(), key, value)


def test_toml_round_trip(tmp_path: Path) -> None:
    cfg = c.Config()
    c.apply_override(cfg, "optim.lr", "0.5")
    c.apply_override(cfg, "model.name", "resnet18")
    path = tmp_path / "run.toml"
    path.write_text(c.to_toml(cfg))
    loaded = c.Config()
    c.apply_mapping(loaded, c.load_toml(path))
    assert loaded == cfg
    assert tomllib.loads(c.to_toml(cfg))["optim"]["lr"] == 0.5


def test_toml_unknown_section_and_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown config section 'optimizer'; sections: model, data"):
        c.apply_mapping(c.Config(), {"optimizer": {"lr": 1.0}})
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr = ")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        c.load_toml(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        c.load_toml(tmp_path / "missing.toml")


def test_validate_names_the_field(tmp_path: Path) -> None:
    cfg = c.Config()
    cfg.optim.lr = 0.0
    with pytest.raises(ConfigError, match=r"optim.lr must be > 0"):
        check_config(cfg)
    cfg = c.Config()
    cfg.data.path = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="data.path .* does not exist"):
        check_config(cfg)


def test_presets_are_valid_and_unknown_preset_lists_choices() -> None:
    for name in PRESETS:
        check_config(get_preset(name))
    with pytest.raises(ConfigError, match="choose one of: cpu-demo"):
        get_preset("nope")


def test_a_removed_setting_says_why_and_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^data.crop_decode was removed: .*remove the setting$") as info:
        c.apply_override(c.Config(), "data.crop-decode", "true")
    assert "\n" not in str(info.value)
    config = tmp_path / "old.toml"
    config.write_text("[data]\ncrop_decode = true\n")
    with pytest.raises(ConfigError, match="data.crop_decode was removed"):
        c.apply_mapping(c.Config(), c.load_toml(config))
