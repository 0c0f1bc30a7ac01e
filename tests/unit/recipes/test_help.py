"""``--help``: what the recipe does, every config group with its options and default (of
``data=``, the ones the recipe reads), and the keys most runs touch that the recipe reads, one line
each, each a key the composed config has, declared once in the schema (``common=``)."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from components.data.checks import checked_source
from recipes.compose import CONF_DIR, compose, compose_distill, compose_dpo, mix_kinds
from recipes.distill_schema import DistillConfig
from recipes.dpo_schema import DpoConfig
from recipes.help import PAGES, common_keys, page
from recipes.schema import Config

RECIPES = {
    "finetune.py": (compose, Config),
    "dpo.py": (compose_dpo, DpoConfig),
    "distill.py": (compose_distill, DistillConfig),
}


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


def data_options(text: str) -> list[str]:
    [line] = [line for line in text.splitlines() if line.startswith("  data=")]
    return [name.strip().rstrip("*") for name in line.removeprefix("  data=").split(",")]


def data_group_read(compose, schema, option: str, path: Path) -> bool:
    """Whether the data checks of the recipe ``schema`` read ``data=option`` (a file of the
    records it trains on given as ``data.path``)."""
    overrides = [f"data={option}"] + ([f"data.path={path}"] if option in ("jsonl", "hf") else [])
    overrides += ["data.sources=[{name:a,weight:1,kind:generated}]"] if option == "mix" else []
    group = OmegaConf.to_container(compose(overrides).data, resolve=True)
    source, found = checked_source(group, schema.preference_pairs, mix_kinds(0))
    return source is not None and not found


@pytest.mark.parametrize("script", ["finetune.py", "dpo.py", "distill.py"])
def test_each_recipes_page_lists_the_data_groups_it_reads_and_keys_it_reads(script, tmp_path):
    """``data=`` lists exactly the options the recipe's data checks accept; the keys are the
    schema's common ones less those the recipe refuses or never reads; the first line says what
    the recipe does."""
    compose, schema = RECIPES[script]
    text = page(script=script, name=script.removesuffix(".py").replace("finetune", "config"),
                schema=schema)  # fmt: skip
    records = {"dpo.py": {"prompt": "a", "chosen": "b", "rejected": "c"}}
    record = records.get(script, {"prompt": "a", "response": "b"})
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(record) + "\n")
    folders = sorted(file.stem for file in (CONF_DIR / "data").glob("*.yaml"))
    read = [option for option in folders if data_group_read(compose, schema, option, path)]
    assert data_options(text) == read == list(PAGES[script].data)
    lines = text.splitlines()
    start = lines.index("Keys most runs touch (KEY=VALUE; types and ranges: recipes/schema.py):")
    listed = [line.split()[0] for line in lines[start + 1 : lines.index("", start)]]
    unread = {*PAGES[script].unread, *schema.DEGREES_AT_ONE}  # dpo.py's cp and pp, ...
    assert listed == [name for name, _ in common_keys(schema) if name not in unread]
    assert lines[0] == f"shardtune: {PAGES[script].does}."


def test_dpos_page_says_its_batches_count_pairs():
    text = page(script="dpo.py", name="dpo", schema=DpoConfig)
    assert "  data=       hf, jsonl, preference*" in text.splitlines()
    assert "full fine-tuning" not in text and "\n  cp " not in text and "train.packing" not in text
    assert "train.global_batch_size         preference pairs per optimizer step" in text


# Which recipe each experiment is an example of, by its name (conf/experiment/ and regression/).
EXAMPLE_OF = {
    "finetune.py": lambda name: not name.startswith(("dpo_", "distill_")),
    "dpo.py": lambda name: name.startswith("dpo_"),
    "distill.py": lambda name: name.startswith("distill_"),
}


@pytest.mark.parametrize("script", ["finetune.py", "dpo.py", "distill.py"])
def test_each_recipes_page_lists_its_own_experiments(script):
    """``experiment=`` lists the recipe's own examples and counts its own regression recipes:
    ``dpo.py``'s page shows no fine-tuning example, ``finetune.py``'s no DPO one."""
    _, schema = RECIPES[script]
    name = script.removesuffix(".py").replace("finetune", "config")
    lines = page(script=script, name=name, schema=schema).splitlines()
    [line] = [line for line in lines if line.startswith("  experiment= ")]
    examples = [path.stem for path in sorted((CONF_DIR / "experiment").glob("*.yaml"))]
    regression = [path.stem for path in (CONF_DIR / "experiment" / "regression").glob("*.yaml")]
    own = [name for name in examples if EXAMPLE_OF[script](name)]
    counted = len([name for name in regression if EXAMPLE_OF[script](name)])
    assert (
        counted >= 2
        and line == f"  experiment= {', '.join([*own, f'regression/NAME ({counted})'])}"
    )
    if script != "finetune.py":
        assert "llama_tp4_sp" not in line and "qwen3_moe_ep" not in line
    else:
        assert {"llama_tp4_sp", "qwen3_moe_ep", "smollm2_chat_sft"} <= set(own)
