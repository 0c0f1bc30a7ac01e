"""shardtune's building blocks, one package per concern.

Importing the package drops two warnings that torchao (the float8 training of
``train.precision=fp8``) gives whenever it is imported, which transformers does at its own import
when torchao is installed: on a CPU build of torch, that its CUDA kernels' libraries did not load
(float8 training needs none of them: it calls ``torch._scaled_mm``); and torch's note that an Enum
torchao registers needs no registration. Every run would print them, on every rank.
"""

import logging


class _TorchaoImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        unloaded = message.startswith("Failed to load") and "torchao/_C" in message
        return not unloaded and "is an Enum subclass and is now natively supported" not in message


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_TorchaoImportNoise())
