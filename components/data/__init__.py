"""Training data: sources (generated, JSONL, any ``datasets`` split), tokenized once into an Arrow
cache, packed or not, and read by every rank as resumable, dp-sharded batches; and the small trained
tokenizer."""

from components.data.collate import IGNORE_INDEX, tokenize_example
from components.data.generated import generate_examples
from components.data.jsonl import DataError
from components.data.loader import Batch, StepBatches, TokenizedSplit, pad_id_of
from components.data.prepare import (
    PreparedData,
    cached_tokenizer,
    data_cache_dir,
    prepare_data,
    source_cache_dir,
)
from components.data.sources import GeneratedSource, HFSource, JsonlSource, build_source
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer, training_texts

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "IGNORE_INDEX",
    "Batch",
    "DataError",
    "GeneratedSource",
    "HFSource",
    "JsonlSource",
    "PreparedData",
    "StepBatches",
    "TokenizedSplit",
    "build_source",
    "cached_tokenizer",
    "data_cache_dir",
    "generate_examples",
    "pad_id_of",
    "prepare_data",
    "source_cache_dir",
    "tokenize_example",
    "train_tokenizer",
    "training_texts",
]
