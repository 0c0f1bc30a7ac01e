"""Models whose own plan uses Hugging Face's ``colwise_gather_output`` + ``rowwise_split_input``
pair (a fused ``qkv_proj``/``gate_up_proj`` sliced after it, or q/k norms over the whole
projection: Phi-3, OLMo 2, GLM-4), ``mla_kv_a_proj`` (MiniCPM3's MLA) or a style on a parameter with
``local_params`` (Granite-SWA's attention sinks sharded with the heads) at tp=2 train as at tp=1
(1e-5), whose first loss is the Hugging Face model's own (1e-6), through the command line on
folders written by ``save_pretrained``.

By default one family per style, SGD and AdamW among them: OLMo 2 (the pair on every attention
projection, its q/k norms then over the whole width), MiniCPM3 and Granite-SWA. Phi-3 and GLM-4,
the same pair on fused projections again, run with ``-m sweep``.
"""

from pathlib import Path

import pytest
from transformers import Glm4Config, GraniteSWAConfig, MiniCPM3Config, Olmo2Config, Phi3Config

from components.data import DEFAULT_VOCAB_SIZE, train_tokenizer
from tests.e2e.test_sequence_parallel_norms import IDS, losses
from tests.saved_models import BATCH, MICRO, SEQ_LEN, SIZES, first_loss, save_model
from tests.selection import selected_params

MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
CONFIGS = {
    "phi3": lambda vocab: Phi3Config(**SIZES, **IDS, vocab_size=vocab),
    "olmo2": lambda vocab: Olmo2Config(**SIZES, **IDS, vocab_size=vocab),
    "glm4": lambda vocab: Glm4Config(**SIZES, **IDS, head_dim=16, vocab_size=vocab),
    "minicpm3": lambda vocab: MiniCPM3Config(**SIZES, **MLA, **IDS, vocab_size=vocab),
    "granite_swa": lambda vocab: GraniteSWAConfig(**SIZES, **IDS, vocab_size=vocab),
}


@pytest.fixture(scope="module")
def folders(request, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tokenizer = train_tokenizer(["hello world", "tune"], DEFAULT_VOCAB_SIZE, root / "tokenizer")
    built = {  # only the families of the selected cases
        name: save_model(root / name, CONFIGS[name](DEFAULT_VOCAB_SIZE), tokenizer)
        for name in selected_params(request, "model")
    }
    return {"cache": root / "cache", **built}


@pytest.mark.parametrize(
    ("model", "optim"),
    [
        ("olmo2", "adamw"),
        ("minicpm3", "sgd"),
        ("granite_swa", "adamw"),
        pytest.param("phi3", "sgd", marks=pytest.mark.sweep),
        pytest.param("glm4", "adamw", marks=pytest.mark.sweep),
    ],
)
def test_tp2_on_the_models_own_plan_equals_tp1(folders, tmp_path, model, optim):
    tp1 = losses(folders, model, tmp_path / "tp1", "tp=1", f"optim={optim}")
    tp2 = losses(folders, model, tmp_path / "tp2", "tp=2", f"optim={optim}")
    assert len(set(tp1)) == 3  # the steps train
    assert tp2 == pytest.approx(tp1, rel=1e-5, abs=1e-5)
    reference = first_loss(folders[model], folders["cache"], SEQ_LEN, BATCH, MICRO)
    assert tp1[0] == pytest.approx(reference, abs=1e-6)
