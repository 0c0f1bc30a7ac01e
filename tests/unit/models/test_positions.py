"""Models whose positions the recipe's explicit position ids would shift are refused: RoBERTa's
embeddings number positions from padding_idx + 1 (the coverage sweep: CamemBERT's first loss 5.9313
against its own 5.9573), while models whose forward takes no position ids number their own."""

from transformers import LlamaConfig, RobertaConfig, TrOCRConfig, XLMRobertaConfig

from components.models.load import position_offset_problems


def test_roberta_embeddings_are_refused_by_name():
    assert position_offset_problems(RobertaConfig()) == [
        "model type 'roberta' numbers its positions from padding_idx + 1 (RoBERTa's embeddings), "
        "and the recipe passes positions from 0: not supported yet"
    ]
    assert len(position_offset_problems(XLMRobertaConfig())) == 1


def test_models_that_take_positions_from_zero_or_none_pass():
    assert position_offset_problems(LlamaConfig()) == []
    assert position_offset_problems(TrOCRConfig()) == []  # its forward takes no position ids
