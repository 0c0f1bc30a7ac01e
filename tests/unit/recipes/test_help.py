"""``--help``: every config group with its options and default, and the keys most runs touch, one
line each, each a key the composed config has, declared once in the schema (``common=``)."""

from omegaconf import OmegaConf

from recipes.compose import CONF_DIR, compose
from recipes.help import common_keys, page
from recipes.schema import Config


def test_the_page_lists_every_group_with_its_default_and_the_common_keys():
    text = page()
    lines = text.splitlines()
    groups = [line.split()[0] for line in lines if line.startswith("  ") and "=" in line.split()[0]]
    folders = sorted(path.name for path in CONF_DIR.iterdir() if path.is_dir())
    assert groups == [f"{folder}=" for folder in folders]
    assert "  model=      llama*, mixtral, pretrained, qwen3, qwen3_moe, smollm2" in lines
    assert any(line.startswith("  experiment= ") and "regression/NAME (" in line for line in lines)
    start = lines.index("Keys most runs touch (KEY=VALUE; types and ranges: recipes/schema.py):")
    listed = [line.split()[0] for line in lines[start + 1 : lines.index("", start)]]
    keys = [name for name, _ in common_keys(Config)]
    assert listed == keys
    assert len(set(keys)) == len(keys) and len(keys) >= 20
    assert {"tp", "dp", "train.max_steps", "optim.lr", "checkpoint.resume", "output_dir"} <= set(
        keys
    )
    assert "  tp" in text and "tensor-parallel size" in text and "--cfg job" in text


def test_every_listed_key_is_a_key_of_the_composed_config():
    composed = compose([])
    for key, sets in common_keys(Config):
        assert OmegaConf.select(composed, key, default=KeyError) is not KeyError, key
        assert sets and "\n" not in sets
