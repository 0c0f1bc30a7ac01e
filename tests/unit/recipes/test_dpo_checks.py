"""``recipes/dpo.py``'s checks of ``dpo.reference_path``, in process and pure: a folder of the
policy's architecture and tokenizer passes; another model type, another tokenizer, a path that
is no model folder, and a policy built from ``model.config`` (whose tokenizer exists only after
preparation) are each one line naming the key. A policy still to be downloaded is fetched by the
preparation, which compares the reference with it then. A policy of a family dpo.py does not
train is one line naming those it does."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from components.runtime.problems import ConfigError
from recipes.compose import compose_dpo
from recipes.dpo_checks import check_dpo, prepare_dpo
from tests.coverage import tiny_config
from tests.saved_models import reference_folders, save_model
from tests.unit.recipes.test_distill_checks import downloaded, hub, refusals_of  # noqa: F401

POLICY_ID = "shardtune-tests/policy"


def refusals(tmp_path: Path, *overrides: str) -> list[str]:
    """The lines the DPO checks refuse ``overrides`` with (none: they pass)."""
    return refusals_of(compose_dpo, check_dpo, tmp_path, *overrides)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return reference_folders(tmp_path_factory.mktemp("models"))


def policy_and(folders: dict[str, Path], reference: str) -> list[str]:
    policy = ["model=pretrained", f"model.pretrained_path={folders['policy']}"]
    return [*policy, f"dpo.reference_path={folders.get(reference, reference)}"]


def test_a_reference_of_the_policys_architecture_and_vocabulary_passes(tmp_path, folders):
    cfg = compose_dpo([f"output_dir={tmp_path / 'run'}", *policy_and(folders, "reference")])
    checked = check_dpo(cfg, None, None)
    assert checked.reference_path == folders["reference"]
    assert checked.reference_config.model_type == "llama"


def test_a_reference_of_another_model_type_is_refused(tmp_path, folders):
    assert refusals(tmp_path, *policy_and(folders, "qwen3")) == [
        f"dpo.reference_path={folders['qwen3']}: the reference is a qwen3 model and the policy a "
        "llama one: the reference must be of the policy's architecture and vocabulary (DPO "
        "compares their log-probabilities token by token)"
    ]


def test_a_reference_of_another_tokenizer_is_refused(tmp_path, folders):
    [said] = refusals(tmp_path, *policy_and(folders, "another_tokenizer"))
    assert said.startswith(
        f"dpo.reference_path={folders['another_tokenizer']}: their vocabularies'"
    )


def test_no_model_folder_and_a_built_policy_are_refused(tmp_path, folders):
    missing = tmp_path / "nothing"
    assert refusals(tmp_path, *policy_and(folders, str(missing))) == [
        f"dpo.reference_path={missing}: the folder {missing} is not a Hugging Face model (no "
        "config.json) (a local folder: a Hub id is not downloaded for the reference)"
    ]
    adapter = tmp_path / "run" / "adapter"  # what a peft=lora run exports
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    assert refusals(tmp_path, *policy_and(folders, str(adapter))) == [
        f"dpo.reference_path={adapter}: the folder {adapter} holds a PEFT adapter "
        "(adapter_config.json), not a whole model: give the folder of a whole model, e.g. the hf/ "
        "of a run exported with peft.merge=true (the base with the adapter merged in) (a local "
        "folder: a Hub id is not downloaded for the reference)"
    ]
    [said] = refusals(tmp_path, f"dpo.reference_path={folders['reference']}")
    assert said.startswith(f"dpo.reference_path={folders['reference']} is checked against")
    assert "the policy (model=llama) is built from model.config" in said


def test_a_model_of_another_family_is_refused_naming_the_families_dpo_trains(tmp_path, folders):
    """A gemma2 policy (a soft-capped head): the line names the families of a plain head, the
    ones dpo.py trains (the MoE ones too)."""
    tokenizer = AutoTokenizer.from_pretrained(folders["policy"])
    config = tiny_config("gemma2")
    config.vocab_size = len(tokenizer)
    folder = save_model(tmp_path / "gemma2", config, tokenizer)
    assert refusals(tmp_path, "model=pretrained", f"model.pretrained_path={folder}") == [
        "model=pretrained is a gemma2 model: dpo.py computes the answers' log-probabilities from "
        "the plain lm_head of llama, mistral, qwen2, qwen3, qwen3_moe, mixtral models: use one of "
        "those"
    ]


def checked_hub_policy(tmp_path: Path, reference: Path, *overrides: str):
    """The DPO checks of a policy named by a Hub id, against the ``reference`` folder."""
    cfg = compose_dpo(
        [
            f"output_dir={tmp_path / 'run'}",
            f"cache_dir={tmp_path / 'cache'}",
            "model=pretrained",
            f"model.pretrained_path={POLICY_ID}",
            f"dpo.reference_path={reference}",
            *overrides,
        ]
    )
    return check_dpo(cfg, None, None)


def test_a_policy_still_to_be_downloaded_is_fetched_then_compared(tmp_path, folders, hub):  # noqa: F811
    """The checks have no effect: the policy's Hub id, not in the cache, is left to the
    preparation, which fetches it (fine-tuning's fetch) and compares the reference with it."""
    checked = checked_hub_policy(tmp_path, folders["reference"], "dry_run=true")
    assert checked.model_awaits_fetch and checked.reference_awaits_fetch
    assert checked.reference_config is None and not any(hub.iterdir())
    policy = downloaded(folders["policy"], hub, POLICY_ID)  # stands for the download
    plan, _ = prepare_dpo(checked)
    assert plan.model.weights == policy and plan.reference.weights == folders["reference"]
    assert plan.reference.config.model_type == "llama"


def test_a_reference_of_another_tokenizer_than_the_fetched_policy_is_refused(
    tmp_path,
    folders,
    hub,  # noqa: F811
):
    checked = checked_hub_policy(tmp_path, folders["another_tokenizer"])
    downloaded(folders["policy"], hub, POLICY_ID)
    with pytest.raises(ConfigError) as refused:
        prepare_dpo(checked)
    [said] = [problem.message for problem in refused.value.problems]
    assert said.startswith(
        f"dpo.reference_path={folders['another_tokenizer']}: their vocabularies'"
    )
    assert not (tmp_path / "run").exists()  # refused before the output folder is claimed


def test_a_moving_routing_bias_under_a_lora_reference_is_refused_in_one_line(tmp_path):
    """With ``peft=lora`` and no reference folder the reference is the policy with its adapters
    off: a routing bias that training moves would move it too. Full fine-tuning (a reference
    built from the starting weights) and a rate of 0 pass."""
    moe = ["model=qwen3_moe", "moe.routing_bias_rate=0.001"]
    assert refusals(tmp_path, *moe, "peft=lora") == [
        "moe.routing_bias_rate=0.001 is not run by dpo.py: with peft=lora the reference is the "
        "policy with its adapters off, whose routers' bias moves with training: give "
        "dpo.reference_path=FOLDER (the starting weights), or leave the rate at 0"
    ]
    assert refusals(tmp_path, *moe) == []
    assert refusals(tmp_path, "model=qwen3_moe", "peft=lora") == []
