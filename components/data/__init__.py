"""Training data: a generated demo dataset, user JSONL, a small trained tokenizer, and resumable dp batches."""

from components.data.collate import IGNORE_INDEX, pad_batch, tokenize_example, tokenize_records
from components.data.generated import generate_examples
from components.data.jsonl import DataError, read_jsonl
from components.data.loader import StepBatches, pad_id_of, split_train_val
from components.data.tokenizer import DEFAULT_VOCAB_SIZE, train_tokenizer, training_texts

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "IGNORE_INDEX",
    "DataError",
    "StepBatches",
    "generate_examples",
    "pad_batch",
    "pad_id_of",
    "read_jsonl",
    "split_train_val",
    "tokenize_example",
    "tokenize_records",
    "train_tokenizer",
    "training_texts",
]
